"""`ModelRunner`: one forward for a whole batch of request windows, then every decoding request's step.

It owns the model, the KV cache tensors (pages are allocated by the scheduler's PagePool; this class only
reads/writes the rows the page ids point at), the per-slot decoding state (`SlotState`, engine/decoding/slots.py)
and one decoder per rule the checkpoint can run (engine/decoding/registry.py). `run` is its seams in order:

    begin_blocks   a grammar writes its forced tokens into a block that (re)began
    plan           batch building and planning                        engine/runtime/batch.py
    load_rows      rows whose block (re)began are loaded from their requests (and their decoder's own state)
    forward        the forward, eager or a CUDA graph                 engine/runtime/forward.py
    decide         each row's decoder step, grammar, packing          engine/runtime/decision.py, output.py
(A batch planned `in_graph` runs forward and decide as one CUDA graph: engine/runtime/cuda_graphs.py.)

The step runs on [N, L] positions: every request's window, padded to the longest in the batch. Likelihood
forwards are engine/runtime/scoring.py's; the overlap scheduler (engine/runtime/overlap.py) wraps `run`.
"""

from __future__ import annotations

import logging

import torch

from redraft.engine.decoding.decoder import Decoder, LogitsAt
from redraft.engine.decoding.logit_controls import LogitControls
from redraft.engine.decoding.registry import DECODER_CLASSES
from redraft.engine.decoding.slots import SlotState
from redraft.engine.model.config import ModelConfig
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.runtime import decision, forward
from redraft.engine.runtime.batch import ForwardBatch, ForwardPlan, build_forward_batch, plan_forward
from redraft.engine.runtime.faults import NO_FAULTS, FaultInjector, Failures, guard
from redraft.engine.runtime.forward import Forward
from redraft.engine.runtime.output import LOGPROB_FLOOR, finite_logprobs  # noqa: F401 - (re-exported)
from redraft.kernels.vocab_top1 import Top1
from redraft.protocol.sampling_params import BLOCK_SIZE
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import StepOutput, WorkItem

log = logging.getLogger("redraft.runner")


class ModelRunner:
    def __init__(self, model: LLaDA2Model, num_pages: int, num_slots: int, mask_id: int, eos_id: int,
                 device: str | torch.device, cuda_graph_max_bs: int = 0):
        cfg: ModelConfig = model.cfg
        self.model, self.cfg = model, cfg
        self.device = torch.device(device)
        self.mask_id = mask_id
        self.block_size = BLOCK_SIZE
        dtype = next(model.parameters()).dtype
        # One page beyond the scheduler's pages 0..num_pages-1: the scratch page that padded batch rows
        # (CUDA graphs) write to and read from; no request ever owns it. Likewise one slot row beyond the
        # scheduler's slots: the padded rows' of a graph that decides.
        self.scratch_page = num_pages
        self.scratch_slot = num_slots
        shape = (cfg.num_hidden_layers, num_pages + 1, BLOCK_SIZE, cfg.num_key_value_heads, cfg.head_dim)
        self.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, P + 1, B, Hkv, D]
        self.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.slots = SlotState(num_slots + 1, BLOCK_SIZE, self.device)  # (+ the scratch slot)
        self.decoders: dict[str, Decoder] = {name: cls(self.slots, cfg, mask_id)
                                             for name, cls in DECODER_CLASSES.items() if cls.runs_on(cfg)}
        # ids that are edits, not text (LLaDA2.2's DELETE and SPLIT): never in logprobs or likelihoods
        self.non_text_ids: tuple[int, ...] = cfg.edit_token_ids
        self.controls = LogitControls(cfg.vocab_size, eos_id, self.device)
        self.step_seconds = 0.0  # host time in the decoders' steps, in total: benchmarks read it
        self.grammar_seconds = 0.0  # host time in structured output's sweeps (engine/runtime/grammar_step.py)
        # Greedy rows decide from vocabulary chunks, without [L, V] logits (off: a vocabulary-parallel lm_head,
        # whose ranks each hold a slice of the vocabulary).
        self.vocab_reduce = True
        self.faults: FaultInjector = NO_FAULTS  # tests only (engine/runtime/faults.py)
        log.info("KV cache: %d pages x %d tokens (%.1f MiB)",
                 num_pages, BLOCK_SIZE, 2 * self.k_cache.numel() * self.k_cache.element_size() / 2**20)
        self.graphs = None  # DecodeGraphs when the denoising step runs as CUDA graphs
        self.graph_error: str | None = None  # why capture failed (the step then runs eagerly)
        if cuda_graph_max_bs > 0:
            self.build_graphs(cuda_graph_max_bs)

    def build_graphs(self, max_bs: int, capture: bool = True, decide: bool = True) -> None:
        """The denoising step's static buffers and, with `capture`, its CUDA graphs (at start-up, and again on
        /resume_memory_occupation: engine/runtime/memory_occupation.py); capture=False (CPU tests) runs the same
        buffers eagerly; `decide` as DecodeGraphs'. A capture that fails leaves the step eager, saying why in
        `graph_error`."""
        if capture and (self.device.type != "cuda" or self.model.kernel_backend != "triton"):
            raise ValueError("CUDA graphs need device='cuda' and kernel_backend='triton'")
        from redraft.engine.runtime.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(self, max_bs, capture, decide)
        try:
            graphs.capture()
            self.graphs, self.graph_error = graphs, None
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
        failed: Failures = {}
        reqs = [it.req for it in items if it.decodes]
        self.begin_blocks(reqs, failed)
        self.faults.check_any("forward", [it.req.rid for it in items])
        plan = self.plan(items, build_forward_batch(items, self.block_size))
        if plan.in_graph:  # (its staging loads the stale rows: one upload with the graph's inputs)
            return decision.decide_in_graph(self, items, failed)
        self.load_rows(reqs)
        return self.decide(items, plan, self.forward(plan), failed)

    def sync_rows(self, reqs: list[Request], failed: Failures) -> None:
        """Before the forward, for each request whose block (re)began since its row was loaded: structured output
        first writes what its grammar forces into the block (the forward reads it), then the row is synced, then
        its decoder's own state (`begin_blocks`, then `load_rows`: the overlap scheduler's decision calls it)."""
        self.begin_blocks(reqs, failed)
        self.load_rows(reqs)

    def begin_blocks(self, reqs: list[Request], failed: Failures) -> None:
        """Structured output writes what its grammar forces into a block that (re)began (the batch reads it)."""
        for r in reqs:
            if self.slots.stale(r) and r.state.constraint is not None:
                guard(self.faults, failed, r.rid, "begin_block", r.begin_constraint)

    def load_rows(self, reqs: list[Request]) -> None:
        """The slot rows of requests whose block (re)began, then their decoders' own state (a batch deciding inside
        the CUDA graph loads them with its staging instead: cuda_graphs.DecodeGraphs.decide)."""
        for r in reqs:
            if self.slots.stale(r):
                self.slots.sync(r)
                self.decoders[r.params.decoder].load(r)

    def plan(self, items: list[WorkItem], batch: ForwardBatch) -> ForwardPlan:
        """What `forward` needs of the items, read now (engine/runtime/batch.py)."""
        graphs = self.graphs is not None and self.graphs.can_run(items)
        return plan_forward(items, batch, self.decoders, graphs, self.vocab_reduce, self.block_size,
                            graph_decides=graphs and self.graphs.decides)

    @torch.inference_mode()
    def forward(self, plan: ForwardPlan) -> Forward:
        """The model forward and the lm_head's work on the decoding rows (engine/runtime/forward.py); changes no
        decoding state (the overlap worker runs it while the host updates the requests)."""
        return forward.run_forward(self, plan)

    @torch.inference_mode()
    def decide(self, items: list[WorkItem], plan: ForwardPlan, fwd: Forward, failed: Failures) -> StepOutput:
        """The decoding step of every decoding item from its forward (engine/runtime/decision.py); advances the
        slot rows."""
        return decision.decide(self, items, plan, fwd, failed)

    def logits_at(self, hidden: torch.Tensor | None, width: int) -> LogitsAt | None:
        """Whole vocabulary rows, on demand, of rows that decided from vocabulary chunks (forward.logits_from)."""
        return forward.logits_from(self, hidden, width)

    def top1(self, hidden: torch.Tensor, also: tuple[int, ...] = ()) -> Top1:
        """Each row's best token and its probability from [R, H] hidden states (forward.top1)."""
        return forward.top1(self, hidden, also)
