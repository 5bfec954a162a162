"""KV page allocator: hands out page ids, never memory.

A page holds the K/V of exactly one 32-token block (see design.md). The pool only does the bookkeeping of which
page ids are in use; the engine owns the tensors the ids index into (with one more page beyond the pool's, the
scratch page that padded batch rows write to: engine/runtime/model_runner.py). Torch-free on purpose.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

__all__ = ["PagePool"]

# Per-page state in PagePool._state.
_FREE = 0
_USED = 1


class PagePool:
    """Fixed set of page ids ``0 .. num_pages-1`` with strict accounting.

    Invariant: ``num_free + num_used == capacity`` after every call. Every misuse (double free, an unknown or
    out-of-range id, a negative request) raises ValueError and leaves the pool exactly as it was.
    """

    __slots__ = ("_num_pages", "_free", "_state")

    def __init__(self, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"need num_pages >= 0, got {num_pages}")
        self._num_pages = num_pages
        # Stack of free ids; popped from the end. Seeded descending so the first allocations get low ids,
        # which keeps page tables readable in logs and tests.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))
        # One byte per page: O(1) double-free detection without a set of ints.
        self._state = bytearray(num_pages)

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated (all of them)."""
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages currently allocated to callers."""
        return self.capacity - len(self._free)

    def peek(self, n: int) -> list[int] | None:
        """The pages ``n`` successive ``alloc(1)`` calls would return now (as ``alloc(n)`` would), allocating
        nothing; None if fewer than ``n`` are free."""
        if not 0 <= n <= len(self._free):
            return None
        return self._free[len(self._free) - n :][::-1]

    def is_allocated(self, page: int) -> bool:
        """True iff ``page`` is a valid id currently handed out by :meth:`alloc`."""
        return 0 <= page < self._num_pages and self._state[page] == _USED

    # ----------------------------------------------------------------------------------------------- updates
    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` free pages, or return None (allocating nothing) if fewer than ``n`` are free."""
        n = operator.index(n)
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free):
            return None
        if n == 0:
            return []
        pages = self._free[-n:]
        del self._free[-n:]
        pages.reverse()  # pop order: lowest id first on a fresh pool
        state = self._state
        for p in pages:
            state[p] = _USED
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return pages to the pool. All-or-nothing: on any invalid id, nothing is freed and ValueError is raised."""
        pages = [operator.index(p) for p in pages]
        state = self._state
        # Validate everything before touching state, so a bad call cannot leave the pool half-updated.
        seen: set[int] = set()
        for p in pages:
            if not 0 <= p < self._num_pages:
                raise ValueError(f"page {p} is not in this pool (0..{self._num_pages - 1})")
            if state[p] != _USED or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            state[p] = _FREE
        self._free.extend(pages)

    def __repr__(self) -> str:
        return (
            f"PagePool(num_pages={self._num_pages}, "
            f"free={self.num_free}, used={self.num_used})"
        )
