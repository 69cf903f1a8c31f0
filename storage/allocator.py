"""The free-list page allocator every pool and lease table hands pages out of (no torch: the router's and
the ingress's processes import the lease types that use it)."""
from __future__ import annotations

from typing import Iterable, Mapping


class PageAllocator:
    """Free-list page allocator. Lowest page indices are handed out first (deterministic)."""

    def __init__(self, num_pages: int, name: str = "pool", on_alloc=None) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.name = name
        self.on_alloc = on_alloc  # debug hook: called with the pages handed out
        self.num_pages = num_pages
        # Stack with the lowest index on top; `_is_free` makes double frees O(1) to detect.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01" * num_pages)
        self.peak_used = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` pages; raises MemoryError when fewer are free (nothing is taken then)."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            raise MemoryError(f"{self.name}: {n} pages requested, {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        for p in out:
            self._is_free[p] = 0
        self.peak_used = max(self.peak_used, self.num_used)
        if self.on_alloc is not None and out:
            self.on_alloc(out)
        return out

    def free(self, pages: Iterable[int]) -> None:
        pages = list(pages)
        for p in pages:
            if not (0 <= p < self.num_pages):
                raise ValueError(f"{self.name}: page {p} out of range [0, {self.num_pages})")
            if self._is_free[p]:
                raise RuntimeError(f"{self.name}: page {p} freed twice")
            self._is_free[p] = 1
            self._free.append(p)

    def reset_peak(self) -> None:
        self.peak_used = self.num_used

    def check_integrity(self, owners: Mapping[str, Iterable[int]] | None = None) -> None:
        """Raise if the free list is inconsistent, or (with ``owners``) if a page is not owned by
        exactly one of: the free list, or one owner (a tree node, a running request, ...)."""
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise AssertionError(f"{self.name}: free list has {len(self._free) - len(free_set)} duplicates")
        flagged = sum(self._is_free)
        if flagged != len(free_set) or any(not self._is_free[p] for p in free_set):
            raise AssertionError(f"{self.name}: free flags ({flagged}) disagree with free list ({len(free_set)})")
        if owners is None:
            return
        seen: dict[int, str] = {}
        for owner, pages in owners.items():
            for p in pages:
                if p in free_set:
                    raise AssertionError(f"{self.name}: page {p} owned by {owner} is also free")
                if p in seen:
                    raise AssertionError(f"{self.name}: page {p} owned by both {seen[p]} and {owner}")
                seen[p] = owner
        if len(seen) + len(free_set) != self.num_pages:
            raise AssertionError(
                f"{self.name}: {self.num_pages - len(seen) - len(free_set)} leaked pages "
                f"(owned {len(seen)}, free {len(free_set)}, total {self.num_pages})"
            )
