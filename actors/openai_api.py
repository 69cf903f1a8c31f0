"""OpenAI's /v1/completions, /v1/chat/completions and /v1/models over the Frontend, with the sampling
fields vLLM and SGLang add there. Chat templates render in the tokenizer room (engine/model/chat.py);
tool calls are parsed back by engine/model/tool_calls.py."""
from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, HTTPException

from actors import logprob_format as lpf
from actors import sampling_args as sa
from actors import token_text as tt
from actors.cache_report import add_tiers, sglext
from actors.frontend import Frontend, Sample, bad
from actors.http_models import (ChatCompletionChunk, ChatCompletionResponse, CompletionChunk,
                                CompletionResponse, ModelCard, ModelList, errors, sse_200)
from actors.openai_chat import ChatPlan, plan_chat, token_ends, tool_call_chunks
from actors.requests import ChatRequest, CompletionRequest
from actors.sse import event, reply, sse

_REASONS = {"stop": "stop", "length": "length", "abort": "abort"}


def _cached(done: list[Sample], warm_cached: int | None) -> int:
    """The request's cache hit: its warm-up's when n > 1 (the samples then hit the warm-up's own KV),
    else the sum over its prompts."""
    return warm_cached if warm_cached is not None else sum(s.last.cached_tokens for s in done)


def usage(samples: list[Sample], prompt_tokens: int, cached: int) -> dict:
    n_out = sum(len(s.token_ids) for s in samples)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": n_out, "total_tokens": prompt_tokens + n_out,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _usage_options(opts) -> tuple[bool, bool]:
    """stream_options -> (a usage chunk at the end, usage on every chunk)."""
    return bool(opts and opts.include_usage), bool(opts and opts.continuous_usage_stats)


def _usage_event(head: dict, started: list, n_prompt: int, warm_cached: int | None, ext: dict | None = None) -> str:
    done = [s for s, _g, _f in started]
    return event({**head, "choices": [], "usage": usage(done, n_prompt, _cached(done, warm_cached)), **(ext or {})})


class OpenAIAdapter:
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    # ---- shared -------------------------------------------------------------------------------------
    async def _start(self, prompts: list[list[int]], params, n: int):
        """Samples for each prompt (n each; n > 1 warms the prompt once and pins its samples to the
        warm-up's workers). Returns (samples, pins, prompt tokens, cached tokens of the request, and its
        tokens by tier when n > 1)."""
        samples, pins, cached, warms = [], [], 0, []
        for ids in prompts:
            route, warm = await self.fe.warm(ids, n)
            cached += warm.cached_tokens if warm is not None else 0
            warms.append(warm.cached_tokens_by_tier if warm is not None else None)
            for s in self.fe.samples(ids, params, n, first_index=len(samples)):
                samples.append(s)
                pins.append(route)
        return (samples, pins, sum(len(p) for p in prompts), (cached if n > 1 else None),
                add_tiers(warms) if n > 1 else None)

    def _sglext(self, body, samples: list[Sample], warm_tiers) -> dict:
        """``{"sglext": ...}`` when the request asked for SGLang's cached_tokens_details (else {}): the
        request's hit by tier, counted as ``usage.prompt_tokens_details.cached_tokens`` counts it."""
        if not getattr(body, "return_cached_tokens_details", False):
            return {}
        tiers = warm_tiers if warm_tiers is not None else add_tiers(s.last.cached_tokens_by_tier for s in samples
                                                                     if s.last is not None)
        return {"sglext": sglext(tiers, getattr(self.fe.backend, "l3_backend", None))}

    def _stream_ext(self, body, started: list, warm_tiers):
        """For a stream: ``ext(started)`` the sglext of the whole request (on the usage chunk), and
        ``last_ext(sample)`` that sglext on the chunk that finishes the last sample (a chunk with a choice:
        clients that index ``choices[0]`` of every chunk read it too), else {}."""
        samples = [s for s, _g, _f in started]

        def ext(_started=None) -> dict:
            return self._sglext(body, samples, warm_tiers)

        def last_ext(s: Sample) -> dict:
            return ext() if s.finished and all(x.finished for x in samples) else {}
        return ext, last_ext

    def _model(self) -> str:
        return self.fe.backend.model_name

    # ---- completions --------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest):
        fe = self.fe
        fe.check_model(body.model)
        fe.check_lora(body.lora_path)
        prompts = self._prompts(body.prompt)
        if body.truncate_prompt_tokens:
            prompts = [p[-body.truncate_prompt_tokens:] for p in prompts]
        n = sa.n_of(body)
        max_new = min(fe.fit(ids, body.max_tokens if "max_tokens" in body.model_fields_set else None,
                             "max_tokens", body.max_tokens or 16) for ids in prompts)
        grammar = sa.one_grammar(response_format=sa.response_format_grammar(body.response_format),
                                 **sa.vllm_grammars(body))
        top_n = body.logprobs or 0
        want_prompt_lp = (body.echo and body.logprobs is not None) or body.prompt_logprobs is not None
        params = fe.params("request", max_new_tokens=max_new, grammar=grammar,
                           logprobs=body.logprobs is not None, top_logprobs=max(top_n, body.prompt_logprobs or 0),
                           logprob_start_len=0 if want_prompt_lp else -1, **sa.common_kwargs(body, fe.backend.vocab_size, fe.sampling_defaults))
        rid = body.request_id or f"cmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        samples, pins, n_prompt, warm_cached, warm_tiers = await self._start(prompts, params, n)
        tok = fe.tok

        def offsets(s: Sample) -> tt.TextOffsets:
            """Where the completion's tokens start in the choice's text: after the echoed prompt."""
            return tt.TextOffsets(tok, len(echo(s)), params.skip_special_tokens)

        def choice(s: Sample, text: str, reason, chunk=None, run: tt.TextOffsets | None = None) -> dict:
            """``chunk``: a streamed chunk's logprobs (this chunk's tokens only, offsets from ``run``)."""
            c = {"index": s.index, "text": text, "finish_reason": reason, "logprobs": None,
                 "stop_reason": s.matched_stop if s.finished else None}
            if body.logprobs is not None and chunk is not None:
                c["logprobs"] = lpf.completion_logprobs(tok, chunk, top_n, run,
                                                        as_ids=body.return_tokens_as_token_ids)
            elif body.logprobs is not None:
                echo_p = s.prompt_logprobs if body.echo else None
                c["logprobs"] = lpf.completion_logprobs(
                    tok, s.logprobs, top_n, offsets(s), echo_p, s.prompt_ids if body.echo else (),
                    body.return_tokens_as_token_ids)
            if body.prompt_logprobs is not None:
                c["prompt_logprobs"] = lpf.vllm_prompt_logprobs(tok, s.prompt_ids, s.prompt_logprobs,
                                                                body.prompt_logprobs)
            return c

        def echo(s: Sample) -> str:
            return tok.decode(s.prompt_ids, skip_special_tokens=False) if body.echo else ""

        if not body.stream:
            done = await fe.collect_all(samples, pins)
            cached = _cached(done, warm_cached)
            return {"id": rid, "object": "text_completion", "created": created, "model": self._model(),
                    "choices": [choice(s, echo(s) + s.text(tok)[0], _REASONS.get(s.finish_reason))
                                for s in done],
                    "usage": usage(done, n_prompt, cached), **self._sglext(body, done, warm_tiers)}
        started = await fe.start_streams(samples, pins)
        include_usage, continuous = _usage_options(body.stream_options)

        ext, last_ext = self._stream_ext(body, started, warm_tiers)

        async def events():
            head = {"id": rid, "object": "text_completion", "created": created, "model": self._model()}
            echoed: set[int] = set()
            runs = {s.index: offsets(s) for s, _g, _f in started}   # text_offset runs on across chunks
            async for s, item in fe.merged(started):
                s.feed(item)
                text = s.delta(tok)
                if s.index not in echoed and body.echo:
                    text = echo(s) + text
                    echoed.add(s.index)
                c = choice(s, text, _REASONS.get(s.finish_reason), list(item.logprobs or ()), runs[s.index])
                chunk = {**head, "choices": [c], **last_ext(s)}
                if continuous:
                    chunk["usage"] = usage([s], len(s.prompt_ids), s.last.cached_tokens)
                yield event(chunk)
            if include_usage:
                yield _usage_event(head, started, n_prompt, warm_cached, ext(started))
        return sse(events())

    def _prompts(self, prompt) -> list[list[int]]:
        fe = self.fe
        if isinstance(prompt, str):
            return [fe.check_ids(fe.encode(prompt, "prompt"))]
        if not prompt:
            raise bad("prompt", "empty")
        if isinstance(prompt[0], str):
            return [fe.check_ids(fe.encode(p, f"prompt[{i}]"), f"prompt[{i}]") for i, p in enumerate(prompt)]
        if isinstance(prompt[0], int):
            return [fe.check_ids(list(prompt))]
        return [fe.check_ids(list(p), f"prompt[{i}]") for i, p in enumerate(prompt)]

    # ---- chat ---------------------------------------------------------------------------------------
    async def chat(self, body: ChatRequest):
        fe = self.fe
        fe.check_model(body.model)
        fe.check_lora(body.lora_path)
        plan: ChatPlan = plan_chat(body, fe.tok)
        ids = fe.check_ids(fe.encode(plan.prompt, "messages"), "messages")
        if body.truncate_prompt_tokens:
            ids = ids[-body.truncate_prompt_tokens:]
        n = sa.n_of(body)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_new = fe.fit(ids, getattr(body, field), field, 128)
        top_n = body.top_logprobs or 0
        if top_n and not body.logprobs:
            raise bad("top_logprobs", "needs logprobs: true")
        grammar = sa.one_grammar(response_format=sa.response_format_grammar(body.response_format),
                                 tool_choice=plan.grammar, **sa.vllm_grammars(body))
        # Where the messages end, so the cache keeps the sliding window before each (a later request
        # editing or adding a message branches there); not for a prompt cut from the left.
        ends = () if body.truncate_prompt_tokens else token_ends(plan, ids, fe.tok.encode)
        params = fe.params("request", max_new_tokens=max_new, grammar=grammar, logprobs=body.logprobs,
                           top_logprobs=top_n, message_boundaries=ends,
                           **sa.common_kwargs(body, fe.backend.vocab_size, fe.sampling_defaults))
        rid = body.request_id or f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        samples, pins, n_prompt, warm_cached, warm_tiers = await self._start([ids], params, n)
        tok = fe.tok

        def logprobs(s: Sample, lps) -> dict | None:
            return lpf.chat_logprobs(tok, lps, top_n, body.return_tokens_as_token_ids) if body.logprobs else None

        def reason(s: Sample, has_calls: bool):
            r = _REASONS.get(s.finish_reason)
            return "tool_calls" if has_calls and r == "stop" else r

        if not body.stream:
            done = await fe.collect_all(samples, pins)
            choices = []
            for s in done:
                text, _ = s.text(tok)
                content, calls = plan.parse(text)
                msg = {"role": "assistant", "content": content if (content or not calls) else None,
                       "refusal": None}
                if calls:
                    msg["tool_calls"] = calls
                choices.append({"index": s.index, "message": msg, "logprobs": logprobs(s, s.logprobs),
                                "finish_reason": reason(s, bool(calls)),
                                "stop_reason": s.matched_stop})
            return {"id": rid, "object": "chat.completion", "created": created, "model": self._model(),
                    "choices": choices, "usage": usage(done, n_prompt, _cached(done, warm_cached)),
                    **self._sglext(body, done, warm_tiers)}
        started = await fe.start_streams(samples, pins)
        include_usage, continuous = _usage_options(body.stream_options)

        ext, last_ext = self._stream_ext(body, started, warm_tiers)

        async def events():
            head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self._model()}
            streamers = {s.index: plan.streamer() for s, _g, _f in started}
            called: set[int] = set()
            for s, _g, _f in started:   # the role comes first, as OpenAI sends it
                yield event({**head, "choices": [{"index": s.index, "delta": {"role": "assistant", "content": ""},
                                                  "logprobs": None, "finish_reason": None}]})
            async for s, item in fe.merged(started):
                s.feed(item)
                st = streamers[s.index]
                content, calls = st.feed(s.delta(tok))
                if s.finished:
                    more_content, more_calls = st.finish()
                    content, calls = content + more_content, calls + more_calls
                if calls:
                    called.add(s.index)
                # a call's head goes in a chunk of its own, before its arguments (OpenAI's order)
                deltas = ([{"content": content}] if content else []) + \
                    [{"tool_calls": part} for part in tool_call_chunks(calls)]
                if not deltas:
                    if not s.finished and not item.logprobs:
                        continue
                    deltas = [{}]
                lps = logprobs(s, list(item.logprobs or ()))
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    c = {"index": s.index, "delta": delta, "logprobs": lps if k == 0 else None,
                         "finish_reason": reason(s, s.index in called) if s.finished and last else None}
                    if s.finished and last:
                        c["stop_reason"] = s.matched_stop
                    chunk = {**head, "choices": [c], **(last_ext(s) if last else {})}
                    if continuous and last:
                        chunk["usage"] = usage([s], len(ids), s.last.cached_tokens)
                    yield event(chunk)
            if include_usage:
                yield _usage_event(head, started, n_prompt, warm_cached, ext(started))
        return sse(events())

    # ---- models -------------------------------------------------------------------------------------
    def card(self) -> dict:
        b = self.fe.backend
        return {"id": b.model_name, "object": "model", "created": 0, "owned_by": "strata",
                "root": b.model_name, "max_model_len": b.max_context}


def add_openai_routes(app: FastAPI, fe: Frontend) -> None:
    api = OpenAIAdapter(fe)

    @app.post("/v1/completions", response_model=CompletionResponse,
              responses={**sse_200(CompletionChunk), **errors(400, 404, 413, 503)})
    async def completions(body: CompletionRequest):
        return reply(await api.completions(body), body)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse,
              responses={**sse_200(ChatCompletionChunk), **errors(400, 404, 413, 503)})
    async def chat(body: ChatRequest):
        return reply(await api.chat(body), body)

    @app.get("/v1/models", response_model=ModelList)
    async def models():
        return {"object": "list", "data": [api.card()]}

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=errors(404))
    async def model(model_id: str):
        if model_id != fe.backend.model_name:
            raise HTTPException(404, {"message": f"The model `{model_id}` does not exist",
                                      "code": "model_not_found", "param": "model"})
        return api.card()
