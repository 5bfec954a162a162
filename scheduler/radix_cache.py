"""Block-granular radix prefix cache over KV pages.

LLaDA2 decodes in blocks of ``block_size`` (32) tokens and a KV page holds exactly one block. The K/V of a
block depend only on the tokens of blocks <= it, so a cached prefix is simply a list of pages, one per whole
block, and the tree can be keyed by whole blocks: every edge is a non-empty run of blocks (a block is a tuple of
``block_size`` token ids) with one page per block. A trailing partial block is never cached nor matched.

Ownership in one paragraph: pages come from a :class:`PagePool`. A page is held either by a request (it
allocated the page and is the only one who may free it) or by the tree (it was handed over through
:meth:`RadixCache.insert`; only the tree frees it, on :meth:`RadixCache.evict` or :meth:`RadixCache.reset`).
Pages returned by :meth:`RadixCache.match_prefix` stay owned by the tree; a request that reads them must
:meth:`RadixCache.inc_lock` the returned node so they are not evicted under it, and ``dec_lock`` it when done.
So ``pool.num_free + cache.cached_pages + pages held by live requests == pool.capacity`` at all times.

Weight versions: K/V depend on the weights that computed them, so the tree has one root per weight version and
lookups and insertions go through the current one only (:meth:`RadixCache.new_version`, called at every weight
update). A block cached under old weights is never matched again, even when it is not flushed (a frozen request
still reads it); its pages leave through LRU eviction like any other, oldest first.

Torch-free: plain dicts, lists and a heap, unit-tested in milliseconds.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from redraft.scheduler.page_pool import PagePool

__all__ = ["MatchResult", "RadixCache", "RadixNode", "blocks_through"]

Block = tuple[int, ...]


class RadixNode:
    """One edge of the tree: ``blocks[i]`` is cached in ``pages[i]``; ``len(blocks) == len(pages) >= 1``.

    Handles returned by :meth:`RadixCache.match_prefix` are nodes. A locked node keeps its identity for as long as
    it is locked: a later split inserts a new node *above* it, so the handle still ends at the same block.
    """

    __slots__ = ("blocks", "pages", "children", "parent", "lock_ref", "last_access", "id")

    def __init__(self, node_id: int, blocks: list[Block], pages: list[int], parent: RadixNode | None) -> None:
        self.id = node_id  # unique, deterministic heap tie-breaker
        self.blocks = blocks
        self.pages = pages
        self.children: dict[Block, RadixNode] = {}  # keyed by the child's first block
        self.parent = parent
        self.lock_ref = 0  # number of locks on this node or any descendant
        self.last_access = 0  # logical clock of the last match/insert that went through this node

    def __repr__(self) -> str:
        return f"RadixNode(id={self.id}, blocks={len(self.blocks)}, lock_ref={self.lock_ref}, t={self.last_access})"


def blocks_through(node: RadixNode) -> int:
    """Blocks on the path from the root through the end of `node` (0 for the root)."""
    n = 0
    while node.parent is not None:
        n += len(node.blocks)
        node = node.parent
    return n


@dataclass(frozen=True, slots=True)
class MatchResult:
    """What :meth:`RadixCache.match_prefix` found.

    pages: one tree-owned page per matched whole block, in order (do not free them).
    num_tokens: ``len(pages) * block_size``.
    last_node: the node ending exactly at the match (the root when nothing matched); pass it to ``inc_lock``.
    """

    pages: list[int]
    num_tokens: int
    last_node: RadixNode


class RadixCache:
    """Radix tree of whole blocks -> KV pages, with lock counts and LRU eviction of unlocked leaves.

    Handle validity: a node from ``match_prefix`` may be trimmed or removed by the next ``evict``/``reset`` unless
    it is locked, so lock it before anything can evict (the scheduler is single-threaded, so "right away").
    """

    def __init__(self, pool: PagePool, block_size: int = 32) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.pool = pool
        self.block_size = block_size
        self._ids = itertools.count()
        self.root = RadixNode(next(self._ids), [], [], None)
        self.version = 0  # the weight version whose K/V the current root's tree holds; only increases
        self._retired: set[RadixNode] = set()  # roots of earlier versions that still hold pages or locks
        self._clock = 0
        self._owned: set[int] = set()  # every page the tree holds; guards against double ownership
        self._protected = 0  # pages in locked nodes
        # Non-root, unlocked nodes without children: exactly the candidates evict() may take. Kept up to date
        # incrementally so evict() never walks the whole tree.
        self._evictable_leaves: set[RadixNode] = set()
        self.hit_tokens = 0
        self.queried_tokens = 0

    # --------------------------------------------------------------------------------------------- counters
    @property
    def cached_pages(self) -> int:
        """Pages owned by the tree (one per cached block)."""
        return len(self._owned)

    @property
    def protected_pages(self) -> int:
        """Pages on locked paths (cannot be evicted now)."""
        return self._protected

    @property
    def evictable_pages(self) -> int:
        """Pages ``evict`` could free now. Locks always cover whole root paths, so every unlocked node
        eventually becomes an unlocked leaf: all unlocked pages are evictable."""
        return len(self._owned) - self._protected

    @property
    def hit_rate(self) -> float:
        """``hit_tokens / queried_tokens`` over all counted matches (0.0 before any)."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def reset_stats(self) -> None:
        self.hit_tokens = 0
        self.queried_tokens = 0

    # --------------------------------------------------------------------------------------------- lookups
    def match_prefix(self, token_ids: Sequence[int], *, record_stats: bool = True) -> MatchResult:
        """Longest cached prefix of ``token_ids`` in whole blocks; a trailing partial block is ignored.

        If the match ends inside an edge, that edge is split so ``last_node`` ends exactly at the match. Every node
        on the matched path becomes most recently used. With ``record_stats`` (the default) the hit-rate counters
        grow: ``queried_tokens += len(token_ids)``, ``hit_tokens += num_tokens``; pass False for internal
        re-matches (e.g. right after committing blocks) so they do not inflate the hit rate.
        """
        blocks = self._to_blocks(token_ids, len(token_ids) // self.block_size)
        self._clock += 1
        node, pages = self._descend(blocks)
        num_tokens = len(pages) * self.block_size
        if record_stats:
            self.queried_tokens += len(token_ids)
            self.hit_tokens += num_tokens
        return MatchResult(pages=pages, num_tokens=num_tokens, last_node=node)

    # --------------------------------------------------------------------------------------------- locking
    def inc_lock(self, node: RadixNode) -> None:
        """Lock ``node`` and all its ancestors: their pages cannot be evicted until the matching ``dec_lock``.
        Locking the root (an empty match) is allowed and protects nothing."""
        if node.parent is None and not self._is_root(node):
            raise ValueError(f"{node!r} is no longer in the cache (evicted or reset); lock handles right after a match")
        while node is not None:
            if node.lock_ref == 0 and not self._is_root(node):
                self._protected += len(node.pages)
                self._evictable_leaves.discard(node)
            node.lock_ref += 1
            node = node.parent

    def dec_lock(self, node: RadixNode) -> None:
        """Undo one ``inc_lock(node)``. Raises ValueError (changing nothing) if ``node`` is not locked."""
        if node.lock_ref <= 0:
            raise ValueError(f"dec_lock on unlocked {node!r}")
        while node is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0 and not self._is_root(node):
                self._protected -= len(node.pages)
                if not node.children:
                    self._evictable_leaves.add(node)
            node = node.parent

    # --------------------------------------------------------------------------------------------- insertion
    def insert(self, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """Cache ``token_ids`` (a whole number of blocks) whose K/V live in ``pages`` (one page per block).

        Ownership contract (SGLang's, with the duplicate freeing moved into the cache):
          * The caller passes pages it holds (allocated from the pool and not yet owned by the tree) or pages the
            tree already holds for these same blocks (a previously matched prefix).
          * Block ``i`` already cached: the tree keeps its own page. If ``pages[i]`` is a different page, the cache
            FREES ``pages[i]`` back to the pool (the caller must stop using it); if it is the tree's page, nothing
            happens.
          * Block ``i`` not cached: the tree takes ``pages[i]`` over and from now on owns it; the caller must never
            free it (it leaves the tree only through ``evict``/``reset``).
          So after this call the caller holds none of ``pages``. A request that keeps running should re-match
          ``match_prefix(token_ids, record_stats=False)`` to learn the canonical pages (its page table must point
          at them) and the node to lock, then ``inc_lock`` the new node and ``dec_lock`` its old one.

        Returns the number of leading blocks that were already cached. The inserted path becomes most recently
        used. Invalid input (partial block, page count mismatch, repeated page, a page the pool has not handed out,
        a tree page at the wrong block) raises ValueError before anything changes.
        """
        bs = self.block_size
        if len(token_ids) % bs:
            raise ValueError(f"insert needs whole blocks: {len(token_ids)} tokens is not a multiple of {bs}")
        n = len(token_ids) // bs
        pages = list(pages)
        if len(pages) != n:
            raise ValueError(f"{n} blocks need {n} pages, got {len(pages)}")
        if len(set(pages)) != n:
            raise ValueError("insert got the same page for two blocks")
        blocks = self._to_blocks(token_ids, n)

        # Validate against a read-only walk first, so a bad call changes nothing.
        tree_pages = self._peek(blocks)
        matched = len(tree_pages)
        for i, p in enumerate(pages):
            if i < matched and p == tree_pages[i]:
                continue
            if p in self._owned:
                raise ValueError(f"page {p} for block {i} already belongs to the cache under another block")
            if not self.pool.is_allocated(p):
                raise ValueError(f"page {p} for block {i} is not allocated from the pool")

        self._clock += 1
        node, _ = self._descend(blocks)  # splits at the end of the cached part and touches it
        if matched < n:
            child = RadixNode(next(self._ids), blocks[matched:], pages[matched:], node)
            child.last_access = self._clock
            node.children[blocks[matched]] = child
            self._owned.update(child.pages)
            self._evictable_leaves.discard(node)  # no longer a leaf
            self._evictable_leaves.add(child)  # new nodes are unlocked leaves
        duplicates = [p for p, t in zip(pages, tree_pages) if p != t]
        if duplicates:
            self.pool.free(duplicates)
        return matched

    # --------------------------------------------------------------------------------------------- eviction
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` pages from unlocked leaves, least recently used first, into the pool.

        A leaf edge is eaten from its tail (its deepest blocks go first), so asking for fewer pages than a leaf
        holds trims it instead of dropping it. A parent whose children are all gone becomes a leaf and competes
        in the same LRU order. Returns the number of pages freed (less than asked when nothing else is evictable).
        """
        if num_pages <= 0 or not self._evictable_leaves:
            return 0
        heap = [(n.last_access, n.id, n) for n in self._evictable_leaves]
        heapq.heapify(heap)
        freed: list[int] = []
        while len(freed) < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            take = min(num_pages - len(freed), len(node.pages))
            first_block = node.blocks[0]
            victims = node.pages[-take:]
            del node.pages[-take:]
            del node.blocks[-take:]
            freed.extend(victims)
            if node.pages:  # trimmed, still a (shorter) leaf; we are done since take < len(pages)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[first_block]
            node.parent = None  # detach: stale handles now fail loudly in inc_lock
            self._evictable_leaves.discard(node)
            if not self._is_root(parent) and parent.lock_ref == 0 and not parent.children:
                self._evictable_leaves.add(parent)
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        self._owned.difference_update(freed)
        self.pool.free(freed)
        return len(freed)

    def reset(self) -> bool:
        """Drop the whole cache (for /flush_cache), freeing every page it owns into the pool.

        Refuses, returning False and changing nothing, while any non-root node is locked (a running request reads
        those pages); returns True once flushed. Locks on the root alone (empty matches) do not block a flush and
        stay valid. Hit-rate counters are kept (see ``reset_stats``). Old node handles become invalid.
        """
        if self._protected:
            return False
        for root in (self.root, *self._retired):
            stack = list(root.children.values())
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                node.parent = None
            root.children.clear()
        self._retired = {r for r in self._retired if r.lock_ref}  # (an empty match's lock on an old root)
        self._evictable_leaves.clear()
        pages = list(self._owned)
        self._owned.clear()
        self.pool.free(pages)
        return True

    # --------------------------------------------------------------------------------------------- versions
    def new_version(self, flush: bool = True) -> int:
        """The weights changed: from now on lookups and insertions use a new, empty tree, so no K/V computed
        under the old weights is ever matched again. With ``flush`` every unlocked page of the old trees is
        freed now (the locked ones stay with the requests that read them, and go by LRU eviction once they
        are unlocked). Returns the new version."""
        self._retired = {r for r in self._retired if r.children or r.lock_ref}
        if self.root.children or self.root.lock_ref:
            self._retired.add(self.root)
        self.version += 1
        self.root = RadixNode(next(self._ids), [], [], None)
        if flush:
            self.evict(self.evictable_pages)  # (the new tree is empty: only old blocks are evictable)
        return self.version

    def _is_root(self, node: RadixNode) -> bool:
        return node is self.root or node in self._retired

    # --------------------------------------------------------------------------------------------- internals
    def _to_blocks(self, token_ids: Sequence[int], n: int) -> list[Block]:
        # Only whole blocks are hashed; tuples of plain ints so keys compare and hash cheaply.
        bs = self.block_size
        if not isinstance(token_ids, (list, tuple)):
            token_ids = [int(t) for t in token_ids[: n * bs]]
        return [tuple(token_ids[i : i + bs]) for i in range(0, n * bs, bs)]

    def _peek(self, blocks: list[Block]) -> list[int]:
        """Pages of the longest cached prefix of ``blocks``, without splitting or touching anything."""
        node, i, pages = self.root, 0, []
        while i < len(blocks):
            child = node.children.get(blocks[i])
            if child is None:
                break
            k = self._common(child.blocks, blocks, i)
            pages.extend(child.pages[:k])
            if k < len(child.blocks):
                break
            node, i = child, i + k
        return pages

    def _descend(self, blocks: list[Block]) -> tuple[RadixNode, list[int]]:
        """Walk the longest cached prefix, splitting the last edge so the returned node ends exactly at the match,
        and stamp every node on the path with the current clock. Returns (node, pages of the path)."""
        node, i, pages = self.root, 0, []
        now = self._clock
        while i < len(blocks):
            child = node.children.get(blocks[i])
            if child is None:
                break
            k = self._common(child.blocks, blocks, i)
            if k < len(child.blocks):
                child = self._split(child, k)
            child.last_access = now
            pages.extend(child.pages)
            node, i = child, i + k
        return node, pages

    @staticmethod
    def _common(edge: list[Block], blocks: list[Block], start: int) -> int:
        """Number of leading blocks ``edge`` shares with ``blocks[start:]`` (>= 1: the dict key matched)."""
        k, limit = 1, min(len(edge), len(blocks) - start)
        while k < limit and edge[k] == blocks[start + k]:
            k += 1
        return k

    def _split(self, node: RadixNode, k: int) -> RadixNode:
        """Cut ``node``'s edge after ``k`` blocks: a new node takes the head and becomes ``node``'s parent.

        ``node`` keeps the tail, its children and its identity, so locked handles keep pointing at the same end.
        The head inherits lock count and access time (it lies on every path through ``node``), so the protected
        page count is unchanged and the head is not a leaf.
        """
        parent = node.parent
        assert parent is not None and 0 < k < len(node.blocks)
        head = RadixNode(next(self._ids), node.blocks[:k], node.pages[:k], parent)
        head.lock_ref = node.lock_ref
        head.last_access = node.last_access
        parent.children[head.blocks[0]] = head
        node.blocks = node.blocks[k:]
        node.pages = node.pages[k:]
        node.parent = head
        head.children[node.blocks[0]] = node
        return head

    def check_invariants(self) -> None:
        """Full O(tree) consistency check for tests and debugging; raises AssertionError on the first problem."""

        def fail(msg: str) -> None:
            raise AssertionError(f"RadixCache invariant broken: {msg}")

        seen: list[int] = []
        protected = 0
        leaves: set[RadixNode] = set()
        stack = [self.root, *self._retired]
        while stack:
            node = stack.pop()
            if not self._is_root(node):
                if not node.blocks or len(node.blocks) != len(node.pages):
                    fail(f"{node!r} has {len(node.blocks)} blocks and {len(node.pages)} pages")
                if any(len(b) != self.block_size for b in node.blocks):
                    fail(f"{node!r} holds a partial block")
                seen.extend(node.pages)
                if node.lock_ref:
                    protected += len(node.pages)
                elif not node.children:
                    leaves.add(node)
            if node.lock_ref < sum(c.lock_ref for c in node.children.values()):
                fail(f"{node!r} has fewer locks than its children")
            for key, child in node.children.items():
                if child.parent is not node or child.blocks[0] != key:
                    fail(f"{child!r} is filed under the wrong parent or key")
                if not self._is_root(node) and child.last_access > node.last_access:
                    fail(f"{child!r} was used more recently than its parent")
                stack.append(child)
        if len(seen) != len(set(seen)) or set(seen) != self._owned:
            fail("owned-page set does not match the pages in the tree")
        if any(not self.pool.is_allocated(p) for p in seen):
            fail("the tree holds a page the pool considers free")
        if protected != self._protected:
            fail(f"protected pages {self._protected} != {protected}")
        if leaves != self._evictable_leaves:
            fail("evictable-leaf set is stale")
