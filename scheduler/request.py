"""One request's decoding state, block by block. Torch-free: plain lists of token ids.

The open window is blocks [window_start, active_block] (multi-block editing, docs/mbe.md; with
mbe_window W = 1 it is the active block alone, the official loop): the active block is the only one that
holds masks, T2T may edit any non-prompt token of the window, and blocks before window_start are committed.

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
            prefill row of the next forward.)
    end:    stop at EOS / a stop token / the last block (every open block commits), else begin block b + 1.
The query of a forward is blocks [cached_blocks, active_block]: uncached committed blocks (prefill,
block-causal), then the open window, in one pass.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field, replace

from redraft.protocol.sampling_params import BLOCK_SIZE, ResolvedParams

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


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: ResolvedParams
    mask_id: int
    eos_id: int
    block_size: int = BLOCK_SIZE
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # prompt + generated, through the active block
    active_block: int = -1
    cached_blocks: int = 0  # blocks [0, cached_blocks) have exact K/V in their pages
    prefix_cached_tokens: int = 0  # tokens matched in the prefix cache at admission
    pages: list[int] = field(default_factory=list)  # one KV page per block, through the active block
    post_steps: int = 0  # mask-free forwards of the active block so far
    finish_reason: FinishReason | None = None
    stats: DecodeStats = field(default_factory=DecodeStats)
    # Blocks [0, final_blocks) hold final tokens (prompt blocks, then every ended block).
    final_blocks: int = 0
    # Scheduler bookkeeping: arrival order (newest is preempted first), the radix node locked for the
    # prefix this request reads from the tree, and how many leading pages the tree owns.
    arrival: int = 0
    cache_node: object | None = None
    tree_blocks: int = 0
    # The stats when the active block began: a preempted request restarts its block from there.
    block_start_stats: DecodeStats = field(default_factory=DecodeStats)
    admitted: bool = False  # admitted at least once (prefix_cached_tokens counts the first admission only)
    # Logprobs of every final block (by block index), kept only when the request asked for them.
    final_logprobs: dict[int, tuple[list[float], list]] = field(default_factory=dict)
    # Every T2T edit as (completion position, old id, new id), kept only when asked (the demo model's
    # evaluation counts which edits repaired a wrong token); entries of a preempted block are dropped.
    edit_trace: list[tuple[int, int, int]] | None = None
    block_start_trace_len: int = 0
    # Output tokens already sent to the consumer (outputs are incremental), and a cut of the output set by
    # an abort that names where the answer ends (a stop string the consumer matched).
    sent_tokens: int = 0
    output_limit: int | None = None
    output_end: int = 2**62  # set when a stop token ends the request: the output ends right after it
    # The model runner's per-request state lives in row `slot` of its slot tensors (given by the scheduler
    # while running, -1 otherwise); `block_version` changes whenever the active block (re)starts, which tells
    # the runner to reload that row.
    slot: int = -1
    block_version: int = 0
    # Unique per Request object (a rid may be reused once its request ended): the runner's per-slot rows are keyed
    # by (uid, block_version), so a new request on a freed slot never inherits a stale row.
    uid: int = field(default_factory=lambda: next(_UIDS))
    # Multi-block editing: the first block of the open window, the window's earlier blocks as they were when
    # the active block began (a preempted request resumes from them), the block to resume at, and the
    # logprobs of the window's blocks from the latest forward (they become final when a block commits).
    window_start: int = 0
    block_start_window: list[int] = field(default_factory=list)
    resume_block: int = 0
    window_logprobs: dict[int, tuple[list[float], list]] = field(default_factory=dict)
    # Structured output: the engine's grammar state (engine/constrained.py Constraint), None when unconstrained.
    # Opaque here: its frontier never passes a mask, so a block that ends mask-free has been validated whole.
    constraint: object | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("the prompt is empty")
        if not self.tokens:
            self.tokens = list(self.prompt_ids)
        self.final_blocks = self.prompt_len // self.block_size
        self.window_start = self.resume_block = self.first_block

    # ---- geometry -----------------------------------------------------------------------------------
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

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def block_slice(self, b: int) -> slice:
        return slice(b * self.block_size, (b + 1) * self.block_size)

    @property
    def window_size(self) -> int:
        """Blocks in the open window now (<= mbe_window: fewer while it begins at the first block)."""
        return self.active_block - self.window_start + 1

    def active_tokens(self) -> list[int]:
        return self.tokens[self.block_slice(self.active_block)]

    def window_tokens(self) -> list[int]:
        return self.tokens[self.window_start * self.block_size : (self.active_block + 1) * self.block_size]

    # ---- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> None:
        """Admitted (or re-admitted after preemption): begin the block it was at (the first one at first)."""
        self.status = Status.RUNNING
        self._begin_block(self.resume_block)

    def preempt(self) -> None:
        """Back to waiting; committed blocks are kept, the window's earlier blocks go back to what they were when
        the active block began, and the active block will start over from all-mask (decoding is
        deterministic from a block's start, so the outcome is unchanged)."""
        self.status = Status.WAITING
        self.stats = replace(self.block_start_stats)
        if self.edit_trace is not None:
            del self.edit_trace[self.block_start_trace_len :]
        keep = max(self.window_start * self.block_size, self.prompt_len)
        self.tokens = self.tokens[:keep] + self.block_start_window[keep - self.window_start * self.block_size :]
        self.resume_block = self.active_block
        self.active_block = -1
        self.block_version += 1
        self.window_logprobs = {}
        self.cached_blocks = 0
        self.pages = []
        self.post_steps = 0

    def prefix_tokens(self) -> list[int]:
        """The whole final blocks a prefix-cache lookup may match."""
        return self.tokens[: self.final_blocks * self.block_size]

    def _begin_block(self, b: int) -> None:
        self.active_block = b
        self.block_version += 1
        self.block_start_stats = replace(self.stats)
        self.block_start_trace_len = len(self.edit_trace) if self.edit_trace is not None else 0
        self.post_steps = 0
        self._commit_through(max(self.first_block, b - self.params.mbe_window + 1))
        end = (b + 1) * self.block_size
        self.tokens = self.tokens[: max(b * self.block_size, self.prompt_len)]
        self.tokens += [self.mask_id] * (end - len(self.tokens))
        self.block_start_window = self.tokens[self.window_start * self.block_size : b * self.block_size]

    def _commit_through(self, window_start: int) -> None:
        """Blocks before `window_start` are committed: final tokens, final logprobs."""
        self.window_start = window_start
        self.final_blocks = max(self.final_blocks, window_start)
        for blk in [k for k in self.window_logprobs if k < window_start]:
            self.final_logprobs[blk] = self.window_logprobs.pop(blk)

    def pre_forward(self) -> bool:
        """The check before a forward. Returns False when the active block ends here (no forward)."""
        if self.mask_id not in self.active_tokens():  # only the active block can hold masks
            self.post_steps += 1
        return self.post_steps <= self.params.max_post_steps

    def set_window_logprobs(self, lps: list[float], tops: list) -> None:
        """The latest forward's logprobs over the window (one entry per window position)."""
        b = self.block_size
        for j, blk in enumerate(range(self.window_start, self.active_block + 1)):
            self.window_logprobs[blk] = (lps[j * b : (j + 1) * b], tops[j * b : (j + 1) * b])

    def mark_prefilled(self, through_block: int) -> None:
        self.cached_blocks = max(self.cached_blocks, through_block + 1)

    def apply_step(self, new_window: list[int], had_mask: bool, m2t: int, t2t: int, mbe_edits: int = 0) -> bool:
        """Record one denoising forward's result (the window's tokens after the step; `mbe_edits` of the t2t
        edits landed in blocks before the active one). Returns True when the active block ended."""
        self.stats.steps += 1
        self.stats.m2t += m2t
        self.stats.edits += t2t
        self.stats.mbe_edits += mbe_edits
        self.cached_blocks = self.window_start  # every committed block of the query is exact now
        window = slice(self.window_start * self.block_size, (self.active_block + 1) * self.block_size)
        if self.edit_trace is not None:
            for i, (old, new) in enumerate(zip(self.tokens[window], new_window)):
                if old != self.mask_id and old != new:
                    self.edit_trace.append((window.start + i - self.prompt_len, old, new))
        self.tokens[window] = new_window
        if not had_mask and t2t == 0:
            # W = 1: the forward saw the block's final tokens, block-causally, and no later window will reopen
            # it. (With W > 1 the block stays open, or its K/V saw later blocks: it is recomputed on commit.)
            if self.params.mbe_window == 1:
                self.cached_blocks = self.active_block + 1
            return True
        return False

    def end_block(self) -> FinishReason | None:
        """The active block is done. Returns why the request finishes (every open block then commits), or None
        to go on with the next block."""
        self.stats.blocks += 1
        # Only the window can hold a new stop token: an earlier one would have ended the request at its block.
        lo = max(self.prompt_len, self.window_start * self.block_size)
        hi = min((self.active_block + 1) * self.block_size, self.prompt_len + self.params.max_new_tokens)
        stops = self.stop_ids()
        hit = next((i for i in range(lo, hi) if self.tokens[i] in stops), None)
        if hit is None and self.active_block < self.last_block:
            return None
        self._commit_through(self.active_block + 1)  # the request ends: every open block commits
        if hit is not None:
            self.output_end = hit + 1  # through the first stop token
            return FinishReason("stop", matched=self.tokens[hit])
        return FinishReason("length")

    def stop_ids(self) -> set[int]:
        p = self.params
        return set(p.stop_token_ids) | (set() if p.ignore_eos else {self.eos_id})

    def advance(self) -> None:
        self._begin_block(self.active_block + 1)

    def output_ids(self) -> list[int]:
        """Generated tokens of the final blocks, cut to max_new_tokens, then through the first EOS/stop token."""
        end = min(self.final_blocks * self.block_size, self.prompt_len + self.params.max_new_tokens, self.output_end)
        if self.output_limit is not None:
            end = min(end, self.prompt_len + self.output_limit)
        return self.tokens[self.prompt_len : end]

    def output_logprobs(self, start: int = 0) -> tuple[list[float], list] | None:
        """(logprob of each output token, top alternatives at each) for output_ids()[start:], or None when
        the request did not ask for logprobs. Reads only the blocks that hold those tokens."""
        if not self.params.wants_logprobs:
            return None
        n = len(self.output_ids())
        lps: list[float] = []
        tops: list = []
        b = (self.prompt_len + start) // self.block_size
        while b < self.final_blocks and len(lps) < n - start:
            block_lp, block_top = self.final_logprobs.get(b, ([0.0] * self.block_size, [[]] * self.block_size))
            lo = max(self.prompt_len + start - b * self.block_size, 0)
            lps += block_lp[lo:]
            tops += block_top[lo:]
            b += 1
        return lps[: n - start], tops[: n - start]

    def finish(self, reason: FinishReason) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
