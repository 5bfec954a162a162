"""The lm_head fused with the decoding step's reduction: Triton twin of `vocab_top1.lm_head_top1_torch`.

One program computes a [BLOCK_R rows x BLOCK_V tokens] tile of logits (a K loop of `tl.dot` over the hidden
size, fp32 accumulation), rounds it to the model's dtype as the lm_head's output would be, drops the MASK
column, and reduces the tile to three numbers per row: its best logit, that token's id (lowest on ties) and
sum(exp(logit - best)). The tile never leaves the chip; what is written is [R, V / BLOCK_V] partials, folded
by `Top1Partials.combine` (a few hundred numbers per row). Rows are the query positions the step decides on.

Interpreted on CPU (TRITON_INTERPRET=1) the dot operands are upcast to fp32: the interpreter's bf16 `tl.dot`
is wrong (Triton 3.9), and its fp32 -> bf16 cast truncates where torch rounds to nearest even (docs/gpu.md), so
interpreted bf16 tiles differ from torch's logits by an ulp at times; the tests bound it. Compiled, the accumulation order is the tensor cores', not cuBLAS's, so a logit can
round to a neighbouring bf16 value where the full path's does not: see docs/gpu.md before relying on ties.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from redraft.kernels.attention_triton import HAS_TRITON, check_device, interpreting, next_pow2
from redraft.kernels.moe import compute_dtype
from redraft.kernels.vocab_top1 import Top1Partials, excluded_ids

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _lm_head_top1_kernel(
        h_ptr, w_ptr, best_ptr, ids_ptr, sum_ptr,
        R, V, H, ex0, ex1, ex2, stride_h, stride_w, stride_part,
        BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_H: tl.constexpr,
        ROUND_TO: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
    ):
        pid_r, pid_v = tl.program_id(0), tl.program_id(1)
        rows = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)  # [BR]
        cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # [BV] token ids
        acc = tl.zeros((BLOCK_R, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_H):
            ks = k0 + tl.arange(0, BLOCK_H)
            h = tl.load(h_ptr + rows[:, None] * stride_h + ks[None, :],
                        mask=(rows[:, None] < R) & (ks[None, :] < H), other=0.0)  # [BR, BH]
            w = tl.load(w_ptr + cols[:, None] * stride_w + ks[None, :],
                        mask=(cols[:, None] < V) & (ks[None, :] < H), other=0.0)  # [BV, BH]
            if UPCAST:
                h, w = h.to(tl.float32), w.to(tl.float32)
            acc += tl.dot(h, tl.trans(w), input_precision=PRECISION)
        logits = acc.to(ROUND_TO).to(tl.float32)  # what the lm_head's output holds, widened
        drop = (cols >= V) | (cols == ex0) | (cols == ex1) | (cols == ex2)  # (-1: no id)
        logits = tl.where(drop[None, :], float("-inf"), logits)  # [BR, BV]
        best = tl.max(logits, 1)  # [BR]
        arg = tl.argmax(logits, 1, tie_break_left=True)
        safe = tl.where(best == float("-inf"), 0.0, best)
        total = tl.sum(tl.exp(logits - safe[:, None]), 1)
        out = rows * stride_part + pid_v
        tl.store(best_ptr + out, best, mask=rows < R)
        tl.store(ids_ptr + out, (arg + pid_v * BLOCK_V).to(tl.int64), mask=rows < R)
        tl.store(sum_ptr + out, total, mask=rows < R)


_ROUND = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def lm_head_top1_triton(hidden: torch.Tensor, weight: torch.Tensor, exclude: int | Sequence[int] | None,
                        vocab_offset: int = 0, block_v: int = 128) -> Top1Partials:
    """hidden [R, H], weight [V, H] (bf16, fp16 or fp32) -> one partial per BLOCK_V tokens, ids global; at most
    three `exclude` ids (MASK, and DELETE and SPLIT on a LLaDA2.2 checkpoint's 2.1-step rows)."""
    check_device(hidden)
    if hidden.dtype not in _ROUND or weight.dtype != hidden.dtype:
        raise TypeError(f"lm_head_top1_triton takes bf16/fp16/fp32 operands of one dtype, got "
                        f"{hidden.dtype} and {weight.dtype}")
    hidden, weight = hidden.contiguous(), weight.contiguous()
    r, h = hidden.shape
    v = weight.shape[0]
    parts = triton.cdiv(v, block_v)
    best = torch.empty(r, parts, dtype=torch.float32, device=hidden.device)
    ids = torch.empty(r, parts, dtype=torch.int64, device=hidden.device)
    sumexp = torch.empty_like(best)
    block_r = min(64, max(16, next_pow2(r)))
    block_h = min(64, max(16, next_pow2(h)))
    gone = [t - vocab_offset for t in excluded_ids(exclude)]
    if len(gone) > 3:
        raise ValueError(f"lm_head_top1_triton leaves out at most 3 ids, got {len(gone)}")
    ex0, ex1, ex2 = gone + [-1] * (3 - len(gone))
    grid = (triton.cdiv(r, block_r), parts)
    _lm_head_top1_kernel[grid](
        hidden, weight, best, ids, sumexp, r, v, h, ex0, ex1, ex2, hidden.stride(0), weight.stride(0), parts,
        BLOCK_R=block_r, BLOCK_V=block_v, BLOCK_H=block_h,
        ROUND_TO=getattr(tl, _ROUND[hidden.dtype]), UPCAST=interpreting(),
        PRECISION="ieee" if interpreting() or hidden.dtype == torch.float32 else "tf32",  # fp32: no tf32 rounding
    )
    cdt = compute_dtype(hidden.dtype)
    return Top1Partials(best=best.to(cdt), ids=ids + vocab_offset, sumexp=sumexp.to(cdt))
