"""Mixture-of-experts in plain torch: LLaDA2's grouped sigmoid router, LLaDA2.2's block router and the routed-expert
SwiGLU sum.

Block routing (LLaDA2.2, docs/llada22.md): each token carries a routing-block label; a block (the tokens of one
request at R consecutive absolute positions, contiguous in the flat batch) admits the `capacity` experts with the
largest max-over-its-tokens biased score, and each token takes its top-k among them. Ties break towards the lower
expert id everywhere (stable sorts).

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


def routing_blocks(positions: torch.Tensor, cu_q: torch.Tensor, block_size: int) -> torch.Tensor:
    """[T] routing-block label of each flat query token: request index * 2**40 + absolute position // block_size,
    from the attention metadata (positions [T], cu_q [N + 1]). Two requests never share a label, and a padded
    batch row (CUDA graphs) is a request of its own. Sync-free (CUDA-graph safe)."""
    t = positions.shape[0]
    owner = torch.searchsorted(cu_q[1:], torch.arange(t, device=positions.device), right=True)  # [T]
    return owner.to(torch.int64) * (1 << 40) + torch.div(positions, block_size, rounding_mode="floor")


def block_segments(labels: torch.Tensor) -> torch.Tensor:
    """[T] routing-block labels (a block's tokens contiguous) -> [T] block index 0, 1, ... in order of first
    appearance. Sync-free."""
    new = torch.ones_like(labels, dtype=torch.bool)  # [T] True where a block starts
    new[1:] = labels[1:] != labels[:-1]
    return new.cumsum(0) - 1


def top_ids(values: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest entries of each row, best first, ties towards the lower index ([R, k] int64)."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[:, :k]


def route_blocks_torch(
    x: torch.Tensor,  # [T, H]
    gate_weight: torch.Tensor,  # [E, H]
    expert_bias: torch.Tensor,  # [E] fp32
    labels: torch.Tensor,  # [T] routing block of each token (routing_blocks)
    *,
    top_k: int,
    capacity: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # topk_ids [T, k] int64, topk_weights [T, k] (router dtype)
    """LLaDA2.2's block routing: per block, the `capacity` experts with the largest max-over-the-block biased
    score; per token, its top_k biased scores among them; weights the unbiased scores (normalised, scaled)."""
    rdt = compute_dtype(x.dtype)
    scores = torch.sigmoid(x.to(rdt) @ gate_weight.to(rdt).t())  # [T, E]
    biased = scores + expert_bias.to(rdt)
    t, e = scores.shape
    seg = block_segments(labels)  # [T]
    # one row per block (T rows: an upper bound on their count, so no sync); rows past the last block stay -inf
    block_max = torch.full((t, e), float("-inf"), dtype=rdt, device=x.device)
    block_max.scatter_reduce_(0, seg[:, None].expand(t, e), biased, "amax")  # [T, E]
    admitted = torch.zeros(t, e, dtype=torch.bool, device=x.device).scatter_(1, top_ids(block_max, capacity), True)
    topk_ids = top_ids(biased.masked_fill(~admitted[seg], float("-inf")), top_k)  # [T, k]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return topk_ids, weights * routed_scaling_factor


def route_layer_torch(moe, x: torch.Tensor, labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing of an MoE layer (`moe.cfg`, `moe.router`, `moe.expert_bias`): block routing when its config has
    an expert capacity (`labels` then required), LLaDA2.0/2.1's grouped routing otherwise."""
    c = moe.cfg
    if c.expert_capacity > 0:
        if labels is None:
            raise ValueError("block routing (expert_capacity > 0) needs each token's routing block")
        return route_blocks_torch(x, moe.router, moe.expert_bias, labels, top_k=c.num_experts_per_tok,
                                  capacity=c.expert_capacity, routed_scaling_factor=c.routed_scaling_factor,
                                  norm_topk_prob=c.norm_topk_prob)
    return route_torch(x, moe.router, moe.expert_bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                       topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                       norm_topk_prob=c.norm_topk_prob)


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
