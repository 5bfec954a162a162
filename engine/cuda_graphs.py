"""CUDA graphs for the denoising step, and the sync-free MoE that lets the step be captured.

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
length. Batches that are not plain denoising steps (prefill chunks, a stale block in the window, multi-block
windows, more than the largest bucket) run eagerly.

Capture needs a forward without device->host syncs. The reference MoE (`moe_experts_torch`) loops over the
experts a batch touches on the host, so with kernel_backend="triton" the engine runs the fused Triton MoE
(`kernels/moe_triton.py`), which never waits on the host, for every forward, eager and captured alike.
`moe_experts_static` below is the sync-free torch alternative (tokens sorted by expert, one grouped GEMM per
projection via `torch._grouped_mm`, or a dense all-experts product where that op is missing), kept for
comparisons.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from redraft.kernels.attention import AttentionMetadata
from redraft.kernels.moe import compute_dtype

if TYPE_CHECKING:
    from redraft.engine.model_runner import ForwardBatch, ModelRunner
    from redraft.scheduler.scheduler import WorkItem

log = logging.getLogger("redraft.cuda_graphs")

BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256)


# ---- sync-free MoE ------------------------------------------------------------------------------------
_GROUPED_MM_WORKS: dict[torch.device, bool] = {}


def _grouped_mm_ok(x: torch.Tensor) -> bool:
    """torch._grouped_mm is a private op: bf16 grouped GEMM on Hopper+ (CUTLASS), an exact loop on CPU. On
    CUDA it is probed once per device with a small product (before any capture: warm-up forwards come first);
    anything else falls back to the dense formulation."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if x.device.type == "cpu":
        return True  # the CPU fallback is exact (used by the tests)
    if not (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)):
        return False
    if x.device not in _GROUPED_MM_WORKS:
        try:
            a = torch.randn(48, 64, device=x.device, dtype=torch.bfloat16)
            b = torch.randn(3, 32, 64, device=x.device, dtype=torch.bfloat16)
            offs = torch.tensor([16, 16, 48], device=x.device, dtype=torch.int32)
            got = torch._grouped_mm(a, b.transpose(1, 2), offs=offs).float()
            want = torch.cat([a[:16] @ b[0].t(), a[16:48] @ b[2].t()]).float()
            _GROUPED_MM_WORKS[x.device] = bool(torch.allclose(got, want, rtol=2e-2, atol=2e-2))
        except Exception as exc:  # noqa: BLE001 - any failure means: use the dense fallback
            log.warning("torch._grouped_mm unusable on %s (%s): MoE falls back to all-experts products", x.device, exc)
            _GROUPED_MM_WORKS[x.device] = False
    return _GROUPED_MM_WORKS[x.device]


def moe_experts_grouped(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H] in x.dtype
    """Routed experts with fixed shapes: the T*k (token, expert) pairs sorted by expert, two grouped GEMMs,
    then each token's k results summed in fp32 (in top-k order). No host sync anywhere."""
    t, k = topk_ids.shape
    e = w13.shape[0]
    flat = topk_ids.flatten()  # [T*k]
    order = flat.argsort(stable=True)  # pairs grouped by expert
    counts = torch.zeros(e, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's rows
    xs = x[order // k]  # [T*k, H]
    gate_up = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)  # [T*k, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    ys = torch._grouped_mm(F.silu(gate) * up, w2.transpose(1, 2), offs=offs)  # [T*k, H]
    y = torch.empty_like(ys)
    y[order] = ys  # back to (token, slot) order; indices are a permutation, so this is deterministic
    acc = compute_dtype(x.dtype)
    out = (y.view(t, k, -1).to(acc) * topk_weights[..., None].to(acc)).sum(1)
    return out.to(x.dtype)


def moe_experts_dense(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """Every expert on every token, weighted by the (mostly zero) routing weights: fixed shapes on any device,
    E/k times the FLOPs. Fallback where grouped GEMM is unavailable."""
    t, _ = topk_ids.shape
    e = w13.shape[0]
    acc = compute_dtype(x.dtype)
    weights = torch.zeros(t, e, dtype=acc, device=x.device).scatter_(1, topk_ids, topk_weights.to(acc))  # [T, E]
    out = torch.zeros(t, x.shape[1], dtype=acc, device=x.device)
    for expert in range(e):  # a fixed loop: E small GEMM pairs, no data-dependent shapes
        gate, up = (x @ w13[expert].t()).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[expert].t()  # [T, H]
        out += y.to(acc) * weights[:, expert, None]
    return out.to(x.dtype)


def moe_experts_static(x, w13, w2, topk_ids, topk_weights) -> torch.Tensor:
    """The capturable routed-experts function the engine uses on CUDA (grouped GEMM where available)."""
    if _grouped_mm_ok(x):
        return moe_experts_grouped(x, w13, w2, topk_ids, topk_weights)
    return moe_experts_dense(x, w13, w2, topk_ids, topk_weights)


# ---- the graph runner ---------------------------------------------------------------------------------
class DecodeGraphs:
    """Static-shape denoising step at batch-size buckets. With capture=False (CPU tests) the same static
    buffers, padding and scratch page are used but the forward runs eagerly on them."""

    def __init__(self, runner: "ModelRunner", max_bs: int, capture: bool = True):
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
            # One logits buffer for every bucket: graph outputs that stayed allocated per bucket would cost
            # sum(buckets) x 32 x V x 4 bytes (~4 GB at the mini shape up to 64).
            cfg = self.model.cfg
            dtype = compute_dtype(self.model.lm_head.weight.dtype)
            self.logits = torch.empty(max_bs, b, cfg.vocab_size, dtype=dtype, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    # -- which batches qualify ------------------------------------------------------------------------
    def can_run(self, items: list["WorkItem"]) -> bool:
        """Plain denoising steps only: every item decodes exactly its active block, with no MBE window."""
        return (
            0 < len(items) <= self.max_bs
            and all(it.decodes and it.first == it.last == it.req.state.window_start and it.last < self.max_pages
                    for it in items)
        )

    def bucket(self, n: int) -> int:
        return next(x for x in self.buckets if x >= n)

    # -- static forward -------------------------------------------------------------------------------
    def _meta(self, bs: int) -> AttentionMetadata:
        n_tok = bs * self.b
        return AttentionMetadata(
            block_size=self.b, positions=self.positions[:n_tok], slot_mapping=self.slot_mapping[:n_tok],
            page_tables=self.page_tables[:bs], kv_lens=self.kv_lens[:bs], q_starts=self.q_starts[:bs],
            q_lens=self.q_lens[:bs], window_starts=self.kv_lens[:bs], cu_q=self.cu_q[: bs + 1], max_q=self.b,
            max_kv=self.max_pages * self.b,
        )

    def _forward(self, bs: int) -> torch.Tensor:  # -> logits [bs, B, V] (>= fp32), a view of self.logits
        r = self.runner
        hidden = self.model(self.input_ids[: bs * self.b], self._meta(bs), r.k_cache, r.v_cache)  # [bs*B, H]
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

    def _pad_all(self, bs: int) -> None:
        b = self.b
        ar = torch.arange(b, device=self.input_ids.device)
        self.input_ids[: bs * b].fill_(self.runner.mask_id)
        self.positions[: bs * b].copy_(ar.repeat(bs))
        self.slot_mapping[: bs * b].copy_((self.scratch * b + ar).repeat(bs))
        self.page_tables[:bs].fill_(self.scratch)
        self.q_starts[:bs].zero_()
        self.kv_lens[:bs].fill_(b)

    # -- capture / replay -----------------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every bucket, largest first (smaller graphs reuse its memory pool)."""
        if not self.capture_graphs:
            return
        pool = None
        stream = torch.cuda.Stream(self.runner.device)
        for bs in reversed(self.buckets):
            self._pad_all(bs)
            stream.wait_stream(torch.cuda.current_stream(self.runner.device))
            with torch.cuda.stream(stream):  # warm-up off the default stream, as PyTorch recommends
                for _ in range(2):
                    self._forward(bs)
            torch.cuda.current_stream(self.runner.device).wait_stream(stream)
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.runner.device)
        log.info("captured CUDA graphs for the denoising step at batch sizes %s", self.buckets)

    @torch.inference_mode()
    def run(self, batch: "ForwardBatch") -> torch.Tensor:
        """Logits [N, B, V] of one denoising step; valid until the next call (graph outputs are reused)."""
        n = len(batch.q_starts)
        bs = self.bucket(n)
        self._fill(batch, bs)
        if self.capture_graphs:
            self.graphs[bs].replay()
        else:
            self._forward(bs)
        return self.logits[:n]
