"""Reference generations from transformers' own GptOss implementation (the test oracle)."""
from __future__ import annotations

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
    r = model(torch.tensor([prompt]), use_cache=True)
    past, logits = r.past_key_values, r.logits[0, -1]
    toks, steps = [], []
    for _ in range(n):
        t = int(logits.argmax())
        toks.append(t)
        steps.append(logits.clone())
        r = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, logits = r.past_key_values, r.logits[0, -1]
    return HFOutput(toks, steps, len(prompt))
