"""PagePool: strict page accounting (torch-free, milliseconds)."""

from __future__ import annotations

import random

import pytest

from redraft.scheduler.page_pool import PagePool


def test_fresh_pool_counts_and_low_ids_first() -> None:
    pool = PagePool(8)
    assert (pool.num_pages, pool.capacity, pool.num_free, pool.num_used) == (8, 8, 8, 0)
    assert pool.alloc(3) == [0, 1, 2]
    assert (pool.num_free, pool.num_used) == (5, 3)
    assert all(pool.is_allocated(p) for p in (0, 1, 2))
    assert not pool.is_allocated(3) and not pool.is_allocated(-1) and not pool.is_allocated(8)


def test_alloc_is_all_or_nothing() -> None:
    pool = PagePool(4)
    assert pool.alloc(3) is not None
    assert pool.alloc(2) is None  # only one free: nothing taken
    assert pool.num_free == 1
    assert pool.alloc(1) is not None
    assert pool.alloc(1) is None
    assert pool.alloc(0) == []


def test_alloc_negative_raises() -> None:
    with pytest.raises(ValueError):
        PagePool(4).alloc(-1)


def test_free_then_realloc_round_trip() -> None:
    pool = PagePool(4)
    pages = pool.alloc(4)
    assert pages is not None
    pool.free(pages[1:3])
    again = pool.alloc(2)
    assert again is not None and sorted(again) == sorted(pages[1:3])
    assert pool.num_free == 0


def test_double_free_raises_and_changes_nothing() -> None:
    pool = PagePool(4)
    pages = pool.alloc(2)
    assert pages is not None
    pool.free([pages[0]])
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[0]])
    # A bad id anywhere in the call: nothing in it is freed.
    with pytest.raises(ValueError):
        pool.free([pages[1], pages[0]])
    assert pool.is_allocated(pages[1]) and pool.num_free == 3
    # The same page twice in one call is a double free too.
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[1], pages[1]])
    assert pool.is_allocated(pages[1]) and pool.num_free == 3


def test_free_unknown_or_never_allocated_raises() -> None:
    pool = PagePool(4)
    for bad in (-1, 4, 100):
        with pytest.raises(ValueError):
            pool.free([bad])
    with pytest.raises(ValueError):
        pool.free([2])  # valid id, but never allocated
    assert pool.num_free == 4 and pool.num_used == 0


@pytest.mark.parametrize("num_pages", [-1, -5])
def test_bad_construction(num_pages: int) -> None:
    with pytest.raises(ValueError):
        PagePool(num_pages)


def test_empty_pool() -> None:
    pool = PagePool(0)
    assert pool.alloc(0) == [] and pool.alloc(1) is None and pool.num_free == 0


@pytest.mark.parametrize("seed", range(5))
def test_random_alloc_free_matches_model(seed: int) -> None:
    rng = random.Random(seed)
    pool = PagePool(32)
    held: set[int] = set()
    for _ in range(400):
        if rng.random() < 0.5:
            n = rng.randint(0, 10)
            got = pool.alloc(n)
            if n > pool.capacity - len(held):
                assert got is None
            else:
                assert got is not None and len(got) == n and not held & set(got)
                held.update(got)
        elif held:
            give = rng.sample(sorted(held), rng.randint(1, len(held)))
            pool.free(give)
            held.difference_update(give)
            if rng.random() < 0.2:
                with pytest.raises(ValueError):
                    pool.free([give[0]])
        assert pool.num_used == len(held) >= 0
        assert pool.num_free + pool.num_used == pool.capacity
        assert all(pool.is_allocated(p) for p in held)
