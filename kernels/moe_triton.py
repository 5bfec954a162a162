"""LLaDA2's MoE layer in Triton: the grouped sigmoid router, the token->expert sort, a fused expert kernel in the
spirit of Alpha-MoE, the unfused sequence for comparison, and a deterministic combine.

    route_triton(x, gate_weight, expert_bias, top_k=, n_group=, topk_group=, routed_scaling_factor=, ...)
        -> topk_ids [T, k] int64, topk_weights [T, k] fp32              twin: kernels/moe.py route_torch
    route_blocks_triton(x, gate_weight, expert_bias, labels, top_k=, capacity=, block_size=, ...)
        -> the same, LLaDA2.2's block routing                           twin: kernels/moe.py route_blocks_torch
    moe_align(topk_ids, num_experts, block_m, shared=) -> MoEPlan      (sorted pair list padded per expert)
    fused_moe(x, w13, w2, topk_ids, topk_weights, ...) -> [T, H]       twin: moe_experts_torch (+ shared)
    unfused_moe(...)                                                  same result, four launches
    moe_forward_triton(moe, x)                                        the MoE layer of kernel_backend="triton"

Routing. The router GEMM (x @ Wg^T, [T, E], fp32) is the same torch matmul as route_torch's, so both start
from bitwise-equal logits; `_route_kernel` then does sigmoid, + expert bias (selection only), per-group sum
of the top-2 biased scores, the topk_group best groups, top-k experts among them, weights = unbiased scores
/ (their sum + 1e-20) x routed_scaling_factor. Ties break towards the lower index; ids come out in descending
biased score, as torch.topk returns them. Block routing (`_block_route_kernel`, LLaDA2.2): one program per
routing block (a run of equal labels, at most block_size tokens: launched per token, the ones that start no block
return at once), which admits the block's `capacity` experts by their max-over-the-block biased score (one
arg-max per admitted expert, ties to the lower id), then picks each token's top-k among them as above.

Pairs. A token's j-th choice is pair p = t * K_OUT + j, K_OUT = k (+1 when the shared expert is folded in:
slot k of every token is expert E with weight 1, "one more expert"). `moe_align` sorts the T * K_OUT pairs by
expert (stable: ascending pair index within an expert) and pads each expert's list to a multiple of BLOCK_M,
in three sync-free launches (per-chunk counts; one program for the scans and each tile's expert; scatter);
every size is an upper bound computed from T alone, so the whole layer can be captured in a CUDA graph.

Fused kernel (`_fused_moe_kernel`). One program per (tile of BLOCK_M pairs of one expert, slice of BLOCK_I
intermediate columns): gate and up GEMMs over all of H for that slice, SiLU(gate) * up in registers (rounded
to the model dtype exactly where torch's swiglu rounds: the gate/up GEMM output, silu, the product), then the
down GEMM of that slice for every BLOCK_N columns of H, stored as a partial [BLOCK_M, H] of the pair's
expert output. With FP8 weights the activations are quantised once per token before the kernel
(`quantize_act_triton`: e4m3 + one scale per 128 channels, `quantize_act`'s bits; in the layer it is the launch
that also gives the router its fp32 input, so it costs none of its own) and every program reads them; the
SwiGLU output is quantised in registers once per program (the slice is its one 128-channel group); both GEMMs
run on e4m3 operands. Tiles under 64 rows are swapped (SWAP): `dot(w, a^T)` with the weight slice as wgmma's
M (64 rows per warpgroup) and the tile's pairs as N (8-256), the accumulators held as [BLOCK_I, BLOCK_M] and
transposed once before the store: wgmma (HGMMA; QGMMA on e4m3 x e4m3, no widening to fp16) instead of
mma.sync, which 16/32-row tiles as M fall back to.

Deterministic combine (`_moe_reduce_kernel`), chosen over atomics: partials go to Y [SLICES, P, H] (fp32 when
the intermediate dim is split, else the model dtype); one program per (token tile, H tile) sums each pair's
slices in slice order, rounds that expert output to the model dtype, and accumulates the routed experts in
ascending expert id in fp32 with their weights, rounds, then adds the shared expert's output: exactly the
order and roundings of `moe_experts_torch(...) + shared(x)` (only the GEMMs' internal K order differs from
torch's). No atomics: same inputs and launch configuration, same bits, run after run (a token's rows never
depend on which other tokens share its tiles, as long as the batch stays on the same path, i.e. the same
tile shapes). Cost: Y is written and read once, SLICES * T * K_OUT * H elements; at the LLaDA2.1-mini
shape that is ~2% of the expert bytes at 32 tokens, ~20% at 512 (fp32, 4 slices), which is why `fused_moe`'s
"auto" method switches to the unfused sequence (one slice, model-dtype intermediates) once that share passes
`FUSED_BUFFER_SHARE`.

Small-token path and the grid. Decode-size batches use 16-row tiles (`fused_config`, the per-device table); the
grid is 1-D, a tile's slices adjacent, so the programs of live tiles are all dispatched before those past
NumPost (the grid is sized from T alone: at 32 tokens max_tiles = (288 + 257 * 15) / 16 = 259 tiles, ~165
live), which exit at once. The slice width sets the program count. A 32-token block (288 pairs, top-8 + the
shared expert) touches 256 * (1 - (1 - 8/256)^32) = 163 routed experts under uniform routing, one 16-row tile
each, + 2 tiles of the shared expert's 32 pairs = ~165 live tiles:
    bf16, BLOCK_I 64:  165 x 8 slices = 1320 programs = 10.0 x 132 SMs, 0.75 MB of weights each
    bf16, BLOCK_I 128: 165 x 4 slices =  660 programs =  5.0 x 132 SMs, 1.5 MB each
    FP8,  BLOCK_I 128: 165 x 4 slices =  660 programs =  5.0 x 132 SMs, 0.75 MB each (e4m3)
Programs are equal work, so the hardware's greedy dispatch is already the best schedule for them (a persistent
grid with a static stride would end the same way, one item per program at most past the mean); what can hang
off the end is one program per SM: routing moves the count by +-5 experts (one standard deviation over 2000
draws: 165.3 +- 5.0 live tiles, 149-181), +-40 programs at 8 slices and +-20 at 4, so about half the batches
leave a last partial round, costing at most 1/10 of the kernel with 8 slices and 1/5 with 4. So bf16 splits 32-token batches into 64-wide
slices (64 rows is exactly one warpgroup's wgmma M), paying a partial buffer of 8 x 288 x 2048 x 4 B written and
read (38 MB, 3.6% of the 1.04 GB of experts); from 64 tokens on (226 tiles x 4 = 904 programs = 6.8 x 132) it
goes back to 128-wide slices (8 would cost 75 MB, 5%). FP8 keeps 128 (the down GEMM's activation group must be
whole in one program; its programs stream the same 0.75 MB as bf16's 64-wide ones). Occupancy (sm_90 compile
report): the bf16 16-row program 72 registers and 72 KB of shared memory (3 per SM), FP8 184 registers and
103 KB (2 per SM). Larger batches use BLOCK_M = 32/64 (more rows per weight read). Untimed: the GPU sweep
(benchmarks/moe_config_sweep.py) measures these against their alternatives.

Interpreter: dot operands upcast to fp32, tl.reduce with explicit combine functions (tl.max/tl.sum cost ~1 ms
each there), big tiles (its cost is per operation, not per element).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from redraft.kernels.fp8 import BLOCK, FP8_DTYPE, cdiv
from redraft.kernels.fp8_triton import (HAS_TRITON, _block_gemm_kernel, _cast, _dot, _jit, _max_fn, _min_fn,
                                        _quant_cols, _quant_rows, _sum_fn, check_device, gemm_config, interpreting,
                                        next_pow2, quantize_act_triton)
from redraft.kernels.moe import compute_dtype, local_expert_ids

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = tl = None

__all__ = ["route_triton", "route_logits_triton", "route_blocks_triton", "route_layer_triton", "moe_align", "MoEPlan",
           "fused_moe", "unfused_moe",
           "moe_forward_triton", "fused_config", "FUSED_BUFFER_SHARE"]

FUSED_BUFFER_SHARE = 0.15  # "auto": fused while its partial buffer traffic is under this share of expert bytes
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)
_TL_DTYPE = {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16} if HAS_TRITON else {}


# ---- routing ------------------------------------------------------------------------------------------
@_jit
def _top_k_weights(cand, s, e, scaling, ROWS: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
                   BLOCK_K: tl.constexpr, NORM: tl.constexpr):
    """Each row's TOP_K experts by `cand` (biased scores, -inf where not allowed), best first (ties: lower id),
    and their weights: the unbiased scores `s`, normalised when NORM, times `scaling`. [ROWS, BLOCK_K] each."""
    neg = float("-inf")
    kcol = tl.arange(0, BLOCK_K)
    ids = tl.zeros([ROWS, BLOCK_K], dtype=tl.int32)
    wts = tl.zeros([ROWS, BLOCK_K], dtype=tl.float32)
    total = tl.zeros([ROWS], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        m = tl.reduce(cand, 1, _max_fn)
        idx = tl.reduce(tl.where(cand == m[:, None], e[None, :], BLOCK_E), 1, _min_fn)
        hit = e[None, :] == idx[:, None]
        w = tl.reduce(tl.where(hit, s, 0.0), 1, _sum_fn)
        cand = tl.where(hit, neg, cand)
        ids = tl.where(kcol[None, :] == j, idx[:, None], ids)
        wts = tl.where(kcol[None, :] == j, w[:, None], wts)
        total += w
    if NORM:
        wts = wts / (total + 1e-20)[:, None]
    return ids, wts * scaling


@_jit
def _route_kernel(
    Logits, Bias, Ids, Weights,  # [T, E] fp32, [E] fp32, [T, TOP_K] out, [T, TOP_K] out
    n_tokens, stride_lt, stride_it, stride_wt, scaling,
    E: tl.constexpr, BLOCK_E: tl.constexpr, GROUP_SIZE: tl.constexpr, N_GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    e = tl.arange(0, BLOCK_E)
    e_ok = e < E
    logit = tl.load(Logits + t[:, None].to(tl.int64) * stride_lt + e[None, :], mask=t_ok[:, None] & e_ok[None, :],
                    other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-logit))  # sigmoid scores: the weights
    b = s + tl.load(Bias + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]  # biased: only to choose
    neg = float("-inf")
    b = tl.where(e_ok[None, :], b, neg)
    grp = e // GROUP_SIZE
    gcol = tl.arange(0, BLOCK_G)
    # group score = the sum of the group's two best biased scores
    gscore = tl.full([BLOCK_T, BLOCK_G], neg, tl.float32)
    for g in tl.static_range(N_GROUP):
        v = tl.where((grp == g)[None, :], b, neg)
        m1 = tl.reduce(v, 1, _max_fn)
        i1 = tl.reduce(tl.where(v == m1[:, None], e[None, :], BLOCK_E), 1, _min_fn)
        m2 = tl.reduce(tl.where(e[None, :] == i1[:, None], neg, v), 1, _max_fn)
        gscore = tl.where(gcol[None, :] == g, (m1 + m2)[:, None], gscore)
    # keep the TOPK_GROUP best groups
    allowed = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int32)
    for _j in tl.static_range(TOPK_GROUP):
        gm = tl.reduce(gscore, 1, _max_fn)
        gi = tl.reduce(tl.where(gscore == gm[:, None], gcol[None, :], BLOCK_G), 1, _min_fn)
        gscore = tl.where(gcol[None, :] == gi[:, None], neg, gscore)
        allowed = tl.where(grp[None, :] == gi[:, None], 1, allowed)
    cand = tl.where(allowed != 0, b, neg)
    ids, wts = _top_k_weights(cand, s, e, scaling, BLOCK_T, BLOCK_E, TOP_K, BLOCK_K, NORM)
    kcol = tl.arange(0, BLOCK_K)
    mask = t_ok[:, None] & (kcol[None, :] < TOP_K)
    tl.store(Ids + t[:, None].to(tl.int64) * stride_it + kcol[None, :], ids.to(Ids.dtype.element_ty), mask=mask)
    tl.store(Weights + t[:, None].to(tl.int64) * stride_wt + kcol[None, :], wts.to(Weights.dtype.element_ty),
             mask=mask)


def route_logits_triton(logits: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int, n_group: int,
                        topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool = True,
                        ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped top-k selection from router logits [T, E] (fp32). Returns ids [T, k], weights [T, k] fp32."""
    check_device(logits)
    t, e = logits.shape
    if e % n_group:
        raise ValueError(f"{e} experts do not split into {n_group} groups")
    group = e // n_group
    if group < 2:
        raise ValueError("grouped routing needs at least 2 experts per group (the group score is a top-2 sum)")
    if not 0 < topk_group <= n_group or top_k > group * topk_group:
        raise ValueError(f"top_k={top_k}, topk_group={topk_group} do not fit {n_group} groups of {group}")
    ids = torch.empty(t, top_k, dtype=ids_dtype, device=logits.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=logits.device)
    if t == 0:
        return ids, weights
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias = expert_bias.float().contiguous()
    interp = interpreting()
    block_e = next_pow2(e)
    block_t = max(1, min(next_pow2(t), 128 if interp else max(1, 4096 // block_e)))
    _route_kernel[(triton.cdiv(t, block_t),)](
        logits, bias, ids, weights, t, logits.stride(0), ids.stride(0), weights.stride(0),
        float(routed_scaling_factor), E=e, BLOCK_E=block_e, GROUP_SIZE=group, N_GROUP=n_group,
        BLOCK_G=next_pow2(n_group), TOPK_GROUP=topk_group, TOP_K=top_k, BLOCK_K=next_pow2(top_k), NORM=bool(norm_topk_prob),
        BLOCK_T=block_t, num_warps=4,
    )
    return ids, weights


def route_triton(x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor, *, top_k: int,
                 n_group: int, topk_group: int, routed_scaling_factor: float, norm_topk_prob: bool = True,
                 ids_dtype: torch.dtype = torch.int64) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `route_torch`: the router GEMM in fp32 (torch, as route_torch computes it), then the kernel."""
    rdt = compute_dtype(x.dtype)
    logits = x.to(rdt) @ gate_weight.to(rdt).t()  # [T, E]
    if rdt != torch.float32:
        raise TypeError(f"the Triton router takes fp32/fp16/bf16 inputs, got {x.dtype}")
    return route_logits_triton(logits, expert_bias, top_k=top_k, n_group=n_group, topk_group=topk_group,
                               routed_scaling_factor=routed_scaling_factor, norm_topk_prob=norm_topk_prob,
                               ids_dtype=ids_dtype)


@_jit
def _block_route_kernel(
    Logits, Bias, Labels, Ids, Weights,  # [T, E] fp32, [E] fp32, [T] int64, [T, TOP_K] out, [T, TOP_K] out
    n_tokens, stride_lt, stride_it, stride_wt, scaling,
    E: tl.constexpr, BLOCK_E: tl.constexpr, CAPACITY: tl.constexpr, TOP_K: tl.constexpr, BLOCK_K: tl.constexpr,
    NORM: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """LLaDA2.2's block routing: program t0 routes the block that starts at token t0 (and does nothing when t0
    does not start one). A block is a run of equal labels, at most BLOCK_R tokens long."""
    t0 = tl.program_id(0)
    lab0 = tl.load(Labels + t0)
    prev = tl.load(Labels + t0 - 1, mask=t0 > 0, other=0)
    if (t0 == 0) | (prev != lab0):
        r = tl.arange(0, BLOCK_R)
        t = t0 + r
        t_ok = t < n_tokens
        lab = tl.load(Labels + t, mask=t_ok, other=0)
        # the run of lab0 from t0 on: every row up to the first other label (or the batch's end)
        in_blk = tl.cumsum(((lab != lab0) | (t >= n_tokens)).to(tl.int32), 0) == 0
        e = tl.arange(0, BLOCK_E)
        e_ok = e < E
        neg = float("-inf")
        logit = tl.load(Logits + t[:, None].to(tl.int64) * stride_lt + e[None, :],
                        mask=in_blk[:, None] & e_ok[None, :], other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-logit))  # sigmoid scores: the weights
        b = s + tl.load(Bias + e, mask=e_ok, other=0.0).to(tl.float32)[None, :]  # biased: only to choose
        b = tl.where(e_ok[None, :], b, neg)
        # the block admits the CAPACITY experts with the largest max-over-its-tokens biased score (ties: lower id)
        score = tl.reduce(tl.where(in_blk[:, None], b, neg), 0, _max_fn)  # [BLOCK_E]
        score = tl.where(e_ok, score, neg)
        admitted = tl.zeros([BLOCK_E], dtype=tl.int32)
        for _c in range(CAPACITY):
            m = tl.reduce(score, 0, _max_fn)
            i = tl.reduce(tl.where(score == m, e, BLOCK_E), 0, _min_fn)
            admitted = tl.where(e == i, 1, admitted)
            score = tl.where(e == i, neg, score)
        cand = tl.where((admitted != 0)[None, :], b, neg)
        ids, wts = _top_k_weights(cand, s, e, scaling, BLOCK_R, BLOCK_E, TOP_K, BLOCK_K, NORM)
        kcol = tl.arange(0, BLOCK_K)
        mask = in_blk[:, None] & (kcol[None, :] < TOP_K)
        tl.store(Ids + t[:, None].to(tl.int64) * stride_it + kcol[None, :], ids.to(Ids.dtype.element_ty), mask=mask)
        tl.store(Weights + t[:, None].to(tl.int64) * stride_wt + kcol[None, :], wts.to(Weights.dtype.element_ty),
                 mask=mask)


def route_blocks_triton(x: torch.Tensor, gate_weight: torch.Tensor, expert_bias: torch.Tensor, labels: torch.Tensor,
                        *, top_k: int, capacity: int, block_size: int, routed_scaling_factor: float,
                        norm_topk_prob: bool = True, ids_dtype: torch.dtype = torch.int64
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop-in for `route_blocks_torch`: the router GEMM in fp32 (torch), then `_block_route_kernel`, one program
    per token (those that start no block return at once). `labels` [T]: each token's routing block, a block's
    tokens contiguous and at most `block_size` of them (as `routing_blocks` labels a forward). Sync-free."""
    check_device(x)
    rdt = compute_dtype(x.dtype)
    if rdt != torch.float32:
        raise TypeError(f"the Triton router takes fp32/fp16/bf16 inputs, got {x.dtype}")
    logits = x.to(rdt) @ gate_weight.to(rdt).t()  # [T, E]
    t, e = logits.shape
    if not top_k <= capacity <= e:
        raise ValueError(f"expert capacity {capacity} must be in top_k ({top_k})..experts ({e})")
    ids = torch.empty(t, top_k, dtype=ids_dtype, device=x.device)
    weights = torch.empty(t, top_k, dtype=torch.float32, device=x.device)
    if t == 0:
        return ids, weights
    labels = labels.to(torch.int64).contiguous()
    _block_route_kernel[(t,)](
        logits, expert_bias.float().contiguous(), labels, ids, weights, t, logits.stride(0), ids.stride(0),
        weights.stride(0), float(routed_scaling_factor), E=e, BLOCK_E=next_pow2(e), CAPACITY=capacity, TOP_K=top_k,
        BLOCK_K=next_pow2(top_k), NORM=bool(norm_topk_prob), BLOCK_R=next_pow2(block_size), num_warps=8,
    )
    return ids, weights


def route_layer_triton(moe: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton twin of `route_layer_torch`: block routing when the layer's config has an expert capacity,
    grouped routing otherwise. The router weight in fp32 comes from `moe.router_f32` when the layer cached it
    (the same values: a bf16 -> fp32 conversion is exact), saving a conversion per forward."""
    c = moe.cfg
    router = moe.router if getattr(moe, "router_f32", None) is None else moe.router_f32
    if c.expert_capacity > 0:
        if labels is None:
            raise ValueError("block routing (expert_capacity > 0) needs each token's routing block")
        return route_blocks_triton(x, router, moe.expert_bias, labels, top_k=c.num_experts_per_tok,
                                   capacity=c.expert_capacity, block_size=c.block_size,
                                   routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob)
    return route_triton(x, router, moe.expert_bias, top_k=c.num_experts_per_tok, n_group=c.n_group,
                        topk_group=c.topk_group, routed_scaling_factor=c.routed_scaling_factor,
                        norm_topk_prob=c.norm_topk_prob)


# ---- token -> expert sort and alignment ---------------------------------------------------------------
@_jit
def _pair_expert(Ids, p, p_ok, stride_it, shared_id, TOP_K: tl.constexpr, K_OUT: tl.constexpr):
    """Expert of pair p (token p // K_OUT, slot p % K_OUT); slot TOP_K (when K_OUT > TOP_K) is the shared one."""
    t = p // K_OUT
    j = p % K_OUT
    if K_OUT > TOP_K:
        e = tl.load(Ids + t.to(tl.int64) * stride_it + j, mask=p_ok & (j < TOP_K), other=0).to(tl.int32)
        e = tl.where(j < TOP_K, e, shared_id)
    else:
        e = tl.load(Ids + t.to(tl.int64) * stride_it + j, mask=p_ok, other=0).to(tl.int32)
    return e


@_jit
def _moe_count_kernel(Ids, Counts, n_pairs, stride_it, shared_id,
                      TOP_K: tl.constexpr, K_OUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    p = c * BLOCK_P + tl.arange(0, BLOCK_P)
    p_ok = p < n_pairs
    e = _pair_expert(Ids, p, p_ok, stride_it, shared_id, TOP_K, K_OUT)
    e = tl.where(p_ok & (e >= 0), e, BLOCK_E)  # no column (past the end, or -1: another rank's expert)
    cols = tl.arange(0, BLOCK_E)
    cnt = tl.reduce((e[:, None] == cols[None, :]).to(tl.int32), 0, _sum_fn)
    tl.store(Counts + c * BLOCK_E + cols, cnt)


@_jit
def _moe_scan_kernel(Counts, Offsets, Starts, TileExpert, NumPost, n_chunks, max_tiles,
                     BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    cols = tl.arange(0, BLOCK_E)
    run = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(n_chunks):  # each chunk's offset inside each expert's list
        cnt = tl.load(Counts + c * BLOCK_E + cols)
        tl.store(Offsets + c * BLOCK_E + cols, run)
        run += cnt
    padded = (run + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(Starts + cols, ends - padded)
    total = tl.reduce(padded, 0, _sum_fn)
    tl.store(NumPost, total)
    for t0 in range(0, max_tiles, BLOCK_TILES):  # the expert of every tile: the first whose end lies past it
        tile = t0 + tl.arange(0, BLOCK_TILES)
        pos = tile * BLOCK_M
        ex = tl.reduce((ends[None, :] <= pos[:, None]).to(tl.int32), 1, _sum_fn)
        tl.store(TileExpert + tile, tl.where(pos < total, ex, -1), mask=tile < max_tiles)


@_jit
def _moe_scatter_kernel(Ids, Offsets, Starts, Sorted, n_pairs, stride_it, shared_id,
                        TOP_K: tl.constexpr, K_OUT: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr):
    c = tl.program_id(0)
    q = tl.arange(0, BLOCK_P)
    p = c * BLOCK_P + q
    p_ok = p < n_pairs
    e = _pair_expert(Ids, p, p_ok, stride_it, shared_id, TOP_K, K_OUT)
    ok = p_ok & (e >= 0)  # -1: an expert another rank holds (expert parallelism), not computed here
    earlier = (e[:, None] == e[None, :]) & (q[None, :] < q[:, None]) & ok[None, :]
    rank = tl.reduce(earlier.to(tl.int32), 1, _sum_fn)  # same-expert pairs before it in this chunk
    base = tl.load(Starts + e, mask=ok, other=0) + tl.load(Offsets + c * BLOCK_E + e, mask=ok, other=0)
    tl.store(Sorted + base + rank, p, mask=ok)


@_jit
def _moe_align_kernel(Ids, Offsets, Starts, Sorted, TileExpert, NumPost, n_pairs, n_chunks, max_tiles, n_slots,
                      stride_it, shared_id, TOP_K: tl.constexpr, K_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_P: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TILES: tl.constexpr):
    """The whole alignment in one program (small batches): counts, scans, every tile's expert, the padding fill
    and the scatter, in that order; the barrier orders the fill and the scan's stores before the scatter."""
    cols = tl.arange(0, BLOCK_E)
    q = tl.arange(0, BLOCK_P)
    run = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c in range(n_chunks):  # per-chunk counts -> each chunk's offset inside each expert's list
        p = c * BLOCK_P + q
        p_ok = p < n_pairs
        e = _pair_expert(Ids, p, p_ok, stride_it, shared_id, TOP_K, K_OUT)
        e = tl.where(p_ok & (e >= 0), e, BLOCK_E)
        tl.store(Offsets + c * BLOCK_E + cols, run)
        run += tl.reduce((e[:, None] == cols[None, :]).to(tl.int32), 0, _sum_fn)
    padded = (run + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    tl.store(Starts + cols, ends - padded)
    total = tl.reduce(padded, 0, _sum_fn)
    tl.store(NumPost, total)
    for t0 in range(0, max_tiles, BLOCK_TILES):
        tile = t0 + tl.arange(0, BLOCK_TILES)
        pos = tile * BLOCK_M
        ex = tl.reduce((ends[None, :] <= pos[:, None]).to(tl.int32), 1, _sum_fn)
        tl.store(TileExpert + tile, tl.where(pos < total, ex, -1), mask=tile < max_tiles)
    for s0 in range(0, n_slots, BLOCK_P):  # padding slots hold n_pairs (the scatter overwrites the used ones)
        tl.store(Sorted + s0 + q, tl.zeros([BLOCK_P], dtype=tl.int32) + n_pairs, mask=s0 + q < n_slots)
    tl.debug_barrier()
    for c in range(n_chunks):
        p = c * BLOCK_P + q
        p_ok = p < n_pairs
        e = _pair_expert(Ids, p, p_ok, stride_it, shared_id, TOP_K, K_OUT)
        ok = p_ok & (e >= 0)
        earlier = (e[:, None] == e[None, :]) & (q[None, :] < q[:, None]) & ok[None, :]
        rank = tl.reduce(earlier.to(tl.int32), 1, _sum_fn)
        base = tl.load(Starts + e, mask=ok, other=0) + tl.load(Offsets + c * BLOCK_E + e, mask=ok, other=0)
        tl.store(Sorted + base + rank, p, mask=ok)


# Up to this many pairs (4 blocks of 32 tokens, top-8 + the shared expert) the alignment is one launch of one
# program (its chunks in series); above it the parallel count and scatter win. Untimed: the GPU probe measures it.
ALIGN_ONE_PROGRAM_PAIRS = 4 * 32 * 9


@dataclass
class MoEPlan:
    """Pairs sorted by expert, each expert's run padded to a multiple of block_m (padding slots hold n_pairs)."""

    sorted_pairs: torch.Tensor  # [max_tiles * block_m] int32
    tile_expert: torch.Tensor  # [max_tiles] int32 (-1 past the used tiles)
    num_post: torch.Tensor  # [1] int32: slots in use
    n_pairs: int
    k_out: int  # pairs per token
    block_m: int
    max_tiles: int


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, shared: bool = False) -> MoEPlan:
    """Sort the T * K_OUT (token, expert) pairs by expert and pad each expert's list to block_m. With
    shared=True every token gets a last pair on expert `num_experts` (the folded shared expert). Pairs on expert
    -1 (another rank's: expert parallelism) are left out. Up to ALIGN_ONE_PROGRAM_PAIRS pairs (a decoding
    batch of a few blocks) in one launch (`_moe_align_kernel`); more: a fill and three launches
    (counts per chunk in parallel, the scans, the scatter in parallel)."""
    check_device(topk_ids)
    t, k = topk_ids.shape
    k_out = k + int(shared)
    n_exp = num_experts + int(shared)
    p = t * k_out
    dev = topk_ids.device
    interp = interpreting()
    block_e = next_pow2(max(n_exp, 2))
    block_p = 128 if not interp else max(16, min(1024, next_pow2(p)))  # (the scatter's rank is BLOCK_P^2)
    n_chunks = max(1, triton.cdiv(p, block_p))
    max_slots = p + min(n_exp, p) * (block_m - 1)
    max_tiles = max(1, triton.cdiv(max_slots, block_m))
    one = 0 < p <= ALIGN_ONE_PROGRAM_PAIRS  # one launch, the padding fill included
    n_slots = max_tiles * block_m
    sorted_pairs = (torch.empty(n_slots, dtype=torch.int32, device=dev) if one else
                    torch.full((n_slots,), p, dtype=torch.int32, device=dev))
    tile_expert = torch.empty(max_tiles, dtype=torch.int32, device=dev)
    num_post = torch.empty(1, dtype=torch.int32, device=dev)
    plan = MoEPlan(sorted_pairs, tile_expert, num_post, p, k_out, block_m, max_tiles)
    if p == 0:
        num_post.zero_()
        tile_expert.fill_(-1)
        return plan
    ids = topk_ids if topk_ids.stride(-1) == 1 else topk_ids.contiguous()
    counts = torch.empty(n_chunks, block_e, dtype=torch.int32, device=dev)
    offsets = torch.empty_like(counts)
    starts = torch.empty(block_e, dtype=torch.int32, device=dev)
    common = dict(TOP_K=k, K_OUT=k_out, BLOCK_P=block_p, BLOCK_E=block_e)
    block_tiles = min(128 if not interp else 1024, next_pow2(max_tiles))
    if one:
        _moe_align_kernel[(1,)](ids, offsets, starts, sorted_pairs, tile_expert, num_post, p, n_chunks, max_tiles,
                                n_slots, ids.stride(0), num_experts, BLOCK_M=block_m,
                                BLOCK_TILES=block_tiles, **common)
        return plan
    _moe_count_kernel[(n_chunks,)](ids, counts, p, ids.stride(0), num_experts, **common)
    _moe_scan_kernel[(1,)](counts, offsets, starts, tile_expert, num_post, n_chunks, max_tiles, BLOCK_M=block_m,
                           BLOCK_E=block_e, BLOCK_TILES=block_tiles)
    _moe_scatter_kernel[(n_chunks,)](ids, offsets, starts, sorted_pairs, p, ids.stride(0), num_experts, **common)
    return plan


# ---- fused experts --------------------------------------------------------------------------------------
@_jit
def _fused_moe_kernel(
    X,  # [T, H] activations (row stride stride_xt); FP8: e4m3, quantised once per token (quantize_act_triton)
    XS,  # FP8: [T, HB] fp32 activation scales (row stride stride_xst); any tensor otherwise
    W13, W2,  # [E, 2I, H] gate | up, [E, H, I] (model dtype or e4m3), rows contiguous
    S13, S2,  # FP8: [E, 2 * IB, HB], [E, HB, IB] fp32 block scales
    W13SH, W2SH, S13SH, S2SH,  # the shared expert (id shared_id): [2I, H], [H, I] and scales
    Sorted, TileExpert, NumPost,  # the plan (moe_align)
    Y,  # [SLICES, P, H] partial expert outputs
    n_pairs, hidden, inter, shared_id, i_blocks,
    stride_xt, stride_xst,
    stride_w13e, stride_w13n, stride_w2e, stride_w2n,
    stride_s13e, stride_s13n, stride_s2e, stride_s2n,
    stride_ys, stride_yp,
    K_OUT: tl.constexpr,
    FP8: tl.constexpr,
    SWAP: tl.constexpr,  # dot(w, a^T): weight rows are the MMA's M (>= 64 for wgmma), the tile's pairs its N
    SLICES: tl.constexpr,  # programs per tile (intermediate slices); program id = tile * SLICES + slice
    BLOCK_M: tl.constexpr,  # pairs per tile
    BLOCK_I: tl.constexpr,  # intermediate columns per program (FP8: one activation group, 128)
    BLOCK_K: tl.constexpr,  # H per step of the gate/up GEMM
    BLOCK_N: tl.constexpr,  # H per step of the down GEMM
    DT: tl.constexpr,  # the model dtype (the activations' before quantisation): where swiglu rounds
    INTERP: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    tile = pid // SLICES  # a tile's slices are neighbours in launch order; unused tiles all come last
    sl = pid % SLICES
    if tile * BLOCK_M < tl.load(NumPost):
        expert = tl.load(TileExpert + tile)
        rows = tl.load(Sorted + tile * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # pair ids (>= P: padding)
        row_ok = rows < n_pairs
        tok = rows // K_OUT
        if expert == shared_id:
            w13 = W13SH
            w2 = W2SH
            s13 = S13SH
            s2 = S2SH
        else:
            w13 = W13 + expert.to(tl.int64) * stride_w13e
            w2 = W2 + expert.to(tl.int64) * stride_w2e
            s13 = S13 + expert.to(tl.int64) * stride_s13e
            s2 = S2 + expert.to(tl.int64) * stride_s2e
        i0 = sl * BLOCK_I
        icol = i0 + tl.arange(0, BLOCK_I)
        i_ok = icol < inter
        ieee: tl.constexpr = IEEE and not FP8  # (a constexpr: else both dots are emitted, unpipelined)

        # gate / up for this intermediate slice, over all of H; swapped: the accumulators hold [BLOCK_I, BLOCK_M]
        if SWAP:
            acc_g = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_I, BLOCK_M], dtype=tl.float32)
        else:
            acc_g = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
        g_rows = icol.to(tl.int64)[:, None] * stride_w13n
        u_rows = (inter + icol).to(tl.int64)[:, None] * stride_w13n
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < hidden
            a = tl.load(X + tok[:, None] * stride_xt + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = i_ok[:, None] & k_ok[None, :]
            wg = tl.load(w13 + g_rows + kk[None, :], mask=w_mask, other=0.0)  # [BLOCK_I, BLOCK_K]
            wu = tl.load(w13 + u_rows + kk[None, :], mask=w_mask, other=0.0)
            if SWAP:
                pg = _dot(wg, tl.trans(a), INTERP, ieee)  # [BLOCK_I, BLOCK_M]
                pu = _dot(wu, tl.trans(a), INTERP, ieee)
            else:
                pg = _dot(a, tl.trans(wg), INTERP, ieee)  # [BLOCK_M, BLOCK_I]
                pu = _dot(a, tl.trans(wu), INTERP, ieee)
            if FP8:  # one activation group and one weight block column per K step: both scales applied here
                kb = k0 // 128
                a_s = tl.load(XS + tok * stride_xst + kb, mask=row_ok, other=0.0)  # [BLOCK_M]
                sg = tl.load(s13 + (icol // 128) * stride_s13n + kb, mask=i_ok, other=0.0)  # [BLOCK_I]
                su = tl.load(s13 + (i_blocks + icol // 128) * stride_s13n + kb, mask=i_ok, other=0.0)
                if SWAP:
                    acc_g += pg * a_s[None, :] * sg[:, None]
                    acc_u += pu * a_s[None, :] * su[:, None]
                else:
                    acc_g += pg * a_s[:, None] * sg[None, :]
                    acc_u += pu * a_s[:, None] * su[None, :]
            else:
                acc_g += pg
                acc_u += pu

        # SiLU(gate) * up in registers, rounded where torch's swiglu rounds (gate_up output, silu, product)
        g = _cast(acc_g, DT, INTERP).to(tl.float32)
        u = _cast(acc_u, DT, INTERP).to(tl.float32)
        act = _cast(_cast(g / (1.0 + tl.exp(-g)), DT, INTERP).to(tl.float32) * u, DT, INTERP)
        if FP8:  # the down GEMM's input: one activation group per pair (the slice), quantised once here
            if SWAP:
                act, act_s = _quant_cols(act.to(tl.float32), INTERP)  # [BLOCK_I, BLOCK_M], [BLOCK_M]
            else:
                act, act_s = _quant_rows(act.to(tl.float32), INTERP)  # [BLOCK_M, BLOCK_I], [BLOCK_M]

        # down GEMM of this slice, BLOCK_N output columns at a time, into the pair's partial row
        y_rows = Y + sl * stride_ys + rows[:, None] * stride_yp
        for n0 in range(0, hidden, BLOCK_N):
            nn = n0 + tl.arange(0, BLOCK_N)
            n_ok = nn < hidden
            wd = tl.load(w2 + nn.to(tl.int64)[:, None] * stride_w2n + icol[None, :],
                         mask=n_ok[:, None] & i_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_I]
            if SWAP:
                part = _dot(wd, act, INTERP, ieee)  # [BLOCK_N, BLOCK_M]
            else:
                part = _dot(act, tl.trans(wd), INTERP, ieee)  # [BLOCK_M, BLOCK_N]
            if FP8:
                sd = tl.load(s2 + (nn // 128) * stride_s2n + i0 // 128, mask=n_ok, other=0.0)
                if SWAP:
                    part = part * act_s[None, :] * sd[:, None]
                else:
                    part = part * act_s[:, None] * sd[None, :]
            if SWAP:
                part = tl.trans(part)  # the accumulator back to [pairs, H] once, for the store
            tl.store(y_rows + nn[None, :], _cast(part, Y.dtype.element_ty, INTERP), mask=row_ok[:, None] & n_ok[None, :])


@_jit
def _silu_mul_kernel(GU, Act, n_rows, inter, stride_g, stride_a, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
                     INTERP: tl.constexpr):
    """Unfused activation: Act[p] = silu(GU[p, :I]) * GU[p, I:], rounded as torch rounds it."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (r < n_rows)[:, None] & (c < inter)[None, :]
    r64 = r.to(tl.int64)[:, None]
    gate = tl.load(GU + r64 * stride_g + c[None, :], mask=mask, other=0.0)
    up = tl.load(GU + r64 * stride_g + inter + c[None, :], mask=mask, other=0.0)
    dt = GU.dtype.element_ty
    g = gate.to(tl.float32)
    act = _cast(_cast(g / (1.0 + tl.exp(-g)), dt, INTERP).to(tl.float32) * up.to(tl.float32), dt, INTERP)
    tl.store(Act + r64 * stride_a + c[None, :], act, mask=mask)


# ---- combine ------------------------------------------------------------------------------------------
@_jit
def _moe_reduce_kernel(
    Y, Ids, Wts, Out,  # Y [SLICES, P, H]; Ids/Wts [T, TOP_K]; Out [T, H]
    n_tokens, hidden,
    stride_ys, stride_yp, stride_it, stride_wt, stride_ot,
    TOP_K: tl.constexpr, BLOCK_K: tl.constexpr, K_OUT: tl.constexpr, SLICES: tl.constexpr,
    SHARED: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, INTERP: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tokens
    t64 = t.to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = t_ok[:, None] & (h < hidden)[None, :]
    dt = Out.dtype.element_ty
    j = tl.arange(0, BLOCK_K)
    j_ok = j < TOP_K
    ids = tl.load(Ids + t64[:, None] * stride_it + j[None, :], mask=t_ok[:, None] & j_ok[None, :], other=0)
    wts = tl.load(Wts + t64[:, None] * stride_wt + j[None, :], mask=t_ok[:, None] & j_ok[None, :], other=0.0)
    # rank of each slot among the token's (distinct) experts: the combine runs in ascending expert id
    rank = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for jj in tl.static_range(TOP_K):
        idj = tl.load(Ids + t64 * stride_it + jj, mask=t_ok, other=0)
        rank += (idj[:, None] < ids).to(tl.int32)
    acc = tl.zeros([BLOCK_T, BLOCK_H], dtype=tl.float32)
    for r in range(TOP_K):  # runtime loops: unrolled, TOP_K x SLICES tiles in flight overflow the registers
        hit = (rank == r) & j_ok[None, :]
        slot = tl.reduce(tl.where(hit, j[None, :], 0), 1, _sum_fn)
        w = tl.reduce(tl.where(hit, wts, 0.0), 1, _sum_fn)
        # a slot on another rank's expert (id -1) was never computed: its rows are not read
        here = tl.reduce(tl.where(hit & (ids >= 0), 1, 0), 1, _sum_fn) > 0
        y_mask = mask & here[:, None]
        y_rows = Y + (t64 * K_OUT + slot)[:, None] * stride_yp + h[None, :]
        y = tl.load(y_rows, mask=y_mask, other=0.0).to(tl.float32)
        for s in range(1, SLICES):
            y += tl.load(y_rows + s * stride_ys, mask=y_mask, other=0.0).to(tl.float32)
        y = _cast(y, dt, INTERP).to(tl.float32)  # the expert's output in the model dtype, as swiglu returns it
        acc += y * w[:, None]
    out = _cast(acc, dt, INTERP)
    if SHARED:
        y_rows = Y + (t64 * K_OUT + TOP_K)[:, None] * stride_yp + h[None, :]
        ys = tl.load(y_rows, mask=mask, other=0.0).to(tl.float32)
        for s in range(1, SLICES):
            ys += tl.load(y_rows + s * stride_ys, mask=mask, other=0.0).to(tl.float32)
        out = _cast(out.to(tl.float32) + _cast(ys, dt, INTERP).to(tl.float32), dt, INTERP)
    tl.store(Out + t64[:, None] * stride_ot + h[None, :], out, mask=mask)


def _reduce(y: torch.Tensor, topk_ids, topk_weights, out: torch.Tensor, k_out: int, shared: bool) -> torch.Tensor:
    t, k = topk_ids.shape
    hidden = out.shape[1]
    interp = interpreting()
    block_t = max(1, min(next_pow2(t), 128 if interp else 16))
    block_h = min(next_pow2(hidden), 1024 if interp else 256)
    _moe_reduce_kernel[(triton.cdiv(t, block_t), triton.cdiv(hidden, block_h))](
        y, topk_ids, topk_weights, out, t, hidden, y.stride(0), y.stride(1), topk_ids.stride(0),
        topk_weights.stride(0), out.stride(0),
        TOP_K=k, BLOCK_K=next_pow2(k), K_OUT=k_out, SLICES=y.shape[0], SHARED=shared, BLOCK_T=block_t,
        BLOCK_H=block_h, INTERP=interp, num_warps=4,
        # no fused multiply-add: acc + w * y rounds the product first, as torch's separate mul and add do, so
        # the combine stays bit for bit moe_experts_torch's on a GPU too (the interpreter never fuses)
        **({} if interp else {"enable_fp_fusion": False}),
    )
    return out


# ---- wrappers -----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SharedExpert:
    """The shared expert folded in as expert id E: gate_up [2I, H], down [H, I] (+ block scales for FP8)."""

    w13: torch.Tensor
    w2: torch.Tensor
    w13_scale: torch.Tensor | None = None
    w2_scale: torch.Tensor | None = None


# Launch configurations of `_fused_moe_kernel` by token count, per device: the table a device's sweep wrote
# (kernels/moe_configs/<device>.json, `benchmarks/moe_config_sweep.py` on that GPU), else these seeds. The bf16
# seeds follow tuned configs of peers for this shape (256 experts, I 512, H 2048): BLOCK_K 128, one warpgroup,
# 2-3 stages; untimed here until a GPU sweep replaces them. Keys: the smallest token count an entry serves.
MOE_CONFIG_DIR = Path(__file__).resolve().parent / "moe_configs"
SEED_CONFIGS = {
    "bf16": {1: dict(BLOCK_M=16, BLOCK_I=64, BLOCK_K=128, num_warps=4, num_stages=2),  # 1 block: 8 slices
             64: dict(BLOCK_M=16, BLOCK_I=128, BLOCK_K=128, num_warps=4, num_stages=2),
             256: dict(BLOCK_M=32, BLOCK_I=128, BLOCK_K=128, num_warps=4, num_stages=2),
             1024: dict(BLOCK_M=64, BLOCK_I=128, BLOCK_K=64, num_warps=8, num_stages=2)},
    "fp8": {1: dict(BLOCK_M=16, BLOCK_K=128, num_warps=4, num_stages=3),  # BLOCK_I: the activation group, 128
            256: dict(BLOCK_M=32, BLOCK_K=128, num_warps=4, num_stages=3),
            1024: dict(BLOCK_M=64, BLOCK_K=128, num_warps=8, num_stages=2)},
}
_TABLES: dict[str, dict] = {}


def device_config_path(name: str) -> Path:
    return MOE_CONFIG_DIR / (re.sub(r"[^A-Za-z0-9]+", "_", name).strip("_") + ".json")


def config_table(fmt: str) -> dict[int, dict]:
    """{min tokens: launch options} for "bf16" / "fp8" on this process's GPU: the seeds, with its sweep's file
    entries over them (a sweep cut short by its time limit leaves the seeds serving the token counts it missed)."""
    if fmt not in _TABLES:
        table = dict(SEED_CONFIGS[fmt])
        if torch.cuda.is_available():
            path = device_config_path(torch.cuda.get_device_name())
            if path.exists():
                table.update({int(t): c for t, c in json.loads(path.read_text()).get(fmt, {}).items()})
        _TABLES[fmt] = table
    return _TABLES[fmt]


def fused_config(n_tokens: int, k_out: int, n_experts: int, hidden: int, inter: int, fp8: bool,
                 interp: bool) -> dict:
    """Launch configuration of `_fused_moe_kernel` (shared with the compile report of benchmarks/bench_moe.py)."""
    pairs = n_tokens * k_out
    block_i = (BLOCK if inter > BLOCK else max(16, next_pow2(inter))) if fp8 else min(128, max(16, next_pow2(inter)))
    if interp:  # the interpreter's cost is per operation: few, big programs
        block_k = BLOCK if fp8 and hidden > BLOCK else min(256, max(16, next_pow2(hidden)))
        block_i = block_i if fp8 else min(256, max(16, next_pow2(inter)))
        return dict(BLOCK_M=max(16, min(64, next_pow2(pairs))), BLOCK_I=block_i, BLOCK_K=block_k,
                    BLOCK_N=min(256, max(16, next_pow2(hidden))), num_warps=4, num_stages=1, path="interpreter")
    table = config_table("fp8" if fp8 else "bf16")
    key = max([t for t in table if t <= n_tokens], default=min(table))
    cfg = dict(dict(BLOCK_I=block_i, BLOCK_N=128), **table[key])
    if fp8:  # one activation group (128 channels) per K step, and one per intermediate slice
        cfg["BLOCK_K"] = BLOCK if hidden > BLOCK else max(16, next_pow2(hidden))
        cfg["BLOCK_I"] = block_i
    else:
        cfg["BLOCK_K"] = min(cfg["BLOCK_K"], max(16, next_pow2(hidden)))
        cfg["BLOCK_I"] = min(cfg["BLOCK_I"], max(16, next_pow2(inter)))
    cfg["path"] = "small" if cfg["BLOCK_M"] == 16 else "large"
    return cfg


def _check_inputs(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, shared):
    check_device(x)
    if x.dtype not in _SUPPORTED:
        raise TypeError(f"the Triton MoE takes float32/float16/bfloat16 activations, got {x.dtype} "
                        "(use kernel_backend='torch' for other dtypes)")
    fp8 = w13.dtype == FP8_DTYPE
    if fp8 != (w2.dtype == FP8_DTYPE) or (fp8 and (w13_scale is None or w2_scale is None)):
        raise TypeError("FP8 experts need e4m3 w13 and w2 with their block scales")
    if not fp8 and not (w13.dtype == w2.dtype == x.dtype):
        raise TypeError(f"x, w13 and w2 must share a dtype (x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype})")
    if shared is not None and (shared.w13.shape != w13.shape[1:] or shared.w2.shape != w2.shape[1:]
                               or (shared.w13.dtype == FP8_DTYPE) != fp8):
        raise ValueError("the folded shared expert must have the routed experts' shapes and weight format")
    if topk_ids.shape != topk_weights.shape:
        raise ValueError("topk_ids and topk_weights differ in shape")
    return fp8


def _rows_contig(t: torch.Tensor | None) -> torch.Tensor | None:
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def fused_moe(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_ids: torch.Tensor,  # [T, k]; -1: an expert another rank holds (skipped)
    topk_weights: torch.Tensor,  # [T, k] fp32
    *,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    shared: SharedExpert | None = None,
    method: str = "auto",  # "fused" | "unfused" | "auto"
    config: dict | None = None,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,  # FP8: x quantised already (quantize_act_triton)
) -> torch.Tensor:  # [T, H] in x.dtype
    """sum_j w_j * SwiGLU_{e_j}(x) (+ SwiGLU_shared(x)): the fused kernel (or the unfused sequence), then the
    deterministic combine. With FP8 experts x is quantised once per token before the GEMMs (`x_q` when the
    caller did it, else one launch here). Launch-only on the host (no device->host sync): CUDA-graph safe."""
    fp8 = _check_inputs(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, shared)
    t, k = topk_ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    k_out = k + int(shared is not None)
    n_exp = e + int(shared is not None)
    interp = interpreting()
    if method == "auto":
        method = "fused" if use_fused(t, k_out, e, hidden, inter, fp8, x.element_size()) else "unfused"
    if method == "unfused":
        return unfused_moe(x, w13, w2, topk_ids, topk_weights, w13_scale=w13_scale, w2_scale=w2_scale,
                           shared=shared, config=config, x_q=x_q)
    if method != "fused":
        raise ValueError(f"unknown MoE method {method!r} (fused, unfused or auto)")
    cfg = dict(fused_config(t, k_out, n_exp, hidden, inter, fp8, interp), **(config or {}))
    cfg.pop("path", None)
    cfg.setdefault("SWAP", cfg["BLOCK_M"] < 64)
    plan = moe_align(topk_ids, e, cfg["BLOCK_M"], shared=shared is not None)
    slices = triton.cdiv(inter, cfg["BLOCK_I"])
    y_dtype = torch.float32 if slices > 1 else x.dtype
    y = torch.empty(slices, plan.n_pairs, hidden, dtype=y_dtype, device=x.device)
    x = _rows_contig(x)
    w13, w2 = _rows_contig(w13), _rows_contig(w2)
    s13 = _rows_contig(w13_scale) if fp8 else w13
    s2 = _rows_contig(w2_scale) if fp8 else w2
    sh = shared or SharedExpert(w13[0], w2[0], s13[0] if fp8 else None, s2[0] if fp8 else None)
    sh13, sh2 = _rows_contig(sh.w13), _rows_contig(sh.w2)
    shs13 = _rows_contig(sh.w13_scale) if fp8 else sh13
    shs2 = _rows_contig(sh.w2_scale) if fp8 else sh2
    # the kernel addresses the shared expert with the routed experts' row strides (weights, and FP8 scales)
    pairs = [(sh13, w13), (sh2, w2)] + ([(shs13, s13), (shs2, s2)] if fp8 else [])
    if any(shared_t.stride(0) != routed.stride(1) for shared_t, routed in pairs):
        raise ValueError("the shared expert's row strides must match the routed experts'")
    if fp8 and x_q is None:
        x_q = quantize_act_triton(x)[:2]
    a, a_s = (x_q[0], x_q[1]) if fp8 else (x, x)
    _fused_moe_kernel[(plan.max_tiles * slices,)](
        a, a_s, w13, w2, s13, s2, sh13, sh2, shs13, shs2,
        plan.sorted_pairs, plan.tile_expert, plan.num_post, y,
        plan.n_pairs, hidden, inter, e if shared is not None else -1, cdiv(inter, BLOCK),
        a.stride(0), a_s.stride(0),
        w13.stride(0), w13.stride(1), w2.stride(0), w2.stride(1),
        s13.stride(0), s13.stride(1), s2.stride(0), s2.stride(1),
        y.stride(0), y.stride(1),
        K_OUT=k_out, FP8=fp8, SLICES=slices, DT=_TL_DTYPE[x.dtype], INTERP=interp, IEEE=x.dtype == torch.float32,
        **cfg,
    )
    return _reduce(y, topk_ids, topk_weights, out, k_out, shared is not None)


def unfused_moe(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
    shared: SharedExpert | None = None, config: dict | None = None,
    x_q: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """The unfused sequence over the same plan: grouped gate_up GEMM -> [P, 2I], activation -> [P, I], grouped
    down GEMM -> [P, H] (model dtype), combine. Intermediates make one round trip through memory each. FP8: x
    quantised once per token first (`x_q`, else here), the activation per K step inside the down GEMM."""
    fp8 = _check_inputs(x, w13, w2, topk_ids, topk_weights, w13_scale, w2_scale, shared)
    t, k = topk_ids.shape
    e, two_i, hidden = w13.shape
    inter = two_i // 2
    out = torch.empty(t, hidden, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    k_out = k + int(shared is not None)
    interp = interpreting()
    p = t * k_out
    rows_per_expert = p // (e + int(shared is not None))  # the M tile follows the rows an expert gets
    cfg1 = gemm_config(rows_per_expert, two_i, hidden, fp8, interp)
    cfg2 = gemm_config(rows_per_expert, hidden, inter, fp8, interp)
    if config:
        cfg1.update(config)
        cfg2.update(config)
    if interp and not (config and "BLOCK_M" in config):
        cfg1["BLOCK_M"] = cfg2["BLOCK_M"] = max(16, min(64, next_pow2(p)))
    cfg2["BLOCK_M"] = cfg1["BLOCK_M"]
    for c in (cfg1, cfg2):  # swap-AB under 64 rows, where the weight tile can be wgmma's M (>= 64 rows)
        if not (config and "SWAP" in config):
            c["SWAP"] = c["BLOCK_M"] < 64 and (interp or c["BLOCK_N"] >= 64)
    if fp8 and x_q is None:
        x_q = quantize_act_triton(x)[:2]
    plan = moe_align(topk_ids, e, cfg1["BLOCK_M"], shared=shared is not None)
    x = _rows_contig(x)
    w13, w2 = _rows_contig(w13), _rows_contig(w2)
    s13 = _rows_contig(w13_scale) if fp8 else w13
    s2 = _rows_contig(w2_scale) if fp8 else w2
    sh = shared or SharedExpert(w13[0], w2[0], s13[0] if fp8 else None, s2[0] if fp8 else None)
    sh13, sh2 = _rows_contig(sh.w13), _rows_contig(sh.w2)
    shs13 = _rows_contig(sh.w13_scale) if fp8 else sh13
    shs2 = _rows_contig(sh.w2_scale) if fp8 else sh2
    shared_id = e if shared is not None else -1
    ieee = x.dtype == torch.float32
    gu = torch.empty(p, two_i, dtype=x.dtype, device=x.device)
    a, a_s = (x_q[0], x_q[1]) if fp8 else (x, x)
    _block_gemm_kernel[(plan.max_tiles, triton.cdiv(two_i, cfg1["BLOCK_N"]))](
        a, a_s, w13, s13, gu, sh13, shs13, plan.sorted_pairs, plan.tile_expert, plan.num_post,
        p, two_i, hidden, a.stride(0), a_s.stride(0), gu.stride(0), w13.stride(0), w13.stride(1), s13.stride(0),
        s13.stride(1), inter, cdiv(inter, BLOCK), shared_id,
        A_DIV=k_out, GROUPED=True, FP8=fp8, PREQ=fp8, INTERP=interp, IEEE=ieee, **cfg1,
    )
    act = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    block_r = 64 if interp else 16
    block_c = min(next_pow2(inter), 1024 if interp else 256)
    _silu_mul_kernel[(triton.cdiv(p, block_r), triton.cdiv(inter, block_c))](
        gu, act, p, inter, gu.stride(0), act.stride(0), BLOCK_R=block_r, BLOCK_C=block_c, INTERP=interp,
        num_warps=4)
    y = torch.empty(1, p, hidden, dtype=x.dtype, device=x.device)
    _block_gemm_kernel[(plan.max_tiles, triton.cdiv(hidden, cfg2["BLOCK_N"]))](
        act, act, w2, s2, y[0], sh2, shs2, plan.sorted_pairs, plan.tile_expert, plan.num_post,
        p, hidden, inter, act.stride(0), 0, y.stride(1), w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1),
        hidden, cdiv(hidden, BLOCK), shared_id,
        A_DIV=1, GROUPED=True, FP8=fp8, PREQ=False, INTERP=interp, IEEE=ieee, **cfg2,
    )
    return _reduce(y, topk_ids, topk_weights, out, k_out, shared is not None)


def use_fused(n_tokens: int, k_out: int, n_experts: int, hidden: int, inter: int, fp8: bool, x_bytes: int) -> bool:
    """The "auto" rule: fused while its partial buffer (written + read) stays under FUSED_BUFFER_SHARE of the
    bytes of the experts the batch touches (uniform routing estimate)."""
    if interpreting():
        return True
    cfg = fused_config(n_tokens, k_out, n_experts + 1, hidden, inter, fp8, False)
    slices = cdiv(inter, cfg["BLOCK_I"])
    y_bytes = 4 if slices > 1 else x_bytes
    buffer = 2 * slices * n_tokens * k_out * hidden * y_bytes
    k = max(1, k_out - 1)
    touched = n_experts * (1 - (1 - k / n_experts) ** n_tokens) + 1
    weights = touched * 3 * hidden * inter * (1 if fp8 else x_bytes)
    return buffer <= FUSED_BUFFER_SHARE * weights


# ---- the MoE layer ------------------------------------------------------------------------------------
def folded_shared(moe: torch.nn.Module) -> SharedExpert | None:
    """The MoE's shared expert as one more expert, when it has the routed experts' shape (LLaDA2: always)."""
    sh = moe.shared
    if sh is None or tuple(sh.gate_up.shape) != tuple(moe.w13.shape[1:]) or sh.gate_up.dtype != moe.w13.dtype:
        return None
    return SharedExpert(sh.gate_up, sh.down, getattr(sh, "gate_up_scale", None), getattr(sh, "down_scale", None))


def moe_forward_triton(moe: torch.nn.Module, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The whole MoE layer for kernel_backend="triton" (`MoE.impl`): Triton router (grouped, or block routing by
    `labels`), fused experts with the shared expert folded in, deterministic combine. `moe.moe_method` (default
    "auto") picks fused/unfused."""
    c = moe.cfg
    x_q = None
    router_x = x
    if moe.w13.dtype == FP8_DTYPE and x.dtype in _SUPPORTED:
        # the experts' input quantised once per token, in the launch that also gives the router its fp32 input
        # (the conversion route_triton would do: the same values), so it costs no launch of its own
        xq, xs, router_x = quantize_act_triton(x.reshape(-1, x.shape[-1]), f32_copy=True)
        x_q = (xq, xs)
    topk_ids, topk_w = route_layer_triton(moe, router_x, labels)
    topk_ids = local_expert_ids(topk_ids, moe.first_expert, moe.w13.shape[0], c.num_experts)
    shared = folded_shared(moe)
    out = fused_moe(x, moe.w13, moe.w2, topk_ids, topk_w, w13_scale=getattr(moe, "w13_scale", None),
                    w2_scale=getattr(moe, "w2_scale", None), shared=shared,
                    method=getattr(moe, "moe_method", "auto"), x_q=x_q)
    if moe.shared is not None and shared is None:
        out = out + moe.shared(x)
    return out
