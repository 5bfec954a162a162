"""CUDA graphs for the denoising step.

A steady-state denoising batch has a fixed shape: every request's window is its one active block (32 query
tokens), so a batch of N requests is N x 32 tokens whatever their contexts. `DecodeGraphs` captures the whole
forward (embedding -> layers -> final norm -> lm_head, logits in fp32) once per batch-size bucket over static
input buffers, and each step only copies that step's inputs into the buffers and replays:
    input_ids [bs*32], positions [bs*32], slot_mapping [bs*32]      flat query tokens
    page_tables [bs, max_pages], kv_lens [bs], q_starts [bs]        per request (q_lens, cu_q are constant)
Rows past the real batch (N < bs) are padding: a one-block request at position 0 whose page table and slots
all point at the scratch page (the KV page after the scheduler's pages, which no request ever owns), so
padding writes land there and never touch a live request. The attention kernel reads each request's
kv_len and page table from device memory and its grid depends only on bs, so one graph serves any context
length. LLaDA2.2's block routing labels each row's tokens from the static positions and cu_q inside the captured
forward (`kernels/moe.py` `routing_blocks`): every row, padding included, is a routing block of its own. Batches that are not plain denoising steps (prefill chunks, a stale block in the window, multi-block
windows, more than the largest bucket) run eagerly.

Capture needs a forward without device->host syncs. The reference MoE (`moe_experts_torch`) loops over the
experts a batch touches on the host, so graphs are used only with kernel_backend="triton", where the engine
runs the fused Triton MoE (`kernels/moe_triton.py`), which never waits on the host, for every forward, eager
and captured alike. (A sync-free torch MoE on `torch._grouped_mm`, the engine's before the fused kernel, lives
on as a benchmark contender: benchmarks/moe_sync_free.py.)

Two variants are captured per bucket:
  * full logits: the graph ends in the lm_head's fp32 logits [bs, 32, V]; the host then proposes, runs the rows'
    decoders and packs (engine/runtime/decision.py), as on the eager path. Rows that read the distribution
    (sampling, logprobs, grammar, logit controls) and rules that are not `Decoder.in_graph` take it.
  * the decision inside the graph (`ForwardPlan.in_graph`: every row greedy, argmax only, one `in_graph` rule):
    the graph ends in the fused lm_head top-1 (kernels/vocab_top1.py: no [bs, 32, V] logits), the rule's step on
    the slot rows, read and written through the static slot-index buffer `slot_idx` (padding rows: the runner's
    scratch slot, whose block is MASK and never editable, so the step leaves it as it is), the next step's query
    (the window after the step) written into `input_ids`, and the host's figures packed into one small int32
    tensor (`output.pack_rows`). The host then copies that tensor into a pinned buffer: one device -> host read
    per step. When a step's rows are the last step's (same slots, positions, page tables, and the query tokens
    that step produced), nothing is copied to the device at all; rows that changed, and the SlotState rows of
    requests whose block (re)began, go through one pinned staging buffer, one host -> device copy and a scatter
    on the device (engine/runtime/graph_inputs.py).
With capture=False (CPU tests) both variants run eagerly over the same buffers, padding rows and scratch rows.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from redraft.engine.decoding.decoder import Decoder
from redraft.engine.runtime import forward
from redraft.engine.runtime.graph_inputs import GraphInputs
from redraft.engine.runtime.output import pack_rows
from redraft.kernels.attention import AttentionMetadata
from redraft.kernels.moe import compute_dtype

if TYPE_CHECKING:
    from redraft.engine.runtime.batch import ForwardBatch
    from redraft.engine.runtime.model_runner import ModelRunner
    from redraft.scheduler.scheduler import WorkItem

log = logging.getLogger("redraft.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


# ---- the graph runner ---------------------------------------------------------------------------------
class DecodeGraphs:
    """Static-shape denoising step at batch-size buckets. With capture=False (CPU tests) the same static
    buffers, padding and scratch page are used but the forward runs eagerly on them. decide=False: no decision
    inside the graph (every batch takes the full-logits variant: the old decision, for benchmarks)."""

    def __init__(self, runner: "ModelRunner", max_bs: int, capture: bool = True, decide: bool = True):
        if max_bs < 1:
            raise ValueError("max_bs must be >= 1")
        if capture and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need device='cuda'")
        self.runner = runner
        self.model = runner.model
        self.capture_graphs = capture
        self.b = b = runner.block_size
        self.scratch = runner.scratch_page
        self.buckets = sorted({x for x in BUCKETS if x < max_bs} | {max_bs})
        self.max_bs = max_bs
        self.max_pages = math.ceil(self.model.cfg.max_position_embeddings / b)
        dev = runner.device
        # CPU tests of the static step on the torch backend (float64 exactness): its attention's gather plan, read
        # back from the buffers each step (capture needs "triton", whose kernels read the buffers themselves)
        self.torch_plan = not capture and self.model.kernel_backend == "torch" and dev.type == "cpu"
        with torch.inference_mode():
            ar = torch.arange(b)
            self.input_ids = torch.full((max_bs * b,), runner.mask_id, dtype=torch.long, device=dev)
            self.positions = ar.repeat(max_bs).to(dev)
            self.slot_mapping = (self.scratch * b + ar).repeat(max_bs).to(dev)
            self.page_tables = torch.full((max_bs, self.max_pages), self.scratch, dtype=torch.long, device=dev)
            self.kv_lens = torch.full((max_bs,), b, dtype=torch.long, device=dev)
            self.q_starts = torch.zeros(max_bs, dtype=torch.long, device=dev)
            self.q_lens = torch.full((max_bs,), b, dtype=torch.long, device=dev)
            self.cu_q = (torch.arange(max_bs + 1) * b).to(dev)
            # [bs] each row's SlotState row (the in-graph decision's; padding rows: the scratch slot)
            self.slot_idx = torch.full((max_bs,), getattr(runner, "scratch_slot", 0), dtype=torch.long, device=dev)
            # One logits buffer for every bucket: graph outputs that stayed allocated per bucket would cost
            # sum(buckets) x 32 x V x 4 bytes (~4 GB at the mini shape up to 64).
            cfg = self.model.cfg
            dtype = compute_dtype(self.model.lm_head.weight.dtype)
            self.logits = torch.empty(max_bs, b, cfg.vocab_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.replays = 0  # steps run from these graphs (/server_info: they are in use after a resume)
        # the decision inside the graph: one variant per bucket and `in_graph` rule
        self.rules: dict[str, Decoder] = {name: d for name, d in getattr(runner, "decoders", {}).items()
                                          if d.in_graph} if decide else {}
        self.decision_graphs: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        self.inputs = GraphInputs(self, runner.scratch_slot) if self.rules else None
        if self.rules:
            runner.slots.tokens[runner.scratch_slot, :b] = runner.mask_id  # padding rows' block: MASK, not editable
        self.decide_on = True  # (benchmarks: False runs every batch on the full-logits variant, the old decision)

    @property
    def decides(self) -> bool:
        """Whether batches of an `in_graph` rule can decide inside the graph."""
        return bool(self.rules) and self.decide_on

    # -- which batches qualify ------------------------------------------------------------------------
    def can_run(self, items: list["WorkItem"]) -> bool:
        """Plain denoising steps only: every item decodes exactly its active block, with no MBE window (a decoding
        query holds its whole window, so first == last means a one-block window; read from the items alone, so
        that engine/runtime/overlap.py can ask about the next iteration's before the requests reach it)."""
        return (
            0 < len(items) <= self.max_bs
            and all(it.decodes and it.first == it.last and it.last < self.max_pages for it in items)
        )

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    # -- static forward -------------------------------------------------------------------------------
    def _meta(self, bs: int) -> AttentionMetadata:
        n_tok = bs * self.b
        meta = AttentionMetadata(
            block_size=self.b, positions=self.positions[:n_tok], slot_mapping=self.slot_mapping[:n_tok],
            page_tables=self.page_tables[:bs], kv_lens=self.kv_lens[:bs], q_starts=self.q_starts[:bs],
            q_lens=self.q_lens[:bs], window_starts=self.kv_lens[:bs], cu_q=self.cu_q[: bs + 1], max_q=self.b,
            max_kv=self.max_pages * self.b,
        )
        if self.torch_plan:
            meta.max_kv = int(self.kv_lens[:bs].max())  # the torch attention's gather plan, read back to the host
            meta._build_torch_plan(self.page_tables[:bs].cpu(), self.q_starts[:bs].cpu(), self.q_lens[:bs].cpu(),
                                   self.cu_q[:bs].cpu(), self.positions.device)
        return meta

    def _hidden(self, bs: int) -> torch.Tensor:  # -> [bs*B, H] the final-normed hidden states
        r = self.runner
        return self.model(self.input_ids[: bs * self.b], self._meta(bs), r.k_cache, r.v_cache)

    def _decide(self, bs: int, rule: Decoder) -> None:
        """The in-graph step (module docstring): forward, fused top-1, the rule's step on the slot rows, the next
        query into `input_ids`, the host's figures into `inputs.packed`."""
        b = self.b
        top = forward.top1(self.runner, self._hidden(bs), rule.excluded)  # ids, prob: [bs*B]
        result = rule.step(top.ids.view(bs, b), top.prob.view(bs, b), self.slot_idx[:bs], [], None)  # [bs, B]
        self.input_ids[: bs * b].copy_(result.tokens.view(-1))  # the next step's query where the rows go on
        self.inputs.packed[:bs].copy_(pack_rows(result))  # [bs, 2B + 3] int32

    def _forward(self, bs: int) -> torch.Tensor:  # -> logits [bs, B, V] (>= fp32), a view of self.logits
        hidden = self._hidden(bs)  # [bs*B, H]
        out = self.logits[:bs]
        # LLaDA2Model.logits (lm_head, then up to >= fp32), its conversion written into the static buffer.
        out.copy_(self.model.lm_head(hidden.view(bs, self.b, -1)))
        return out

    def _fill(self, batch: "ForwardBatch", bs: int) -> None:
        """This step's inputs (built by model_runner.build_forward_batch, as for the eager path) into rows
        [0, N) of the static buffers; rows [N, bs) become padding."""
        b, n = self.b, len(batch.q_starts)
        ar = torch.arange(b)
        starts = torch.tensor(batch.q_starts + [0] * (bs - n), dtype=torch.long)  # [bs]
        max_pages = max(len(t) for t in batch.page_tables)
        table = torch.full((bs, max_pages), self.scratch, dtype=torch.long)
        for i, pages in enumerate(batch.page_tables):
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        ids = torch.full((bs * b,), self.runner.mask_id, dtype=torch.long)
        ids[: n * b] = batch.input_ids  # every item is one block of b query tokens
        active_page = table[torch.arange(bs), starts // b]  # [bs] (padding rows: the scratch page)
        self.input_ids[: bs * b].copy_(ids)
        self.positions[: bs * b].copy_((starts[:, None] + ar[None, :]).flatten())
        self.slot_mapping[: bs * b].copy_((active_page[:, None] * b + ar[None, :]).flatten())
        self.page_tables[:bs, :max_pages].copy_(table)
        self.q_starts[:bs].copy_(starts)
        self.kv_lens[:bs].copy_(starts + b)
        if self.inputs is not None:
            self.inputs.forget(bs)

    def _pad_all(self, bs: int) -> None:
        b = self.b
        ar = torch.arange(b, device=self.input_ids.device)
        self.input_ids[: bs * b].fill_(self.runner.mask_id)
        self.positions[: bs * b].copy_(ar.repeat(bs))
        self.slot_mapping[: bs * b].copy_((self.scratch * b + ar).repeat(bs))
        self.page_tables[:bs].fill_(self.scratch)
        self.q_starts[:bs].zero_()
        self.kv_lens[:bs].fill_(b)
        if self.inputs is not None:
            self.slot_idx[:bs].fill_(self.inputs.scratch_slot)
            self.inputs.forget(bs)

    # -- capture / replay -----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (smaller graphs reuse its memory pool): the full-logits
        variant, then the in-graph decision of each `in_graph` rule."""
        if not self.capture_graphs:
            return
        pool = None
        for bs in reversed(self.buckets):
            programs = [(bs, lambda bs=bs: self._forward(bs))]
            programs += [((name, bs), lambda bs=bs, rule=rule: self._decide(bs, rule)) for name, rule in self.rules.items()]
            for key, program in programs:
                self._pad_all(bs)  # (padding rows only: the decision variant steps the scratch slot alone)
                graph = self._capture_one(program, pool)
                pool = graph.pool()
                if isinstance(key, int):
                    self.graphs[key] = graph
                else:
                    self.decision_graphs[key] = graph
        torch.cuda.synchronize(self.runner.device)
        log.info("captured CUDA graphs for the denoising step at batch sizes %s (decision inside the graph: %s)",
                 self.buckets, sorted(self.rules) or "none")

    def _capture_one(self, program: Callable[[], object], pool: object) -> torch.cuda.CUDAGraph:
        dev = self.runner.device
        stream = torch.cuda.Stream(dev)
        stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(stream):  # warm-up off the default stream, as PyTorch recommends
            for _ in range(2):
                program()
        torch.cuda.current_stream(dev).wait_stream(stream)
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            program()
        return graph

    def static_bytes(self) -> int:
        """Bytes of the static input and logits buffers, the in-graph decision's included (the graphs' private
        pool and the pinned host buffers not counted)."""
        bufs = (self.input_ids, self.positions, self.slot_mapping, self.page_tables, self.kv_lens, self.q_starts,
                self.q_lens, self.cu_q, self.logits, self.slot_idx)
        if self.inputs is not None:
            bufs += (self.inputs.staged, self.inputs.packed, self.inputs.ar)
        return sum(t.numel() * t.element_size() for t in bufs)

    def reset(self) -> None:
        """Drop the graphs (their memory pool goes with them): /release_memory_occupation
        (engine/runtime/memory_occupation.py); the runner then builds a new DecodeGraphs."""
        for graph in [*self.graphs.values(), *self.decision_graphs.values()]:
            graph.reset()
        self.graphs.clear()
        self.decision_graphs.clear()

    @torch.inference_mode()
    def run(self, batch: "ForwardBatch") -> torch.Tensor:
        """Logits [N, B, V] of one denoising step; valid until the next call (graph outputs are reused)."""
        n = len(batch.q_starts)
        bs = self.bucket(n)
        self._fill(batch, bs)
        if self.capture_graphs:
            self.graphs[bs].replay()
            self.replays += 1
        else:
            self._forward(bs)
        return self.logits[:n]

    @torch.inference_mode()
    def decide(self, items: list["WorkItem"], rule: Decoder) -> list[list[int]]:
        """One denoising step of `items` decided inside the graph by `rule` (an `in_graph` decoder): the rows that
        changed since the last step staged (GraphInputs.stage), the graph replayed, its packed rows read back
        in one transfer: per item [B tokens, had_mask, M2T, T2T, B confidence bits] (output.pack_rows)."""
        n = len(items)
        bs = self.bucket(n)
        try:
            for r in self.inputs.stage(items, bs):  # (the rows whose block (re)began, loaded by the staging)
                rule.load(r)
            if self.capture_graphs:
                self.decision_graphs[(rule.name, bs)].replay()
                self.replays += 1
            else:
                self._decide(bs, rule)
            return self.inputs.read(n)
        except BaseException:
            self.inputs.forget(self.max_bs)  # what the buffers hold is unknown now: restage every row next time
            raise
