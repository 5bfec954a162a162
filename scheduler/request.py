"""One request, in three parts that change for different reasons. Torch-free: plain lists of token ids.

    RequestInputs  what was asked: ids, resolved parameters, geometry. Frozen: nothing writes it.
    DecodeState    the decoding state of the open window (`Request.state`): tokens, the window's blocks, the
                   block-start snapshots, stats, logprobs, edit trace, finish. Written only by `Request`'s own
                   methods below; the model runner mirrors it to its device row keyed by `Request.row_key`.
    Bookkeeping    the scheduler's pages and slot (`Request.book`). Written only by the scheduler.

The open window is blocks [window_start, active_block] (multi-block editing, docs/mbe.md; with
mbe_window W = 1 it is the active block alone, the official loop): the active block is the only one that
holds masks, T2T may edit any non-prompt token of the window, and blocks before window_start are committed
(final tokens). A waiting request's active_block is the block it (re)starts at.

Lifecycle of a block b (with a paged cache):
    begin:  the block is filled with MASK after any prompt tokens it shares (only the first block does);
            the window becomes [max(first_block, b - W + 1), b] and blocks that left it are committed
    each iteration, before the forward (`pre_forward`): if the window has no mask, `post_steps += 1`; once
            `post_steps > max_post_steps` the block ends without a forward. Its last edits came after its last
            forward, so its cached K/V are stale: it stays uncached and joins the next forward's query.
    after the forward (`apply_step`): the step's result replaces the window; every committed block in the
            query now has exact K/V. If the window had no mask and nothing was edited, the block ends; with
            W = 1 the forward that saw its final tokens wrote exact K/V: no extra forward. (With W > 1 the
            window's K/V saw later blocks: a block leaving the window is recomputed block-causally as a
            prefill row of the next forward.) `apply_step` says how many leading blocks are exact; the
            scheduler records it (`Bookkeeping.exact_blocks`).
    end:    stop at EOS / a stop token / the last block (every open block commits), else begin block b + 1.
The query of a forward is blocks [book.exact_blocks, active_block]: uncached committed blocks (prefill,
block-causal), then the open window, in one pass.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from redraft.protocol.sampling_params import BLOCK_SIZE, ResolvedParams
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.denoise_trace import DenoiseTrace
from redraft.scheduler.radix_cache import RadixNode, blocks_through

_UIDS = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class FinishReason:
    kind: str  # "stop" | "length" | "abort" | "error" (a failure inside the engine ended this request alone)
    matched: int | str | None = None  # the EOS / stop token id or stop string that ended it
    message: str | None = None

    def to_json(self) -> dict:
        out: dict = {"type": self.kind}
        if self.matched is not None:
            out["matched"] = self.matched
        if self.message:
            out["message"] = self.message
        return out


@dataclass
class DecodeStats:
    steps: int = 0  # denoising forwards spent on this request
    m2t: int = 0  # masks filled
    edits: int = 0  # T2T replacements
    mbe_edits: int = 0  # of those, the ones in open blocks before the active one (multi-block editing)
    blocks: int = 0  # blocks finished
    deletions: int = 0  # DELETEs applied (a decoder's `deletions` report, LLaDA2.2)
    insertions: int = 0  # and SPLITs applied (a mask inserted)


def stop_ids(params: ResolvedParams, eos_id: int | frozenset[int]) -> set[int]:
    """The token ids that end a request's output: its stop_token_ids and, unless ignore_eos, the EOS id or ids
    (a checkpoint's generation_config.json may list several: each one ends it)."""
    eos = {eos_id} if isinstance(eos_id, int) else set(eos_id)
    return set(params.stop_token_ids) | (set() if params.ignore_eos else eos)


@dataclass(frozen=True, eq=False)
class RequestInputs:
    """What a request asked for, resolved; never changes. `uid` is unique per request object (a rid may be reused
    once its request ended)."""

    rid: str
    prompt_ids: tuple[int, ...]
    params: ResolvedParams
    mask_id: int
    eos_id: int | frozenset[int]  # the EOS id, or every id that is one (Tokenizer.eos_token_ids)
    block_size: int = BLOCK_SIZE
    uid: int = field(default_factory=lambda: next(_UIDS), init=False)

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def first_block(self) -> int:
        return self.prompt_len // self.block_size

    @property
    def last_block(self) -> int:
        return (self.prompt_len + self.params.max_new_tokens - 1) // self.block_size

    @property
    def total_blocks(self) -> int:
        """Blocks (= pages) the request holds at most."""
        return self.last_block + 1

    def block_slice(self, b: int) -> slice:
        return slice(b * self.block_size, (b + 1) * self.block_size)

    def stop_ids(self) -> set[int]:
        return stop_ids(self.params, self.eos_id)


@dataclass
class DecodeState:
    """The decoding state of one request. Written only by `Request`'s methods."""

    tokens: list[int]  # prompt + generated, through the active block
    active_block: int  # the block being decoded (while waiting: the block it (re)starts at)
    window_start: int  # first block of the open window; blocks before it hold final tokens
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    post_steps: int = 0  # mask-free forwards of the active block so far
    # Changes whenever the active block (re)starts: with the request's uid it keys the runner's device row.
    version: int = 0
    stats: DecodeStats = field(default_factory=DecodeStats)
    # As they were when the active block began: a preempted request restarts its block from there.
    block_start_stats: DecodeStats = field(default_factory=DecodeStats)
    block_start_window: list[int] = field(default_factory=list)  # the window's earlier blocks
    block_start_trace: tuple | None = None  # DenoiseTrace.mark() at the block's start
    # Logprobs by block index, kept only when the request asked for them: of the window's blocks from the latest
    # forward, and of every final block (a window block's become final when it commits).
    window_logprobs: dict[int, tuple[list[float], list]] = field(default_factory=dict)
    final_logprobs: dict[int, tuple[list[float], list]] = field(default_factory=dict)
    # What each forward placed and edited (scheduler/denoise_trace.py), kept only when asked: --trace-edits
    # (the demo model's evaluation counts which edits repaired a wrong token), step maps, per-forward events;
    # entries of a preempted block are dropped.
    trace: DenoiseTrace | None = None
    output_end: int = 2**62  # set when a stop token ends the request: the output ends right after it
    output_limit: int | None = None  # a cut of the output set by an abort (a stop string the consumer matched)
    # Structured output: the engine's grammar state (engine/decoding/constrained.py Constraint), None when unconstrained.
    # Opaque here: its frontier never passes a mask, so a block that ends mask-free has been validated whole.
    constraint: object | None = None


@dataclass
class Bookkeeping:
    """The scheduler's record of a request. Written only by the scheduler."""

    arrival: int = 0  # arrival order (the newest is preempted first)
    admitted: bool = False  # admitted at least once (prefix_cached_tokens counts the first admission only)
    prefix_cached_tokens: int = 0  # tokens matched in the prefix cache at admission
    # While admitted: the model runner's row (-1 otherwise), one KV page per block through the active block, the
    # radix node locked for the prefix this request reads from the tree, and how many leading blocks have exact
    # K/V in their pages.
    slot: int = -1
    pages: list[int] = field(default_factory=list)
    cache_node: RadixNode | None = None
    exact_blocks: int = 0
    kv_version: int = 0  # the radix cache's weight version when admitted: its K/V are cached only under it

    @property
    def tree_blocks(self) -> int:
        """Leading pages the tree owns: the blocks of the locked prefix."""
        return blocks_through(self.cache_node) if self.cache_node is not None else 0


class StepEnd(NamedTuple):
    ended: bool  # the active block ended
    exact_blocks: int  # blocks [0, exact_blocks) have exact K/V after this forward


class Request(RequestInputs):
    """A request's inputs, its decoding state (`state`) and the scheduler's bookkeeping (`book`)."""

    def __init__(self, rid: str, prompt_ids: list[int] | tuple[int, ...], params: ResolvedParams, mask_id: int,
                 eos_id: int | frozenset[int], block_size: int = BLOCK_SIZE, *, trace_edits: bool = False,
                 constraint: object | None = None, max_trace_changes: int = ServerArgs.max_trace_changes,
                 max_forwards_per_token: int = 0):
        super().__init__(rid, tuple(prompt_ids), params, mask_id, eos_id, block_size)
        # the forward budget (--max-forwards-per-token; 0: none): a multiple of the positions of the blocks its
        # output may span
        self.forward_budget = max_forwards_per_token * (self.last_block - self.first_block + 1) * block_size
        self.trace_edits = trace_edits  # meta_info.edit_trace (the server's --trace-edits)
        traced = trace_edits or params.stream_denoise or params.return_step_maps
        trace = DenoiseTrace(self.prompt_len, mask_id, self.prompt_len + params.max_new_tokens, block_size,
                             events=params.stream_denoise,
                             change_logprobs=[] if params.placement_logprobs else None,
                             max_changes=max_trace_changes) if traced else None
        self.state = DecodeState(list(self.prompt_ids), self.first_block, self.first_block, trace=trace,
                                 constraint=constraint)
        self.book = Bookkeeping()

    # ---- reading the state ----------------------------------------------------------------------------
    @property
    def finished(self) -> bool:
        return self.state.status is Status.FINISHED

    @property
    def row_key(self) -> tuple[int, int]:
        """Names the state of the current block start: a device row loaded for another key is stale."""
        return self.uid, self.state.version

    @property
    def window_size(self) -> int:
        """Blocks in the open window now (<= mbe_window: fewer while it begins at the first block)."""
        return self.state.active_block - self.state.window_start + 1

    def active_tokens(self) -> list[int]:
        return self.state.tokens[self.block_slice(self.state.active_block)]

    def window_tokens(self) -> list[int]:
        s, b = self.state, self.block_size
        return s.tokens[s.window_start * b : (s.active_block + 1) * b]

    def prefix_tokens(self) -> list[int]:
        """The whole final blocks a prefix-cache lookup may match."""
        return self.state.tokens[: self.state.window_start * self.block_size]

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Admitted (or re-admitted after preemption): begin the block it is at (the first one at first)."""
        self.state.status = Status.RUNNING
        self._begin_block(self.state.active_block)

    def preempt(self) -> None:
        """Back to waiting; committed blocks are kept, the window's earlier blocks go back to what they were when
        the active block began, and the active block will start over from all-mask (decoding is
        deterministic from a block's start, so the outcome is unchanged)."""
        self.state.status = Status.WAITING
        self.rewind_block()

    def restart_block(self) -> None:
        """A running request's active block starts over from its entry (its device row is reloaded): a
        decoder that keeps block state (`Decoder.keeps_block_state`) holds it on the device only, so a row that
        must be resynced mid-block restarts the block (decoding is deterministic from a block's entry: the same
        tokens and forward count)."""
        self.rewind_block()
        self._begin_block(self.state.active_block)

    def rewind_block(self) -> None:
        """The active block back to its entry (tokens, stats, trace), to be begun again."""
        s, b = self.state, self.block_size
        s.stats = replace(s.block_start_stats)
        if s.trace is not None and s.block_start_trace is not None:
            s.trace.rollback(s.block_start_trace)
        keep = max(s.window_start * b, self.prompt_len)
        s.tokens = s.tokens[:keep] + s.block_start_window[keep - s.window_start * b :]
        s.window_logprobs = {}
        s.post_steps = 0

    def _begin_block(self, blk: int) -> None:
        s, b = self.state, self.block_size
        s.active_block = blk
        s.version += 1
        s.block_start_stats = replace(s.stats)
        s.block_start_trace = s.trace.mark() if s.trace is not None else None
        s.post_steps = 0
        self._commit_through(max(self.first_block, blk - self.params.mbe_window + 1))
        end = (blk + 1) * b
        s.tokens = s.tokens[: max(blk * b, self.prompt_len)]
        s.tokens += [self.mask_id] * (end - len(s.tokens))
        s.block_start_window = s.tokens[s.window_start * b : blk * b]

    def _commit_through(self, window_start: int) -> None:
        """Blocks before `window_start` are committed: final tokens, final logprobs."""
        s = self.state
        s.window_start = window_start
        for blk in [k for k in s.window_logprobs if k < window_start]:
            s.final_logprobs[blk] = s.window_logprobs.pop(blk)

    def begin_constraint(self) -> None:
        """Structured output, before the block's first forward: the grammar restarts at the block and writes the
        tokens it forces into the window (engine/decoding/constrained.py `Constraint.begin_block`)."""
        s, b = self.state, self.block_size
        s.constraint.begin_block(s.tokens, s.active_block * b, (s.active_block + 1) * b)  # type: ignore[union-attr]

    def pre_forward(self) -> bool:
        """The check before a forward. Returns False when the active block ends here (no forward). A decoder
        whose blocks end after a forward only (`ResolvedParams.ends_blocks_after_forward`: `apply_step`'s `ended`)
        is left alone."""
        if self.params.ends_blocks_after_forward:
            return True
        if self.mask_id not in self.active_tokens():  # only the active block can hold masks
            self.state.post_steps += 1
        return self.state.post_steps <= self.params.max_post_steps

    def ends_at_pre_forward(self, active: list[int]) -> bool:
        """`pre_forward`'s verdict once the active block holds `active`, without counting anything (the overlap
        scheduler's forecast of the next iteration, engine/runtime/overlap.py): True when the block ends there."""
        if self.params.ends_blocks_after_forward:
            return False
        return self.state.post_steps + (self.mask_id not in active) > self.params.max_post_steps

    def set_window_logprobs(self, lps: list[float], tops: list) -> None:
        """The latest forward's logprobs over the window (one entry per window position)."""
        s, b = self.state, self.block_size
        for j, blk in enumerate(range(s.window_start, s.active_block + 1)):
            s.window_logprobs[blk] = (lps[j * b : (j + 1) * b], tops[j * b : (j + 1) * b])

    def apply_step(self, new_window: list[int], had_mask: bool, m2t: int, t2t: int, mbe_edits: int = 0,
                   ended: bool | None = None, deletions: int = 0, insertions: int = 0,
                   confidence: list[float] | None = None, logprobs: list[float] | None = None) -> StepEnd:
        """Record one denoising forward's result (the window's tokens after the step; `mbe_edits` of the t2t
        edits landed in blocks before the active one). `ended`: the step's own verdict, from a decoder that reports one
        (the block commits after this forward, which saw its final tokens), else LLaDA2.1's rule below.
        `confidence`: each position's proposal probability, copied back only for a request that streams its
        forwards."""
        s, b = self.state, self.block_size
        s.stats.steps += 1
        s.stats.m2t += m2t
        s.stats.edits += t2t
        s.stats.mbe_edits += mbe_edits
        s.stats.deletions += deletions
        s.stats.insertions += insertions
        window = slice(s.window_start * b, (s.active_block + 1) * b)
        if s.trace is not None:  # (where a decoder inserts or deletes, positions shift: the trace records them as they are)
            s.trace.record(s.stats.steps, s.active_block, window.start, s.tokens[window], new_window, confidence,
                           logprobs)
        s.tokens[window] = new_window
        if ended is not None:  # W = 1 (admission): an ended block's last forward saw its final tokens
            return StepEnd(ended, s.active_block + 1 if ended else s.window_start)
        if not had_mask and t2t == 0:
            # W = 1: the forward saw the block's final tokens, block-causally, and no later window will reopen
            # it. (With W > 1 the block stays open, or its K/V saw later blocks: it is recomputed on commit.)
            return StepEnd(True, s.active_block + 1 if self.params.mbe_window == 1 else s.window_start)
        return StepEnd(False, s.window_start)  # every committed block of the query is exact now

    def end_block(self) -> FinishReason | None:
        """The active block is done. Returns why the request finishes (every open block then commits), or None
        to go on with the next block."""
        s, b = self.state, self.block_size
        s.stats.blocks += 1
        # Only the window can hold a new stop token: an earlier one would have ended the request at its block.
        lo = max(self.prompt_len, s.window_start * b)
        hi = min((s.active_block + 1) * b, self.prompt_len + self.params.max_new_tokens)
        stops = self.stop_ids()
        hit = next((i for i in range(lo, hi) if s.tokens[i] in stops), None)
        if hit is None and s.active_block < self.last_block:
            return None
        self._commit_through(s.active_block + 1)  # the request ends: every open block commits
        if hit is not None:
            s.output_end = hit + 1  # through the first stop token
            return FinishReason("stop", matched=s.tokens[hit])
        return FinishReason("length")

    def advance(self) -> None:
        self._begin_block(self.state.active_block + 1)

    def out_of_forwards(self) -> FinishReason | None:
        """A `length` finish once the request has spent its forward budget, else None."""
        if not self.forward_budget or self.state.stats.steps < self.forward_budget:
            return None
        return FinishReason("length", message=f"the request used its {self.forward_budget} denoising forwards "
                                              "(--max-forwards-per-token x max_new_tokens, by blocks)")

    def finish(self, reason: FinishReason, keep_tokens: int | None = None) -> None:
        """Finished as `reason`; `keep_tokens` cuts the output (an abort that names where the answer ends)."""
        self.state.status = Status.FINISHED
        self.state.finish_reason = reason
        if keep_tokens is not None:
            self.state.output_limit = keep_tokens

    # ---- output -------------------------------------------------------------------------------------
    def output_ids(self) -> list[int]:
        """Generated tokens of the final blocks, cut to max_new_tokens, then through the first EOS/stop token."""
        s = self.state
        end = min(s.window_start * self.block_size, self.prompt_len + self.params.max_new_tokens, s.output_end)
        if s.output_limit is not None:
            end = min(end, self.prompt_len + s.output_limit)
        return s.tokens[self.prompt_len : end]

    def output_logprobs(self, start: int = 0) -> tuple[list[float], list] | None:
        """(logprob of each output token, top alternatives at each) for output_ids()[start:], or None when
        the request did not ask for logprobs. Reads only the blocks that hold those tokens."""
        if not self.params.wants_logprobs:
            return None
        s, bs = self.state, self.block_size
        n = len(self.output_ids())
        lps: list[float] = []
        tops: list = []
        b = (self.prompt_len + start) // bs
        while b < s.window_start and len(lps) < n - start:
            block_lp, block_top = s.final_logprobs.get(b, ([0.0] * bs, [[]] * bs))
            lo = max(self.prompt_len + start - b * bs, 0)
            lps += block_lp[lo:]
            tops += block_top[lo:]
            b += 1
        return lps[: n - start], tops[: n - start]
