"""Requests as other people's benchmark clients send them, and their answers read as those clients read
them. Written down here from the clients' sources (SGLang: python/sglang/bench_serving.py and
benchmark/hicache/bench_multiturn.py; vLLM: vllm/benchmarks/lib/endpoint_request_func.py, which
`vllm bench serve` uses, and benchmarks/multi_turn/benchmark_serving_multi_turn.py), so a field those
clients add or a way they read the stream is what strata is tested against, not strata's own idea of it.

Each ``*_payload`` returns (path, headers, JSON body); each ``read_*`` takes the SSE ``data:`` strings of
one response and returns what the client records: (generated text, completion tokens or None, extra)."""
from __future__ import annotations

import json
import uuid


# ---- SGLang -----------------------------------------------------------------------------------------
def sglang_bench_multiturn_payload(prompt: str, output_len: int) -> tuple[str, dict, dict]:
    """benchmark/hicache/bench_multiturn.py gen_payload (native mode), as of the issue's report."""
    return "/generate", {}, {
        "text": prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "stream_options": {"include_usage": True},
        "lora_path": "",
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def sglang_bench_serving_payload(prompt: str | list[int], output_len: int) -> tuple[str, dict, dict]:
    """bench_serving --backend sglang (async_request_sglang_generate): lora_path is the request's lora
    name, None without --lora-name."""
    return "/generate", {}, {
        ("text" if isinstance(prompt, str) else "input_ids"): prompt,
        "sampling_params": {"temperature": 0.0, "max_new_tokens": output_len, "ignore_eos": True},
        "stream": True,
        "lora_path": None,
        "return_logprob": False,
        "logprob_start_len": -1,
    }


def sglang_bench_serving_oai_payload(model: str, prompt: str, output_len: int) -> tuple[str, dict, dict]:
    """bench_serving --backend sglang-oai (async_request_openai_completions)."""
    return "/v1/completions", {}, {
        "model": model, "prompt": prompt, "temperature": 0.0, "best_of": 1, "max_tokens": output_len,
        "stream": True, "ignore_eos": True,
    }


def read_sglang_generate(events: list[str]) -> tuple[str, int | None, dict]:
    """SGLang's clients: ``text`` is the whole text so far (the last non-empty one wins),
    ``meta_info.completion_tokens`` the count; the hicache tooling takes ``cached_tokens`` from the
    first chunk."""
    text, n, first_cached = "", None, None
    for ev in events:
        if ev == "[DONE]":
            continue
        data = json.loads(ev)
        if data["text"]:
            text = data["text"]
            n = data["meta_info"]["completion_tokens"]
            if first_cached is None:
                first_cached = data["meta_info"]["cached_tokens"]
    last = json.loads([e for e in events if e != "[DONE]"][-1])
    return text, n, {"first_cached_tokens": first_cached, "last_meta": last["meta_info"]}


# ---- vLLM -------------------------------------------------------------------------------------------
def vllm_bench_openai_payload(model: str, prompt: str, output_len: int) -> tuple[str, dict, dict]:
    """`vllm bench serve --backend openai` (async_request_openai_completions), --ignore-eos."""
    return "/v1/completions", {"x-request-id": uuid.uuid4().hex}, {
        "model": model, "prompt": prompt, "repetition_penalty": 1.0, "max_tokens": output_len,
        "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    }


def vllm_bench_openai_chat_payload(model: str, prompt: str, output_len: int) -> tuple[str, dict, dict]:
    """`vllm bench serve --backend openai-chat`: the prompt as a list of content parts."""
    return "/v1/chat/completions", {"Content-Type": "application/json"}, {
        "model": model, "messages": [{"role": "user", "content": [{"type": "text", "text": prompt}]}],
        "max_completion_tokens": output_len, "stream": True, "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }


def vllm_multi_turn_payload(model: str, messages: list[dict], max_tokens: int,
                            conversation_id: str | None = None) -> tuple[str, dict, dict]:
    """benchmarks/multi_turn/benchmark_serving_multi_turn.py send_request (stream on)."""
    body: dict = {"model": model, "messages": messages}
    headers = {"Content-Type": "application/json"}
    if conversation_id is not None:
        body["conversation_id"] = conversation_id
        headers["X-Session-ID"] = conversation_id
    body["stream"] = True
    body["stream_options"] = {"include_usage": False}
    body["max_tokens"] = max_tokens
    return "/v1/chat/completions", headers, body


def read_openai_stream(events: list[str], chat: bool) -> tuple[str, int | None, dict]:
    """vLLM's and SGLang's OpenAI readers: text or delta.content of choices[0] concatenated; the
    completion tokens from a chunk with usage and no choices."""
    text, n, chunks = "", None, 0
    for ev in events:
        if ev == "[DONE]":
            continue
        data = json.loads(ev)
        if data.get("choices"):
            chunks += 1
            c = data["choices"][0]
            text += (c["delta"].get("content") if chat else c.get("text")) or ""
        elif data.get("usage"):
            n = data["usage"].get("completion_tokens")
    return text, n, {"chunks": chunks}


# ---- SGLang bench_serving --cache-report --------------------------------------------------------------
# sglang.bench_serving 0.5.x (python/sglang/benchmark/serving.py and backends/*_client.py): --cache-report
# adds ``return_cached_tokens_details: true`` to the OpenAI-format bodies, reads
# ``sglext.cached_tokens_details`` from any streamed chunk (the OpenAI backends) or
# ``meta_info.cached_tokens_details`` (the native sglang backend), counts a request's hit as
# device + host + storage, and prints the hit rate as cached / prompt tokens over all requests.
def with_cache_report(path: str, headers: dict, body: dict) -> tuple[str, dict, dict]:
    """The body as --cache-report sends it (the native /generate body is unchanged)."""
    return path, headers, (body if path == "/generate" else {**body, "return_cached_tokens_details": True})


def sglang_bench_serving_oai_chat_payload(model: str, prompt: str, output_len: int) -> tuple[str, dict, dict]:
    """bench_serving --backend sglang-oai-chat (backends/oai_chat_client.py OpenAIChatBackendClient)."""
    return "/v1/chat/completions", {}, {
        "model": model, "messages": [{"role": "user", "content": prompt}], "max_completion_tokens": output_len,
        "stream": True, "temperature": 0.0, "ignore_eos": True,
    }


def read_cache_report(events: list[str]) -> int | None:
    """A request's cached tokens as --cache-report counts them: the last ``cached_tokens_details`` seen,
    device + host + storage (None when the server sent none)."""
    details = None
    for ev in events:
        if ev == "[DONE]":
            continue
        data = json.loads(ev)
        d = (data.get("meta_info") or {}).get("cached_tokens_details") or \
            (data.get("sglext") or {}).get("cached_tokens_details")
        if d:
            details = d
    if details is None:
        return None
    return sum(int(details.get(k, 0) or 0) for k in ("device", "host", "storage"))
