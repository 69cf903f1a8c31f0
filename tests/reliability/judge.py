"""The soak's judge: greedy answers recorded by ``workload`` compared, after the run, with an offline
``Engine`` on the same model. A completed request must match exactly, an aborted or failed stream must be
a prefix of the right answer. A departure is excused only where the model itself is undecided: a near-tie
of the reference's logits (``explain_by_ties``) or of a top-k MoE routing decision
(``explain_by_routing_tie``), after which the reference reproduces the cluster's own answer."""
from __future__ import annotations

import dataclasses
import random

from engine import Engine, SamplingParams
from tests import numerics
from tests.reliability.workload import OK, Outcome, Recorder
from tests.routing_probe import RouterProbe


def verify(rec: Recorder, reference, limit: int | None = None, seed: int = 0) -> dict:
    """Compare greedy outputs with ``reference`` (an offline Engine on the same model). Returns
    {"checked", "wrong": [...], "near_ties": [...]}; an ok request must match exactly, any other a
    prefix, except that a departure at a near-tie of the reference's logits, after which the reference
    continues the cluster's own tokens, is a correct answer (``explain_by_ties``) reported apart."""
    cands = [o for o in rec.outcomes if o.tokens or o.text or (o.kind == OK)]
    if limit is not None and len(cands) > limit:
        cands = random.Random(seed).sample(cands, limit)
    # Answers are memoized on the reference across calls (fault tests, then the soak, judge the same
    # requests); computed in prompt order so a conversation's turns reuse the reference's prefix cache.
    memo: dict[tuple, list[int]] = reference.__dict__.setdefault("_reliability_memo", {})
    todo = sorted({(tuple(o.prompt), o.max_new) for o in cands} - set(memo))
    for i in range(0, len(todo), 4):  # in order, small batches: a turn finds earlier turns cached
        chunk = todo[i:i + 4]
        outs = reference.generate([list(p) for p, _ in chunk],
                                  [SamplingParams(max_new_tokens=n, temperature=0.0) for _, n in chunk])
        memo.update({k: o.token_ids for k, o in zip(chunk, outs)})
    wrong, ties = [], []
    for o in cands:
        want, got = memo[(tuple(o.prompt), o.max_new)], o.tokens
        if o.text is not None or o.endpoint != "/generate":
            want, got = reference.tokenizer.decode(want), o.text or ""
        ok = got == want if o.kind == OK else got == want[:len(got)]
        if ok:
            continue
        tie = explain_by_ties(reference, o) if isinstance(got, list) else explain_text_by_ties(reference, o)
        if tie is None or not tie["explained"]:
            rt = explain_by_routing_tie(reference, o)
            if rt is not None:
                tie = {**(tie or {}), **rt}
        entry = {"kind": o.kind, "endpoint": o.endpoint, "stream": o.stream, "prompt_len": len(o.prompt),
                 "got": got[:16], "want": want[:16], "prompt": list(o.prompt), "max_new": o.max_new,
                 "started": round(o.started, 2), "ended": round(o.ended, 2),   # time.monotonic()
                 "meta": o.meta, **(tie or {})}
        (ties if tie is not None and tie["explained"] else wrong).append(entry)
    return {"checked": len(cands), "wrong": wrong, "near_ties": ties}


def brief(wrong: list[dict]) -> list[dict]:
    """Wrong answers for a failure message: what was asked and answered, where it departed, the route
    and cache tiers; the prompt itself stays in the full report."""
    keys = ("endpoint", "stream", "prompt_len", "got", "want", "near_ties", "routing_tie", "meta")
    return [{k: w.get(k) for k in keys} for w in wrong]


# Two correct computations of one sequence (alone or batched, prefix recomputed or read back from a
# cache tier) differ in their fp32 logits by rounding noise, so at a near-tie greedy decoding may pick
# either token. How close is a tie is the numerics policy's logit tolerance (tests/numerics.py; measured
# noise is 1-2 orders of magnitude under it). A wrong KV page moves logits by far more than this.


def explain_by_ties(reference, o: Outcome, tol: float | None = None, max_ties: int = 3) -> dict:
    """Whether a greedy answer that differs from the reference's is still a correct one: at each point
    where it departs, the reference's logit of the token the cluster chose must be within ``tol`` (default:
    the policy's logit tolerance there) of its top logit (a near-tie), and from there the reference,
    continuing the cluster's own tokens, must reproduce the rest. Returns the divergence points, their
    margins and ``explained``."""
    got, points = list(o.tokens), []
    start = 0   # got[:start] is already explained
    while True:
        ctx = list(o.prompt) + got[:start]
        n = o.max_new - start
        if n <= 0 or start >= len(got):
            return {"explained": True, "near_ties": points}
        ref = reference.generate([ctx], SamplingParams(max_new_tokens=n, temperature=0.0, return_logits=True))[0]
        tail, want = got[start:], ref.token_ids
        k = next((i for i, (a, b) in enumerate(zip(tail, want)) if a != b), None)
        if k is None:   # the rest agrees (a shorter answer must be a prefix: aborted, or a stop token)
            ok = len(tail) <= len(want) if o.kind != OK else tail == want
            return {"explained": ok, "near_ties": points}
        logits = ref.logits[k].float()
        gap = float(logits.max() - logits[tail[k]])
        limit = tol if tol is not None else numerics.logit_tolerance(
            reference.model_config, len(ctx) + k, numerics.magnitude(logits))
        points.append({"at": start + k, "ref_token": want[k], "got_token": tail[k], "ref_margin": gap,
                       "tolerance": limit})
        if gap > limit or len(points) > max_ties:
            return {"explained": False, "near_ties": points}
        start += k + 1


def explain_text_by_ties(reference, o: Outcome, tol: float | None = None, max_ties: int = 3) -> dict:
    """``explain_by_ties`` for an answer that came back as text (/v1/completions): the token path the
    text implies is rebuilt from the reference. At the first step where the reference's text stops
    being a prefix of the cluster's, the cluster must have chosen a token within ``tol`` (default: the
    policy's logit tolerance there) of the reference's top logit whose text continues its answer (tried
    in logit order, at that step or up to three steps before it: the bytes of one character are several
    tokens and show nothing until the last); from there the reference, continuing that token, must
    reproduce the rest of the text. Returns the departure points, their margins and ``explained``."""
    tok = reference.tokenizer
    got = o.text or ""

    def fits(ids: list[int]) -> bool:   # the text of ids is consistent with got, an unfinished character aside
        return got.startswith(tok.decode(ids).rstrip("\ufffd"))

    def done(ids: list[int]) -> bool:
        text = tok.decode(ids)
        return text == got if o.kind == OK else text.startswith(got)

    def walk(ids: list[int], points: list) -> dict:
        n = o.max_new - len(ids)
        if n <= 0:
            return {"explained": done(ids), "near_ties": points}
        ctx = list(o.prompt) + ids
        ref = reference.generate([ctx], SamplingParams(max_new_tokens=n, temperature=0.0, return_logits=True))[0]
        path = ids + ref.token_ids
        if done(path):
            return {"explained": True, "near_ties": points}
        k = next((i for i in range(len(ref.token_ids)) if not fits(path[:len(ids) + i + 1])), None)
        if k is None or len(points) >= max_ties:
            return {"explained": False, "near_ties": points}
        best = None
        for j in range(k, max(-1, k - 4), -1):
            logits = ref.logits[j].float()
            limit = tol if tol is not None else numerics.logit_tolerance(
                reference.model_config, len(ctx) + j, numerics.magnitude(logits))
            for t in logits.argsort(descending=True).tolist():
                margin = float(logits.max() - logits[t])
                if margin > limit:
                    break
                head = path[:len(ids) + j] + [t]
                if t == ref.token_ids[j] or not fits(head):
                    continue
                point = {"at": len(ids) + j, "ref_token": ref.token_ids[j], "got_token": t, "ref_margin": margin,
                         "tolerance": limit}
                res = walk(head, points + [point])
                if res["explained"]:
                    return res
                best = best or res
        if best is not None:
            return best
        # No token within the tolerance continues the text: report the reference's margin to the runner-up.
        logits = ref.logits[k].float()
        return {"explained": False, "near_ties": points + [{
            "at": len(ids) + k, "ref_token": ref.token_ids[k], "got_token": None,
            "ref_margin": float(logits.topk(2).values[0] - logits.topk(2).values[1]),
            "tolerance": tol if tol is not None else numerics.logit_tolerance(
                reference.model_config, len(ctx) + k, numerics.magnitude(logits))}]}

    return walk([], [])


# Top-k MoE routing has near-ties too: a token's k-th and (k+1)-th expert logits can be 1e-6 apart, and
# the rounding noise between batch shapes (chunked or one-step prefill, other requests in the step) then
# picks the other expert; everything after that layer follows. Under the policy's router tolerance
# (tests/numerics.py) a routing decision is a tie.


def explain_by_routing_tie(reference, o: Outcome, tol: float | None = None, max_tries: int = 4) -> dict | None:
    """Whether an answer that departs from the reference is the model's answer with one routing tie
    broken the other way. The prompt is prefilled in one step and decoded alone; every top-k decision
    (layer, step, token position) whose gap between the k-th and (k+1)-th router logit is within ``tol``
    (default: the policy's router tolerance for that layer) is a tie, in the prefill step or in a decode
    step. For the closest ``max_tries`` ties in turn, that one decision is given the other expert (nothing
    else changes) and the answer regenerated. None when there is no tie."""
    eng = reference.__dict__.get("_one_step")
    if eng is None:   # one-step prefill, one request alone: a row's position is its token position
        eng = Engine(dataclasses.replace(reference.cfg, max_batch_tokens=8192, enable_prefix_cache=False,
                                         hicache=None, eplb=None))
        reference.__dict__["_one_step"] = eng

    def matches(ids: list[int]) -> bool:
        if o.text is not None or o.endpoint != "/generate":
            want, got = reference.tokenizer.decode(ids), o.text or ""
        else:
            want, got = ids, list(o.tokens)
        return got == want if o.kind == OK else got == want[:len(got)]

    def run(flip=None) -> tuple[list[int], RouterProbe]:
        with RouterProbe(eng, flip) as probe:
            ids = eng.generate([list(o.prompt)], SamplingParams(max_new_tokens=o.max_new, temperature=0.0))
        return ids[0].token_ids, probe

    base, probe = run()
    seq_len = len(o.prompt) + o.max_new
    limit = [tol if tol is not None else numerics.router_tolerance(
        eng.model_config, layer, seq_len, numerics.magnitude(probe.logits(layer)))
        for layer in range(len(probe.routers))]
    ties = sorted(d for d in probe.decisions if d.gap <= limit[d.layer])[:max_tries]
    if not ties:
        return None
    brief = [{"gap": d.gap, "layer": d.layer, "step": d.step, "position": d.position} for d in ties]
    if matches(base):   # the batched reference broke a tie, not the cluster
        return {"explained": True, "routing_tie": {**brief[0], "broken_by": "reference"}}
    for tie, d in zip(brief, ties):
        if matches(run((d.layer, d.position))[0]):
            return {"explained": True, "routing_tie": tie}
    return {"explained": False, "routing_tie": brief[0], "routing_ties_tried": len(brief)}
