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
Of a request, the scheduler writes only its bookkeeping (`Request.book`: pages, slot, locked prefix, exact
blocks); its decoding state changes through the request's own methods (scheduler/request.py).
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from redraft.protocol.sampling_params import BLOCK_SIZE
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.page_pool import PagePool
from redraft.scheduler.radix_cache import MatchResult, RadixCache
from redraft.scheduler.request import FinishReason, Request

log = logging.getLogger("redraft.scheduler")


def describe(exc: BaseException, limit: int = 300) -> str:
    """An exception in one short line (a grammar library's message may carry a page of parser state)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def error_reason(exc: BaseException) -> FinishReason:
    """The finish of a request that a failure inside the engine ended (that request alone)."""
    return FinishReason("error", message=describe(exc))


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
    # Benchmark baseline: no K/V is ever reused, not even a request's own earlier blocks (every forward
    # recomputes the whole prefix) and nothing is cached.
    recompute_prefix: bool = False

    def __post_init__(self) -> None:
        if self.policy not in ("fcfs", "lpm"):
            raise ValueError(f"policy must be fcfs or lpm, got {self.policy!r}")
        if self.max_prefill_tokens < self.block_size:
            raise ValueError("max_prefill_tokens must hold at least one block")

    @property
    def caches_prefixes(self) -> bool:
        return self.enable_prefix_cache and not self.recompute_prefix


@dataclass
class WorkItem:
    """One request's share of a forward: blocks [first, last]. `decodes` when `last` is its active block: the
    query then ends with its open window [req.state.window_start, last], and the blocks before it are prefill
    rows."""

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
    # A decoder's verdicts per item (`Decoder.reports`, LLaDA2.2's step): whether the block commits after this
    # forward (None: LLaDA2.1's rule in Request.apply_step), and the DELETEs and SPLITs it applied. Empty when no
    # item runs such a decoder.
    ended: list[bool | None] = field(default_factory=list)
    deletions: list[int] = field(default_factory=list)
    insertions: list[int] = field(default_factory=list)
    # Per decoding item, None unless its request asked for logprobs: the log-probability of each position's
    # token after the step, and the top alternatives [(token, logprob), ...] at each position.
    logprobs: list[list[float] | None] = field(default_factory=list)
    top_logprobs: list[list[list[tuple[int, float]]] | None] = field(default_factory=list)
    # Per decoding item, None unless its request streams its forwards (stream_denoise): each position's proposal
    # probability p (-1 where the step's token is not the proposal: structured output changed it)
    confidence: list[list[float] | None] = field(default_factory=list)
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
        self.fault_hook = None  # tests only: fault_hook(stage, rid) may raise (engine/runtime/faults.py)
        # Whether pages are held outside the requests now (alloc_pages' callers: the engine's likelihood jobs);
        # while they are, a request that does not fit waits for them instead of failing.
        self.pages_held_elsewhere: Callable[[], bool] = lambda: False
        # Requests whose committed output changed or that finished since the last drain.
        self._updated: dict[str, Request] = {}
        # The training control plane (engine/runtime/weight_update.py): no admission while a weight update waits
        # for the running requests or generation is paused; `frozen`: no forward at all (pause mode in_place).
        self.hold_admission = False
        self.frozen = False

    # ---- queue ------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.add_requests([req])

    def add_requests(self, reqs: list[Request]) -> None:
        """Queue requests together: all or none (QueueFull, RequestTooLarge)."""
        limit = self.config.max_queued_requests
        if limit is not None and len(self.waiting) + len(reqs) > limit:
            raise QueueFull(f"the queue is full ({limit} waiting requests)")
        for req in reqs:
            if req.total_blocks > self.pool.capacity:
                raise RequestTooLarge(
                    f"the request needs {req.total_blocks * self.config.block_size} tokens of KV cache; "
                    f"the cache holds {self.pool.capacity * self.config.block_size}"
                )
        for req in reqs:
            req.book.arrival = next(self._arrivals)
            self.waiting.append(req)

    def abort(self, rid: str, reason: FinishReason | None = None, keep_tokens: int | None = None) -> bool:
        """End a request now, as `reason` (default: abort), its output cut to `keep_tokens` if given.
        Idempotent: aborting an unknown or finished request does nothing and returns False."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    if queue is self.waiting:
                        self.waiting.remove(req)
                    self._finish(req, reason or FinishReason("abort"), keep_tokens)
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

    def can_progress(self) -> bool:
        """Whether `schedule` would give work now (not while frozen, nor only held-back requests waiting)."""
        return not self.frozen and bool(self.running or (self.waiting and not self.hold_admission))

    def abort_all(self, reason: FinishReason, waiting_reason: FinishReason | None = None) -> list[Request]:
        """End every request (running as `reason`, the ones never admitted as `waiting_reason`); returns them."""
        reqs = [(r, reason) for r in self.running] + [(r, waiting_reason or reason) for r in self.waiting]
        self.waiting.clear()
        for req, why in reqs:
            if why is not reason and req.book.admitted:
                why = reason  # (preempted: it had started)
            self._finish(req, why)
        return [req for req, _ in reqs]

    def retract_all(self) -> int:
        """Every running request back to the queue (pages released, exact blocks cached); how many."""
        reqs = sorted(self.running, key=lambda r: r.book.arrival, reverse=True)
        for req in reqs:  # the newest first, so the oldest ends up at the head of the queue
            self._preempt(req)
        self.num_preemptions -= len(reqs)  # (not for lack of pages)
        return len(reqs)

    def drain_updates(self) -> list[Request]:
        out = list(self._updated.values())
        self._updated.clear()
        return out

    def flush_cache(self) -> bool:
        """Drop every cached block; refused (False) while a request still reads from the tree."""
        return self.cache.reset()

    # ---- one iteration ----------------------------------------------------------------------------
    def schedule(self) -> list[WorkItem]:
        if self.frozen:
            return []
        for req in list(self.running):
            self._guarded(req, "pre_forward", self._pre_forward, req)
        self._grow_running()
        if not self.hold_admission:
            self._admit()
        return self._build_batch()

    def _pre_forward(self, req: Request) -> None:
        while not req.finished and not req.pre_forward():
            self._end_block(req)

    def update(self, items: list[WorkItem], out: StepOutput) -> None:
        decoding = [it for it in items if it.decodes]
        for it in items:
            if not it.decodes and not it.req.finished:
                self._guarded(it.req, "prefill", self._mark_prefilled, it.req, it.last)
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
        conf = out.confidence[i] if out.confidence else None
        verdict = (out.ended[i], out.deletions[i], out.insertions[i]) if out.ended else (None, 0, 0)
        lps = out.logprobs[i] if out.logprobs and req.params.placement_logprobs else None
        end = req.apply_step(out.tokens[i], out.had_mask[i], out.m2t[i], out.t2t[i], mbe, *verdict,
                             confidence=conf, logprobs=lps)
        req.book.exact_blocks = end.exact_blocks
        if end.ended:
            self._end_block(req)
        if not req.finished and (spent := req.out_of_forwards()) is not None:  # the committed blocks are its answer
            self._finish(req, spent)

    @staticmethod
    def _mark_prefilled(req: Request, through_block: int) -> None:
        req.book.exact_blocks = max(req.book.exact_blocks, through_block + 1)

    # ---- internals --------------------------------------------------------------------------------
    def _end_block(self, req: Request) -> None:
        reason = req.end_block()
        self._updated[req.rid] = req
        if reason is not None:
            self._finish(req, reason)
        else:
            req.advance()

    def _finish(self, req: Request, reason: FinishReason, keep_tokens: int | None = None) -> None:
        req.finish(reason, keep_tokens)
        if req in self.running:
            self.running.remove(req)
            self._free_slots.append(req.book.slot)
            req.book.slot = -1
        self._release(req)
        self._updated[req.rid] = req

    def _release(self, req: Request) -> None:
        """Hand the exact blocks to the tree, free the rest, unlock the prefix: the request holds no page."""
        book = req.book
        if book.pages and self.config.caches_prefixes:
            self._cache_exact_blocks(req)
        leftover = book.pages[book.tree_blocks :]
        if leftover:
            self.pool.free(leftover)
        if book.cache_node is not None:
            self.cache.dec_lock(book.cache_node)
        book.cache_node = None
        book.pages = []
        book.exact_blocks = 0

    def _cache_exact_blocks(self, req: Request) -> None:
        book = req.book
        n = book.exact_blocks
        if not self.config.caches_prefixes or n <= book.tree_blocks or book.kv_version != self.cache.version:
            return  # (K/V computed, at least partly, under weights the tree no longer serves: never cached)
        tokens = req.state.tokens[: n * self.config.block_size]
        self.cache.insert(tokens, book.pages[:n])  # the tree takes new pages, frees our duplicates
        match = self.cache.match_prefix(tokens, record_stats=False)
        self.cache.inc_lock(match.last_node)
        if book.cache_node is not None:
            self.cache.dec_lock(book.cache_node)
        book.cache_node = match.last_node  # its prefix is the n blocks: tree_blocks == n
        book.pages[:n] = match.pages

    def alloc_pages(self, n: int) -> list[int] | None:
        """`n` pages from the pool, evicting unlocked cache leaves if need be; None when they cannot be had now.
        For K/V outside the requests too (the caller frees them with `free_pages` or hands them to the tree)."""
        pages = self.pool.alloc(n)
        if pages is None and n > self.pool.num_free:
            self.cache.evict(n - self.pool.num_free)
            pages = self.pool.alloc(n)
        return pages

    def _grow_running(self) -> None:
        """A page for every running request's active block, oldest first; preempt the newest if need be."""
        for req in sorted(self.running, key=lambda r: r.book.arrival):
            need = req.state.active_block + 1 - len(req.book.pages)
            while need > 0 and req in self.running:
                pages = self.alloc_pages(need)
                if pages is not None:
                    req.book.pages.extend(pages)
                    break
                victim = max(self.running, key=lambda r: r.book.arrival)
                self._preempt(victim)

    def free_pages(self, pages: list[int]) -> None:
        self.pool.free(pages)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free_slots.append(req.book.slot)
        req.book.slot = -1
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
            match = self.cache.match_prefix(prefix, record_stats=False) if self.config.caches_prefixes else None
            matched = len(match.pages) if match else 0
            need = req.state.active_block + 1 - matched  # uncached blocks through the block it (re)starts at
            if match is not None:
                self.cache.inc_lock(match.last_node)  # protect the match from our own eviction
            pages = self.alloc_pages(need)
            if pages is None:
                if match is not None:
                    self.cache.dec_lock(match.last_node)
                if not self.running and not self.pages_held_elsewhere():
                    raise RuntimeError("KV cache too small to admit a single request")
                break
            self.waiting.remove(req)
            self._seat(req, match, pages)
            req.start()
            self.running.append(req)
            budget -= max(0, req.state.window_start - matched) * b

    def _seat(self, req: Request, match: MatchResult | None, pages: list[int]) -> None:
        """The admitted request's pages (the matched prefix's, then its own), lock, slot and first-admission
        figures."""
        book, b = req.book, self.config.block_size
        matched = len(match.pages) if match else 0
        book.pages = (match.pages if match else []) + pages
        book.cache_node = match.last_node if match else None
        book.exact_blocks = matched
        book.kv_version = self.cache.version
        if not book.admitted:  # hit-rate and cached_tokens describe a request's first admission only
            book.admitted = True
            book.prefix_cached_tokens = matched * b
            self.cache.queried_tokens += len(req.prompt_ids)
            self.cache.hit_tokens += matched * b
        book.slot = self._free_slots.pop()

    def _pick_waiting(self) -> Request:
        if self.config.policy == "fcfs" or len(self.waiting) == 1:
            return self.waiting[0]
        # longest prefix match first; ties keep arrival order (max returns the first maximum)
        return max(self.waiting, key=lambda r: len(self.cache.match_prefix(r.prefix_tokens(), record_stats=False).pages))

    def _build_batch(self) -> list[WorkItem]:
        budget = self.config.max_prefill_tokens
        b = self.config.block_size
        items = []
        # recompute_prefix: every query starts at block 0 (the budget still counts as if K/V were kept)
        recompute = self.config.recompute_prefix
        for req in sorted(self.running, key=lambda r: r.book.arrival):
            first, last, window = req.book.exact_blocks, req.state.active_block, req.state.window_start
            assert first <= window, "an open block must be in the query (its K/V are recomputed)"
            prefill_blocks = max(0, window - first - 1)  # beyond the open window and one stale block
            if prefill_blocks * b <= budget:
                budget -= prefill_blocks * b
                items.append(WorkItem(req, 0 if recompute else first, last, True))
            elif budget >= b:
                n = budget // b
                budget -= n * b
                items.append(WorkItem(req, 0 if recompute else first, first + n - 1, False))
        return items

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
