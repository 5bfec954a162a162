"""`levenshtein`: LLaDA2.2's Levenshtein step (M2T, T2T, DELETE and SPLIT) for a whole batch, with its per-slot state.

THE definition is the project's LLaDA2.2 decoding reference ("Decoding one block", steps 1-13), as
docs/llada22.md restates it with the choices redraft made; the comments below number the steps the same way. One block of B positions
per request (multi-block editing is refused for this step at admission). Everything is tensor ops over
[N, B] rows; the only Python loops are over the at most five anti-loop rounds and the slots being (re)loaded.

Per slot, on the device (`LevenshteinSlots`): the block's original-mask flags `orig` (they travel with the
tokens through the structural scan), the initial mask count N, the block's step id, the post counter, the
finalized flag (the next forward is the stability forward), the request's settings, and `seen`, every
pre-scan block of this block's non-final steps, kept whole so that the anti-loop test is exact equality.

The step reads whole vocabulary rows only at a few positions (step 7's structural fix, step 11's escapes): it asks
for them by (row, column) of its [N, B] block (`LogitsAt`), so rows that decided from vocabulary chunks need no
full logits. `LevenshteinDecoder` is the rule behind the decoder interface (engine/decoding/decoder.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from redraft.engine.decoding.decoder import Decoder, LogitsAt, Report, logits_at_of
from redraft.engine.decoding.decoding import StepResult
from redraft.engine.decoding.slots import SlotState
from redraft.engine.model.config import ModelConfig
from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import ResolvedParams
from redraft.scheduler.request import Request

__all__ = ["LevenshteinDecoder", "LevenshteinSlots", "StructuralIds", "levenshtein_step", "logits_at_of",
           "structural_scan"]

ANTI_LOOP_ROUNDS = 5  # step 11: at most this many next-best escapes per step
_SEEN_CHUNK = 16  # `seen` grows by this many entries when a slot fills it
_SHRINK_ABOVE = 4 * _SEEN_CHUNK  # `seen` longer than this shrinks back when a block begins (LevenshteinSlots._shrink)


@dataclass(frozen=True)
class StructuralIds:
    mask: int
    delete: int
    split: int


@dataclass
class LevenshteinResult:
    """One step's outcome for N rows ([N, B] / [N])."""

    tokens: torch.Tensor  # [N, B] the block after the step (z; x unchanged on a stability forward)
    m2t: torch.Tensor  # [N, B] bool: masked positions written this step
    t2t: torch.Tensor  # [N, B] bool: placed positions rewritten this step
    had_mask: torch.Tensor  # [N] bool
    ended: torch.Tensor  # [N] bool: the block commits after this forward (its K/V are exact)
    deletions: torch.Tensor  # [N] long: DELETE written (and applied by the scan)
    insertions: torch.Tensor  # [N] long: SPLIT written (a mask inserted by the scan)


def scheduled_m2t(p: torch.Tensor, masked: torch.Tensor, need: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Step 6 outside a final round: the masks with p > threshold if there are at least `need` of them, else the
    min(need, masks) masks with the largest p (ties: lower position). p, masked: [N, B]; need, threshold: [N]."""
    hi = masked & (p > threshold[:, None].to(p.dtype))  # [N, B]
    key = torch.where(masked, p, torch.full_like(p, -1.0))  # masks first: p >= 0 > -1
    order = key.sort(dim=-1, descending=True, stable=True).indices  # [N, B]: ties keep the lower position first
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(p.shape[1], device=p.device).expand_as(order))
    quota = torch.minimum(need, masked.sum(-1))  # [N]
    top = masked & (rank < quota[:, None])
    return torch.where((hi.sum(-1) >= need)[:, None], hi, top)


def structural_scan(x: torch.Tensor, y: torch.Tensor, orig: torch.Tensor, prompt: torch.Tensor,
                    ids: StructuralIds) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 12 as a prefix-sum scatter: each position emits 0 (DELETE), 2 (SPLIT: MASK, then x's token) or 1
    tokens; an exclusive cumsum gives where each lands; what lands at or past B falls off, and the tail the
    deletions free is MASK (flag False). x, y, prompt: [N, B]; orig: [N, B] bool -> (z, zo) [N, B]."""
    n, b = y.shape
    is_del = ~prompt & (y == ids.delete)
    is_spl = ~prompt & (y == ids.split)
    count = torch.where(is_del, 0, torch.where(is_spl, 2, 1))  # [N, B]
    start = count.cumsum(-1) - count  # [N, B] exclusive prefix sum: first output slot of each position
    dump = 2 * b  # a scratch column for everything that is dropped or falls off
    first = torch.where((count > 0) & (start < b), start, dump)
    second = torch.where(is_spl & (start + 1 < b), start + 1, dump)
    z = torch.full((n, dump + 1), ids.mask, dtype=y.dtype, device=y.device)
    zo = torch.zeros((n, dump + 1), dtype=torch.bool, device=y.device)
    z.scatter_(1, first, torch.where(is_spl, ids.mask, y))
    zo.scatter_(1, first, ~is_spl & orig & ~prompt)
    z.scatter_(1, second, x)
    zo.scatter_(1, second, orig)
    z[:, dump] = ids.mask  # (the dump column may hold anything; it is cut off below)
    return z[:, :b], zo[:, :b]


@dataclass
class BlockState:
    """The per-row state the step reads and returns ([N, ...] rows gathered from LevenshteinSlots)."""

    tokens: torch.Tensor  # [N, B] x
    prompt: torch.Tensor  # [N, B] bool
    orig: torch.Tensor  # [N, B] bool
    n_masks: torch.Tensor  # [N] N, the block's initial mask count
    step: torch.Tensor  # [N]
    post: torch.Tensor  # [N]
    finalized: torch.Tensor  # [N] bool
    seen: torch.Tensor  # [N, H, B] earlier pre-scan blocks
    seen_len: torch.Tensor  # [N] how many of them are filled


@dataclass
class Settings:
    """Per-row settings ([N] tensors)."""

    threshold: torch.Tensor
    edit_threshold: torch.Tensor
    steps: torch.Tensor
    max_post_steps: torch.Tensor
    max_steps_per_block: torch.Tensor


def _is_final(st: BlockState, s: Settings, post: torch.Tensor) -> torch.Tensor:
    """Step 3: the max_post_steps budget or the hard cap makes this a final round."""
    return ((s.max_post_steps > 0) & (post >= s.max_post_steps)) | (st.step >= s.max_steps_per_block - 1)


def _m2t(p: torch.Tensor, st: BlockState, s: Settings, masked: torch.Tensor, final: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 5-7: which masks are written, and `final` after step 7's early final round."""
    new = (masked & ~st.orig).sum(-1)  # [N] masks the scan inserted
    need = st.n_masks // s.steps + (st.step < st.n_masks % s.steps).long() + new
    m2t = torch.where((final | (st.step >= s.steps))[:, None], masked,
                      scheduled_m2t(p, masked, need, s.threshold))
    # 7: without a post budget, the round that leaves no original mask is final (and fills every mask)
    early = (s.max_post_steps == 0) & ~(st.orig & masked & ~m2t).any(-1)
    final = final | early
    return torch.where(final[:, None], masked, m2t), final


def _in_seen(y: torch.Tensor, st: BlockState) -> torch.Tensor:
    """[N] bool: y equals one of the row's earlier pre-scan blocks (exact, all B tokens)."""
    h = st.seen.shape[1]
    filled = torch.arange(h, device=y.device)[None, :] < st.seen_len[:, None]  # [N, H]
    return ((st.seen == y[:, None, :]).all(-1) & filled).any(-1)


def _anti_loop(logits_at: LogitsAt, p: torch.Tensor, x: torch.Tensor, y: torch.Tensor, st: BlockState,
               live: torch.Tensor, ids: StructuralIds) -> torch.Tensor:
    """Step 11 for the rows in `live` (not final): while y repeats an earlier pre-scan block, its least confident
    changed position takes its next-best token (MASK and the tokens already tried there left out)."""
    n, b = y.shape
    y = y.clone()
    tried = torch.full((n, b, ANTI_LOOP_ROUNDS), -1, dtype=torch.long, device=y.device)  # [N, B, R]
    for r in range(ANTI_LOOP_ROUNDS):
        changed = y != x  # [N, B]
        act = live & changed.any(-1) & _in_seen(y, st)
        if not bool(act.any()):
            break
        rows = act.nonzero().flatten()  # [n]
        c = torch.where(changed, p, torch.full_like(p, float("inf"))).argmin(-1)[rows]  # [n]: lowest p, then position
        tried[rows, c, r] = y[rows, c]
        row = logits_at(rows, c)  # [n, V] (MASK already -inf)
        vocab = row.shape[-1]
        banned = tried[rows, c]  # [n, R]
        fill = torch.zeros(row.shape[0], vocab + 1, dtype=torch.bool, device=y.device)
        fill.scatter_(1, torch.where(banned >= 0, banned, vocab), True)
        y[rows, c] = row.masked_fill(fill[:, :vocab], float("-inf")).argmax(-1)
    return y


def levenshtein_step(logits_at: LogitsAt, v: torch.Tensor, p: torch.Tensor, st: BlockState, s: Settings,
                     ids: StructuralIds) -> tuple[LevenshteinResult, BlockState, torch.Tensor, torch.Tensor]:
    """One forward's step for N rows. logits_at: the vocabulary rows of positions of the block (LogitsAt); v, p:
    the proposals and their probabilities [N, B] (argmax and its softmax mass at temperature 0). Returns the result,
    the rows' next state, the pre-scan blocks y [N, B] and which rows append y to `seen` [N] (the non-final
    ones; the caller stores them)."""
    x, stable = st.tokens, st.finalized  # 1: finalized rows only run their stability forward
    post = torch.where((st.orig & (x == ids.mask)).any(-1), 0, st.post + 1)  # 2
    final = _is_final(st, s, post)  # 3
    masked = (x == ids.mask) & ~st.prompt  # 5
    m2t, final = _m2t(p, st, s, masked, final)  # 6, 7
    t2t = ~masked & ~st.prompt & (v != x) & (p > s.edit_threshold[:, None].to(p.dtype))  # 8
    write = m2t | t2t  # 9
    structural = (v == ids.delete) | (v == ids.split)
    fix = (final & ~stable)[:, None] & write & structural
    if bool(fix.any()):  # 7: a structural proposal written in a final round takes the best ordinary token
        rows, cols = fix.nonzero(as_tuple=True)  # [n] each
        row = logits_at(rows, cols)  # [n, V]
        row[:, [ids.delete, ids.split]] = float("-inf")
        v = v.index_put((rows, cols), row.argmax(-1))
    y = torch.where(write, v, x)  # 10
    live = ~final & ~stable
    y = _anti_loop(logits_at, p, x, y, st, live, ids)  # 11
    z, zo = structural_scan(x, y, st.orig, st.prompt, ids)  # 12
    changed = (z != x).any(-1)  # 13
    had_mask = masked.any(-1)
    ended = stable | (~final & ~had_mask & ~changed)
    keep = stable[:, None]
    nxt = BlockState(
        tokens=torch.where(keep, x, z), prompt=st.prompt, orig=torch.where(keep, st.orig, zo), n_masks=st.n_masks,
        step=torch.where(stable, st.step, st.step + 1), post=torch.where(stable, st.post, post),
        finalized=stable | final, seen=st.seen, seen_len=st.seen_len)
    edits = ~st.prompt & ~keep
    result = LevenshteinResult(
        tokens=nxt.tokens, m2t=m2t & ~keep, t2t=t2t & ~keep, had_mask=had_mask & ~stable, ended=ended,
        deletions=(edits & (y == ids.delete)).sum(-1), insertions=(edits & (y == ids.split)).sum(-1))
    return result, nxt, y, live


class LevenshteinSlots:
    """The step's per-slot state on the device ([S, ...], indexed by Request.book.slot), loaded when a row's
    block (re)begins and advanced in place by each step."""

    def __init__(self, num_slots: int, block_size: int, ids: StructuralIds, device: torch.device):
        s, b = num_slots, block_size
        self.ids, self.block_size, self.device = ids, b, device
        self.prompt = torch.zeros(s, b, dtype=torch.bool, device=device)
        self.orig = torch.zeros(s, b, dtype=torch.bool, device=device)
        self.n_masks = torch.zeros(s, dtype=torch.long, device=device)
        self.step = torch.zeros(s, dtype=torch.long, device=device)
        self.post = torch.zeros(s, dtype=torch.long, device=device)
        self.finalized = torch.zeros(s, dtype=torch.bool, device=device)
        self.steps = torch.ones(s, dtype=torch.long, device=device)
        self.max_post_steps = torch.zeros(s, dtype=torch.long, device=device)
        self.max_steps_per_block = torch.ones(s, dtype=torch.long, device=device)
        self.seen = torch.zeros(s, _SEEN_CHUNK, b, dtype=torch.long, device=device)  # [S, H, B]
        self.seen_len = torch.zeros(s, dtype=torch.long, device=device)

    def load(self, slot: int, tokens: torch.Tensor, editable: torch.Tensor, steps: int, max_post_steps: int,
             max_steps_per_block: int) -> None:
        """A block's entry state (tokens, editable: [B] on the device): every generated position is an original
        mask; the block is finalized at once when it has none."""
        self.prompt[slot] = ~editable
        self.orig[slot] = editable & (tokens == self.ids.mask)
        n = self.orig[slot].sum()
        self.n_masks[slot] = n
        self.step[slot] = 0
        self.post[slot] = 0
        self.finalized[slot] = n == 0
        self.seen_len[slot] = 0
        self._shrink()
        self.steps[slot], self.max_post_steps[slot] = steps, max_post_steps
        self.max_steps_per_block[slot] = max_steps_per_block

    def state(self, slots: torch.Tensor, tokens: torch.Tensor) -> BlockState:
        """The rows `slots` [N] as a BlockState; tokens: their blocks [N, B] (kept by the runner's SlotState)."""
        return BlockState(tokens=tokens, prompt=self.prompt[slots], orig=self.orig[slots], n_masks=self.n_masks[slots],
                          step=self.step[slots], post=self.post[slots], finalized=self.finalized[slots],
                          seen=self.seen[slots], seen_len=self.seen_len[slots])

    def settings(self, slots: torch.Tensor, threshold: torch.Tensor, edit_threshold: torch.Tensor) -> Settings:
        return Settings(threshold=threshold, edit_threshold=edit_threshold, steps=self.steps[slots],
                        max_post_steps=self.max_post_steps[slots],
                        max_steps_per_block=self.max_steps_per_block[slots])

    def advance(self, logits_at: LogitsAt, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor,
                tokens: torch.Tensor, threshold: torch.Tensor, edit_threshold: torch.Tensor,
                history: int | None = None) -> LevenshteinResult:
        """The step for the rows `slots` [N] (logits_at: their vocabulary rows, LogitsAt; v, p, tokens [N, B]);
        their state here moves to the next iteration. The caller stores result.tokens as the rows' blocks. `history`: an
        upper bound on the rows' `seen` length after this step (their forwards in this block so far + 1),
        which spares a device sync; None: read it from the device."""
        self._reserve(history if history is not None else int(self.seen_len[slots].max()) + 1)
        st = self.state(slots, tokens)
        result, nxt, y, append = levenshtein_step(logits_at, v, p, st,
                                                  self.settings(slots, threshold, edit_threshold), self.ids)
        self.orig[slots], self.step[slots], self.post[slots] = nxt.orig, nxt.step, nxt.post
        self.finalized[slots] = nxt.finalized
        self._remember(slots, y, append)
        return result

    def _remember(self, slots: torch.Tensor, y: torch.Tensor, append: torch.Tensor) -> None:
        """Append y to `seen` of the rows in `append` (room was reserved), with no device sync."""
        # (every row writes: a row that does not append writes its own entry back where nothing is kept)
        where = self.seen_len[slots].clamp(max=self.seen.shape[1] - 1)  # [N]
        old = self.seen[slots, where]  # [N, B]
        self.seen[slots, where] = torch.where(append[:, None], y, old)
        self.seen_len[slots] += append.long()

    def _shrink(self) -> None:
        """Give back `seen` rows a long block grew (4096 steps: [S, 4096, B] ids) once no slot holds that many:
        checked when a block begins and only while `seen` is over _SHRINK_ABOVE rows (one device read then)."""
        if self.seen.shape[1] <= _SHRINK_ABOVE:
            return
        needed = int(self.seen_len.max())
        rows = max(_SEEN_CHUNK, -(-needed // _SEEN_CHUNK) * _SEEN_CHUNK)
        if rows < self.seen.shape[1]:
            self.seen = self.seen[:, :rows].clone()

    def _reserve(self, entries: int) -> None:
        """Room for `entries` history rows per slot (grown in chunks: a block's steps are few in practice)."""
        if entries > self.seen.shape[1]:
            more = -(-(entries - self.seen.shape[1]) // _SEEN_CHUNK) * _SEEN_CHUNK
            grow = self.seen.new_zeros(self.seen.shape[0], more, self.block_size)
            self.seen = torch.cat([self.seen, grow], dim=1)


class LevenshteinDecoder(Decoder):
    """`decoder: "levenshtein"` (LLaDA2.2 checkpoints, the default there). One block per row; its state of each
    slot (`LevenshteinSlots`) is not in the request, so a row reloaded mid-block restarts the block. It reports
    per row whether the block commits after this forward (`ended`) and the DELETEs and SPLITs applied."""

    name = "levenshtein"
    reads_vocab_rows = True
    keeps_block_state = True
    reports = (Report("ended", -1, flag=True), Report("deletions", 0), Report("insertions", 0))

    def __init__(self, slots: SlotState, cfg: ModelConfig, mask_id: int):
        super().__init__(slots, cfg, mask_id)
        self.ids = StructuralIds(mask_id, cfg.delete_token_id, cfg.split_token_id)
        self.rows = LevenshteinSlots(slots.tokens.shape[0], slots.block_size, self.ids, slots.tokens.device)

    @classmethod
    def runs_on(cls, cfg: ModelConfig) -> bool:
        return cfg.structural_edits

    @classmethod
    def implied_by(cls, cfg: ModelConfig) -> bool:
        return cfg.structural_edits

    @classmethod
    def admit(cls, params: ResolvedParams, cfg: ModelConfig) -> None:
        """It needs a checkpoint that predicts DELETE and SPLIT, and runs one block at a time without a grammar:
        anything else is a 400 that says why."""
        if not cfg.structural_edits:
            raise RequestError("decoder 'levenshtein' needs a LLaDA2.2 checkpoint (delete_token_id and "
                               "split_token_id in config.json); this one has none: use decoder 'threshold'",
                               param="decoder")
        if params.mbe_window > 1:
            raise RequestError(f"mbe_window {params.mbe_window} is not supported with decoder 'levenshtein': its "
                               "insertions and deletions shift positions inside one block, and multi-block editing "
                               "of such blocks is not defined; use mbe_window 1 or decoder 'threshold'",
                               param="mbe_window")
        if params.grammar is not None:
            raise RequestError(f"structured output ({params.grammar[0]}) is not supported with decoder "
                               "'levenshtein': its insertions and deletions move tokens the grammar has already "
                               "validated; use decoder 'threshold' for constrained output", param=params.grammar[0])

    def load(self, r: Request) -> None:
        """The step's entry state of r's block (from the row SlotState.sync just loaded)."""
        i, b, p = r.book.slot, self.slots.block_size, r.params
        self.rows.load(i, self.slots.tokens[i, :b], self.slots.editable[i, :b], p.steps, p.max_post_steps,
                       p.max_steps_per_block)

    def step(self, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor, reqs: list[Request],
             logits_at: LogitsAt | None) -> StepResult:
        s, b, (n, width) = self.slots, self.slots.block_size, v.shape
        # (a bound on the history rows the step may append to, known here without a sync)
        history = max(r.state.stats.steps - r.state.block_start_stats.steps for r in reqs) + 1
        res = self.rows.advance(logits_at, v[:, :b], p[:, :b], slots, s.tokens[slots, :b], s.threshold[slots],
                                s.edit_threshold[slots], history)
        s.tokens[slots, :b] = res.tokens
        s.steps[slots] += 1
        m2t = torch.zeros(n, width, dtype=torch.bool, device=v.device)  # [N, L]: the block is the window's start
        t2t = torch.zeros_like(m2t)
        m2t[:, :b], t2t[:, :b] = res.m2t, res.t2t
        return StepResult(tokens=s.tokens[slots, :width], proposal=v, confidence=p, m2t=m2t, t2t=t2t,
                          had_mask=res.had_mask, reports={"ended": res.ended.long(), "deletions": res.deletions,
                                                          "insertions": res.insertions})
