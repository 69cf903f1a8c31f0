"""SGLang's --cache-report against the real cluster: the request shapes sglang.bench_serving sends on its
three backends (sglang, sglang-oai, sglang-oai-chat), parsed the way it parses them
(tests/e2e/client_payloads.py: with_cache_report, read_cache_report), give the hit rate /metrics gives."""
import random
import re

import httpx
import pytest

from engine.model.tokenizer import TextTokenizer
from tests.e2e import client_payloads as cp
from tests.e2e.test_client_payloads import _post

MODEL = "strata-tiny"
BACKENDS = {
    "sglang": lambda p: cp.sglang_bench_serving_payload(p, 4),
    "sglang-oai": lambda p: cp.sglang_bench_serving_oai_payload(MODEL, p, 4),
    "sglang-oai-chat": lambda p: cp.sglang_bench_serving_oai_chat_payload(MODEL, p, 4),
}


def _metrics(url: str) -> tuple[float, float]:
    """(cache hit tokens over every tier, prompt tokens) from /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    hits = sum(float(v) for v in re.findall(r'^strata_cache_hit_tokens_total\{[^}]*\} ([\d.e+]+)$', text, re.M))
    prompt = re.findall(r'^strata_prompt_tokens_total(?:\{\})? ([\d.e+]+)$', text, re.M)
    return hits, float(prompt[0]) if prompt else 0.0


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_bench_serving_cache_report_sees_the_hit_rate_metrics_sees(cluster, backend):
    url = cluster["url"]
    rnd = random.Random(f"cache-report-{backend}")
    prompts = ["".join(rnd.choice("abcdefghij klmnop") for _ in range(300)) for _ in range(3)]
    tok = TextTokenizer(cluster["model_path"])
    hits0, prompt0 = _metrics(url)
    cached = client_prompt = 0
    for _round in range(3):       # the same prompt set three times: 2/3 of the tokens can hit
        for p in prompts:
            path, headers, body = cp.with_cache_report(*BACKENDS[backend](p))
            events = _post(url, path, headers, body)
            got = cp.read_cache_report(events)
            assert got is not None, f"{backend}: no cached_tokens_details in {events[-3:]}"
            cached += got
            client_prompt += len(tok.encode(p))     # bench_serving's prompt_len: its own tokenization
    hits1, prompt1 = _metrics(url)
    hits, prompt = hits1 - hits0, prompt1 - prompt0
    assert hits / prompt >= 0.5, (hits, prompt)
    assert cached == hits, (backend, cached, hits)
    # The rate: bench_serving divides by its prompt lengths. For /generate and /v1/completions they are
    # the server's; chat renders a template around the text, which the client does not count.
    if backend != "sglang-oai-chat":
        assert client_prompt == prompt
    assert cached / prompt == hits / prompt
