"""Likelihood work (engine/likelihood.py's masked variants) as a job that the engine loop advances one bounded
chunk at a time, between decoding iterations, so a large `/score` or `echo` request never stalls the requests
that are running, and can be dropped at once when its client leaves.

A job holds, from its start to its end, a lease on the clean prefix blocks its variants attend to (cached pages
from the radix tree, fresh ones for the rest). Its chunks, in order:
  1. the uncached parts of those prefixes, computed block-causally (their K/V then enter the tree at the end);
     a prefix longer than the budget is split into block-aligned pieces of exactly the budget (so no two pieces
     of one prefix ever share a forward: a later piece reads the K/V the earlier one wrote);
  2. the variants, each on a scratch page of its own (allocated and freed within its chunk).
Each chunk is at most `budget` tokens of forward (CHUNK_TOKENS, or less): a fixed size, so a job's values do not
depend on what runs beside it or when. While requests decode, chunks run only within SHARE of the engine's time
(TimeShare), so running requests keep their pace.
"""

from __future__ import annotations

from typing import Any, Callable

RequestRejectedFactory = Callable[..., Exception]

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


class ScoreJob:
    """One likelihood request: `start` leases its prefixes, each `advance` runs one chunk (True when done:
    `results` then holds per variant the (logprob, top alternatives) at each target), `release` hands the leased
    pages back (to the tree when their K/V were computed). `token` names it (ScoreReq.token)."""

    def __init__(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int, budget: int,
                 block_size: int, mask_id: int, rejected: RequestRejectedFactory):
        self.token = token
        self.sequences, self.variants, self.top_k = sequences, variants, top_k
        self.block_size, self.mask_id = block_size, mask_id
        self.budget = max(block_size, budget // block_size * block_size)
        self._rejected = rejected  # core.RequestRejected (this module stays free of the core's imports)
        self.leases: list = []
        self.results: list = [None] * len(variants)
        self._prefill: list[list[tuple[list[int], int, list[int]]]] = []
        self._variant_chunks: list[list[int]] = []
        self.prefilled = False  # every leased prefix has its K/V
        self.chunks_run = 0

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, sched: Any) -> None:
        """Lease the clean prefixes (RequestRejected 503 when the KV cache cannot hold them now) and plan the
        chunks."""
        b = self.block_size
        need = [0] * len(self.sequences)  # per sequence: the prefix blocks its variants attend to
        for seq, block, _, _ in self.variants:
            need[seq] = max(need[seq], block)
        for seq, k in zip(self.sequences, need):
            lease = sched.lease_prefix(seq[: k * b])
            if lease is None:
                raise self._rejected("the KV cache is full: try again", status=503, code="cache_full")
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

    def advance(self, sched: Any, runner: Any) -> bool:
        """Run the next chunk; True once every variant has its values. RequestRejected (503) when no scratch
        page can be had and nothing else would free one."""
        if self._prefill:
            chunk = self._prefill[0]
            runner.query_logprobs(chunk, [[] for _ in chunk])
            self._prefill.pop(0)
            self.prefilled = not self._prefill
        elif self._variant_chunks:
            if not self._run_variants(self._variant_chunks[0], sched, runner):
                return False  # no scratch pages this iteration: decoding holds them; try again next time
            self._variant_chunks.pop(0)
        self.chunks_run += 1
        return self.done

    def release(self, sched: Any) -> None:
        """Hand every leased page back (idempotent): computed prefixes join the radix tree."""
        for lease in self.leases:
            sched.release_prefix(lease, computed=self.prefilled)
        self.leases = []

    # ---- internals ---------------------------------------------------------------------------------
    def _run_variants(self, chunk: list[int], sched: Any, runner: Any) -> bool:
        b, mask = self.block_size, self.mask_id
        pages = sched.alloc_scratch(len(chunk))
        if pages is None:
            if not sched.running:  # nothing will free pages for us: give up now rather than wait forever
                raise self._rejected("the KV cache is full: try again", status=503, code="cache_full")
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
            for i, row in zip(chunk, runner.query_logprobs(queries, reads, self.top_k)):
                self.results[i] = row
        finally:
            sched.free_scratch(pages)
        return True
