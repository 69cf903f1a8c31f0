"""Per-request sampling state around the sampler: what a row of the batch reads (RowState), what a
sampled token does to the request (grammar, logprobs, stop), and a decode worker's catch-up on the token
its prefill worker sampled. Kept out of engine.py, which only drives the steps."""
from __future__ import annotations

from engine.request import Request
from engine.sampler import RowState


def row_state(req: Request, eos_ids: frozenset[int]) -> RowState:
    p = req.params
    masked: tuple[int, ...] = ()
    if len(req.output_ids) < p.min_new_tokens and req.matcher is None:
        # the grammar decides when it may end; otherwise nothing that would stop it before min_new_tokens
        masked = tuple(p.stop_token_ids) + (() if p.ignore_eos else tuple(sorted(eos_ids)))
    mask = req.matcher.allowed() if req.matcher is not None and not req.matcher.done else None
    return RowState(p, req.prompt_ids, req.output_ids, req.generator, mask, masked)


def stop_reason(req: Request, tok: int, eos_ids: frozenset[int], max_context: int, decode_tail) -> str | None:
    """Why ``req`` ends after its latest token ``tok`` (already appended), or None; sets matched_stop.
    ``decode_tail(ids) -> str`` decodes the end of the completion for the stop-string check."""
    p = req.params
    n = len(req.output_ids)
    if req.matcher is not None and req.matcher.done:
        req.matched_stop = tok if tok in eos_ids else None
        return "stop"
    if n > p.min_new_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in eos_ids)):
        req.matched_stop = tok
        return "stop"
    if p.stop and n >= p.min_new_tokens:
        # A token is at least one byte: 4 tokens per character cover any stop string that ends here.
        longest = max(len(s) for s in p.stop)
        tail = decode_tail(req.output_ids[-(4 * longest + 4):])
        hit = min(((tail.find(s), s) for s in p.stop if s in tail), default=None)
        if hit is not None:
            req.matched_stop = hit[1]
            return "stop"
    if n >= p.max_new_tokens or req.seq_len >= max_context:
        return "length"
    return None


def catch_up_first_token(req: Request, vocab_size: int) -> None:
    """A decode worker admits a request whose first token the prefill worker sampled: advance the
    grammar past it and the generator past its draw, so the rest is what one engine would produce."""
    first = req.output_ids[0]
    if req.matcher is not None:
        req.matcher.consume(first)
    if req.generator is not None:
        import torch
        torch.empty(vocab_size, dtype=torch.float64).exponential_(generator=req.generator)
