"""A request's state inside one engine."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.kv_manager import PageTable
from engine.sampling import SamplingParams
from storage.transfer.payload import KVPayload


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0                      # admission order, for FIFO and preemption
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0                 # tokens whose KV is in the pools
    pages: PageTable = field(default_factory=PageTable)   # its L1 pages; written by engine/kv_manager.py only
    cached_tokens: int = 0
    cached_by_tier: dict[str, int] = field(default_factory=lambda: {"L1": 0, "L2": 0, "L3": 0})
    hit: Any = None                       # the prefix cache's PrefixHit while pages are borrowed
    prefetch: Any = None                  # the L3 prefetch of its prefix while it waits for it
    prefetch_checked: bool = False        # L3 was asked for its prefix (while queued or at admission)
    num_preemptions: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)
    prefill_only: bool = False            # stop after the first token and export the prompt KV
    kv_payload: KVPayload | None = None   # the export of a prefill_only request (AsyncEngine.prefill's payload)
    offloaded_pages: int = 0              # leading prompt pages its prefill worker offloads (KVPayload)
    generator: torch.Generator | None = None
    matcher: Any = None                   # engine/grammar.py Matcher of a structured-output request
    logprobs: list = field(default_factory=list)          # TokenLogprob per output token, if asked
    prompt_logprobs: list | None = None   # TokenLogprob | None per prompt position from logprob_start_len
    new_prompt_logprobs: int = 0          # of those, how many the next StepOutput has not carried yet
    matched_stop: int | str | None = None
    # Token positions where a message of the prompt ends (the chat template's render): a later prompt
    # editing or adding a message branches there, so the cache keeps the sliding window before each.
    boundaries: tuple[int, ...] = ()

    def prompt_logprob_positions(self, start: int, end: int) -> list[int]:
        """Of the positions [start, end) run this step, those whose logits score a prompt token still
        without its logprob (position p scores token p + 1)."""
        lps = self.params.logprob_start_len
        if lps < 0:
            return []
        first = max(lps, 1) - 1 + self.num_prompt_logprobs_done()
        last = len(self.prompt_ids) - 2
        return list(range(max(start, first), min(end - 1, last) + 1))

    def num_prompt_logprobs_done(self) -> int:
        """Prompt-token logprobs already computed (position 0 has none and counts as done)."""
        lps = self.params.logprob_start_len
        if self.prompt_logprobs is None:
            return 0
        return len(self.prompt_logprobs) - (1 if lps == 0 else 0)

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    def tokens(self, start: int, end: int) -> list[int]:
        return (self.prompt_ids + self.output_ids)[start:end] if end > len(self.prompt_ids) \
            else self.prompt_ids[start:end]

    @property
    def remaining(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.seq_len - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.remaining == 1 and bool(self.output_ids)
