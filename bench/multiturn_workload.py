"""The multi-turn workload and its statistics, pure (no HTTP, no clock): what bench/multiturn.py sends
and how it sums up what came back.

The shape is the one of SGLang's HiCache multi-turn benchmark: ``num_clients`` conversations of
``num_rounds`` rounds. Round 1 asks a question of ``request_length`` tokens; every later round sends
the whole history (questions and answers so far) plus a new sub-question of ``sub_question_length``
tokens, so a prefix cache can serve everything but the last answer and the new question. Requests
arrive as a Poisson process of ``request_rate`` per second (``inf``: as fast as allowed), at most
``max_parallel`` in flight; with ``round_barrier`` no conversation starts round r + 1 before every one
has finished round r. Text is seeded random words: one character is one token on strata-tiny's
byte-level tokenizer, so lengths are exact there and approximate elsewhere.
"""
from __future__ import annotations

import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

APIS = ("generate", "chat")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class WorkloadConfig:
    num_clients: int = 16
    num_rounds: int = 4
    request_length: int = 512        # tokens of round 1's question
    sub_question_length: int = 64    # tokens of each later round's new question
    output_length: int = 32          # tokens asked for per answer
    request_rate: float = math.inf   # Poisson arrivals per second; inf: no pacing
    max_parallel: int = 4            # requests in flight at most
    round_barrier: bool = False
    seed: int = 0
    api: str = "generate"            # generate (SGLang /generate) | chat (OpenAI /v1/chat/completions)

    def __post_init__(self) -> None:
        for name in ("num_clients", "num_rounds", "request_length", "sub_question_length", "output_length",
                     "max_parallel"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        if not isinstance(self.request_rate, (int, float)) or not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: no pacing), got {self.request_rate!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.api not in APIS:
            raise ValueError(f"api must be one of {APIS}, got {self.api!r}")

    @property
    def num_requests(self) -> int:
        return self.num_clients * self.num_rounds


def random_text(rng: random.Random, n: int) -> str:
    """``n`` characters of lowercase words separated by single spaces."""
    out: list[str] = []
    size = 0
    while size < n:
        word = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 9)))
        piece = word if not out else " " + word
        out.append(piece)
        size += len(piece)
    return "".join(out)[:n]


@dataclass
class Conversation:
    """One client's questions (fixed by the seed) and the history the server's answers build up."""

    cid: int
    questions: list[str]
    answers: list[str] = field(default_factory=list)

    @property
    def next_round(self) -> int:
        return len(self.answers)

    def prompt(self) -> str:
        """The text of the next request: every question and answer so far, then the new question."""
        r = self.next_round
        parts: list[str] = []
        for q, a in zip(self.questions[:r], self.answers):
            parts += [q, a]
        return "".join(parts + [self.questions[r]])

    def messages(self) -> list[dict]:
        """The same conversation as OpenAI chat messages."""
        r = self.next_round
        msgs: list[dict] = []
        for q, a in zip(self.questions[:r], self.answers):
            msgs += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
        return msgs + [{"role": "user", "content": self.questions[r]}]

    def answer(self, text: str) -> None:
        if self.next_round >= len(self.questions):
            raise ValueError(f"conversation {self.cid} has no round left")
        self.answers.append(text)


def make_conversations(cfg: WorkloadConfig) -> list[Conversation]:
    """Every client's questions, from ``cfg.seed`` alone (each client its own stream, so changing
    the number of clients does not change the others' text)."""
    convs = []
    for c in range(cfg.num_clients):
        rng = random.Random(f"{cfg.seed}/{c}")
        qs = [random_text(rng, cfg.request_length if r == 0 else cfg.sub_question_length)
              for r in range(cfg.num_rounds)]
        convs.append(Conversation(c, qs))
    return convs


def arrival_gaps(rate: float, n: int, seed: int) -> list[float]:
    """Seconds to wait before each of ``n`` sends: exponential gaps of mean 1/rate (zero when inf)."""
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(f"{seed}/arrivals")
    return [rng.expovariate(rate) for _ in range(n)]


class TurnQueue:
    """Which conversation may send next. A conversation is ready again when its answer is back; with
    ``barrier`` round r + 1 opens only when every conversation has finished round r."""

    def __init__(self, num_clients: int, num_rounds: int, barrier: bool = False) -> None:
        self.num_rounds = num_rounds
        self.barrier = barrier
        self.done_rounds = [0] * num_clients
        self.ready: deque[int] = deque(range(num_clients))
        self.held: list[int] = []       # finished the open round, waiting at the barrier
        self.in_flight: set[int] = set()

    def pop(self) -> Optional[tuple[int, int]]:
        """(client, round) to send now, or None when nobody is ready."""
        if not self.ready:
            return None
        cid = self.ready.popleft()
        self.in_flight.add(cid)
        return cid, self.done_rounds[cid]

    def finish(self, cid: int) -> None:
        if cid not in self.in_flight:
            raise ValueError(f"client {cid} has no request in flight")
        self.in_flight.remove(cid)
        self.done_rounds[cid] += 1
        if self.done_rounds[cid] >= self.num_rounds:
            pass
        elif not self.barrier:
            self.ready.append(cid)
        else:
            self.held.append(cid)
        if self.barrier and not self.in_flight and not self.ready:
            self.ready.extend(sorted(self.held))   # the round is over everywhere: open the next
            self.held = []

    @property
    def finished(self) -> bool:
        return not self.ready and not self.in_flight and not self.held


@dataclass
class RequestRecord:
    """What one request measured (times in seconds from the start of the run)."""

    client: int
    round: int                  # 1-based
    start: float
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    ttft: Optional[float] = None
    latency: Optional[float] = None
    itl: list[float] = field(default_factory=list)   # seconds per token between streamed chunks
    error: Optional[str] = None


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); nan when empty."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _dist(xs: Sequence[float]) -> dict:
    return {"mean": statistics.fmean(xs) if xs else math.nan, "p50": percentile(xs, 50),
            "p90": percentile(xs, 90), "p99": percentile(xs, 99)}


def hit_rate(records: Sequence[RequestRecord]) -> float:
    """Cached prompt tokens over prompt tokens (token-weighted, as the server counts them)."""
    prompt = sum(r.prompt_tokens for r in records)
    return sum(r.cached_tokens for r in records) / prompt if prompt else math.nan


def summarize(records: Sequence[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.error is None]
    rounds = sorted({r.round for r in ok})
    per_round = []
    for n in rounds:
        rs = [r for r in ok if r.round == n]
        per_round.append({"round": n, "requests": len(rs), "hit_rate": hit_rate(rs),
                          "ttft_mean_s": statistics.fmean(r.ttft for r in rs),
                          "ttft_p50_s": percentile([r.ttft for r in rs], 50),
                          "prompt_tokens_mean": statistics.fmean(r.prompt_tokens for r in rs)})
    dur = max(duration, 1e-9)
    return {
        "requests": len(records), "errors": len(records) - len(ok), "duration_s": duration,
        "ttft_s": _dist([r.ttft for r in ok]),
        "itl_s": _dist([x for r in ok for x in r.itl]),
        "latency_s": _dist([r.latency for r in ok]),
        "input_tokens_per_s": sum(r.prompt_tokens for r in ok) / dur,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / dur,
        "hit_rate": hit_rate(ok),
        "per_round": per_round,
    }


def format_summary(s: dict) -> str:
    ms = lambda d: f"mean {1e3 * d['mean']:.1f}  p50 {1e3 * d['p50']:.1f}  p90 {1e3 * d['p90']:.1f}  " \
                   f"p99 {1e3 * d['p99']:.1f} ms"  # noqa: E731
    lines = [f"requests {s['requests']} ({s['errors']} failed) in {s['duration_s']:.1f} s",
             f"TTFT            {ms(s['ttft_s'])}",
             f"inter-token     {ms(s['itl_s'])}",
             f"throughput      input {s['input_tokens_per_s']:,.0f} tok/s  output {s['output_tokens_per_s']:,.1f} tok/s",
             f"cache hit rate  {s['hit_rate']:.3f}  per round: "
             + "  ".join(f"r{p['round']} {p['hit_rate']:.3f}" for p in s["per_round"])]
    return "\n".join(lines)
