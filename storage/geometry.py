"""KV geometry: where a request's KV lives, in pages. One frozen object, built once from the model's
layer spec and the engine's page size, handed to the pools, the radix tree, the scheduler, the P/D
leases and the router, so the window-in-pages rule is written here only.

Full-attention layers keep every position; sliding layers (window W: a token attends to itself and
the W - 1 before it) need only the last W - 1 positions before a point to continue from it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

SLIDING = "sliding_attention"


@dataclass(frozen=True)
class KVGeometry:
    page_size: int = 16
    window: Optional[int] = None          # tokens a sliding layer attends to; None: no sliding layers
    full_layers: tuple[int, ...] = ()
    swa_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or isinstance(self.page_size, bool) or self.page_size < 1:
            raise ValueError(f"page_size must be a positive int, got {self.page_size!r}")
        if self.window is not None and (not isinstance(self.window, int) or self.window < 1):
            raise ValueError(f"window must be a positive int or None, got {self.window!r}")
        if self.swa_layers and self.window is None:
            raise ValueError(f"sliding layers {list(self.swa_layers)} need a window")
        object.__setattr__(self, "full_layers", tuple(self.full_layers))
        object.__setattr__(self, "swa_layers", tuple(self.swa_layers))

    @classmethod
    def from_layers(cls, layer_types: Sequence[str], window: Optional[int], page_size: int) -> "KVGeometry":
        """From a model's per-layer types (``sliding_attention`` or anything else: full) and window."""
        swa = tuple(i for i, t in enumerate(layer_types) if t == SLIDING)
        full = tuple(i for i, t in enumerate(layer_types) if t != SLIDING)
        return cls(page_size, window if swa else None, full, swa)

    @property
    def has_swa(self) -> bool:
        return self.window is not None

    @property
    def window_pages(self) -> int:
        """Whole pages whose SWA data a continuation at a page boundary p reads ([p - W + 1, p)); 0 without
        sliding layers."""
        return -(-(self.window - 1) // self.page_size) if self.window else 0

    @property
    def swa_pages_bound(self) -> int:
        """Most SWA pages one request ever holds (unaligned or page-aligned retention alike)."""
        return self.window_pages + 1 if self.window else 0

    def pages(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def swa_lo(self, end: int) -> int:
        """First position a token at ``end`` reads from a sliding layer's KV (0 without a window)."""
        return max(0, end - self.window + 1) if self.window else 0

    def swa_needed_first_page(self, prompt_len: int) -> int:
        """First page holding SWA data the first decode step after a prompt of ``prompt_len`` reads."""
        return self.swa_lo(prompt_len) // self.page_size

    def swa_aligned_first_page(self, prompt_len: int) -> int:
        """First page of the whole-page window before the last page boundary before the prompt's last
        token (``swa_retained_from``'s page): exporting from here lets the receiver's prefix cache serve a
        repeat of the prompt (matched whole pages up to that boundary: its last token is always computed)
        and a continuation from the prompt's own last page boundary, one page later when the prompt ends
        on one."""
        return self.swa_retained_from(prompt_len) // self.page_size

    def swa_retained_from(self, end: int) -> int:
        """First position page-aligned SWA retention (prefix cache on) keeps once positions [0, end) are
        written: the whole-page window before the last page boundary *before position end - 1*. That
        boundary, not the last one at or before ``end``: a repeat of a prompt ending on a page boundary
        matches only up to the page before (its last token is always computed), and the window ending
        there needs one page more. At most ``window_pages + 1`` pages; 0 without a window."""
        if not self.window:
            return 0
        return max(0, ((end - 1) // self.page_size - self.window_pages) * self.page_size)

    CHECKPOINT_WINDOWS = 4
    """Default spacing of a prompt's kept SWA windows (checkpoints), in windows: one window kept per four
    windows of prompt, so checkpoints cost at most a quarter of the interior sliding KV and a branch point
    anywhere in a prompt finds one at most ``4 * window_pages`` pages before it."""

    def checkpoint_pages(self, interval_tokens: int = 0) -> int:
        """Pages between checkpoints: ``interval_tokens`` rounded down to whole pages (at least one), or
        for 0 the default rule (``CHECKPOINT_WINDOWS`` windows: 256 tokens for a window of 64 and pages of
        16). 0 without sliding layers (nothing to keep)."""
        if not self.window:
            return 0
        if interval_tokens:
            return max(1, interval_tokens // self.page_size)
        return self.CHECKPOINT_WINDOWS * self.window_pages

    def plan_pages(self, prompt_len: int) -> tuple[int, int, int]:
        """(full pages, first SWA logical page, SWA pages) a decode side reserves for a prompt. The SWA
        range starts at ``swa_aligned_first_page`` (the earliest a prefill export may use)."""
        if prompt_len < 1:
            raise ValueError(f"prompt_len must be >= 1, got {prompt_len}")
        n_full = self.pages(prompt_len)
        if not self.window:
            return n_full, 0, 0
        first = self.swa_aligned_first_page(prompt_len)
        return n_full, first, n_full - first

    def cacheable_tokens(self, prompt_len: int) -> int:
        """Prompt tokens whose pages a prefix cache can serve: whole pages before the last token, which
        is always computed (so a page ending exactly at the prompt end never hits)."""
        return max(0, prompt_len - 1) // self.page_size * self.page_size
