"""The numerics policy: when two computations of the same math count as the same, on any x86-64 CPU.

Two correct computations of one formula may add their terms in another order: another SIMD width
(``ATEN_CPU_CAPABILITY``: avx512, avx2, default), another BLAS blocking, another batch shape (chunked or
one-step prefill, a request alone or in a batch, an expert's rows split over replicas). Each rounds
differently, so a test may never ask two of them for equal bits, nor for a closeness tuned to one CPU.
What it asks is derived here, and nowhere else, from three things:

- the dtype's unit roundoff ``u`` (half its machine epsilon);
- the reduction length ``n``: the most terms one output element sums (a dot product's length, the
  positions attention sums over);
- the magnitude ``scale`` of the values compared (for logits: the largest |logit|, their scale).

One length-n sum in precision u is off by at most ``LAMBDA * sqrt(n) * u`` of the magnitude of its terms
with probability at least ``1 - 2 n exp(-LAMBDA^2 / 2)`` (Higham & Mary, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 2019); with LAMBDA = 8 that is 1 - 1e-11 for
n = 1000, so a sound computation does not fail by chance. A value built by ``depth`` chained stages of
such sums (layers of a model) accumulates their independent errors: sqrt(n * depth). Two computations are
each that far from the exact value, so they may be twice that far from each other.

"Same tokens" (greedy decoding): the token lists are identical, except that from a step where the
reference's own logits have a near-tie (its top logit and the token the other computation chose are
closer than the logit tolerance) the two may continue differently; what follows that step is not
compared. A wrong KV page, a wrong expert or a wrong position moves logits by orders of magnitude more
than these tolerances, so the policy keeps every such defect visible.
"""
from __future__ import annotations

import json
import math
import os
from typing import Sequence

import torch

LAMBDA = 8.0

# Chained rounding stages in one decoder layer of the models served here: input norm, q/k/v projection,
# q.k scores, softmax, weights.v, o projection, post-attention norm, router, expert gate_up, expert down,
# the weighted sum over the chosen experts. The final norm and the LM head add two more.
STAGES_PER_LAYER = 11
HEAD_STAGES = 2


def unit_roundoff(dtype: torch.dtype = torch.float32) -> float:
    return torch.finfo(dtype).eps / 2


def tolerance(dtype: torch.dtype, n: int, scale: float, depth: int = 1) -> float:
    """The largest |a - b| between two computations of one value of magnitude ``scale`` made by ``depth``
    chained stages that each sum at most ``n`` terms in ``dtype``."""
    if n < 1 or depth < 1:
        raise ValueError(f"reduction length and depth must be >= 1, got n={n}, depth={depth}")
    if not math.isfinite(scale) or scale < 0:
        raise ValueError(f"scale must be a finite magnitude >= 0, got {scale}")
    return 2.0 * LAMBDA * unit_roundoff(dtype) * math.sqrt(n * depth) * scale


def _record(kind: str, what: str, diff: float, tol: float) -> None:
    """With STRATA_NUMERICS_LOG=<file>, every check appends {kind, what, diff, tol} to it: the policy's
    headroom on this CPU, measured (how the closing notes' figures are made)."""
    path = os.environ.get("STRATA_NUMERICS_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"kind": kind, "what": what, "diff": diff, "tol": tol}) + "\n")


def magnitude(x: torch.Tensor) -> float:
    """The scale of a tensor: its largest |value| (0 for an empty one)."""
    return float(x.detach().abs().max()) if x.numel() else 0.0


def assert_close(got: torch.Tensor, want: torch.Tensor, *, n: int, depth: int = 1,
                 scale: float | None = None, dtype: torch.dtype | None = None, what: str = "") -> None:
    """``got`` equals ``want`` within the policy's tolerance for ``n``-term sums over ``depth`` stages, at
    the magnitude ``scale`` (default: the largest |value| of ``want``), in ``dtype`` (default: the coarser
    of the two tensors' dtypes; name it when either was computed in a coarser one and then converted)."""
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shapes differ, {tuple(got.shape)} vs {tuple(want.shape)}")
    if dtype is None:
        dtype = got.dtype if torch.finfo(got.dtype).eps >= torch.finfo(want.dtype).eps else want.dtype
    s = magnitude(want) if scale is None else scale
    tol = tolerance(dtype, n, s, depth)
    diff = magnitude(got.double() - want.double())
    _record("values", what, diff, tol)
    if not diff <= tol:
        raise AssertionError(f"{what}: max |difference| {diff:.3g} > tolerance {tol:.3g} "
                             f"({dtype}, n={n}, depth={depth}, scale={s:.3g})")


# ------------------------------------------------------------------------------------ model outputs

def reduction_length(mc, seq_len: int) -> int:
    """The longest sum in a forward over ``seq_len`` positions of a model with config ``mc``: a hidden,
    intermediate or head dimension, or the positions attention sums over."""
    return max(mc.hidden_size, mc.intermediate_size, mc.head_dim, seq_len, 1)


def logit_tolerance(mc, seq_len: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of a model's output logits at position ``seq_len`` may be apart."""
    depth = mc.num_hidden_layers * STAGES_PER_LAYER + HEAD_STAGES
    return tolerance(dtype, reduction_length(mc, seq_len), scale, depth)


def router_tolerance(mc, layer: int, seq_len: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of layer ``layer``'s MoE router logits may be apart: under this gap
    between the k-th and (k+1)-th expert, a routing decision is a tie either computation may break."""
    depth = layer * STAGES_PER_LAYER + STAGES_PER_LAYER - 3   # up to and including the router
    return tolerance(dtype, reduction_length(mc, seq_len), scale, depth)


def assert_logits_close(got: torch.Tensor, want: torch.Tensor, mc, seq_len: int, what: str = "") -> None:
    """One step's logits [V] (or several steps' [S, V]) of two computations agree within the policy."""
    tol = logit_tolerance(mc, seq_len, magnitude(want))
    diff = magnitude(got.double() - want.double())
    _record("logits", what, diff, tol)
    if not diff <= tol:
        raise AssertionError(f"{what}: logits differ by {diff:.3g} > tolerance {tol:.3g} "
                             f"(seq_len={seq_len}, scale={magnitude(want):.3g})")


def departure(got: Sequence[int], want: Sequence[int], want_logits: Sequence[torch.Tensor], mc,
              prompt_len: int) -> dict | None:
    """Where greedy ``got`` first departs from the reference ``want`` (None: identical), the reference's
    margin there (its top logit minus its logit of got's token), the tolerance, and ``excused``: the
    margin is within it, so the reference itself was undecided there."""
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if k is None:
        if len(got) == len(want):
            return None
        return {"at": min(len(got), len(want)), "excused": False, "why": "lengths differ",
                "got_len": len(got), "want_len": len(want)}
    if k >= len(want_logits):
        raise ValueError(f"the reference has logits for {len(want_logits)} steps; it departs at step {k}: "
                         "generate it with return_logits=True")
    lg = want_logits[k].float()
    margin = float(lg.max() - lg[got[k]])
    tol = logit_tolerance(mc, prompt_len + k, magnitude(lg))
    return {"at": k, "got": got[k], "want": want[k], "margin": margin, "tolerance": tol,
            "excused": margin <= tol}


def assert_same_tokens(got: Sequence[int], want: Sequence[int], want_logits: Sequence[torch.Tensor], mc,
                       prompt_len: int, what: str = "") -> dict | None:
    """``got`` is the same greedy answer as the reference ``want`` (with its per-step logits): identical,
    or departing only at a near-tie of the reference. Returns the departure (None when identical)."""
    d = departure(list(got), list(want), want_logits, mc, prompt_len)
    if d is not None:
        _record("departure", what, d.get("margin", math.inf), d.get("tolerance", 0.0))
    if d is not None and not d["excused"]:
        raise AssertionError(f"{what}: tokens depart from the reference: {d}; got {list(got)[:24]}, "
                             f"want {list(want)[:24]}")
    return d


def assert_same_output(got, want, mc, what: str = "", logits: bool = True) -> dict | None:
    """``got`` (a ``GenerationOutput``, or just its token ids, e.g. from HTTP) and the reference ``want``
    (a ``GenerationOutput`` with logits) of one prompt: same tokens under the near-tie rule, and, where
    both carry logits, the same logits up to and including the step where they depart (after it, the
    two condition on different tokens)."""
    ids = list(got) if isinstance(got, (list, tuple)) else got.token_ids
    d = assert_same_tokens(ids, want.token_ids, want.logits, mc, want.prompt_tokens, what)
    if logits and not isinstance(got, (list, tuple)) and got.logits and want.logits:
        last = len(want.token_ids) if d is None else d["at"] + 1
        for i in range(min(last, len(got.logits), len(want.logits))):
            assert_logits_close(got.logits[i], want.logits[i], mc, want.prompt_tokens + i, f"{what} step {i}")
    return d


def assert_same_outputs(got: Sequence, want: Sequence, mc, what: str = "") -> list:
    """Pairs of outputs of the same prompts, each as ``assert_same_output``; returns the departures."""
    assert len(got) == len(want), f"{what}: {len(got)} outputs for {len(want)} prompts"
    return [assert_same_output(g, w, mc, f"{what} #{i}") for i, (g, w) in enumerate(zip(got, want))]


def assert_same_turns(got: Sequence, want: Sequence, mc, what: str = "") -> int:
    """The turns of one conversation, each prompt holding the earlier answers: compared turn by turn up
    to and including the first excused departure (later prompts differ). Returns the turns compared."""
    for i, (g, w) in enumerate(zip(got, want)):
        if assert_same_output(g, w, mc, f"{what} turn {i}") is not None:
            return i + 1
    return min(len(got), len(want))


def logprob_tolerance(mc, seq_len: int, scale: float, dtype: torch.dtype = torch.float32) -> float:
    """How far two computations of one token's logprob at position ``seq_len`` may be apart: a logprob is
    a logit minus the log-sum-exp of all of them, each off by up to the logit tolerance."""
    return 2 * logit_tolerance(mc, seq_len, scale, dtype)


def assert_same_logprobs(got_tokens: Sequence[int], got_logprobs: Sequence[float], want, mc,
                         what: str = "") -> dict | None:
    """A greedy answer's tokens and their logprobs (e.g. from HTTP) against the reference output ``want``
    (with logits): the same tokens under the near-tie rule, and each logprob equal to the reference's
    log_softmax of that token up to and including the step where they depart (the context is the same
    until then). Returns the departure (None when identical)."""
    d = assert_same_tokens(got_tokens, want.token_ids, want.logits, mc, want.prompt_tokens, what)
    last = len(got_tokens) if d is None else d["at"] + 1
    for k in range(min(last, len(got_logprobs), len(want.logits))):
        logits = want.logits[k]
        ref = float(torch.log_softmax(logits.double(), -1)[got_tokens[k]])
        tol = logprob_tolerance(mc, want.prompt_tokens + k, magnitude(logits))
        diff = abs(float(got_logprobs[k]) - ref)
        _record("logprobs", f"{what} step {k}", diff, tol)
        if not diff <= tol:
            raise AssertionError(f"{what} step {k}: logprob {got_logprobs[k]:.6g} vs {ref:.6g}: differ by "
                                 f"{diff:.3g} > tolerance {tol:.3g}")
    return d


def with_logits(sp):
    """The same SamplingParams, returning each step's logits: what a reference run needs for the rule."""
    import dataclasses
    return dataclasses.replace(sp, return_logits=True)


def assert_same_text(got: str, want, tokenizer, mc, what: str = "") -> dict | None:
    """A text answer (OpenAI surfaces carry no token ids) against the reference output ``want``: equal
    to its decoded text, or departing from it at a token where the reference was undecided (its top two
    logits within the logit tolerance). Returns the departure (None when equal)."""
    text = tokenizer.decode(want.token_ids)
    if got == text:
        return None
    k = next((i for i in range(len(want.token_ids))
              if not got.startswith(tokenizer.decode(want.token_ids[:i + 1]))), len(want.token_ids))
    if k >= len(want.token_ids):
        raise AssertionError(f"{what}: text {got!r} goes on past the reference's {text!r}")
    lg = want.logits[k].float()
    top2 = lg.topk(2).values
    margin = float(top2[0] - top2[1])
    tol = logit_tolerance(mc, want.prompt_tokens + k, magnitude(lg))
    d = {"at": k, "margin": margin, "tolerance": tol, "excused": margin <= tol}
    _record("departure", what, margin, tol)
    if not d["excused"]:
        raise AssertionError(f"{what}: text departs from the reference at token {k}: {d}; got {got!r}, "
                             f"want {text!r}")
    return d
