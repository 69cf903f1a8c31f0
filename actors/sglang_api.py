"""SGLang's native API over the Frontend: /generate (one prompt or a batch, ``n`` samples each, streamed
or not, with SGLang's ``meta_info``: id, finish_reason object, token counts, cached_tokens on every
chunk, logprob triples), /get_model_info and /get_server_info (also at /model_info, /server_info)."""
from __future__ import annotations

import time
import uuid
from typing import Union

from fastapi import FastAPI

from actors import logprob_format as lpf
from actors import sampling_args as sa
from actors.cache_report import cached_tokens_details
from actors.frontend import Frontend, Sample, bad
from actors.http_models import GenerateChunk, GenerateResponse, ModelInfo, ServerInfo, errors, sse_200
from actors.requests import GenerateRequest, SGLSampling
from actors.sse import event, reply, sse


def finish_reason(s: Sample) -> dict | None:
    """SGLang's finish_reason object."""
    if not s.finished:
        return None
    r = s.finish_reason
    if r == "length":
        return {"type": "length", "length": len(s.token_ids)}
    if r == "stop":
        return {"type": "stop", "matched": s.matched_stop}
    return {"type": r or "abort", "message": getattr(s.last, "error", None)}


class SGLangAdapter:
    def __init__(self, fe: Frontend) -> None:
        self.fe = fe

    def _prompts(self, body: GenerateRequest) -> tuple[list[list[int]], bool]:
        fe = self.fe
        if (body.text is None) == (body.input_ids is None):
            raise bad("text", "exactly one of text or input_ids is required")
        if body.text is not None:
            if isinstance(body.text, str):
                return [fe.check_ids(fe.encode(body.text, "text"))], False
            if not body.text:
                raise bad("text", "an empty batch")
            return [fe.check_ids(fe.encode(t, f"text[{i}]"), f"text[{i}]") for i, t in enumerate(body.text)], True
        ids = body.input_ids
        if ids and isinstance(ids[0], list):
            return [fe.check_ids(list(p), f"input_ids[{i}]") for i, p in enumerate(ids)], True
        return [fe.check_ids(list(ids))], False

    def _params(self, sp: SGLSampling, ids: list[int], body: GenerateRequest, field: str):
        fe = self.fe
        max_new = fe.fit(ids, sp.max_new_tokens if "max_new_tokens" in sp.model_fields_set else None,
                         f"{field}.max_new_tokens", sp.max_new_tokens)
        if sp.seed is not None and sp.sampling_seed is not None and sp.seed != sp.sampling_seed:
            raise bad(f"{field}.sampling_seed", "differs from seed")
        grammar = sa.one_grammar(**{f"{field}.{k}": v for k, v in sa.vllm_grammars(sp).items()})
        given, d = sp.model_fields_set, fe.sampling_defaults
        value = {k: sa.sampling_value(sp, k, d, k in given) for k in sa.SAMPLING_FALLBACK}
        return fe.params(field, max_new_tokens=max_new, temperature=float(value["temperature"]),
                         top_p=float(value["top_p"]), top_k=sa.top_k(value["top_k"]),
                         min_p=float(value["min_p"]),
                         presence_penalty=float(sp.presence_penalty),
                         frequency_penalty=float(sp.frequency_penalty),
                         repetition_penalty=float(value["repetition_penalty"]),
                         logit_bias=sa.logit_bias(sp.logit_bias, fe.backend.vocab_size),
                         seed=sa.seed(sp.seed if sp.seed is not None else sp.sampling_seed),
                         stop=sa.stops(sp.stop), stop_token_ids=tuple(sp.stop_token_ids or ()),
                         ignore_eos=sp.ignore_eos, min_new_tokens=sp.min_new_tokens,
                         skip_special_tokens=sp.skip_special_tokens,
                         spaces_between_special_tokens=sp.spaces_between_special_tokens,
                         no_stop_trim=sp.no_stop_trim, grammar=grammar,
                         logprobs=body.return_logprob, top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
                         logprob_start_len=body.logprob_start_len if body.return_logprob else -1)

    async def generate(self, body: GenerateRequest):
        fe = self.fe
        fe.check_lora(body.lora_path)
        prompts, batch = self._prompts(body)
        sps = body.sampling_params if body.sampling_params is not None else SGLSampling()
        if isinstance(sps, list):
            if len(sps) != len(prompts):
                raise bad("sampling_params", f"{len(sps)} entries for {len(prompts)} prompts")
        else:
            sps = [sps] * len(prompts)
        rids = body.rid if isinstance(body.rid, list) else [body.rid] * len(prompts)
        if len(rids) != len(prompts):
            raise bad("rid", f"{len(rids)} entries for {len(prompts)} prompts")
        samples, pins, rid_of = [], [], {}
        for i, (ids, sp) in enumerate(zip(prompts, sps)):
            field = f"sampling_params[{i}]" if isinstance(body.sampling_params, list) else "sampling_params"
            params = self._params(sp, ids, body, field)
            route, _ = await fe.warm(ids, sp.n)
            base, start = rids[i] or uuid.uuid4().hex, len(samples)
            for s in fe.samples(ids, params, sp.n, first_index=start):
                rid_of[s.index] = base if sp.n == 1 else f"{base}-{s.index - start}"
                samples.append(s)
                pins.append(route)
        many = batch or len(samples) > 1
        l3 = getattr(fe.backend, "l3_backend", None)
        t0 = time.perf_counter()
        tok = fe.tok

        def out(s: Sample) -> dict:
            text, _ = s.text(tok)
            meta = {"id": rid_of[s.index], "finish_reason": finish_reason(s),
                    "prompt_tokens": len(s.prompt_ids), "completion_tokens": len(s.token_ids),
                    "cached_tokens": s.last.cached_tokens if s.last else 0,
                    "e2e_latency": time.perf_counter() - t0}
            if s.last is not None:
                meta["cached_tokens_by_tier"] = s.last.cached_tokens_by_tier
                meta["cached_tokens_details"] = cached_tokens_details(s.last.cached_tokens_by_tier, l3)
                if s.served is not None:
                    meta["route"] = s.served.route_json()
            if body.return_logprob:
                with_text = body.return_text_in_logprobs
                meta["input_token_logprobs"] = lpf.sglang_input(
                    tok, s.prompt_ids, body.logprob_start_len, s.prompt_logprobs, with_text) \
                    if body.logprob_start_len >= 0 else []
                meta["output_token_logprobs"] = lpf.sglang_triples(tok, s.logprobs, with_text)
                if body.top_logprobs_num:
                    meta["input_top_logprobs"] = lpf.sglang_top(tok, s.prompt_logprobs or [],
                                                                 body.top_logprobs_num, with_text)
                    meta["output_top_logprobs"] = lpf.sglang_top(tok, s.logprobs, body.top_logprobs_num, with_text)
            o = {"text": text, "output_ids": list(s.token_ids), "meta_info": meta}
            if many:
                o["index"] = s.index
            return o

        if not body.stream:
            done = await fe.collect_all(samples, pins)
            return [out(s) for s in done] if many else out(done[0])
        started = await fe.start_streams(samples, pins)

        async def events():
            async for s, item in fe.merged(started):
                s.feed(item)
                s.delta(tok)   # what is safe to show so far: stop strings and split characters held back
                o = out(s)
                o["text"] = s.sent
                yield event(o)
        return sse(events())


def add_sglang_routes(app: FastAPI, fe: Frontend) -> None:
    api = SGLangAdapter(fe)

    @app.post("/generate", response_model=Union[GenerateResponse, list[GenerateResponse]], response_model_exclude_none=True,
              responses={**sse_200(GenerateChunk), **errors(400, 413, 422, 503)})
    async def generate(body: GenerateRequest):
        return reply(await api.generate(body), body)

    async def model_info():
        b = fe.backend
        return {"model_path": getattr(b, "model_path", b.model_name), "tokenizer_path": getattr(b, "model_path", None),
                "is_generation": True, "served_model_name": b.model_name, "max_context_length": b.max_context,
                "preferred_sampling_params": None, "weight_version": "default", "has_image_understanding": False,
                "has_audio_understanding": False, "model_type": getattr(b, "model_type", None)}

    async def server_info():
        info = await fe.backend.server_info()
        return {**info, "internal_states": [fe.internal_state()], "version": "strata-0.1.0"}

    for path in ("/get_model_info", "/model_info"):
        app.get(path, response_model=ModelInfo)(model_info)
    for path in ("/get_server_info", "/server_info"):
        app.get(path, response_model=ServerInfo)(server_info)
