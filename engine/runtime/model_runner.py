"""Runs one forward for a whole batch of request windows and applies the decoding step to every request.

Owns the model, the KV cache tensors (pages are allocated by the scheduler's PagePool; this class only
reads/writes the rows the page ids point at) and the per-slot decoding state: each running request holds a
slot (`Request.book.slot`, given by the scheduler), and the tensors below keep, per slot, the tokens of its open
window (the active block alone without multi-block editing), which of them may be edited, and its thresholds
and sampling settings. `SlotState.sync` mirrors a request's decoding state to its row when its block (re)began
(`Request.row_key` changed) and the row is updated in place by each step, so a steady-state step builds no
per-request Python lists for the decoding step. The step runs on [N, L] positions: every request's window,
padded to the longest in the batch. Structured output's grammar (engine/decoding/constrained.py) and logit controls
(engine/decoding/logit_controls.py) run per request inside the step; likelihood forwards are engine/runtime/scoring.py's.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass, field

import torch

from redraft.engine.model.config import ModelConfig
from redraft.engine.decoding.constrained import Constraint
from redraft.engine.decoding.decoding import SamplingBatch, StepResult, exclude_mask_, propose, threshold_step
from redraft.engine.runtime.faults import NO_FAULTS, FaultInjector
from redraft.engine.decoding.levenshtein import LevenshteinResult, LevenshteinSlots, LogitsAt, StructuralIds, logits_at_of
from redraft.engine.decoding.logit_controls import LogitControls
from redraft.engine.model.model import LLaDA2Model
from redraft.kernels.attention import AttentionMetadata
from redraft.kernels.vocab_top1 import Top1, lm_head_top1_torch
from redraft.protocol.sampling_params import BLOCK_SIZE, MAX_MBE_WINDOW
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import StepOutput, WorkItem

log = logging.getLogger("redraft.runner")


GRAMMAR_CANDIDATES = 8  # the model's top-k a rejected position may take an allowed token from
LOGPROB_FLOOR = -9999.0  # OpenAI's value for "impossible": JSON has no -inf


def finite_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, floored at LOGPROB_FLOOR (a token with probability 0, MASK included, would
    be -inf, which no JSON reply can carry)."""
    return torch.log_softmax(logits, -1).nan_to_num(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)


@dataclass
class ForwardBatch:
    """The inputs of one forward, on the host: what both the eager path and the CUDA-graph path consume."""

    input_ids: torch.Tensor  # [T] flat query tokens
    q_starts: list[int]  # [N] first query position of each item
    q_lens: list[int]  # [N]
    page_tables: list[list[int]]  # [N][pages through the item's last block]
    window_starts: list[int]  # [N] first position of the open MBE window (q_start + q_len: none)


def build_forward_batch(items: list[WorkItem], block_size: int) -> ForwardBatch:
    """Every item's query: blocks [first, last] of its tokens, with its page table through `last`; a decoding
    item's open window [req.state.window_start, last] is bidirectional (prefill items are block-causal
    throughout)."""
    q_starts, q_lens, tables, windows, ids = [], [], [], [], []
    for it in items:
        start, end = it.first * block_size, (it.last + 1) * block_size
        q_starts.append(start)
        q_lens.append(end - start)
        tables.append(it.req.book.pages[: it.last + 1])
        windows.append(it.req.state.window_start * block_size if it.decodes else end)
        ids.extend(it.req.state.tokens[start:end])
    return ForwardBatch(torch.tensor(ids, dtype=torch.long), q_starts, q_lens, tables, windows)


@dataclass
class ForwardPlan:
    """One forward, fixed before it starts: `ModelRunner.forward` reads this and nothing else (it may run on the
    overlap worker, engine/runtime/overlap.py, while the host changes the requests)."""

    batch: ForwardBatch
    decoding: list[int]  # which items decode
    lens: list[int]  # [n] window positions of each decoding item
    quick: list[int]  # of the decoding rows, those decided from vocabulary chunks (`needs_distribution` false)
    graphs: bool  # replayed from a CUDA graph (every row then gets full logits)
    plain: list[int] = field(default_factory=list)  # of `quick`, the 2.1 step's rows on a LLaDA2.2 checkpoint:
    #   their argmax leaves DELETE and SPLIT out too


@dataclass
class Forward:
    """What a forward hands the decision: per row of `ForwardPlan.decoding`, the argmax and its probability of the
    quick rows, full logits of the others."""

    top: Top1 | None = None  # [n_quick * L] flat, row-major
    logits: torch.Tensor | None = None  # [n_full, L, V]
    width: int = 0  # L: the longest window
    quick_hidden: torch.Tensor | None = None  # [n_quick * L, H]: the quick rows' states, for the few vocabulary
    #   rows the Levenshtein step reads (LLaDA2.2 checkpoints only)


def needs_distribution(r: Request) -> bool:
    """Whether a request's step reads more of the distribution than each position's argmax and its probability:
    sampling, logprobs, a grammar's candidates, logit controls (penalties, logit_bias, min_tokens)."""
    p = r.params
    return p.temperature > 0 or p.wants_logprobs or p.has_logit_controls or r.state.constraint is not None


def merge_outputs(parts: list[tuple[list[int], StepOutput]], n: int) -> StepOutput:
    """StepOutputs of disjoint subsets of a batch's rows (the request indices of each) as one, in row order."""
    out = StepOutput(tokens=[[]] * n, had_mask=[False] * n, m2t=[0] * n, t2t=[0] * n, mbe_edits=[0] * n,
                     logprobs=[None] * n, top_logprobs=[None] * n)
    for rows, part in parts:
        for j, i in enumerate(rows):
            out.tokens[i], out.had_mask[i], out.m2t[i] = part.tokens[j], part.had_mask[j], part.m2t[j]
            out.t2t[i], out.mbe_edits[i] = part.t2t[j], part.mbe_edits[j]
            if part.logprobs:
                out.logprobs[i], out.top_logprobs[i] = part.logprobs[j], part.top_logprobs[j]
            if part.confidence:
                out.confidence = out.confidence or [None] * n
                out.confidence[i] = part.confidence[j]
            if part.ended:
                out.ended = out.ended or [None] * n
                out.deletions, out.insertions = out.deletions or [0] * n, out.insertions or [0] * n
                out.ended[i], out.deletions[i], out.insertions[i] = part.ended[j], part.deletions[j], part.insertions[j]
    if all(lp is None for lp in out.logprobs):
        out.logprobs, out.top_logprobs = [], []
    return out


def denoise_columns(result: StepResult) -> torch.Tensor:
    """[N, L] int64: each position's proposal probability as float32 bits (-1.0 where the step's token is not the
    proposal), to ride in the step's one int64 device -> host read."""
    p = torch.where(result.tokens == result.proposal, result.confidence.float(), -1.0)  # [N, L] float32
    return p.view(torch.int32).long()


def unpack_floats(bits: list[int]) -> list[float]:
    """The floats of denoise_columns' float32 bits."""
    return list(struct.unpack(f"{len(bits)}f", struct.pack(f"{len(bits)}i", *bits)))


class SlotState:
    """Per-slot decoding state on the device, indexed by Request.book.slot: [S, ...] tensors, S = running slots,
    L = the longest window (MAX_MBE_WINDOW blocks). Positions past a request's window hold PAD (never MASK)
    and are not editable, so the step leaves them alone. Each row mirrors one request's decoding state as of its
    block's start (`Request.row_key`); the steps then advance it in place."""

    PAD = -1

    def __init__(self, num_slots: int, block_size: int, device: torch.device):
        s, w = num_slots, MAX_MBE_WINDOW * block_size
        self.block_size = block_size
        self.tokens = torch.full((s, w), self.PAD, dtype=torch.long, device=device)  # [S, L] the open window
        self.editable = torch.zeros(s, w, dtype=torch.bool, device=device)  # [S, L] False on prompt and padding
        self.window_start = torch.zeros(s, dtype=torch.long, device=device)  # [S] absolute position of the window
        self.steps = torch.zeros(s, dtype=torch.long, device=device)  # [S] the request's denoising steps
        self.threshold = torch.zeros(s, dtype=torch.float64, device=device)
        self.edit_threshold = torch.zeros(s, dtype=torch.float64, device=device)
        self.temperature = torch.zeros(s, dtype=torch.float64, device=device)
        self.top_k = torch.zeros(s, dtype=torch.long, device=device)
        self.top_p = torch.ones(s, dtype=torch.float64, device=device)
        self.seed = torch.zeros(s, dtype=torch.long, device=device)
        self._owner: list[tuple[int, int] | None] = [None] * s  # the Request.row_key each row was loaded for

    def stale(self, r: Request) -> bool:
        """Whether r's row does not hold r's current block start (a block began, or the row was forgotten)."""
        return self._owner[r.book.slot] != r.row_key

    def sync(self, r: Request) -> None:
        """THE mirror of a request's decoding state to its device row: the window's tokens, which of them may be
        edited, the step counter, thresholds and sampling settings."""
        i, p, b = r.book.slot, r.params, self.block_size
        start = r.state.window_start * b
        window = r.window_tokens()
        n = len(window)
        self.tokens[i] = self.PAD
        self.tokens[i, :n] = torch.tensor(window, dtype=torch.long)
        self.editable[i] = False
        self.editable[i, :n] = torch.arange(start, start + n) >= r.prompt_len
        self.window_start[i] = start
        self.steps[i] = r.state.stats.steps
        self.threshold[i], self.edit_threshold[i] = p.threshold, p.edit_threshold
        self.temperature[i], self.top_k[i], self.top_p[i] = p.temperature, p.top_k, p.top_p
        self.seed[i] = p.seed or 0
        self._owner[i] = r.row_key

    def slot_ids(self, reqs: list[Request]) -> torch.Tensor:
        return torch.tensor([r.book.slot for r in reqs], dtype=torch.long, device=self.tokens.device)  # [N]

    def forget(self, reqs: list[Request]) -> None:
        """Resync these requests' rows (and their grammars) from the requests before their next step (a step that
        failed half-way may have advanced them)."""
        for r in reqs:
            if r.book.slot >= 0:
                self._owner[r.book.slot] = None

    def sampling(self, slots: torch.Tensor, width: int) -> SamplingBatch:
        ar = torch.arange(width, device=slots.device)
        return SamplingBatch(
            temperature=self.temperature[slots], top_k=self.top_k[slots], top_p=self.top_p[slots],
            seeds=self.seed[slots], steps=self.steps[slots], positions=self.window_start[slots, None] + ar[None, :],
        )


class ModelRunner:
    def __init__(self, model: LLaDA2Model, num_pages: int, num_slots: int, mask_id: int, eos_id: int,
                 device: str | torch.device, cuda_graph_max_bs: int = 0):
        cfg: ModelConfig = model.cfg
        self.model = model
        self.cfg = cfg
        self.device = torch.device(device)
        self.mask_id = mask_id
        self.block_size = BLOCK_SIZE
        dtype = next(model.parameters()).dtype
        # One page beyond the scheduler's pages 0..num_pages-1: the scratch page that padded batch rows
        # (CUDA graphs) write to and read from; no request ever owns it.
        self.scratch_page = num_pages
        shape = (cfg.num_hidden_layers, num_pages + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, P + 1, B, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.slots = SlotState(num_slots, BLOCK_SIZE, self.device)
        # LLaDA2.2 checkpoints (DELETE and SPLIT in the vocabulary): the Levenshtein step's rows, and the two ids
        # every other use of the distribution leaves out (the 2.1 step on such a checkpoint, logprobs)
        self.structural: StructuralIds | None = None
        self.lev: LevenshteinSlots | None = None
        if cfg.structural_edits:
            self.structural = StructuralIds(mask_id, cfg.delete_token_id, cfg.split_token_id)
            self.lev = LevenshteinSlots(num_slots, BLOCK_SIZE, self.structural, self.device)
        self.step_seconds = 0.0  # host time in the decoding step (`_step`), in total: benchmarks read it
        self.controls = LogitControls(cfg.vocab_size, eos_id, self.device)
        log.info(
            "KV cache: %d pages x %d tokens (%.1f MiB)",
            num_pages, BLOCK_SIZE, 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20,
        )
        self.graphs = None  # DecodeGraphs when the denoising step runs as CUDA graphs
        # Greedy rows decide from vocabulary chunks, without [L, V] logits (off: a vocabulary-parallel lm_head,
        # whose ranks each hold a slice of the vocabulary).
        self.vocab_reduce = True
        self.grammar_seconds = 0.0  # host time in structured output's sweeps (engine/decoding/constrained.py), in total
        self._bit_index = torch.arange(8, dtype=torch.uint8, device=self.device)
        self.graph_error: str | None = None  # why capture failed (the step then runs eagerly)
        self.faults: FaultInjector = NO_FAULTS  # tests only (engine/runtime/faults.py)
        if cuda_graph_max_bs > 0:
            if self.device.type != "cuda" or model.kernel_backend != "triton":
                raise ValueError("CUDA graphs need device='cuda' and kernel_backend='triton'")
            from redraft.engine.runtime.cuda_graphs import DecodeGraphs

            graphs = DecodeGraphs(self, cuda_graph_max_bs)
            try:
                graphs.capture()
                self.graphs = graphs
            except Exception as exc:  # noqa: BLE001 - serve eagerly rather than not at all
                self.graph_error = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed, the denoising step runs eagerly: %s", self.graph_error)
                torch.cuda.synchronize(self.device)

    @staticmethod
    def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * torch.finfo(dtype).bits // 8

    @torch.inference_mode()
    def run(self, items: list[WorkItem]) -> StepOutput:
        """One forward over every item's window, then the decoding step for the items that decode.

        A per-request stage (structured output's block start and sweep, logit controls) that raises ends only
        that request: its rid and exception go to `StepOutput.failed` (its row's results are then meaningless and
        the engine ends it before `update`). An exception from the batch itself (the forward) propagates."""
        failed: dict[str, tuple[str, BaseException]] = {}
        self.sync_rows([it.req for it in items if it.decodes], failed)
        self.faults.check_any("forward", [it.req.rid for it in items])
        plan = self.plan(items, build_forward_batch(items, self.block_size))
        return self.decide(items, plan, self.forward(plan), failed)

    def plan(self, items: list[WorkItem], batch: ForwardBatch) -> ForwardPlan:
        """What `forward` needs of the items, read now: which decode, their windows, which rows decide from
        vocabulary chunks (a request that needs nothing but each position's argmax and its probability), and
        whether a CUDA graph runs the batch."""
        decoding = [i for i, it in enumerate(items) if it.decodes]
        reqs = [items[i].req for i in decoding]
        graphs = self.graphs is not None and self.graphs.can_run(items)
        chunked = self.vocab_reduce and not graphs
        quick = [j for j, r in enumerate(reqs) if chunked and not needs_distribution(r)]
        plain = [j for j in quick if self.structural is not None and not reqs[j].params.levenshtein]
        return ForwardPlan(batch, decoding, [r.window_size * self.block_size for r in reqs], quick, graphs, plain)

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> Forward:
        """The model forward and the lm_head's work on the decoding rows: the argmax and its probability of the
        quick rows (kernels/vocab_top1.py: no [L, V] logits), full logits of the others. Writes the query's K/V,
        reads nothing but `plan`, the weights and the KV cache, and changes no decoding state (the overlap
        worker runs it while the host updates the requests)."""
        if plan.graphs:
            logits = self.graphs.run(plan.batch)  # [N, B, V]: every item decodes its one active block
            return Forward(logits=logits, width=logits.shape[1])
        hidden, rows = self._forward_eager(plan)
        if rows is None:
            return Forward()
        n, width = rows.shape
        quick_set = set(plan.quick)
        full = [j for j in range(n) if j not in quick_set]
        top = self._quick_top1(hidden, rows, plan) if plan.quick else None
        logits = self.model.logits(hidden, rows[full]) if full else None  # [n_full, L, V]
        keep = self.lev is not None and bool(plan.quick)  # (the Levenshtein step's vocabulary rows on demand)
        quick_hidden = hidden[rows[plan.quick].reshape(-1)] if keep else None  # [n_quick * L, H]
        return Forward(top, logits, width, quick_hidden=quick_hidden)

    @torch.inference_mode()
    def decide(self, items: list[WorkItem], plan: ForwardPlan, fwd: Forward,
               failed: dict[str, tuple[str, BaseException]]) -> StepOutput:
        """The decoding step of every decoding item from its forward: quick rows from their argmax and probability,
        the others from full logits (`_decide`); advances the slot rows."""
        reqs = [items[i].req for i in plan.decoding]
        if not reqs:
            return StepOutput(failed=failed)
        quick_set = set(plan.quick)
        full = [j for j in range(len(reqs)) if j not in quick_set]
        parts = []
        if plan.quick:
            parts.append((plan.quick, self._decide_top1(fwd, [reqs[j] for j in plan.quick])))
        if full:
            parts.append((full, self._decide(fwd.logits, [reqs[j] for j in full], failed)))
        out = parts[0][1] if len(parts) == 1 and parts[0][0] == list(range(len(reqs))) \
            else merge_outputs(parts, len(reqs))
        out.failed = failed
        return out

    def _decide_top1(self, fwd: Forward, reqs: list[Request]) -> StepOutput:
        n, width = len(reqs), fwd.width
        t0 = time.perf_counter()
        result = self._advance_rows(fwd.top.ids.view(n, width), fwd.top.prob.view(n, width),
                                    self.slots.slot_ids(reqs), reqs, self._logits_from(fwd.quick_hidden, width))
        self.step_seconds += time.perf_counter() - t0
        return self._step_output(result, [r.window_size * self.block_size for r in reqs], reqs)

    def _logits_from(self, hidden: torch.Tensor | None, width: int) -> LogitsAt | None:
        """The LogitsAt of rows that have no full logits: position (row, col) is hidden[row * width + col]
        through the lm_head, in the full logits' dtype, MASK at -inf."""
        if hidden is None:
            return None

        def at(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
            logits = self.model.logits(hidden, rows * width + cols)  # [n, V]
            exclude_mask_(logits, self.mask_id)
            return logits

        return at

    def _quick_top1(self, hidden: torch.Tensor, rows: torch.Tensor, plan: ForwardPlan) -> Top1:
        """The quick rows' top-1 [n_quick * L]: MASK left out, and on a LLaDA2.2 checkpoint DELETE and SPLIT too
        for the 2.1 step's rows (`plan.plain`; the Levenshtein step proposes them)."""
        if not plan.plain:
            return self.top1(hidden[rows[plan.quick].reshape(-1)])
        plain = set(plan.plain)
        structural = (self.structural.delete, self.structural.split)
        groups = [([q for q, j in enumerate(plan.quick) if j not in plain], ()),
                  ([q for q, j in enumerate(plan.quick) if j in plain], structural)]
        width = rows.shape[1]
        tops = [(qs, self.top1(hidden[rows[[plan.quick[q] for q in qs]].reshape(-1)], also))
                for qs, also in groups if qs]
        ids = torch.empty(len(plan.quick), width, dtype=torch.long, device=self.device)  # [n_quick, L]
        prob = torch.empty(len(plan.quick), width, dtype=tops[0][1].prob.dtype, device=self.device)
        for qs, top in tops:
            ids[qs], prob[qs] = top.ids.view(len(qs), width), top.prob.view(len(qs), width)
        return Top1(ids=ids.reshape(-1), prob=prob.reshape(-1))

    def top1(self, hidden: torch.Tensor, also: tuple[int, ...] = ()) -> Top1:
        """Each row's best token (MASK and `also` excluded, lowest id on ties) and its probability, from [R, H]
        hidden states. Compiled Triton on CUDA (one fused lm_head + reduction); the chunked torch path elsewhere,
        whose ids are the full logits' (the Triton kernel accumulates in another order: see
        kernels/vocab_top1_triton.py)."""
        weight = self.model.lm_head.weight  # [V, H]
        if self.device.type == "cuda" and self.model.kernel_backend == "triton" and hidden.dtype != torch.float64:
            from redraft.kernels.vocab_top1_triton import lm_head_top1_triton  # imports triton lazily

            return lm_head_top1_triton(hidden, weight, (self.mask_id, *also)).combine()
        return lm_head_top1_torch(hidden, weight, (self.mask_id, *also)).combine()

    def _decide(self, logits: torch.Tensor, reqs: list[Request],
                failed: dict[str, tuple[str, BaseException]]) -> StepOutput:
        """The step on full logits [N, L, V] (>= fp32, a scratch of ours): logit controls, the step, structured
        output's sweep, logprobs."""
        exclude_mask_(logits, self.mask_id)  # the step and the logprobs both read it this way
        if self.structural is not None:  # the 2.1 step on a 2.2 checkpoint never proposes DELETE or SPLIT
            rows = [i for i, r in enumerate(reqs) if not r.params.levenshtein]
            if rows:
                self._exclude_structural(logits, rows)
        slots = self.slots.slot_ids(reqs)  # [N]
        lens = [r.window_size * self.block_size for r in reqs]  # each window's positions
        if any(r.params.has_logit_controls for r in reqs):
            window = self.slots.tokens[slots, : logits.shape[1]]
            for i, r in enumerate(reqs):  # one request at a time, so that a failure is that request's alone
                if r.params.has_logit_controls and r.rid not in failed:
                    self._guard(failed, r, "controls", self._controls, logits, window, i, r)
        constrained = [i for i, r in enumerate(reqs) if r.state.constraint is not None and r.rid not in failed]
        before = self.slots.tokens[slots, : logits.shape[1]].clone() if constrained else None  # [N, L]
        result = self._step(logits, slots, reqs)
        if constrained:
            self._constrain(logits, slots, reqs, constrained, before, result, lens, failed)
        out = self._step_output(result, lens, reqs)
        wants = [r.params.wants_logprobs for r in reqs]
        if any(wants):
            if self.structural is not None:  # DELETE/SPLIT never reach logprobs (2.2 rows saw them in the step)
                self._exclude_structural(logits, [i for i, w in enumerate(wants) if w])
            self._logprobs(logits, result.tokens, reqs, wants, lens, out)
        return out

    def _exclude_structural(self, logits: torch.Tensor, rows: list[int]) -> None:
        """DELETE's and SPLIT's logits to -inf in rows `rows` of logits [N, L, V], in place."""
        idx = torch.tensor(rows, device=logits.device)
        for t in (self.structural.delete, self.structural.split):
            logits[idx, :, t] = float("-inf")

    def _step_output(self, result: StepResult, lens: list[int], reqs: list[Request]) -> StepOutput:
        """The step's result as plain lists, read from the device in one transfer: per row the window's tokens,
        then had_mask, the M2T and T2T counts and the multi-block edits ([N, L + 4] int64); when a request of the
        batch streams its forwards (stream_denoise), L more columns: the confidences (denoise_columns)."""
        width = result.tokens.shape[1]
        # T2T edits in blocks before the active one (the last block of each window): multi-block edits
        before_active = torch.arange(width, device=self.device)[None, :] < \
            torch.tensor(lens, device=self.device)[:, None] - self.block_size
        cols = [result.tokens, result.had_mask[:, None], result.m2t.sum(-1, keepdim=True),
                result.t2t.sum(-1, keepdim=True), (result.t2t & before_active).sum(-1, keepdim=True)]
        levenshtein = result.ended is not None  # the Levenshtein step's rows: -1 = the 2.1 rule (another row)
        if levenshtein:
            cols += [result.ended[:, None], result.deletions[:, None], result.insertions[:, None]]
        streams = [r.params.stream_denoise for r in reqs]
        if any(streams):
            cols.append(denoise_columns(result))
        # [N, L + 4 (+ 3) (+ L)]: the one device -> host read
        packed = torch.cat([c.long() for c in cols], dim=1).tolist()
        out = StepOutput(tokens=[row[:n] for row, n in zip(packed, lens)],
                         had_mask=[bool(row[width]) for row in packed], m2t=[row[width + 1] for row in packed],
                         t2t=[row[width + 2] for row in packed], mbe_edits=[row[width + 3] for row in packed])
        col = width + 4
        if levenshtein:
            out.ended = [None if row[col] < 0 else bool(row[col]) for row in packed]
            out.deletions, out.insertions = [row[col + 1] for row in packed], [row[col + 2] for row in packed]
            col += 3
        if any(streams):
            out.confidence = [unpack_floats(row[col : col + n]) if s else None
                              for row, n, s in zip(packed, lens, streams)]
        return out

    def _guard(self, failed: dict[str, tuple[str, BaseException]], req: Request, stage: str, fn, *args) -> None:
        """One request's share of a stage; an exception is recorded as that request's failure (EngineCore logs
        it and ends that request with an error finish)."""
        try:
            self.faults.check(stage, req.rid)
            fn(*args)
        except Exception as exc:  # noqa: BLE001 - ends this request only
            failed[req.rid] = (stage, exc)

    def sync_rows(self, reqs: list[Request], failed: dict[str, tuple[str, BaseException]]) -> None:
        """Before the forward, for each request whose block (re)began since its row was loaded: structured output
        first writes what its grammar forces into the block (the forward reads it), then the row is synced."""
        for r in reqs:
            if self.slots.stale(r):
                if r.state.constraint is not None:
                    self._guard(failed, r, "begin_block", r.begin_constraint)
                self.slots.sync(r)
                if r.params.levenshtein:
                    self._load_levenshtein(r)

    def _load_levenshtein(self, r: Request) -> None:
        """The Levenshtein step's entry state of r's block (from the row SlotState.sync just loaded)."""
        i, b, p = r.book.slot, self.block_size, r.params
        self.lev.load(i, self.slots.tokens[i, :b], self.slots.editable[i, :b], p.steps, p.max_post_steps,
                      p.max_steps_per_block)

    def _controls(self, logits: torch.Tensor, window: torch.Tensor, i: int, r: Request) -> None:
        self.controls.apply(logits[i : i + 1], [r], window[i : i + 1], self.mask_id)

    def _forward_eager(self, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Any batch: the hidden states [T, H] and the rows [N, L] of the decoding items' open windows in them (L:
        the longest; shorter windows repeat their last row in the padding, which the step never reads; None when
        no item decodes)."""
        batch = plan.batch
        meta = AttentionMetadata.build(batch.q_starts, batch.q_lens, batch.page_tables, self.block_size, self.device,
                                       with_torch_plan=self.model.kernel_backend == "torch",
                                       window_starts=batch.window_starts)
        hidden = self.model(batch.input_ids.to(self.device), meta, self.k_cache, self.v_cache)  # [T, H]
        if not plan.decoding:
            return hidden, None
        lens = torch.tensor(plan.lens, device=self.device)  # [N]
        ends = meta.cu_q[1:][plan.decoding]  # [N] flat end of each decoding query = end of its active block
        width = int(lens.max())
        rows = (ends - lens)[:, None] + torch.arange(width, device=self.device)[None, :]  # [N, L]
        return hidden, torch.minimum(rows, ends[:, None] - 1)

    def _step(self, logits: torch.Tensor, slots: torch.Tensor, reqs: list[Request]) -> StepResult:
        """decoding.joint_threshold_step on logits whose MASK is already excluded: propose, then `_advance`."""
        t0 = time.perf_counter()
        width = logits.shape[1]
        sampling = self.slots.sampling(slots, width) if any(r.params.temperature > 0 for r in reqs) else None
        v, p = propose(logits, sampling)
        result = self._advance_rows(v, p, slots, reqs, logits_at_of(logits))
        self.step_seconds += time.perf_counter() - t0
        return result

    def _advance_rows(self, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor, reqs: list[Request],
                      logits_at: LogitsAt | None) -> StepResult:
        """The step of each row from its proposals v and their probabilities p ([N, L]): the 2.1 step, or the
        Levenshtein step on the rows that asked for it (logits_at: their vocabulary rows where it needs them)."""
        lev = [i for i, r in enumerate(reqs) if r.params.levenshtein]
        if not lev:
            return self._advance(v, p, slots)
        # (a bound on the history rows the Levenshtein step may append to, known here without a sync)
        history = max(reqs[i].state.stats.steps - reqs[i].state.block_start_stats.steps for i in lev) + 1
        return self._advance_mixed(logits_at, v, p, slots, lev, history)

    def _advance_mixed(self, logits_at: LogitsAt, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor,
                       lev: list[int], history: int) -> StepResult:
        """The Levenshtein step on rows `lev` (one block each) and the 2.1 step on the others, as one StepResult
        whose `ended`, `deletions`, `insertions` say what the Levenshtein rows did (ended -1 on the others)."""
        n, width, b = v.shape[0], v.shape[1], self.block_size
        idx = torch.tensor(lev, device=self.device)
        lev_set = set(lev)
        rest = [i for i in range(n) if i not in lev_set]
        ended = torch.full((n,), -1, dtype=torch.long, device=self.device)
        dels = torch.zeros(n, dtype=torch.long, device=self.device)
        ins = torch.zeros_like(dels)
        if rest:
            base = self._advance(v[rest], p[rest], slots[rest])
            tokens, m2t, t2t, had = (torch.empty((n, *t.shape[1:]), dtype=t.dtype, device=self.device)
                                     for t in (base.tokens, base.m2t, base.t2t, base.had_mask))
            for full, part in ((tokens, base.tokens), (m2t, base.m2t), (t2t, base.t2t), (had, base.had_mask)):
                full[rest] = part
        else:
            tokens = torch.full((n, width), SlotState.PAD, dtype=torch.long, device=self.device)
            m2t = torch.zeros(n, width, dtype=torch.bool, device=self.device)
            t2t, had = torch.zeros_like(m2t), torch.zeros(n, dtype=torch.bool, device=self.device)
        s, rows = self.slots, slots[idx]
        res: LevenshteinResult = self.lev.advance(lambda r, c: logits_at(idx[r], c), v[idx, :b], p[idx, :b], rows,
                                                  s.tokens[rows, :b], s.threshold[rows], s.edit_threshold[rows],
                                                  history)
        s.tokens[rows, :b] = res.tokens
        s.steps[rows] += 1
        tokens[idx] = s.tokens[rows, :width]
        m2t[idx], t2t[idx] = False, False
        m2t[idx, :b], t2t[idx, :b], had[idx] = res.m2t, res.t2t, res.had_mask
        ended[idx], dels[idx], ins[idx] = res.ended.long(), res.deletions, res.insertions
        return StepResult(tokens=tokens, proposal=v, confidence=p, m2t=m2t, t2t=t2t, had_mask=had, ended=ended,
                          deletions=dels, insertions=ins)

    def _advance(self, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor) -> StepResult:
        """M2T and T2T on the slot rows from the proposals v and their probabilities p ([N, L]); the rows then hold
        the window after this step (the next step's input)."""
        s, width = self.slots, v.shape[1]
        result = threshold_step(v, p, s.tokens[slots, :width], s.editable[slots, :width], s.threshold[slots],
                                s.edit_threshold[slots], self.mask_id)
        s.tokens[slots, :width] = result.tokens
        s.steps[slots] += 1
        return result

    def _constrain(self, logits: torch.Tensor, slots: torch.Tensor, reqs: list[Request], rows: list[int],
                   before: torch.Tensor, result: StepResult, lens: list[int],
                   failed: dict[str, tuple[str, BaseException]]) -> None:
        """Structured output: each constrained row's window goes through its grammar's frontier sweep
        (engine/decoding/constrained.py), in place in `result` and the slot state. Reads only the row's own logits."""
        t0 = time.perf_counter()
        idx = torch.tensor(rows, device=self.device)
        before_rows, after_rows = before[idx].tolist(), result.tokens[idx].tolist()
        b = self.block_size
        for j, i in enumerate(rows):
            r, n = reqs[i], lens[i]
            c: Constraint = r.state.constraint  # type: ignore[assignment]
            fixed: list[list[int]] = []
            self._guard(failed, r, "sweep", lambda: fixed.append(c.sweep(
                r.state.window_start * b, before_rows[j][:n], after_rows[j][:n], self.mask_id,
                lambda pos, row=i: self._candidates(logits[row, pos]), r.params.threshold,
                lambda pos, bitmask, row=i: self._masked_argmax(logits[row, pos], bitmask))))
            if fixed and fixed[0] != after_rows[j][:n]:
                result.tokens[i, :n] = torch.tensor(fixed[0], device=self.device)
        # the counts of the changed rows, as joint_threshold_step defines them
        masked = before[idx] == self.mask_id
        placed = result.tokens[idx] != self.mask_id
        result.m2t[idx] = masked & placed
        result.t2t[idx] = ~masked & placed & (result.tokens[idx] != before[idx]) & self.slots.editable[slots[idx], : before.shape[1]]
        self.slots.tokens[slots[idx], : before.shape[1]] = result.tokens[idx]
        self.grammar_seconds += time.perf_counter() - t0

    @staticmethod
    def _candidates(row: torch.Tensor) -> list[tuple[int, float]]:
        """The model's top GRAMMAR_CANDIDATES at one position (row: [V] logits), with their probabilities in the
        step's distribution (no temperature), best first. One position at a time: the sweep asks for about one
        per request and forward, and a top-k over the whole window cost more than the grammar itself."""
        probs = torch.softmax(row.float(), -1)  # [V]
        p, ids = probs.topk(min(GRAMMAR_CANDIDATES, probs.shape[-1]))
        return list(zip(ids.tolist(), p.tolist()))

    def _masked_argmax(self, row: torch.Tensor, bitmask: bytes) -> int:
        """The highest-logit token among those `bitmask` allows (row: [V] logits of one position)."""
        bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8).to(row.device)
        allowed = ((bits[:, None] >> self._bit_index) & 1).bool().flatten()  # [8 * bytes]
        v = row.shape[-1]
        allowed = allowed[:v] if allowed.numel() >= v else torch.cat([allowed, allowed.new_zeros(v - allowed.numel())])
        best = int(row.masked_fill(~allowed, float("-inf")).argmax())
        if not allowed[best]:  # every allowed token has probability 0 (e.g. EOS under min_tokens): take the first
            best = int(allowed.nonzero()[0])
        return best

    @staticmethod
    def _logprobs(logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Request], wants: list[bool],
                  lens: list[int], out: StepOutput) -> None:
        """Log-probabilities of the window's tokens after the step, under this forward's distribution after the
        request's logit controls (no temperature or filtering; MASK excluded), and the top alternatives where asked."""
        rows = [i for i, w in enumerate(wants) if w]
        lp = finite_logprobs(logits[rows])  # [n, L, V]
        chosen = lp.gather(-1, tokens[rows].clamp(min=0)[..., None]).squeeze(-1).tolist()  # [n, L] (PAD: any row)
        k = max(reqs[i].params.top_logprobs for i in rows)
        top_v, top_i = lp.topk(k, -1) if k else (None, None)
        out.logprobs = [None] * len(reqs)
        out.top_logprobs = [None] * len(reqs)
        for j, i in enumerate(rows):
            n = lens[i]
            out.logprobs[i] = chosen[j][:n]
            ki = reqs[i].params.top_logprobs
            if ki and top_v is not None:
                ids, vals = top_i[j, :n, :ki].tolist(), top_v[j, :n, :ki].tolist()
                out.top_logprobs[i] = [list(zip(a, b)) for a, b in zip(ids, vals)]
            else:
                out.top_logprobs[i] = [[] for _ in range(n)]
