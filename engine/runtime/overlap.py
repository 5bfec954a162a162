"""The overlap scheduler: forward k+1 runs while the host finishes iteration k.

Serially an iteration is schedule -> forward -> decision -> update -> outputs, and the device idles while the host
updates, reports, reads messages and schedules. Here, as soon as step k's decision has reached the host (its
`StepOutput`), the forward of iteration k+1 starts (queued on the GPU from this thread; on CPU, on a worker
thread) with the inputs iteration k+1 will have if
every request goes on (`next_iteration`): the same requests, each query its open window holding the tokens step
k produced, or, where a block ends, the next block (all MASK) in the page the scheduler will hand out next. While
it runs, the host updates the requests, builds step k's outputs, (in the server) sends them and reads new
messages, and schedules iteration k+1. Then the guess is checked (`take`): when iteration k+1 has the same items
and builds the same forward batch (query tokens, positions, page tables, windows) and plan, the speculative
forward is the forward the serial path would run (same inputs, same K/V pages, no other forward in between), so
its result is used; the decision k+1 (which advances the slot rows) is made only then, on the host thread: only
the forward is speculative. Otherwise (an admission, an abort, a finish, a preemption, a failure, another page)
the result is dropped and the serial path runs.

A dropped forward leaves no trace:
  * K/V: a forward writes only the pages of its query. Here that is each request's open window, blocks at or after
    `Bookkeeping.exact_blocks` even after step k's update (blocks that became exact are only read), and new
    blocks in pages that are free when it starts. The scheduler reads no block at or after `exact_blocks` before
    a forward recomputes it (every query starts there) and never caches one; a free page, or one freed meanwhile
    (an abort), is written by its next owner's forward before anyone reads it; and every other forward waits for
    the worker (`take`, `settle`).
  * decoding state: the forward changes none. Slot rows, step counters, `meta_info.steps`, the stats and the
    engine's forward count move with the decision and the update alone.
  * the worker reads only its `ForwardPlan` (built before it starts), the weights and the KV cache, never a
    request, so the host may change the requests meanwhile.
On CUDA the host thread itself queues the forward on the default stream (`inline`): kernel launches and a graph
replay return at once, so the device computes while the host goes on, and stream order keeps the forward ahead of
everything queued later (no side stream, no thread). On CPU an op returns only when done, so the forward runs on
a worker thread (torch releases the GIL inside each op).

A batch that decides inside the CUDA graph (`ForwardPlan.in_graph`) is never run ahead: its forward is its
decision, which advances the slot rows (and its host work is one packed read).

It is off unless --enable-overlap, because it measured slower wherever it ran: on CPU the forward's Python code
between ops and the host's work take turns on the GIL (docs/benchmarks.md); on an H100 and an H200 (LLaDA2.1-mini
shape, CUDA graphs), with the forward on a worker thread as on CPU, 0.95-0.96x offline and 0.84-0.88x served at
16-64 concurrent requests (docs/gpu.md): the replayed forward is ~90% of a step, and the thread's hand-offs cost
more than the host work hidden. The inline CUDA path replaced that thread afterwards and has not been timed yet.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from redraft.engine.runtime.batch import ForwardBatch, ForwardPlan, build_forward_batch
from redraft.engine.runtime.forward import Forward
from redraft.engine.runtime.model_runner import ModelRunner
from redraft.scheduler.page_pool import PagePool
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import Scheduler, StepOutput, WorkItem

log = logging.getLogger("redraft.overlap")


def off_reason(args: Any) -> str | None:
    """Why the overlap scheduler is off for these settings (None: on)."""
    if args.disable_overlap:
        return "--disable-overlap"
    if args.tp_size > 1:
        # every rank would run the dropped forwards too, and a failed one leaves the ranks out of step
        return "tensor parallelism (--tp-size > 1) runs the serial loop"
    if not args.enable_overlap:
        # measured slower everywhere so far: on CPU the forward's Python code and the host's take turns on the GIL
        # (docs/benchmarks.md); on an H100/H200 the graph-replayed forward already dominates the step, and the
        # thread hand-off costs more than the host work it hides (docs/gpu.md)
        return "the default (--enable-overlap turns it on)"
    return None


def next_iteration(items: list[WorkItem], out: StepOutput, block_size: int, mask_id: int, pool: PagePool
                   ) -> tuple[list[WorkItem], ForwardBatch] | None:
    """Iteration k+1's items and forward batch if every request goes on: a block that goes on queries its open
    window holding the tokens step k produced (`out.tokens`); a block that ends is followed by the next one
    (`_next_block_follows`), all MASK, in the page the scheduler will give it (`PagePool.peek`: it hands pages out
    in arrival order, the batch's order). A block ends after step k (Request.apply_step: no mask before the step,
    no edit in it; its K/V are exact) or at the pre-forward check of k+1 (Request.pre_forward: its K/V are stale,
    so the next query recomputes it ahead of the new block). None when iteration k+1 cannot be that."""
    b = block_size
    if not all(it.decodes for it in items):
        return None  # a prefill chunk: what comes next depends on the prefill budget (and out has no row for it)
    ended = [not out.had_mask[i] and out.t2t[i] == 0 for i in range(len(items))]
    stale = [not ended[i] and it.req.ends_at_pre_forward(out.tokens[i][-b:]) for i, it in enumerate(items)]
    fresh = pool.peek(sum(ended) + sum(stale))
    if fresh is None:
        return None  # the scheduler would evict (or preempt) for pages
    nxt, q_starts, q_lens, tables, windows, ids = [], [], [], [], [], []
    for i, it in enumerate(items):
        req = it.req
        # committed blocks ahead of the window (prefill rows) are exact after step k: the query is the window
        first, last, window = req.state.window_start, it.last, req.state.window_start
        pages, query = req.book.pages[: last + 1], out.tokens[i]
        if ended[i] or stale[i]:
            if not _next_block_follows(req, out.tokens[i], b) or len(req.book.pages) != last + 1:
                return None
            first, last = (last + 1 if ended[i] else last), last + 1
            window, pages = last, pages + [fresh.pop(0)]
            query = (query if stale[i] else []) + [mask_id] * b
        nxt.append(WorkItem(req, first, last, True))
        q_starts.append(first * b)
        q_lens.append((last - first + 1) * b)
        tables.append(pages)
        windows.append(window * b)
        ids += query
    return nxt, ForwardBatch(ids, q_starts, q_lens, tables, windows)


def _next_block_follows(req: Request, window: list[int], block_size: int) -> bool:
    """Whether a request whose active block just ended goes on with the next block, a query that needs nothing
    but its position: a one-block window (no MBE shift), no grammar (it writes forced tokens first), no stop
    token in the block and not its last block (Request.end_block)."""
    if req.params.mbe_window != 1 or req.state.constraint is not None or req.state.active_block >= req.last_block:
        return False
    start = req.state.window_start * block_size
    stops = req.stop_ids()
    return not any(t in stops for t in window[max(req.prompt_len - start, 0):])


def same_forward(a: ForwardPlan, b: ForwardPlan) -> bool:
    """Whether two plans describe the same forward: equal inputs, geometry and decision split."""
    x, y = a.batch, b.batch
    return (a.decoding == b.decoding and a.lens == b.lens and a.quick == b.quick and a.excluded == b.excluded
            and a.keep_hidden == b.keep_hidden and a.graphs == b.graphs and a.in_graph == b.in_graph
            and x.q_starts == y.q_starts and x.q_lens == y.q_lens and x.page_tables == y.page_tables
            and x.window_starts == y.window_starts and torch.equal(x.input_ids, y.input_ids))


@dataclass
class _Speculation:
    items: list[WorkItem]  # iteration k+1's, as guessed
    plan: ForwardPlan
    result: Future  # -> Forward


class Overlap:
    """The speculative next forward of an `EngineCore` (module docstring): it wraps the runner. `run` is
    ModelRunner.run with the speculation around it (`take` the last one, then `launch` the next); `settle`
    before any other use of the device."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, reason_off: str | None,
                 inline: bool | None = None):
        """inline: enqueue the speculative forward on the calling thread (default on CUDA, where launches are
        asynchronous, so the device computes while the host goes on; no thread, no GIL hand-off); else run it
        on a worker thread (CPU, where an op returns only when it is done)."""
        self.runner, self.scheduler = runner, scheduler
        self.reason_off = reason_off
        self.inline = runner.device.type == "cuda" if inline is None else inline
        threaded = reason_off is None and not self.inline
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="redraft-forward") if threaded else None
        self._pending: _Speculation | None = None
        self.num_used = 0  # speculative forwards whose result a step used
        self.num_dropped = 0  # speculative forwards thrown away (the next iteration differed)

    @property
    def enabled(self) -> bool:
        return self.reason_off is None

    def run(self, items: list[WorkItem], busy: bool = False) -> StepOutput:
        """ModelRunner.run of `items`: the decision on the speculative forward when it was the forward of exactly
        these items, else the serial path; then forward k+1 is launched (it runs while the caller updates the
        requests). `busy`: other device work is queued (likelihood jobs), which must not run beside a forward."""
        decide = self.take(items)
        out = decide(items) if decide is not None else self.runner.run(items)
        self.launch(items, out, busy)
        return out

    def launch(self, items: list[WorkItem], out: StepOutput, busy: bool) -> None:
        """After step k's decision `out`, before its update: start forward k+1 (queued on CUDA, on the worker
        thread on CPU) when the batch ran without failures and the next one can repeat it."""
        if not self.enabled or busy or out.failed:
            return
        sched = self.scheduler
        if sched.waiting and len(sched.running) < sched.config.max_running_requests or sched.config.recompute_prefix:
            return  # an admission would change the batch; every query of a recompute_prefix run starts at 0
        guess = next_iteration(items, out, self.runner.block_size, self.runner.mask_id, sched.pool)
        if guess is None:
            return
        plan = self.runner.plan(*guess)  # (a new block's window is one block, like the ended one's)
        if plan.in_graph:
            return  # its forward is also its decision, which advances the slot rows: nothing to run ahead
        if self.inline:
            future: Future = Future()
            try:
                future.set_result(self.runner.forward(plan))  # (on CUDA: returns once the kernels are queued)
            except Exception as exc:  # noqa: BLE001 - take() drops it; the serial path reruns and reports it
                future.set_exception(exc)
        else:
            future = self._pool.submit(self._forward, plan, torch.get_num_threads())
        self._pending = _Speculation(guess[0], plan, future)

    def _forward(self, plan: ForwardPlan, threads: int) -> Forward:
        """The worker's job: the forward alone (ModelRunner.forward reads nothing but the plan)."""
        if torch.get_num_threads() != threads:  # OpenMP's thread count is per thread: match the engine's
            torch.set_num_threads(threads)
        dev = self.runner.device
        with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
            return self.runner.forward(plan)

    def take(self, items: list[WorkItem]) -> Callable[[list[WorkItem]], StepOutput] | None:
        """Iteration k+1's items, just scheduled: the decision from the speculative forward when it is the forward
        of exactly these items (to run in place of ModelRunner.run), else None (dropped: the serial path runs).
        Returns once the worker is done either way."""
        spec, self._pending = self._pending, None
        if spec is None:
            return None
        plan = self._plan_if_same(spec, items)  # host work, while the forward may still run
        try:
            fwd = spec.result.result()
        except Exception as exc:  # noqa: BLE001 - the serial path reruns it and handles the failure
            log.debug("a speculative forward failed; the serial path reruns it", exc_info=exc)
            fwd = None
        if plan is None or fwd is None:
            self.num_dropped += 1
            return None
        self.num_used += 1
        return lambda its: self._decide(its, plan, fwd)

    def _plan_if_same(self, spec: _Speculation, items: list[WorkItem]) -> ForwardPlan | None:
        """The plan of `items`, when it is the speculative forward's, else None."""
        if len(items) != len(spec.items):
            return None
        slots = self.runner.slots
        for now, then in zip(items, spec.items):
            if (now.req is not then.req or (now.first, now.last, now.decodes) != (then.first, then.last, then.decodes)
                    or now.req.finished or (slots.stale(now.req) and now.req.state.constraint is not None)):
                return None  # (a grammar writes a block's forced tokens before its forward: the serial path)
        plan = self.runner.plan(items, build_forward_batch(items, self.runner.block_size))
        return plan if same_forward(plan, spec.plan) else None

    def _decide(self, items: list[WorkItem], plan: ForwardPlan, fwd: Forward) -> StepOutput:
        """ModelRunner.run's decision on the speculative forward: the rows of new blocks are loaded first."""
        failed: dict[str, tuple[str, BaseException]] = {}
        self.runner.sync_rows([it.req for it in items if it.decodes], failed)
        self.runner.faults.check_any("forward", [it.req.rid for it in items])
        return self.runner.decide(items, plan, fwd, failed)

    def settle(self) -> None:
        """Wait for a speculative forward and drop it: before the device does anything else (a likelihood chunk),
        when the next iteration has no batch, at shutdown."""
        spec, self._pending = self._pending, None
        if spec is None:
            return
        with contextlib.suppress(Exception):
            spec.result.result()
        self.num_dropped += 1

    def shutdown(self) -> None:
        self.settle()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
