"""The sampler: one step's tokens for the running batch, as tensor operations over the batch.

Per row (one request): processed logits = logits + logit_bias, penalised (repetition over prompt and
output; presence and frequency over the output), with the min_new_tokens and grammar masks; logprobs
are log_softmax of the processed logits. Then greedy rows take the argmax; sampled rows are scaled by
temperature, cut by top-k, top-p and min-p, and drawn by the exponential race (argmax of p / q with
q ~ Exp(1)): each row draws its q from its own generator, one vector of vocabulary size per token, so a
seeded request's tokens do not depend on the batch it ran in. ``ref_sample_row`` is the per-row torch
version, the oracle of tests."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling import SamplingParams, TokenLogprob

NEG_INF = float("-inf")


def make_generator(seed: int | None, fallback: torch.Generator) -> torch.Generator:
    """A request's own generator: seeded by its ``seed``, else drawn from the engine's ``fallback``."""
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,), generator=fallback)))
    return g


@dataclass
class RowState:
    """What the sampler reads of one request."""
    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None = None
    grammar_mask: torch.Tensor | None = None     # [vocab] bool: allowed tokens (None: no grammar)
    stop_masked: tuple[int, ...] = ()            # ids forbidden now (eos / stop ids before min_new_tokens)


def _penalize(x: torch.Tensor, rows: list[int], states: list[RowState]) -> None:
    """In place on x [B, V] for the penalised ``rows``."""
    if not rows:
        return
    b, v, dev = len(rows), x.shape[1], x.device
    out_len = max(1, max(len(states[r].output_ids) for r in rows))
    all_len = max(1, max(len(states[r].prompt_ids) + len(states[r].output_ids) for r in rows))
    out_ids = torch.full((b, out_len), v, dtype=torch.long)           # v: a padding column, dropped
    all_ids = torch.full((b, all_len), v, dtype=torch.long)
    for k, r in enumerate(rows):
        s = states[r]
        if s.output_ids:
            out_ids[k, :len(s.output_ids)] = torch.tensor(s.output_ids)
        seq = s.prompt_ids + s.output_ids
        all_ids[k, :len(seq)] = torch.tensor(seq)
    # The id lists are built on the host (Python lists), the counts where the logits live.
    out_ids, all_ids = out_ids.to(dev), all_ids.to(dev)
    counts = torch.zeros(b, v + 1, device=dev).scatter_add_(1, out_ids, torch.ones(b, out_len, device=dev))[:, :v]
    seen = torch.zeros(b, v + 1, dtype=torch.bool, device=dev).scatter_(1, all_ids, True)[:, :v]
    p = [states[r].params for r in rows]
    rep = torch.tensor([q.repetition_penalty for q in p], device=dev)[:, None]
    pres = torch.tensor([q.presence_penalty for q in p], device=dev)[:, None]
    freq = torch.tensor([q.frequency_penalty for q in p], device=dev)[:, None]
    idx = torch.tensor(rows, device=dev)
    y = x[idx]
    y = torch.where(seen, torch.where(y > 0, y / rep, y * rep), y)
    y = y - freq * counts - pres * (counts > 0).float()
    x[idx] = y


def processed_logits(logits: torch.Tensor, states: list[RowState]) -> torch.Tensor:
    """logits [B, V] fp32 -> the processed logits [B, V] fp32 (a new tensor)."""
    x = logits.float().clone()
    v, dev = x.shape[1], x.device
    bias = [(r, t, b) for r, s in enumerate(states) for t, b in s.params.logit_bias if t < v]
    if bias:
        r, t, b = zip(*bias)
        x.index_put_((torch.tensor(r, device=dev), torch.tensor(t, device=dev)),
                     torch.tensor(b, dtype=x.dtype, device=dev), accumulate=True)
    _penalize(x, [r for r, s in enumerate(states) if s.params.penalized], states)
    masked = [(r, t) for r, s in enumerate(states) for t in s.stop_masked if t < v]
    if masked:
        r, t = zip(*masked)
        x[torch.tensor(r, device=dev), torch.tensor(t, device=dev)] = NEG_INF
    g = [r for r, s in enumerate(states) if s.grammar_mask is not None]
    if g:
        allowed = torch.stack([states[r].grammar_mask[:v] for r in g]).to(dev)
        idx = torch.tensor(g, device=dev)
        x[idx] = x[idx].masked_fill(~allowed, NEG_INF)
    return x


def _draw(x: torch.Tensor, states: list[RowState], rows: list[int]) -> torch.Tensor:
    """Sampled tokens of ``rows`` from processed logits x [B, V]: temperature, top-k, top-p, min-p and
    the exponential race. Float64 and shifted so the top logit is 0: a tiny temperature (1e-300 is a
    valid one, 0 in float32) then gives -inf for the others instead of nan."""
    dev = x.device
    idx = torch.tensor(rows, device=dev)
    p = [states[r].params for r in rows]
    y = x[idx].double()
    y = (y - y.max(dim=-1, keepdim=True).values) / torch.tensor([q.temperature for q in p], dtype=torch.float64,
                                                                device=dev)[:, None]
    v = y.shape[1]
    srt, order = torch.sort(y, dim=-1, descending=True, stable=True)
    probs = torch.softmax(srt, dim=-1)
    rank = torch.arange(v, device=dev)[None, :]
    k = torch.tensor([q.top_k if 0 < q.top_k < v else v for q in p], device=dev)[:, None]
    top_p = torch.tensor([q.top_p for q in p], dtype=torch.float64, device=dev)[:, None]
    min_p = torch.tensor([q.min_p for q in p], dtype=torch.float64, device=dev)[:, None]
    # Keep the smallest head whose mass reaches top_p (the first token always stays), the top k, and
    # what is at least min_p times as likely as the best.
    drop = (rank >= k) | (probs.cumsum(-1) - probs >= top_p) | (probs < min_p * probs[:, :1])
    drop[:, 0] = False
    srt = srt.masked_fill(drop, NEG_INF)
    y = torch.full_like(y, NEG_INF).scatter_(1, order, srt)
    probs = torch.softmax(y, dim=-1)
    # Each request's race is drawn from its own (host) generator, so a seeded request samples the same
    # tokens whatever the device or the batch.
    q = torch.stack([torch.empty(v, dtype=torch.float64).exponential_(generator=states[r].generator) for r in rows])
    return (probs / q.to(dev)).argmax(dim=-1)


def sample(logits: torch.Tensor, states: list[RowState]) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits [B, V] fp32 -> (token per row, its TokenLogprob or None when the row did not ask)."""
    x = processed_logits(logits, states)
    toks = x.argmax(dim=-1)
    rows = [r for r, s in enumerate(states) if not s.params.greedy]
    if rows:
        toks[torch.tensor(rows, device=x.device)] = _draw(x, states, rows)
    out = toks.tolist()
    return out, logprobs_of(x, out, states)


def logprobs_of(x: torch.Tensor, toks: list[int], states: list[RowState]) -> list[TokenLogprob | None]:
    lp_rows = [r for r, s in enumerate(states) if s.params.wants_logprobs]
    res: list[TokenLogprob | None] = [None] * len(states)
    if not lp_rows:
        return res
    idx = torch.tensor(lp_rows, device=x.device)
    lp = torch.log_softmax(x[idx], dim=-1)
    chosen = lp.gather(1, torch.tensor([[toks[r]] for r in lp_rows], device=x.device))[:, 0].tolist()
    n = max(states[r].params.top_logprobs for r in lp_rows)
    top_v, top_i = (torch.topk(lp, min(n, lp.shape[1]), dim=-1) if n else (None, None))
    for k, r in enumerate(lp_rows):
        m = states[r].params.top_logprobs
        top = tuple(zip(top_i[k, :m].tolist(), top_v[k, :m].tolist())) if m else ()
        res[r] = TokenLogprob(toks[r], chosen[k], top)
    return res


def token_logprobs(logits: torch.Tensor, tokens: list[int], top_n: int) -> list[TokenLogprob]:
    """logits [N, V] (raw: prompt positions) -> the logprob of tokens[i] under row i, with top-N."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])
    chosen = picked[:, 0].tolist()
    ranks = ((lp > picked).sum(dim=-1) + 1).tolist()
    if not top_n:
        return [TokenLogprob(t, c, (), r) for t, c, r in zip(tokens, chosen, ranks)]
    v, i = torch.topk(lp, min(top_n, lp.shape[1]), dim=-1)
    return [TokenLogprob(t, c, tuple(zip(ii, vv)), r)
            for t, c, ii, vv, r in zip(tokens, chosen, i.tolist(), v.tolist(), ranks)]


def ref_sample_row(logits: torch.Tensor, s: RowState) -> int:
    """One row, straight from the definitions (the test oracle of ``sample``): logits [V] -> token."""
    p = s.params
    x = logits.double().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if p.penalized:
        for t in set(s.prompt_ids + s.output_ids):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        for t in set(s.output_ids):
            x[t] -= p.frequency_penalty * s.output_ids.count(t) + p.presence_penalty
    for t in s.stop_masked:
        x[t] = NEG_INF
    if s.grammar_mask is not None:
        x[~s.grammar_mask] = NEG_INF
    if p.greedy:
        return int(x.argmax())
    y = (x - x.max()) / p.temperature
    probs = torch.softmax(y, dim=-1)
    order = sorted(range(len(y)), key=lambda i: (-float(y[i]), i))
    keep, mass = set(), 0.0
    for r, i in enumerate(order):
        if r == 0 or ((not p.top_k or r < p.top_k) and mass < p.top_p and probs[i] >= p.min_p * probs[order[0]]):
            keep.add(i)
        mass += float(probs[i])
    y = torch.tensor([float(y[i]) if i in keep else NEG_INF for i in range(len(y))], dtype=torch.float64)
    q = torch.empty(len(y), dtype=torch.float64).exponential_(generator=s.generator)
    return int((torch.softmax(y, dim=-1) / q).argmax())
