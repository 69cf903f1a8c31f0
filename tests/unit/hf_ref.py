"""Reference generations from transformers' own GptOss implementation (the test oracle)."""
from __future__ import annotations

import torch


def load_hf(path):
    from transformers import GptOssForCausalLM
    return GptOssForCausalLM.from_pretrained(path, attn_implementation="eager", dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens and the logits at the last prompt position."""
    r = model(torch.tensor([prompt]), use_cache=True)
    past, logits = r.past_key_values, r.logits[0, -1]
    first = logits.clone()
    toks = []
    for _ in range(n):
        t = int(logits.argmax())
        toks.append(t)
        r = model(torch.tensor([[t]]), past_key_values=past, use_cache=True)
        past, logits = r.past_key_values, r.logits[0, -1]
    return toks, first
