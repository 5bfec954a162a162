"""KV page allocator: hands out page ids, never memory.

A page holds the K/V of exactly one 32-token block (see design.md). The pool only does the bookkeeping of which
page ids are in use; the engine owns the tensors the ids index into. Torch-free on purpose.

Reserved pages: ``PagePool(num_pages, reserved=1)`` keeps page ids ``0 .. reserved-1`` out of circulation. They
are never returned by :meth:`PagePool.alloc` and can never be freed, so a kernel may point padding entries of a
page table (and the slots of padded batch rows under CUDA graphs) at page 0: writes there are scratch, and
nothing a live request reads ever lives there.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

__all__ = ["PagePool"]

# Per-page state in PagePool._state.
_FREE = 0
_USED = 1
_RESERVED = 2


class PagePool:
    """Fixed set of page ids ``0 .. num_pages-1`` with strict accounting.

    Invariant: ``num_free + num_used == capacity`` (``capacity = num_pages - reserved``) after every call. Every
    misuse (double free, freeing a reserved, unknown or out-of-range id, a negative request) raises ValueError
    and leaves the pool exactly as it was.
    """

    __slots__ = ("_num_pages", "_reserved", "_free", "_state")

    def __init__(self, num_pages: int, reserved: int = 0) -> None:
        if num_pages < 0 or reserved < 0 or reserved > num_pages:
            raise ValueError(f"need 0 <= reserved <= num_pages, got num_pages={num_pages}, reserved={reserved}")
        self._num_pages = num_pages
        self._reserved = reserved
        # Stack of free ids; popped from the end. Seeded descending so the first allocations get low ids,
        # which keeps page tables readable in logs and tests.
        self._free: list[int] = list(range(num_pages - 1, reserved - 1, -1))
        # One byte per page: O(1) double-free detection without a set of ints.
        self._state = bytearray(num_pages)
        for p in range(reserved):
            self._state[p] = _RESERVED

    # ----------------------------------------------------------------------------------------------- queries
    @property
    def num_pages(self) -> int:
        """All page ids, reserved ones included (the size of the engine's KV tensors)."""
        return self._num_pages

    @property
    def num_reserved(self) -> int:
        return self._reserved

    @property
    def capacity(self) -> int:
        """Pages that can ever be allocated: ``num_pages - reserved``."""
        return self._num_pages - self._reserved

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages currently allocated to callers (reserved pages are not counted)."""
        return self.capacity - len(self._free)

    @property
    def scratch_page(self) -> int | None:
        """The page padding should point at (page 0), or None when nothing is reserved."""
        return 0 if self._reserved else None

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
            if state[p] == _RESERVED:
                raise ValueError(f"page {p} is reserved and can never be freed")
            if state[p] != _USED or p in seen:
                raise ValueError(f"double free of page {p}")
            seen.add(p)
        for p in pages:
            state[p] = _FREE
        self._free.extend(pages)

    def __repr__(self) -> str:
        return (
            f"PagePool(num_pages={self._num_pages}, reserved={self._reserved}, "
            f"free={self.num_free}, used={self.num_used})"
        )
