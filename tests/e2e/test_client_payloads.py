"""Other people's benchmark clients against the real cluster: the exact payloads of SGLang's
bench_serving (sglang, sglang-oai) and hicache bench_multiturn, of `vllm bench serve` (openai,
openai-chat) and vLLM's multi-turn benchmark (tests/e2e/client_payloads.py), read back the way those
clients read them. Every request must stream to completion; SGLang's cache-hit tooling, which reads
``meta_info.cached_tokens`` from the first chunk, must see the real hit."""
import random
import zlib

import httpx
import pytest

from tests.e2e import client_payloads as cp

MODEL = "strata-tiny"


def _text(n: int, seed: int) -> str:
    rnd = random.Random(seed)
    return "".join(rnd.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(n))


def _post(url: str, path: str, headers: dict, body: dict) -> list[str]:
    with httpx.stream("POST", url + path, json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200, (path, resp.status_code, resp.read()[:500])
        events = [line[len("data: "):] for line in resp.iter_lines() if line.startswith("data: ")]
    assert events and events[-1] == "[DONE]", events[-3:]
    return events


CLIENTS = {
    "sglang bench_multiturn": (lambda p, n: cp.sglang_bench_multiturn_payload(p, n), cp.read_sglang_generate, True),
    "sglang bench_serving sglang": (lambda p, n: cp.sglang_bench_serving_payload(p, n), cp.read_sglang_generate, True),
    "sglang bench_serving sglang-oai": (lambda p, n: cp.sglang_bench_serving_oai_payload(MODEL, p, n),
                                        lambda ev: cp.read_openai_stream(ev, chat=False), False),
    "vllm bench serve openai": (lambda p, n: cp.vllm_bench_openai_payload(MODEL, p, n),
                                lambda ev: cp.read_openai_stream(ev, chat=False), True),
    "vllm bench serve openai-chat": (lambda p, n: cp.vllm_bench_openai_chat_payload(MODEL, p, n),
                                     lambda ev: cp.read_openai_stream(ev, chat=True), True),
}


@pytest.mark.parametrize("client", list(CLIENTS))
def test_benchmark_client_payloads_stream_to_completion(cluster, client):
    build, read, counts = CLIENTS[client]
    path, headers, body = build(_text(48, zlib.crc32(client.encode()) % 1000), 6)   # the same prompt every run
    text, n, _ = read(_post(cluster["url"], path, headers, body))
    assert text, f"{client}: no text"
    if counts:   # ignore_eos: exactly the asked tokens, as the client counts them
        assert n == 6, (client, n)


def test_sglang_cache_hit_tooling_reads_the_real_hit_from_the_first_chunk(cluster):
    url = cluster["url"]
    history = _text(160, 11)
    path, headers, body = cp.sglang_bench_multiturn_payload(history, 8)
    answer, _, first = cp.read_sglang_generate(_post(url, path, headers, body))
    history += answer + _text(24, 12)                                  # round 2: the whole history again
    path, headers, body = cp.sglang_bench_multiturn_payload(history, 8)
    _, n, second = cp.read_sglang_generate(_post(url, path, headers, body))
    meta = second["last_meta"]
    assert n == 8 and meta["completion_tokens"] == 8
    assert meta["cached_tokens"] >= 144, meta                          # round 1's prompt, whole pages
    assert second["first_cached_tokens"] == meta["cached_tokens"], second
    for key in ("id", "prompt_tokens", "completion_tokens", "cached_tokens"):
        assert key in meta, key


def test_vllm_multi_turn_client_runs_a_conversation(cluster):
    url = cluster["url"]
    messages = [{"role": "user", "content": _text(80, 21)}]
    for turn in range(2):
        path, headers, body = cp.vllm_multi_turn_payload(MODEL, messages, 6, conversation_id=f"conv-{turn}")
        events = _post(url, path, headers, body)
        text, n, info = cp.read_openai_stream(events, chat=True)
        assert text and n is None and info["chunks"] >= 1          # include_usage false: no usage chunk
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": _text(20, 22 + turn)}]
