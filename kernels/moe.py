"""Mixture-of-experts in plain torch: LLaDA2's grouped sigmoid router and the routed-expert SwiGLU sum.

These are the reference twins of the Triton kernels; the engine uses them on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """At least fp32 (router, norms, accumulation); float64 stays float64 for exact tests."""
    return torch.promote_types(dtype, torch.float32)


def route_torch(
    x: torch.Tensor,  # [T, H]
    gate_weight: torch.Tensor,  # [E, H]
    expert_bias: torch.Tensor,  # [E] fp32
    *,
    top_k: int,
    n_group: int,
    topk_group: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_ids [T, k] int64, topk_weights [T, k] (router dtype)
    """Sigmoid scores; the expert bias only chooses (grouped top-k); weights are the unbiased scores."""
    rdt = compute_dtype(x.dtype)
    scores = torch.sigmoid(x.to(rdt) @ gate_weight.to(rdt).t())  # [T, E]
    biased = scores + expert_bias.to(rdt)
    t, e = scores.shape
    group_scores = biased.view(t, n_group, e // n_group).topk(2, dim=-1).values.sum(-1)  # [T, G]
    keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros(t, n_group, dtype=torch.bool, device=x.device).scatter_(1, keep_groups, True)
    expert_mask = group_mask.repeat_interleave(e // n_group, dim=1)  # [T, E]
    topk_ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * routed_scaling_factor


def local_expert_ids(topk_ids: torch.Tensor, first: int, n_local: int, n_experts: int) -> torch.Tensor:
    """Global expert ids [T, k] -> ids among the n_local experts [first, first + n_local) this rank holds
    (expert parallelism), -1 for an expert another rank holds; unchanged when this rank holds them all.
    Sync-free (CUDA-graph safe)."""
    if n_local == n_experts:
        return topk_ids
    local = topk_ids - first
    return torch.where((local >= 0) & (local < n_local), local, torch.full_like(local, -1))


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)); gate_up is the packed [2I, H] weight (gate rows first)."""
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return (F.silu(gate) * up) @ down.t()


def moe_experts_torch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] gate | up
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H] in x.dtype
    """Sum over each token's k experts of weight * SwiGLU_e(x), one GEMM pair per touched expert.

    Accumulates in at least fp32, in ascending expert order for every token: a token's result never
    depends on which other tokens share the batch.
    """
    return combine_experts_torch(x, topk_ids, topk_weights, w13.shape[0],
                                 lambda e, xs: swiglu(xs, w13[e], w2[e]))


def combine_experts_torch(
    x: torch.Tensor,  # [T, H]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
    num_experts: int,
    expert_fn,  # (expert, x_rows [n, H]) -> [n, H]
) -> torch.Tensor:  # [T, H] in x.dtype
    """Dispatch each token to its k experts and sum weight * expert_fn(e, x), one call per touched expert;
    a slot with expert id -1 (held by another rank: local_expert_ids) adds nothing.

    Accumulates in at least fp32, in ascending expert order for every token: a token's result never depends
    on which other tokens share the batch. Shared by every torch MoE twin (bf16/fp32 and FP8 weights).
    """
    t, k = topk_ids.shape
    acc_dtype = compute_dtype(x.dtype)
    out = torch.zeros(t, x.shape[1], dtype=acc_dtype, device=x.device)
    flat_ids = topk_ids.flatten()
    flat_ids = torch.where(flat_ids >= 0, flat_ids, num_experts)  # other ranks' slots: one bin past the last
    order = flat_ids.argsort(stable=True)  # slots grouped by expert
    counts = torch.bincount(flat_ids, minlength=num_experts + 1).tolist()[:num_experts]
    flat_w = topk_weights.flatten()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        tokens = slots // k
        y = expert_fn(expert, x[tokens])  # [count, H]
        out.index_add_(0, tokens, y.to(acc_dtype) * flat_w[slots, None].to(acc_dtype))
    return out.to(x.dtype)
