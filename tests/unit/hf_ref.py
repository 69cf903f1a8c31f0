"""Reference generations from transformers' own GptOss implementation (the test oracle)."""
from __future__ import annotations

import inspect
from typing import NamedTuple

import torch


class HFOutput(NamedTuple):
    """transformers' greedy answer, in the fields tests/numerics.py reads of a GenerationOutput."""
    token_ids: list[int]
    logits: list[torch.Tensor]      # [V] per step: the logits each token was chosen from
    prompt_tokens: int


def load_hf(path):
    from transformers import GptOssForCausalLM
    return GptOssForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> HFOutput:
    """Greedy tokens and the logits each of them was chosen from."""
    # transformers 5.25 renamed the forward's `past_key_values` (and the output's) to `cache`; the old name
    # warns and goes in 5.40.
    new_name = "cache" in inspect.signature(model.forward).parameters
    r = model(torch.tensor([prompt]), use_cache=True)
    toks, steps = [], []
    for _ in range(n):
        past, logits = (r.cache if new_name else r.past_key_values), r.logits[0, -1]
        t = int(logits.argmax())
        toks.append(t)
        steps.append(logits.clone())
        r = model(torch.tensor([[t]]), use_cache=True, **{"cache" if new_name else "past_key_values": past})
    return HFOutput(toks, steps, len(prompt))
