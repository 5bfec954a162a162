"""Likelihood work (engine/text/likelihood.py's masked variants): everything the engine does for `/score` and `echo`.
The engine loop advances each job one bounded chunk at a time, between decoding iterations, so a large request
never stalls the requests that are running, and can be dropped at once when its client leaves.

A job holds, from its start to its end, a lease on the clean prefix blocks its variants attend to (cached pages
from the radix tree, fresh ones for the rest: `PrefixLeases`). Its chunks, in order:
  1. the uncached parts of those prefixes, computed block-causally (their K/V then enter the tree at the end);
     a prefix longer than the budget is split into block-aligned pieces of exactly the budget (so no two pieces
     of one prefix ever share a forward: a later piece reads the K/V the earlier one wrote);
  2. the variants, each on a scratch page of its own (allocated and freed within its chunk).
Each chunk is at most `budget` tokens of forward (CHUNK_TOKENS, or less): a fixed size, so a job's values do not
depend on what runs beside it or when. While requests decode, chunks run only within SHARE of the engine's time
(TimeShare), so running requests keep their pace. `Scoring` is the engine's queue of jobs; `score_forward` their
forward on the model runner's KV cache.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from redraft.engine.decoding.decoding import exclude_mask_
from redraft.engine.runtime.model_runner import ModelRunner
from redraft.engine.runtime.output import finite_logprobs
from redraft.kernels.attention import AttentionMetadata
from redraft.protocol.errors import RequestError
from redraft.protocol.messages import ScoreResult
from redraft.scheduler.radix_cache import RadixNode
from redraft.scheduler.scheduler import Scheduler, describe

log = logging.getLogger("redraft.engine")

Query = tuple[list[int], int, list[int]]  # (token ids, first position, page table)
Values = list[tuple[float, list[tuple[int, float]]]]  # per read: (logprob, top alternatives [(token, logprob)])

# Tokens of forward in one chunk of a job (at most --chunked-prefill-size), by device type: fixed, so a job's values
# never depend on timing, and small enough that one chunk delays the running requests' next step by little (on this
# project's CPU test machine a 1024-token forward of the demo model takes about 0.2 s; a GPU's is milliseconds).
CHUNK_TOKENS = {"cpu": 1024, "cuda": 4096}
# While requests are decoding, likelihood work gets at most this much engine time per second of decoding time
# (between the two, chunks wait): running requests keep most of their pace, jobs still progress.
SHARE = 0.25
MAX_CREDIT_S = 0.25  # unused credit kept across idle spells (a burst of chunks after a pause stays short)


class TimeShare:
    """When a job may run its next chunk: at once while nothing decodes, else when scoring has spent less than
    SHARE of the decoding time (a credit in seconds, earned by decoding, spent by chunks)."""

    def __init__(self, share: float = SHARE):
        self.share = share
        self.credit = 0.0

    def decoded(self, seconds: float) -> None:
        self.credit = min(self.credit + self.share * seconds, MAX_CREDIT_S)

    def may_run(self, decoding: bool) -> bool:
        return not decoding or self.credit > 0

    def scored(self, seconds: float, decoding: bool) -> None:
        self.credit = self.credit - seconds if decoding else 0.0


def chunks(items: list, budget: int, cost: Callable[[Any], int]) -> list[list]:
    """Consecutive groups of `items` whose summed cost stays within `budget` (at least one item each)."""
    out: list[list] = [[]]
    used = 0
    for item in items:
        c = cost(item)
        if out[-1] and used + c > budget:
            out.append([])
            used = 0
        out[-1].append(item)
        used += c
    return [g for g in out if g]


@dataclass
class PrefixLease:
    """Pages for the whole blocks of a token prefix: the first `cached` come from the radix tree (`node` locked);
    the job computes the K/V of the rest, then `PrefixLeases.release` hands them to the tree."""

    tokens: list[int]
    pages: list[int]
    cached: int
    node: RadixNode | None


class PrefixLeases:
    """Scoring's pages, taken from the scheduler's pool and radix tree outside any request: leased prefixes
    (locked until released) and scratch pages for one forward. `count` leases are held now; while any is, the
    scheduler lets a request that does not fit wait for them (`Scheduler.pages_held_elsewhere`)."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.count = 0

    def lease(self, tokens: list[int]) -> PrefixLease | None:
        """Pages for the whole blocks of `tokens` (cached ones from the tree, fresh ones for the rest), or None
        when the pool cannot hold them now."""
        sched, b = self.sched, self.sched.config.block_size
        tokens = tokens[: len(tokens) // b * b]
        match = sched.cache.match_prefix(tokens) if sched.config.caches_prefixes else None
        cached = len(match.pages) if match else 0
        if match is not None:
            sched.cache.inc_lock(match.last_node)
        fresh = sched.alloc_pages(len(tokens) // b - cached)
        if fresh is None:
            if match is not None:
                sched.cache.dec_lock(match.last_node)
            return None
        self.count += 1
        return PrefixLease(tokens, (match.pages if match else []) + fresh, cached, match.last_node if match else None)

    def release(self, lease: PrefixLease, computed: bool) -> None:
        """Hand the lease's pages to the tree (when their K/V were computed) or back to the pool; unlock."""
        sched = self.sched
        fresh = lease.pages[lease.cached :]
        if computed and sched.config.caches_prefixes and fresh:
            sched.cache.insert(lease.tokens, lease.pages)  # the tree takes the new pages, frees duplicates
        elif fresh:
            sched.free_pages(fresh)
        if lease.node is not None:
            sched.cache.dec_lock(lease.node)
        self.count -= 1

    def scratch(self, n: int) -> list[int] | None:
        """`n` pages for one forward's throw-away K/V (give them back with `free`)."""
        return self.sched.alloc_pages(n)

    def free(self, pages: list[int]) -> None:
        self.sched.free_pages(pages)

    @property
    def requests_running(self) -> bool:
        """Whether running requests hold pages that they will free."""
        return bool(self.sched.running)


@torch.inference_mode()
def score_forward(runner: ModelRunner, queries: list[Query], reads: list[list[tuple[int, int]]],
                  top_k: int = 0) -> list[Values]:
    """Scoring forwards outside the decode batches: each query (token ids, first position, page table) is
    block-causal, its K/V written where its page table says; then, per query, for each (offset, token) in
    its reads, the token's log-probability at that offset (MASK excluded, as in decoding) and the top_k
    alternatives [(token, logprob)] of the same row."""
    model, dev = runner.model, runner.device
    ids = torch.tensor([t for q in queries for t in q[0]], dtype=torch.long, device=dev)  # [T]
    meta = AttentionMetadata.build([q[1] for q in queries], [len(q[0]) for q in queries], [q[2] for q in queries],
                                   runner.block_size, dev, with_torch_plan=model.kernel_backend == "torch")
    hidden = model(ids, meta, runner.k_cache, runner.v_cache)  # [T, H]
    starts = meta.cu_q[:-1].tolist()
    flat = [starts[i] + off for i, rs in enumerate(reads) for off, _ in rs]
    if not flat:
        return [[] for _ in queries]
    logits = exclude_mask_(model.logits(hidden, torch.tensor(flat, device=dev)), runner.mask_id)  # [R, V]
    if runner.non_text_ids:  # LLaDA2.2: DELETE and SPLIT are edits, not text: left out as MASK is
        logits[:, list(runner.non_text_ids)] = float("-inf")
    lp = finite_logprobs(logits)  # [R, V]
    want = torch.tensor([tok for rs in reads for _, tok in rs], device=dev)  # [R]
    chosen = lp.gather(-1, want[:, None]).squeeze(-1).tolist()
    top_v, top_i = lp.topk(top_k, -1) if top_k else (None, None)  # [R, k]
    out, r = [], 0
    for rs in reads:
        row = []
        for _ in rs:
            alts = list(zip(top_i[r].tolist(), top_v[r].tolist())) if top_k else []
            row.append((chosen[r], alts))
            r += 1
        out.append(row)
    return out


class ScoreJob:
    """One likelihood request: `start` leases its prefixes, each `advance` runs one chunk (True when done:
    `results` then holds per variant the (logprob, top alternatives) at each target), `release` hands the leased
    pages back (to the tree when their K/V were computed). `token` names it (ScoreReq.token)."""

    def __init__(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int, budget: int,
                 block_size: int, mask_id: int):
        self.token = token
        self.sequences, self.variants, self.top_k = sequences, variants, top_k
        self.block_size, self.mask_id = block_size, mask_id
        self.budget = max(block_size, budget // block_size * block_size)
        self.leases: list[PrefixLease] = []
        self.results: list = [None] * len(variants)
        self._prefill: list[list[Query]] = []
        self._variant_chunks: list[list[int]] = []
        self.prefilled = False  # every leased prefix has its K/V
        self.chunks_run = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, leases: PrefixLeases) -> None:
        """Lease the clean prefixes (RequestError 503 when the KV cache cannot hold them now) and plan the
        chunks."""
        b = self.block_size
        need = [0] * len(self.sequences)  # per sequence: the prefix blocks its variants attend to
        for seq, block, _, _ in self.variants:
            need[seq] = max(need[seq], block)
        for seq, k in zip(self.sequences, need):
            lease = leases.lease(seq[: k * b])
            if lease is None:
                raise RequestError("the KV cache is full: try again", status=503, code="cache_full")
            self.leases.append(lease)
        todo = []
        for seq, lease in zip(self.sequences, self.leases):
            start, end = lease.cached * b, len(lease.tokens)
            while start < end:  # pieces of at most `budget` tokens, block-aligned
                stop = min(end, start + self.budget)
                todo.append((seq[start:stop], start, lease.pages[: stop // b]))
                start = stop
        self._prefill = chunks(todo, self.budget, lambda q: len(q[0]))
        self._variant_chunks = chunks(list(range(len(self.variants))), self.budget, lambda i: b)
        self.prefilled = not self._prefill

    @property
    def done(self) -> bool:
        return not self._prefill and not self._variant_chunks

    def advance(self, leases: PrefixLeases, runner: ModelRunner) -> bool:
        """Run the next chunk; True once every variant has its values. RequestError (503) when no scratch
        page can be had and nothing else would free one."""
        if self._prefill:
            chunk = self._prefill[0]
            score_forward(runner, chunk, [[] for _ in chunk])
            self._prefill.pop(0)
            self.prefilled = not self._prefill
        elif self._variant_chunks:
            if not self._run_variants(self._variant_chunks[0], leases, runner):
                return False  # no scratch pages this iteration: decoding holds them; try again next time
            self._variant_chunks.pop(0)
        self.chunks_run += 1
        return self.done

    def release(self, leases: PrefixLeases) -> None:
        """Hand every leased page back (idempotent): computed prefixes join the radix tree."""
        for lease in self.leases:
            leases.release(lease, computed=self.prefilled)
        self.leases = []

    # ---- internals ---------------------------------------------------------------------------------
    def _run_variants(self, chunk: list[int], leases: PrefixLeases, runner: ModelRunner) -> bool:
        b, mask = self.block_size, self.mask_id
        pages = leases.scratch(len(chunk))
        if pages is None:
            if not leases.requests_running:  # nothing will free pages for us: give up now rather than wait forever
                raise RequestError("the KV cache is full: try again", status=503, code="cache_full")
            return False
        try:
            queries, reads = [], []
            for i, page in zip(chunk, pages):
                s, block, masked_at, targets = self.variants[i]  # a likelihood.Variant, or the plain tuple of one
                seq, start = self.sequences[s], block * b
                ids = seq[start : start + b]
                masked = set(masked_at)
                # a whole block, past the text's end padded with MASK (as a block being decoded is), so a value
                # never depends on what follows
                ids = [mask if start + j in masked else t for j, t in enumerate(ids)] + [mask] * (b - len(ids))
                queries.append((ids, start, self.leases[s].pages[:block] + [page]))
                reads.append([(p - start, seq[p]) for p in targets])
            for i, row in zip(chunk, score_forward(runner, queries, reads, self.top_k)):
                self.results[i] = row
        finally:
            leases.free(pages)
        return True


class Scoring:
    """The engine's likelihood jobs by token: each engine step advances the oldest by one chunk, which then goes to
    the back of the line (round-robin: a small echo request does not wait behind a large /score); finished jobs'
    ScoreResults wait in `take_results`."""

    def __init__(self, sched: Scheduler, runner: ModelRunner, chunk_tokens: int, mask_id: int):
        self.leases = PrefixLeases(sched)
        self.runner = runner
        self.chunk_tokens = chunk_tokens  # a job's forward tokens per chunk unless it names its own
        self.mask_id = mask_id
        self.jobs: dict[str, ScoreJob] = {}
        self._results: list[ScoreResult] = []  # finished jobs not yet taken
        self._share = TimeShare()  # scoring's share of the engine's time while requests decode

    def start(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int = 0,
              max_tokens: int | None = None) -> ScoreJob:
        """A job with its prefixes leased (RequestError 503 when the KV cache cannot hold them now)."""
        job = ScoreJob(token, sequences, variants, top_k, max_tokens or self.chunk_tokens,
                       self.leases.sched.config.block_size, self.mask_id)
        try:
            job.start(self.leases)
        except BaseException:
            job.release(self.leases)  # the prefixes leased before the one that did not fit
            raise
        return job

    def add(self, job: ScoreJob) -> None:
        self.jobs[job.token] = job

    def cancel(self, token: str) -> bool:
        """Drop a job (its client left): its leased pages are released now. Idempotent."""
        job = self.jobs.pop(token, None)
        if job is None:
            return False
        job.release(self.leases)
        log.info("score job %s cancelled after %d chunks", token, job.chunks_run)
        return True

    def take_results(self) -> list[ScoreResult]:
        out, self._results = self._results, []
        return out

    def decoded(self, seconds: float) -> None:
        """The engine spent `seconds` on a decoding iteration (it earns scoring its share)."""
        self._share.decoded(seconds)

    def advance(self, decoding: bool, faults: Any) -> None:
        """One chunk of the oldest job. While requests decode (`decoding`: this iteration ran a forward), only
        within scoring's share of the time. A job that fails ends alone with an error result; `faults` is the
        engine's test hook (stage "score")."""
        if not self.jobs or not self._share.may_run(decoding):
            return
        token, job = next(iter(self.jobs.items()))
        del self.jobs[token]
        t0 = time.monotonic()
        try:
            faults.check("score", token)
            done = job.advance(self.leases, self.runner)
            self._share.scored(time.monotonic() - t0, decoding)
        except RequestError as exc:
            job.release(self.leases)
            self._results.append(ScoreResult.failed(token, exc))
            return
        except Exception as exc:  # noqa: BLE001 - one job's failure must not stop the loop
            log.error("score job %s failed: %s", token, describe(exc))
            log.debug("score job %s failed", token, exc_info=True)
            job.release(self.leases)
            self._results.append(ScoreResult(token, None, 500, f"scoring failed: {describe(exc)}", "internal_error"))
            return
        if done:
            job.release(self.leases)
            self._results.append(ScoreResult(token, job.results))
        else:
            self.jobs[token] = job  # to the back of the line

    def run_to_end(self, job: ScoreJob) -> list[Values]:
        """Run a started job to its end at once (the offline Engine), then release it: its results."""
        try:
            while True:
                before = job.chunks_run
                if job.advance(self.leases, self.runner):
                    break
                if job.chunks_run == before:  # no scratch page (requests hold them): nothing frees one here
                    raise RequestError("the KV cache is full: try again", status=503, code="cache_full")
        finally:
            job.release(self.leases)
        return job.results

    def shutdown(self) -> None:
        for token in list(self.jobs):
            self.cancel(token)
