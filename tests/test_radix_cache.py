"""RadixCache: block-granular prefix cache over PagePool pages (torch-free, milliseconds)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from redraft.scheduler.page_pool import PagePool
from redraft.scheduler.radix_cache import RadixCache, RadixNode

BS = 4  # small blocks keep the hand-written tests readable; one test uses the real 32


def toks(*symbols: int, tail: int = 0, bs: int = BS) -> list[int]:
    """One block per symbol (the symbol repeated bs times), then `tail` extra tokens (a partial block)."""
    out = [s for s in symbols for _ in range(bs)]
    return out + [99] * tail


def make(capacity: int = 16, bs: int = BS) -> tuple[PagePool, RadixCache]:
    pool = PagePool(capacity)
    return pool, RadixCache(pool, block_size=bs)


def put(pool: PagePool, cache: RadixCache, *symbols: int) -> list[int]:
    """Allocate pages for whole blocks and hand them to the tree, as a finished request would."""
    pages = pool.alloc(len(symbols))
    assert pages is not None
    cache.insert(toks(*symbols), pages)
    return pages


# ------------------------------------------------------------------------------------------- match / insert
def test_empty_cache_matches_nothing() -> None:
    _, cache = make()
    res = cache.match_prefix(toks(1, 2, tail=3))
    assert res.pages == [] and res.num_tokens == 0 and res.last_node is cache.root
    assert cache.cached_pages == 0 and cache.evictable_pages == 0


def test_insert_then_match_whole_blocks_only() -> None:
    pool, cache = make()
    pages = put(pool, cache, 1, 2, 3)
    assert cache.cached_pages == 3 and pool.num_used == 3
    res = cache.match_prefix(toks(1, 2, 3, tail=BS - 1))  # trailing partial block ignored
    assert res.pages == pages and res.num_tokens == 3 * BS
    assert res.last_node.pages == pages
    # A prompt whose partial tail happens to equal the start of a cached block still matches only whole blocks.
    assert cache.match_prefix(toks(1, 2) + [3] * (BS - 1)).pages == pages[:2]
    assert cache.match_prefix(toks(2, 1)).pages == []
    cache.check_invariants()


def test_match_inside_edge_splits_and_returns_exact_node() -> None:
    pool, cache = make()
    pages = put(pool, cache, 1, 2, 3, 4)
    (edge,) = cache.root.children.values()
    res = cache.match_prefix(toks(1, 2, 7))
    assert res.pages == pages[:2]
    head = res.last_node
    assert head.pages == pages[:2] and head.parent is cache.root
    assert list(head.children.values()) == [edge] and edge.pages == pages[2:]
    assert cache.cached_pages == 4
    cache.check_invariants()


def test_insert_diverging_path_splits_and_frees_duplicate_pages() -> None:
    pool, cache = make()
    first = put(pool, cache, 1, 2, 3)
    mine = pool.alloc(3)  # another request computed the same two leading blocks itself
    assert mine is not None
    used_before = pool.num_used
    assert cache.insert(toks(1, 2, 5), mine) == 2
    # The tree kept its pages for blocks 1,2; the caller's duplicates went back to the pool; block 5 was adopted.
    assert not pool.is_allocated(mine[0]) and not pool.is_allocated(mine[1])
    assert pool.num_used == used_before - 2
    assert cache.match_prefix(toks(1, 2, 5)).pages == first[:2] + [mine[2]]
    assert cache.match_prefix(toks(1, 2, 3)).pages == first
    assert cache.cached_pages == 4 == pool.num_used
    cache.check_invariants()


def test_insert_shorter_than_cached_edge_splits_and_counts_all_cached() -> None:
    pool, cache = make()
    first = put(pool, cache, 1, 2, 3)
    mine = pool.alloc(2)
    assert mine is not None
    assert cache.insert(toks(1, 2), mine) == 2
    assert pool.num_used == 3 and cache.cached_pages == 3
    assert cache.match_prefix(toks(1, 2)).pages == first[:2]
    cache.check_invariants()


def test_reinserting_tree_pages_frees_nothing() -> None:
    """The commit pattern: a request hands back its matched (tree-owned) prefix plus its own new pages."""
    pool, cache = make()
    put(pool, cache, 1, 2)
    res = cache.match_prefix(toks(1, 2, 3))
    cache.inc_lock(res.last_node)
    new = pool.alloc(1)
    assert new is not None
    assert cache.insert(toks(1, 2, 3), res.pages + new) == 2
    assert pool.num_used == 3 == cache.cached_pages
    again = cache.match_prefix(toks(1, 2, 3), record_stats=False)
    assert again.pages == res.pages + new
    cache.inc_lock(again.last_node)
    cache.dec_lock(res.last_node)
    assert cache.protected_pages == 3 and cache.evictable_pages == 0
    cache.dec_lock(again.last_node)
    cache.check_invariants()


def test_insert_empty_is_a_noop() -> None:
    pool, cache = make()
    assert cache.insert([], []) == 0
    assert cache.cached_pages == 0 and pool.num_used == 0


@pytest.mark.parametrize(
    "case",
    ["partial_block", "too_few_pages", "repeated_page", "unallocated_page", "tree_page_elsewhere"],
)
def test_insert_rejects_bad_input_and_changes_nothing(case: str) -> None:
    pool, cache = make()
    cached = put(pool, cache, 1, 2)
    mine = pool.alloc(2)
    assert mine is not None
    args = {
        "partial_block": (toks(3, 4, tail=1), mine),
        "too_few_pages": (toks(3, 4), mine[:1]),
        "repeated_page": (toks(3, 4), [mine[0], mine[0]]),
        "unallocated_page": (toks(3, 4), [mine[0], 15]),
        "tree_page_elsewhere": (toks(3, 4), [mine[0], cached[0]]),  # tree page offered for a different block
    }[case]
    with pytest.raises(ValueError):
        cache.insert(*args)
    assert cache.cached_pages == 2 and pool.num_used == 4
    assert all(pool.is_allocated(p) for p in mine)
    assert cache.match_prefix(toks(3, 4)).pages == []
    cache.check_invariants()


def test_default_block_size_and_long_prompt() -> None:
    pool = PagePool(1024)
    cache = RadixCache(pool)
    assert cache.block_size == 32
    prompt = list(range(1000 * 32 + 17))
    pages = pool.alloc(1000)
    assert pages is not None
    assert cache.insert(prompt[: 1000 * 32], pages) == 0
    res = cache.match_prefix(prompt)
    assert res.pages == pages and res.num_tokens == 32_000
    half = cache.match_prefix(prompt[:500 * 32] + [-1] * 64)
    assert half.pages == pages[:500]
    cache.check_invariants()


def test_accepts_non_list_token_sequences() -> None:
    pool, cache = make()
    pages = put(pool, cache, 1, 2)
    assert cache.match_prefix(tuple(toks(1, 2))).pages == pages
    assert cache.match_prefix(range(0)).pages == []


# ------------------------------------------------------------------------------------------- stats
def test_hit_rate_counters() -> None:
    pool, cache = make()
    put(pool, cache, 1, 2)
    cache.match_prefix(toks(1, 2, 3, tail=2))  # 2 of 3 blocks hit, 14 tokens queried
    assert (cache.hit_tokens, cache.queried_tokens) == (2 * BS, 3 * BS + 2)
    cache.match_prefix(toks(1), record_stats=False)
    assert (cache.hit_tokens, cache.queried_tokens) == (2 * BS, 3 * BS + 2)
    assert cache.hit_rate == pytest.approx(8 / 14)
    cache.reset_stats()
    assert cache.hit_rate == 0.0 and cache.queried_tokens == 0


# ------------------------------------------------------------------------------------------- eviction
def test_evict_lru_order() -> None:
    pool, cache = make()
    a = put(pool, cache, 1)
    b = put(pool, cache, 2)
    c = put(pool, cache, 3)
    cache.match_prefix(toks(1))  # a becomes the most recently used
    assert cache.evict(1) == 1
    assert not pool.is_allocated(b[0]) and pool.is_allocated(a[0]) and pool.is_allocated(c[0])
    assert cache.evict(1) == 1
    assert not pool.is_allocated(c[0]) and pool.is_allocated(a[0])
    assert cache.match_prefix(toks(1)).pages == a
    cache.check_invariants()


def test_evict_trims_leaf_from_its_tail() -> None:
    pool, cache = make()
    pages = put(pool, cache, 1, 2, 3, 4)
    assert cache.evict(1) == 1
    assert not pool.is_allocated(pages[3])
    assert cache.match_prefix(toks(1, 2, 3, 4)).pages == pages[:3]
    assert cache.evict(2) == 2
    assert cache.match_prefix(toks(1, 2, 3, 4)).pages == pages[:1]
    assert cache.cached_pages == 1 == pool.num_used
    cache.check_invariants()


def test_evict_makes_parents_leaves() -> None:
    pool, cache = make()
    put(pool, cache, 1, 2, 3)
    put(pool, cache, 1, 2, 4)  # splits: [1,2] -> {[3], [4]}
    assert cache.cached_pages == 4
    assert cache.evict(100) == 4  # both leaves, then their parent once it became a leaf
    assert cache.cached_pages == 0 and pool.num_used == 0 and not cache.root.children
    cache.check_invariants()


def test_evict_zero_or_nothing_evictable() -> None:
    pool, cache = make()
    assert cache.evict(5) == 0
    put(pool, cache, 1)
    assert cache.evict(0) == 0 and cache.evict(-3) == 0
    assert cache.evict(5) == 1 and cache.evict(5) == 0


def test_parent_is_older_than_fresh_child_and_goes_last() -> None:
    pool, cache = make()
    old = put(pool, cache, 1, 2)
    newer = put(pool, cache, 3)
    cache.match_prefix(toks(1))  # touches only the [1] half: the edge [1,2] splits, [2] stays old
    assert cache.evict(1) == 1
    assert not pool.is_allocated(old[1]) and pool.is_allocated(old[0]) and pool.is_allocated(newer[0])
    cache.check_invariants()


# ------------------------------------------------------------------------------------------- locking
def test_locked_path_survives_evict() -> None:
    pool, cache = make()
    kept = put(pool, cache, 1, 2, 3)
    other = put(pool, cache, 1, 2, 4)
    res = cache.match_prefix(toks(1, 2, 3))
    cache.inc_lock(res.last_node)
    assert cache.protected_pages == 3 and cache.evictable_pages == 1
    assert cache.evict(100) == 1  # only the unlocked sibling
    assert not pool.is_allocated(other[2]) and all(pool.is_allocated(p) for p in kept)
    assert cache.match_prefix(toks(1, 2, 3)).pages == kept
    cache.dec_lock(res.last_node)
    assert cache.evictable_pages == 3
    assert cache.evict(100) == 3 and pool.num_used == 0
    cache.check_invariants()


def test_lock_counts_nest() -> None:
    pool, cache = make()
    put(pool, cache, 1, 2)
    node = cache.match_prefix(toks(1, 2)).last_node
    cache.inc_lock(node)
    cache.inc_lock(node)
    cache.dec_lock(node)
    assert cache.evict(10) == 0
    cache.dec_lock(node)
    assert cache.evict(10) == 2


def test_dec_lock_below_zero_raises() -> None:
    pool, cache = make()
    put(pool, cache, 1)
    node = cache.match_prefix(toks(1)).last_node
    with pytest.raises(ValueError):
        cache.dec_lock(node)
    with pytest.raises(ValueError):
        cache.dec_lock(cache.root)
    cache.inc_lock(node)
    cache.dec_lock(node)
    with pytest.raises(ValueError):
        cache.dec_lock(node)
    assert node.lock_ref == 0 and cache.root.lock_ref == 0
    cache.check_invariants()


def test_locking_an_evicted_handle_raises() -> None:
    pool, cache = make()
    put(pool, cache, 1)
    node = cache.match_prefix(toks(1)).last_node
    cache.evict(1)
    with pytest.raises(ValueError):
        cache.inc_lock(node)
    assert cache.root.lock_ref == 0


def test_locked_handle_survives_split() -> None:
    pool, cache = make()
    pages = put(pool, cache, 1, 2, 3)
    node = cache.match_prefix(toks(1, 2, 3)).last_node
    cache.inc_lock(node)
    cache.match_prefix(toks(1))  # splits the locked edge above the handle
    cache.insert(toks(1, 5), [pages[0]] + (pool.alloc(1) or []))  # and a branch off the locked path
    assert node.pages == pages[1:] and node.lock_ref == 1
    assert cache.protected_pages == 3
    cache.check_invariants()
    assert cache.evict(10) == 1  # only the new branch
    cache.dec_lock(node)
    assert cache.evict(10) == 3
    cache.check_invariants()


def test_root_lock_is_harmless() -> None:
    pool, cache = make()
    root = cache.match_prefix(toks(7)).last_node
    cache.inc_lock(root)
    put(pool, cache, 1)
    assert cache.evict(1) == 1 and cache.protected_pages == 0
    cache.dec_lock(root)


# ------------------------------------------------------------------------------------------- reset
def test_reset_refuses_while_locked_then_flushes() -> None:
    pool, cache = make()
    put(pool, cache, 1, 2)
    put(pool, cache, 3)
    node = cache.match_prefix(toks(1, 2)).last_node
    cache.inc_lock(node)
    root = cache.match_prefix(toks(9)).last_node
    cache.inc_lock(root)  # an empty match holds a root lock; that alone would not block a flush
    assert cache.reset() is False
    assert cache.cached_pages == 3 == pool.num_used
    cache.dec_lock(node)
    assert cache.reset() is True
    assert cache.cached_pages == 0 and pool.num_used == 0 and cache.evictable_pages == 0
    assert cache.match_prefix(toks(1, 2)).pages == []
    with pytest.raises(ValueError):
        cache.inc_lock(node)  # stale handle
    cache.dec_lock(root)
    cache.check_invariants()
    put(pool, cache, 1, 2)  # usable again
    assert cache.match_prefix(toks(1, 2)).num_tokens == 2 * BS


# ------------------------------------------------------------------------------------------- model-based property
@dataclass
class Req:
    tokens: list[int]
    blocks: list[tuple[int, ...]]
    node: RadixNode
    locked: int = 0  # blocks covered by the locked tree path
    tree_pages: list[int] = field(default_factory=list)  # tree-owned pages of those blocks
    own: list[int] = field(default_factory=list)  # pages this request holds for blocks locked.. (not in the tree)


class Sim:
    """Drives a PagePool + RadixCache like a scheduler would and mirrors it in a dumb model.

    Model: every cached prefix (tuple of blocks) -> its page, plus the time it was last used. Eviction in the
    model removes, one page at a time, the unlocked prefix without cached extensions that was used longest ago.
    """

    BS = 2
    CAPACITY = 13

    def __init__(self) -> None:
        self.pool = PagePool(self.CAPACITY)
        self.cache = RadixCache(self.pool, block_size=self.BS)
        self.model: dict[tuple, int] = {}
        self.atime: dict[tuple, int] = {}
        self.clock = 0
        self.reqs: list[Req] = []
        self.stray: list[int] = []  # pages allocated outside the cache (e.g. a request's open block)

    # model helpers
    def blocks(self, tokens: list[int]) -> list[tuple[int, ...]]:
        n = len(tokens) // self.BS
        return [tuple(tokens[i * self.BS : (i + 1) * self.BS]) for i in range(n)]

    def model_match(self, blocks: list[tuple]) -> list[int]:
        pages = []
        while len(pages) < len(blocks) and tuple(blocks[: len(pages) + 1]) in self.model:
            pages.append(self.model[tuple(blocks[: len(pages) + 1])])
        return pages

    def touch(self, blocks: list[tuple], k: int) -> None:
        for i in range(k):
            self.atime[tuple(blocks[: i + 1])] = self.clock

    def locked(self, prefix: tuple) -> bool:
        return any(r.locked >= len(prefix) and tuple(r.blocks[: len(prefix)]) == prefix for r in self.reqs)

    def match(self, tokens: list[int], record: bool = True):
        blocks = self.blocks(tokens)
        expect = self.model_match(blocks)
        self.clock += 1
        self.touch(blocks, len(expect))
        res = self.cache.match_prefix(tokens, record_stats=record)
        assert res.pages == expect and res.num_tokens == len(expect) * self.BS
        return res

    def insert(self, r: Req, upto: int) -> None:
        pages = r.tree_pages + r.own[: upto - r.locked]
        blocks = r.blocks[:upto]
        before = len(self.model_match(blocks))
        dups = [p for i, p in enumerate(pages[:before]) if p != self.model[tuple(blocks[: i + 1])]]
        self.clock += 1
        for i in range(before, upto):
            self.model[tuple(blocks[: i + 1])] = pages[i]
        self.touch(blocks, upto)
        assert self.cache.insert(r.tokens[: upto * self.BS], pages) == before
        assert not any(self.pool.is_allocated(p) for p in dups)

    def evict(self, n: int) -> int:
        expect = []
        while len(expect) < n:
            leaves = [
                p for p in self.model
                if not self.locked(p) and not any(len(q) == len(p) + 1 and q[:-1] == p for q in self.model)
            ]
            if not leaves:
                break
            oldest = min(leaves, key=self.atime.__getitem__)
            assert [self.atime[p] for p in leaves].count(self.atime[oldest]) == 1  # LRU order is well defined
            expect.append(self.model.pop(oldest))
            del self.atime[oldest]
        assert self.cache.evict(n) == len(expect)
        assert not any(self.pool.is_allocated(p) for p in expect)
        return len(expect)

    # operations
    def op_new(self, tokens: list[int]) -> None:
        res = self.match(tokens)
        self.cache.inc_lock(res.last_node)
        r = Req(tokens, self.blocks(tokens), res.last_node, len(res.pages), list(res.pages))
        self.reqs.append(r)  # registered first: its lock must count while we evict for it
        need = len(r.blocks) - r.locked
        pages = self.pool.alloc(need)
        if pages is None:
            self.evict(need - self.pool.num_free)
            pages = self.pool.alloc(need)
        if pages is None:  # admission fails: give everything back
            self.reqs.remove(r)
            self.cache.dec_lock(r.node)
            return
        r.own = pages

    def op_commit(self, r: Req, k: int) -> None:
        """Commit the next k blocks mid-request: hand them to the tree, re-match, move the lock forward."""
        if r.locked == len(r.blocks):
            return
        upto = min(len(r.blocks), r.locked + 1 + k % 3)
        self.insert(r, upto)
        res = self.match(r.tokens[: upto * self.BS], record=False)
        assert len(res.pages) == upto
        self.cache.inc_lock(res.last_node)
        self.cache.dec_lock(r.node)
        r.own = r.own[upto - r.locked :]
        r.node, r.locked, r.tree_pages = res.last_node, upto, list(res.pages)

    def op_finish(self, r: Req) -> None:
        if r.locked < len(r.blocks):
            self.insert(r, len(r.blocks))
        self.reqs.remove(r)
        self.cache.dec_lock(r.node)

    def op_abort(self, r: Req) -> None:
        self.pool.free(r.own)
        self.reqs.remove(r)
        self.cache.dec_lock(r.node)

    def op_reset(self) -> None:
        ok = self.cache.reset()
        assert ok == (not any(r.locked for r in self.reqs))
        if ok:
            self.model.clear()
            self.atime.clear()

    def op_stray(self, a: int) -> None:
        if self.stray and a % 2:
            self.pool.free(self.stray[: a % 4])
            del self.stray[: a % 4]
        else:
            self.stray += self.pool.alloc(a % 3) or []

    def step(self, kind: int, a: int, tokens: list[int]) -> None:
        r = self.reqs[a % len(self.reqs)] if self.reqs else None
        kinds = ("new", "new", "new", "commit", "commit", "finish", "abort", "evict", "probe", "stray", "reset")
        name = kinds[kind % len(kinds)]
        if name == "new":
            self.op_new(tokens)
        elif name == "commit" and r:
            self.op_commit(r, a)
        elif name == "finish" and r:
            self.op_finish(r)
        elif name == "abort" and r:
            self.op_abort(r)
        elif name == "evict":
            self.evict(a % 6)
        elif name == "probe":
            self.match(tokens)
        elif name == "stray":
            self.op_stray(a)
        elif name == "reset":
            self.op_reset()
        self.check()

    def check(self) -> None:
        pool, cache = self.pool, self.cache
        held = sum(len(r.own) for r in self.reqs) + len(self.stray)
        assert pool.num_free >= 0 and pool.num_used >= 0 and cache.cached_pages >= 0
        assert pool.num_free + cache.cached_pages + held == pool.capacity
        assert cache.cached_pages == len(self.model)
        assert cache.evictable_pages == sum(not self.locked(p) for p in self.model)
        cache.check_invariants()
        # The tree holds exactly the model's prefixes, each in the model's page.
        contents: dict[tuple, int] = {}
        stack: list[tuple[tuple, RadixNode]] = [((), cache.root)]
        while stack:
            prefix, node = stack.pop()
            for child in node.children.values():
                p = prefix
                for b, page in zip(child.blocks, child.pages):
                    p = p + (b,)
                    contents[p] = page
                stack.append((p, child))
        assert contents == self.model
        for r in self.reqs:  # a running request's pages are never freed under it
            assert all(pool.is_allocated(p) for p in r.own + r.tree_pages)
            assert r.tree_pages == [self.model[tuple(r.blocks[: i + 1])] for i in range(r.locked)]

    def teardown(self) -> None:
        for r in list(self.reqs):
            self.op_abort(r)
        assert self.cache.reset() is True
        self.pool.free(self.stray)
        assert self.pool.num_free == self.pool.capacity and self.cache.root.lock_ref == 0


OPS = st.lists(
    st.tuples(st.integers(0, 10), st.integers(0, 15), st.lists(st.integers(0, 1), max_size=11)), max_size=50
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(OPS)
def test_random_ops_keep_accounting_exact_hypothesis(ops: list[tuple[int, int, list[int]]]) -> None:
    sim = Sim()
    for kind, a, tokens in ops:
        sim.step(kind, a, tokens)
    sim.teardown()


@pytest.mark.parametrize("seed", range(12))
def test_random_ops_keep_accounting_exact_seeded(seed: int) -> None:
    rng = random.Random(seed)
    sim = Sim()
    for _ in range(300):
        tokens = [rng.randint(0, 1) for _ in range(rng.randint(0, 11))]
        sim.step(rng.randint(0, 10), rng.randint(0, 15), tokens)
    sim.teardown()
