"""A sync-free MoE in plain torch: the routed experts with fixed shapes and no device->host sync, so a CUDA graph
can capture it. The engine does not run it: with kernel_backend="triton" it runs the fused Triton MoE
(kernels/moe_triton.py, sync-free too) in every forward, and with "torch" the reference `moe_experts_torch`
(eager, no graphs). It was the engine's CUDA MoE before the fused kernel; bench_moe.py keeps it as the "torch"
contender, and tests/test_engine_triton.py as a capturable MoE for the meta-device check of the captured
forward.

    moe_experts_static   grouped GEMM (torch._grouped_mm) where it works, else the dense all-experts product
    moe_experts_grouped  the T*k (token, expert) pairs sorted by expert, one grouped GEMM per projection
    moe_experts_dense    every expert on every token, weighted by the (mostly zero) routing weights
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from redraft.kernels.moe import compute_dtype

log = logging.getLogger("redraft.bench.moe_sync_free")

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
    """Capturable routed experts: grouped GEMM where torch._grouped_mm works, else the dense product."""
    if _grouped_mm_ok(x):
        return moe_experts_grouped(x, w13, w2, topk_ids, topk_weights)
    return moe_experts_dense(x, w13, w2, topk_ids, topk_weights)
