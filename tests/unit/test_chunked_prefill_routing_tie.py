"""Why chunked and one-shot prefill can give different answers on a top-k MoE model, pinned down on a
626-token conversation turn of the soak (model output carried into the next turn).

Prefilled in chunks of 512, its logits end 0.13 away from the same prompt prefilled at once (greedy
tokens depart at the 9th token; the one-shot result agrees with transformers). Nothing is wrong with
either computation: up to the first routing decision that differs, the two agree to fp32 noise (router
logits within 1e-5), and that decision is a near-tie, a token whose k-th and (k+1)-th expert logits are
under 1e-5 apart in the one-shot run (layer 1, position 573: 6e-7). The noise between the two batch
shapes picks the other expert, and everything after that layer follows. The soak's judge excuses such
a departure only if reversing that one decision reproduces it (tests/reliability/judge.py)."""
import json
import os

import torch

from engine import Engine, SamplingParams
from engine.model.moe import TopKRouter

PROMPT = json.load(open(os.path.join(os.path.dirname(__file__), "data", "chunked_prefill_626.json")))["prompt"]
TIE = 1e-5


def _prefill(max_batch_tokens: int):
    """Router logits [T, E] and chosen experts [T, k] of every layer over the prompt's prefill, and the
    first token's logits."""
    eng = Engine.from_pretrained("strata-tiny", page_size=16, num_pages=1024, max_batch_tokens=max_batch_tokens)
    routers = [m for m in eng.model.modules() if isinstance(m, TopKRouter)]
    seen: list[list[tuple]] = [[] for _ in routers]

    def hook(layer):
        def h(mod, args, out):
            seen[layer].append((torch.nn.functional.linear(args[0], mod.weight, mod.bias), out[1]))
        return h
    hs = [r.register_forward_hook(hook(i)) for i, r in enumerate(routers)]
    try:
        out = eng.generate([PROMPT], SamplingParams(max_new_tokens=1, temperature=0.0, return_logits=True))[0]
    finally:
        for h in hs:
            h.remove()
    per_layer = [(torch.cat([lg for lg, _ in calls]), torch.cat([i for _, i in calls])) for calls in seen]
    return per_layer, out.logits[0].float(), routers[0].top_k


def test_chunked_prefill_departs_from_one_shot_only_at_a_routing_near_tie():
    one, a, k = _prefill(4096)
    chunked, b, _ = _prefill(512)
    assert float((a - b).abs().max()) > 1e-2, "the two prefills agree: the example no longer shows the effect"
    first = None
    for layer, ((lg1, i1), (lg2, i2)) in enumerate(zip(one, chunked)):
        assert lg1.shape == lg2.shape == (len(PROMPT), lg1.shape[1])
        differ = (i1.sort(-1).values != i2.sort(-1).values).any(-1).nonzero().flatten().tolist()
        if not differ:
            continue
        # Up to here the two computations are the same up to fp32 noise...
        assert float((lg1 - lg2).abs().max()) < TIE, (layer, float((lg1 - lg2).abs().max()))
        # ...and every expert choice that differs is a near-tie of the one-shot run.
        v = lg1.sort(-1, descending=True).values
        gaps = (v[:, k - 1] - v[:, k])[differ]
        assert float(gaps.max()) < TIE, (layer, differ, gaps.tolist())
        first = (layer, differ)
        break
    assert first is not None, "the final logits differ but no routing decision does"
    assert first[0] == 1 and 573 in first[1], first
