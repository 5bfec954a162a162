"""Continuous batching at block granularity, with a block radix prefix cache. Torch-free.

Each iteration (`schedule` -> model runner -> `update`):
  1. running requests run their pre-forward check (a block may end here, by max_post_steps);
  2. each running request gets a page for its active block: from the pool, else by evicting unlocked cache
     leaves, else by preempting the newest running request (its exact blocks stay cached);
  3. waiting requests are admitted (FCFS, or longest-prefix-first) while there is room: a free running
     slot, pages for their uncached prompt blocks and first block, and prefill-token budget;
  4. the batch: one denoising window for every running request, with prefill chunks (uncached prompt
     blocks, block-causal) limited by the per-iteration prefill-token budget.
After the forward, blocks whose K/V became exact are inserted into the radix tree (prompt blocks after
their prefill, generated blocks as they are committed), so the next turn of a chat reuses them.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from redraft.protocol.sampling_params import BLOCK_SIZE
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.page_pool import PagePool
from redraft.scheduler.radix_cache import RadixCache
from redraft.scheduler.request import FinishReason, Request, Status

log = logging.getLogger("redraft.scheduler")


def describe(exc: BaseException, limit: int = 300) -> str:
    """An exception in one short line (a grammar library's message may carry a page of parser state)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_reason(exc: BaseException) -> FinishReason:
    """The finish of a request that a failure inside the engine ended (that request alone)."""
    return FinishReason("error", message=describe(exc))


@dataclass
class PrefixLease:
    """Pages for the whole blocks of a token prefix, for scoring (engine/likelihood.py): the first `cached`
    come from the radix tree; the caller computes the K/V of the rest, then `Scheduler.release_prefix` hands
    them to the tree. Held pages are locked until released."""

    tokens: list[int]
    pages: list[int]
    cached: int
    node: object | None


class QueueFull(Exception):
    """The waiting queue is at --max-queued-requests."""


class RequestTooLarge(ValueError):
    """The request can never fit in the KV cache."""


@dataclass(frozen=True)
class SchedulerConfig:
    num_pages: int
    block_size: int = BLOCK_SIZE
    # the operator's settings: their defaults are ServerArgs' (written once there)
    max_running_requests: int = ServerArgs.max_running_requests
    max_queued_requests: int | None = ServerArgs.max_queued_requests
    max_prefill_tokens: int = ServerArgs.chunked_prefill_size  # prefill-chunk token budget per iteration
    policy: str = ServerArgs.schedule_policy  # "fcfs" | "lpm" (longest prefix match first)
    enable_prefix_cache: bool = ServerArgs.enable_prefix_cache

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be fcfs or lpm, got {self.policy!r}")
        if self.max_prefill_tokens < self.block_size:
            raise ValueError("max_prefill_tokens must hold at least one block")


@dataclass
class WorkItem:
    """One request's share of a forward: blocks [first, last]. `decodes` when `last` is its active block: the
    query then ends with its open window [req.window_start, last], and the blocks before it are prefill rows."""

    req: Request
    first: int
    last: int
    decodes: bool


@dataclass
class StepOutput:
    """The model runner's answer for the decoding items of a batch (one denoising step each), in order, as
    plain lists."""

    tokens: list[list[int]] = field(default_factory=list)  # each item's open window after the step
    had_mask: list[bool] = field(default_factory=list)
    m2t: list[int] = field(default_factory=list)
    t2t: list[int] = field(default_factory=list)
    mbe_edits: list[int] = field(default_factory=list)  # of t2t, the edits in blocks before the active one
    # Per decoding item, None unless its request asked for logprobs: the log-probability of each position's
    # token after the step, and the top alternatives [(token, logprob), ...] at each position.
    logprobs: list[list[float] | None] = field(default_factory=list)
    top_logprobs: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)
    # rid -> (stage, exception) of a per-request stage of the step that raised (grammar, logit controls): the
    # engine ends those requests with an error finish before `update`, which then skips them.
    failed: dict[str, tuple[str, BaseException]] = field(default_factory=dict)


class Scheduler:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.pool = PagePool(config.num_pages)
        self.cache = RadixCache(self.pool, config.block_size)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._arrivals = itertools.count()
        self._free_slots = list(range(config.max_running_requests - 1, -1, -1))  # the model runner's rows
        self.num_preemptions = 0
        self.fault_hook = None  # tests only: fault_hook(stage, rid) may raise (engine/faults.py)
        self.num_leases = 0  # scoring leases not yet released (they may hold the pages a request waits for)
        # Requests whose committed output changed or that finished since the last drain.
        self._updated: dict[str, Request] = {}

    # ---- queue ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFull(f"the queue is full ({limit} waiting requests)")
        if req.total_blocks > self.pool.capacity:
            raise RequestTooLarge(
                f"the request needs {req.total_blocks * self.config.block_size} tokens of KV cache; "
                f"the cache holds {self.pool.capacity * self.config.block_size}"
            )
        req.arrival = next(self._arrivals)
        req.status = Status.WAITING
        self.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason | None = None, keep_tokens: int | None = None) -> bool:
        """End a request now, as `reason` (default: abort), its output cut to `keep_tokens` if given.
        Idempotent: aborting an unknown or finished request does nothing and returns False."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    if queue is self.waiting:
                        self.waiting.remove(req)
                    if keep_tokens is not None:
                        req.output_limit = keep_tokens
                    self._finish(req, reason or FinishReason("abort"))
                    return True
        return False

    def fail(self, rid: str, exc: BaseException) -> bool:
        """End a request with an error finish (a failure inside the engine that concerns it alone); its pages
        are released at once. Idempotent like `abort`."""
        return self.abort(rid, error_reason(exc))

    def forget_update(self, rid: str) -> None:
        """Drop a pending update (its request's last message was already built)."""
        self._updated.pop(rid, None)

    def _guarded(self, req: Request, stage: str, fn, *args):
        """Run one request's share of a stage; an exception ends that request alone (error finish)."""
        try:
            if self.fault_hook is not None:
                self.fault_hook(stage, req.rid)
            return fn(*args)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the batch
            log.error("request %s failed in %s: %s", req.rid, stage, describe(exc))
            log.debug("request %s failed in %s", req.rid, stage, exc_info=True)
            if not req.finished:
                self._finish(req, error_reason(exc))
            return None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def drain_updates(self) -> list[Request]:
        out = list(self._updated.values())
        self._updated.clear()
        return out

    def flush_cache(self) -> bool:
        """Drop every cached block; refused (False) while a request still reads from the tree."""
        return self.cache.reset()

    # ---- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> list[WorkItem]:
        for req in list(self.running):
            self._guarded(req, "pre_forward", self._pre_forward, req)
        self._grow_running()
        self._admit()
        return self._build_batch()

    def _pre_forward(self, req: Request) -> None:
        while not req.finished and not req.pre_forward():
            self._end_block(req)

    def update(self, items: list[WorkItem], out: StepOutput) -> None:
        decoding = [it for it in items if it.decodes]
        for it in items:
            if not it.decodes and not it.req.finished:
                self._guarded(it.req, "prefill", it.req.mark_prefilled, it.last)
        for i, it in enumerate(decoding):
            if not it.req.finished:  # (else aborted or failed while the forward ran)
                self._guarded(it.req, "update", self._apply, it.req, out, i)
        for it in items:
            if not it.req.finished:
                self._cache_exact_blocks(it.req)

    def _apply(self, req: Request, out: StepOutput, i: int) -> None:
        if out.logprobs and out.logprobs[i] is not None:
            req.set_window_logprobs(out.logprobs[i], out.top_logprobs[i])
        mbe = out.mbe_edits[i] if out.mbe_edits else 0
        if req.apply_step(out.tokens[i], out.had_mask[i], out.m2t[i], out.t2t[i], mbe):
            self._end_block(req)

    # ---- internals --------------------------------------------------------------------------------
    def _end_block(self, req: Request) -> None:
        reason = req.end_block()
        self._updated[req.rid] = req
        if reason is not None:
            self._finish(req, reason)
        else:
            req.advance()

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish(reason)
        if req in self.running:
            self.running.remove(req)
            self._free_slots.append(req.slot)
            req.slot = -1
        self._release(req)
        self._updated[req.rid] = req

    def _release(self, req: Request) -> None:
        """Hand the exact blocks to the tree, free the rest, unlock the prefix."""
        if req.pages and self.config.enable_prefix_cache:
            self._cache_exact_blocks(req)
        leftover = req.pages[req.tree_blocks :]
        if leftover:
            self.pool.free(leftover)
        if req.cache_node is not None:
            self.cache.dec_lock(req.cache_node)
        req.cache_node = None
        req.tree_blocks = 0
        req.pages = []

    def _cache_exact_blocks(self, req: Request) -> None:
        n = req.cached_blocks
        if not self.config.enable_prefix_cache or n <= req.tree_blocks:
            return
        tokens = req.tokens[: n * self.config.block_size]
        self.cache.insert(tokens, req.pages[:n])  # the tree takes new pages, frees our duplicates
        match = self.cache.match_prefix(tokens, record_stats=False)
        self.cache.inc_lock(match.last_node)
        if req.cache_node is not None:
            self.cache.dec_lock(req.cache_node)
        req.cache_node = match.last_node
        req.pages[:n] = match.pages
        req.tree_blocks = n

    def _alloc(self, n: int) -> list[int] | None:
        pages = self.pool.alloc(n)
        if pages is None and n > self.pool.num_free:
            self.cache.evict(n - self.pool.num_free)
            pages = self.pool.alloc(n)
        return pages

    def _grow_running(self) -> None:
        """A page for every running request's active block, oldest first; preempt the newest if need be."""
        for req in sorted(self.running, key=lambda r: r.arrival):
            need = req.active_block + 1 - len(req.pages)
            while need > 0 and req in self.running:
                pages = self._alloc(need)
                if pages is not None:
                    req.pages.extend(pages)
                    break
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_slots.append(req.slot)
        req.slot = -1
        self._release(req)
        req.preempt()
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _admit(self) -> None:
        budget = self.config.max_prefill_tokens
        b = self.config.block_size
        while self.waiting and len(self.running) < self.config.max_running_requests and budget >= b:
            req = self._pick_waiting()
            prefix = req.prefix_tokens()
            match = self.cache.match_prefix(prefix, record_stats=False) if self.config.enable_prefix_cache else None
            matched = len(match.pages) if match else 0
            need = req.resume_block + 1 - matched  # uncached blocks through the block it (re)starts at
            if match is not None:
                self.cache.inc_lock(match.last_node)  # protect the match from our own eviction
            pages = self._alloc(need)
            if pages is None:
                if match is not None:
                    self.cache.dec_lock(match.last_node)
                if not self.running and not self.num_leases:
                    raise RuntimeError("KV cache too small to admit a single request")
                break
            self.waiting.remove(req)
            req.pages = (match.pages if match else []) + pages
            req.cache_node = match.last_node if match else None
            req.tree_blocks = matched
            req.cached_blocks = matched
            if not req.admitted:  # hit-rate and cached_tokens describe a request's first admission only
                req.admitted = True
                req.prefix_cached_tokens = matched * b
                self.cache.queried_tokens += len(req.prompt_ids)
                self.cache.hit_tokens += matched * b
            req.slot = self._free_slots.pop()
            req.start()
            self.running.append(req)
            budget -= max(0, req.window_start - matched) * b

    def _pick_waiting(self) -> Request:
        if self.config.policy == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        # longest prefix match first; ties keep arrival order (max returns the first maximum)
        return max(self.waiting, key=lambda r: len(self.cache.match_prefix(r.prefix_tokens(), record_stats=False).pages))

    def _build_batch(self) -> list[WorkItem]:
        budget = self.config.max_prefill_tokens
        b = self.config.block_size
        items = []
        for req in sorted(self.running, key=lambda r: r.arrival):
            first, last = req.cached_blocks, req.active_block
            assert first <= req.window_start, "an open block must be in the query (its K/V are recomputed)"
            prefill_blocks = max(0, req.window_start - first - 1)  # beyond the open window and one stale block
            if prefill_blocks * b <= budget:
                budget -= prefill_blocks * b
                items.append(WorkItem(req, first, last, True))
            elif budget >= b:
                n = budget // b
                budget -= n * b
                items.append(WorkItem(req, first, first + n - 1, False))
        return items

    # ---- scoring: prefixes and scratch pages outside the decode batches ----------------------------------
    def lease_prefix(self, tokens: list[int]) -> PrefixLease | None:
        """Pages for the whole blocks of `tokens` (cached ones from the tree, fresh ones for the rest), or None
        when the pool cannot hold them now."""
        b = self.config.block_size
        tokens = tokens[: len(tokens) // b * b]
        match = self.cache.match_prefix(tokens) if self.config.enable_prefix_cache else None
        cached = len(match.pages) if match else 0
        if match is not None:
            self.cache.inc_lock(match.last_node)
        fresh = self._alloc(len(tokens) // b - cached)
        if fresh is None:
            if match is not None:
                self.cache.dec_lock(match.last_node)
            return None
        self.num_leases += 1
        return PrefixLease(tokens, (match.pages if match else []) + fresh, cached, match.last_node if match else None)

    def release_prefix(self, lease: PrefixLease, computed: bool) -> None:
        """Hand the lease's pages to the tree (when their K/V were computed) or back to the pool; unlock."""
        fresh = lease.pages[lease.cached :]
        if computed and self.config.enable_prefix_cache and fresh:
            self.cache.insert(lease.tokens, lease.pages)  # the tree takes the new pages, frees duplicates
        elif fresh:
            self.pool.free(fresh)
        if lease.node is not None:
            self.cache.dec_lock(lease.node)
        self.num_leases -= 1

    def alloc_scratch(self, n: int) -> list[int] | None:
        """`n` pages for one forward's throw-away K/V (free them with free_scratch)."""
        return self._alloc(n)

    def free_scratch(self, pages: list[int]) -> None:
        self.pool.free(pages)

    # ---- stats --------------------------------------------------------------------------------------
    def stats(self) -> dict:
        b = self.config.block_size
        return {
            "num_running_reqs": len(self.running),
            "num_queue_reqs": len(self.waiting),
            "num_used_tokens": self.pool.num_used * b,
            "max_total_tokens": self.pool.capacity * b,
            "token_usage": self.pool.num_used / max(self.pool.capacity, 1),
            "cache_hit_rate": self.cache.hit_rate,
            "cached_tokens": self.cache.cached_pages * b,
            "num_preemptions": self.num_preemptions,
        }
