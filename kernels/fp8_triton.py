"""Triton block GEMM: bf16/fp16/fp32 or W8A8 with DeepSeek 128x128 weight blocks; dense or grouped by expert.

    fp8_linear_triton(x, weight, scale, seg_rows=None, bias=None) -> y      twin: kernels/fp8.py fp8_linear_torch
    quantize_act_triton(x, f32_copy=False) -> (q, scale, x_f32)           twin: kernels/fp8.py quantize_act

`_block_gemm_kernel` computes C[row] = A[row // A_DIV] @ W[e]^T for a tile of rows and a tile of output columns.
Dense (GROUPED=False): rows are consecutive, one weight. Grouped (the unfused MoE path in kernels/moe_triton.py):
rows come from the expert-sorted, tile-padded pair list and each tile reads its expert's weight (the shared
expert, id `shared_id`, has its own tensors). With FP8=True the weight is e4m3 and the activation tile of every
128-deep K step is e4m3 too: quantised in registers per row (= per token per 128-channel group, as
`quantize_act`), or read already quantised (PREQ: `quantize_act_triton` ran once per token before the GEMM,
so no program re-quantises a row), so the product runs on e4m3 operands with an fp32 accumulator and both scales
are applied per K step:
    acc += dot(q_a, q_w^T) * s_a[:, None] * s_w[None, :]
K steps are 128 deep (or all of K when K <= 128), so every step is one activation group and one weight block
column; weight rows pick their block row through the segment rule of kernels/fp8.py (`seg_rows`).

Swap-AB (SWAP, tiles under 64 rows): Hopper's wgmma takes M in multiples of 64 per warpgroup and N from 8 to 256,
so a decode-size tile of 16 or 32 rows as M falls back to mma.sync (HMMA; with e4m3 operands every weight element
is widened to fp16 first). Swapped, the weight tile is the M operand and the rows are N:
    acc^T [BLOCK_N, BLOCK_M] += dot(w, a^T)        (then transposed once, before the store)
which is wgmma (HGMMA, QGMMA on e4m3 x e4m3) with no conversion. Only the order of the sums inside one K step
may differ (the tensor cores' own), as between any two GEMM tilings.

Interpreter (TRITON_INTERPRET=1, CPU; Triton 3.9): dot operands are upcast to fp32 (its tl.dot is wrong on
bf16); its fp32 -> e4m3 cast rounds wrongly when the mantissa carries into the next binade (7.98 -> 4 instead
of 8), so `_e4m3_grid` rounds to the e4m3 grid in fp32 instead; its fp32 -> bf16 cast truncates (half of all
values land one ulp off), so `_cast` rounds to nearest even first. Both give what the GPU's cvt.rn gives.
"""

from __future__ import annotations

import torch

from redraft.kernels.attention_triton import check_device, interpreting, next_pow2  # noqa: F401 - re-exported
from redraft.kernels.fp8 import BLOCK, FP8_DTYPE, cdiv  # (importing redraft.kernels settles TRITON_INTERPRET)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - the wrappers raise a clear error when called
    triton = tl = None
    HAS_TRITON = False


def _jit(fn):
    return triton.jit(fn) if HAS_TRITON else fn


FP8_MAX = 448.0
ACT_EPS = 1e-10


# ---- shared device helpers ----------------------------------------------------------------------------
# Combine functions for tl.reduce: Triton's own, which the interpreter maps onto numpy (a combine function of
# our own would run element by element in Python there: seconds per reduction); compiled, they are plain
# max/min/add. tl.max/tl.sum wrap the same reductions but cost ~1 ms per call when interpreted.
if HAS_TRITON:
    _max_fn = tl.standard._elementwise_max
    _min_fn = tl.standard._elementwise_min
    _sum_fn = tl.standard._sum_combine
else:  # pragma: no cover
    _max_fn = _min_fn = _sum_fn = None


@_jit
def _round_bf16(v):
    """fp32 -> fp32 rounded to bfloat16, nearest even (the interpreter's own bf16 cast truncates)."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    return (bits & 0xFFFF0000).to(tl.float32, bitcast=True)


@_jit
def _cast(v, dt: tl.constexpr, INTERP: tl.constexpr):
    """v.to(dt), rounding to nearest even in the interpreter too."""
    if INTERP and dt == tl.bfloat16:
        v = _round_bf16(v.to(tl.float32))
    return v.to(dt)


@_jit
def _e4m3_grid(v):
    """Round fp32 values (|v| <= 448) to the nearest e4m3 value, ties to even, staying in fp32 (interpreter)."""
    bits = v.to(tl.int32, bitcast=True)
    exp = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9
    step = ((exp - 3) << 23).to(tl.float32, bitcast=True)  # 3 mantissa bits
    y = v / step  # exact (a power of two); |y| < 16
    r = tl.abs(((y + 12582912.0) - 12582912.0) * step)  # 1.5 * 2^23: round half to even in fp32
    return tl.where(bits < 0, -r, r)  # the sign of v, zeros included (-0.0 stays -0.0, as the GPU's cvt.rn)


@_jit
def _quant_groups(a, AXIS: tl.constexpr, INTERP: tl.constexpr):
    """a fp32 tile, one quantisation group per slice along AXIS (1: a [M, G] row per group, 0: a [G, N] column per
    group, the transposed tile of a swapped dot) -> (q e4m3 (fp32 on the e4m3 grid when interpreting) of a's
    shape, scale [M] or [N] fp32) with a ~= q * scale. Both forms do the same arithmetic, so give the same bits."""
    amax = tl.reduce(tl.abs(a), AXIS, _max_fn)
    scale = tl.maximum(amax, 1e-10) / 448.0
    v = tl.minimum(tl.maximum(a / tl.expand_dims(scale, AXIS), -448.0), 448.0)
    if INTERP:
        q = _e4m3_grid(v)
    else:
        q = v.to(tl.float8e4nv)
    return q, scale


@_jit
def _quant_rows(a, INTERP: tl.constexpr):
    return _quant_groups(a, 1, INTERP)


@_jit
def _quant_cols(a, INTERP: tl.constexpr):
    return _quant_groups(a, 0, INTERP)


@_jit
def _dot(a, b, INTERP: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] with an fp32 accumulator: exact fp32 products for fp32 operands (IEEE), the
    tensor cores' own precision otherwise; upcast to fp32 when interpreting (its tl.dot is wrong on bf16)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


# ---- activations quantised once per token ---------------------------------------------------------------
@_jit
def _quant_act_kernel(
    X, XF, Q, S,  # [M, K] activations; [M, K] fp32 copy (F32 only); [M, K] e4m3 out; [M, KB] fp32 scales out
    n_rows, n_cols, stride_x, stride_f, stride_q, stride_s,
    F32: tl.constexpr, BLOCK_R: tl.constexpr, INTERP: tl.constexpr,
):
    """One program per (BLOCK_R rows, 128-channel group): `quantize_act`'s numbers, and the rows in fp32 when
    F32 (the router's input: a bf16 -> fp32 conversion is exact)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * 128 + tl.arange(0, 128)
    r64 = rows.to(tl.int64)[:, None]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if F32:
        tl.store(XF + r64 * stride_f + cols[None, :], x, mask=mask)
    q, scale = _quant_rows(x, INTERP)  # masked columns are zeros: the twin's zero padding of a partial group
    tl.store(Q + r64 * stride_q + cols[None, :], q.to(Q.dtype.element_ty), mask=mask)
    tl.store(S + rows.to(tl.int64) * stride_s + tl.program_id(1), scale, mask=rows < n_rows)


def quantize_act_triton(x: torch.Tensor, f32_copy: bool = False
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, ceil(K/128)] fp32, x in fp32 or None): `quantize_act` (twin:
    kernels/fp8.py), bit for bit, in one launch. With f32_copy the same launch also writes x in fp32 (x itself
    when it is fp32 already): the MoE's router reads that, so quantising the experts' input costs no launch of
    its own (it replaces the router input's conversion). Launch-only on the host (CUDA-graph safe)."""
    check_device(x)
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"quantize_act_triton takes float32/float16/bfloat16 activations, got {x.dtype}")
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, cdiv(k, BLOCK), dtype=torch.float32, device=x.device)
    write_f32 = f32_copy and x.dtype != torch.float32
    xf = torch.empty(m, k, dtype=torch.float32, device=x.device) if write_f32 else (x if f32_copy else None)
    if m:
        interp = interpreting()
        block_r = max(1, min(next_pow2(m), 64 if interp else 16))
        f = xf if write_f32 else x
        _quant_act_kernel[(triton.cdiv(m, block_r), cdiv(k, BLOCK))](
            x, f, q, scale, m, k, x.stride(0), f.stride(0), q.stride(0), scale.stride(0),
            F32=write_f32, BLOCK_R=block_r, INTERP=interp, num_warps=4)
    return q, scale, xf


# ---- the block GEMM -----------------------------------------------------------------------------------
@_jit
def _block_gemm_kernel(
    A,  # [rows_a, K] activations (row stride stride_am, inner stride 1); e4m3 when PREQ
    AS,  # PREQ: [rows_a, KB] fp32 activation scales (row stride stride_asm); any tensor otherwise
    W,  # [E, N, K] or [N, K] weights (model dtype or e4m3), inner stride 1
    WS,  # [E, NB, KB] / [NB, KB] fp32 block scales (FP8); any tensor otherwise
    C,  # [M, N] output (row stride stride_cm)
    WSH, WSSH,  # grouped: the shared expert's weight [N, K] and scales (expert id == shared_id)
    Sorted, TileExpert, NumPost,  # grouped: row of each tile slot (>= M: padding), expert of each tile, #slots used
    M, N, K,
    stride_am, stride_asm, stride_cm,
    stride_we, stride_wn,
    stride_se, stride_sn,
    seg_rows, seg_blocks, shared_id,
    A_DIV: tl.constexpr,  # A row = C row // A_DIV (grouped gate/up: pairs -> tokens)
    GROUPED: tl.constexpr,
    FP8: tl.constexpr,
    PREQ: tl.constexpr,  # FP8 with A quantised already (quantize_act_triton): no quantisation in the K loop
    SWAP: tl.constexpr,  # dot(w, a^T): the weight tile is the MMA's M operand (tiles under 64 rows)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INTERP: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if GROUPED:
        live = pid_m * BLOCK_M < tl.load(NumPost)
    else:
        live = pid_m * BLOCK_M < M
    if live:
        if GROUPED:
            expert = tl.load(TileExpert + pid_m)
            rows = tl.load(Sorted + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            if expert == shared_id:
                w_base = WSH
                s_base = WSSH
            else:
                w_base = W + expert.to(tl.int64) * stride_we
                s_base = WS + expert.to(tl.int64) * stride_se
        else:
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
            w_base = W
            s_base = WS
        row_ok = rows < M
        a_rows = rows // A_DIV
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        s_row = (n // seg_rows) * seg_blocks + (n % seg_rows) // 128
        if SWAP:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # C^T tile
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + tl.arange(0, BLOCK_K)
            k_ok = kk < K
            a = tl.load(A + a_rows[:, None] * stride_am + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_base + n[:, None].to(tl.int64) * stride_wn + kk[None, :],
                        mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            if FP8:
                if PREQ:
                    a_s = tl.load(AS + a_rows * stride_asm + k0 // 128, mask=row_ok, other=0.0)
                else:
                    a, a_s = _quant_rows(a.to(tl.float32), INTERP)
                w_s = tl.load(s_base + s_row * stride_sn + k0 // 128, mask=n_ok, other=0.0)
                if SWAP:
                    acc += _dot(w, tl.trans(a), INTERP, False) * a_s[None, :] * w_s[:, None]
                else:
                    acc += _dot(a, tl.trans(w), INTERP, False) * a_s[:, None] * w_s[None, :]
            elif SWAP:
                acc += _dot(w, tl.trans(a), INTERP, IEEE)
            else:
                acc += _dot(a, tl.trans(w), INTERP, IEEE)
        if SWAP:
            out = tl.trans(acc)
        else:
            out = acc
        tl.store(C + rows[:, None] * stride_cm + n[None, :], _cast(out, C.dtype.element_ty, INTERP),
                 mask=row_ok[:, None] & n_ok[None, :])


def gemm_config(m: int, n: int, k: int, fp8: bool, interp: bool) -> dict:
    """Tile sizes of `_block_gemm_kernel`. K steps are 128 deep for FP8 (one activation group each). GPU: a
    small M tile for decode-size batches (weights dominate; 16 rows is the MMA minimum), 64 rows above."""
    if fp8:
        block_k = BLOCK if k > BLOCK else max(16, next_pow2(k))
    else:
        block_k = min(64, max(16, next_pow2(k))) if not interp else min(128, max(16, next_pow2(k)))
    if interp:
        block_m = max(16, min(128, next_pow2(m)))
        return dict(BLOCK_M=block_m, BLOCK_N=max(16, min(128, next_pow2(n))), BLOCK_K=block_k,
                    SWAP=block_m < 64, num_warps=4, num_stages=1)
    block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    block_n = 128 if n >= 128 else max(16, next_pow2(n))
    if m <= 64 and n >= 1024:  # decode: more programs over N to stream the weight from more SMs
        block_n = 64
    # swap-AB under 64 rows: wgmma's M is 64 per warpgroup, so a 16/32-row tile as M runs on mma.sync (and, in
    # FP8, widens every e4m3 weight to fp16 for it); as N (8..256) it runs on wgmma with the weight as M
    swap = block_m < 64 and block_n >= 64
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SWAP=swap, num_warps=4,
                num_stages=3 if fp8 else 4)


def fp8_linear_triton(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, seg_rows: int | None = None,
                      bias: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear, y = x @ W^T with activations quantised per token per 128 channels in the kernel.
    x [..., K] (fp32/fp16/bf16), weight [N, K] e4m3, scale [ceil(N/128) (per segment), ceil(K/128)] fp32.
    One launch; launch-only on the host (no sync), so it can be captured in a CUDA graph."""
    check_device(x)
    if weight.dtype != FP8_DTYPE:
        raise TypeError(f"fp8_linear_triton takes an e4m3 weight, got {weight.dtype}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton FP8 GEMM takes float32/float16/bfloat16 activations, got {x.dtype}")
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        weight = weight if weight.stride(-1) == 1 else weight.contiguous()
        scale = scale if scale.stride(-1) == 1 else scale.contiguous()
        r = seg_rows or n
        cfg = gemm_config(m, n, k, fp8=True, interp=interpreting())
        grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _block_gemm_kernel[grid](
            x2, scale, weight, scale, out, weight, scale, scale, scale, scale,
            m, n, k, x2.stride(0), 0, out.stride(0), 0, weight.stride(0), 0, scale.stride(0),
            r, cdiv(r, BLOCK), -1,
            A_DIV=1, GROUPED=False, FP8=True, PREQ=False, INTERP=interpreting(), IEEE=False, **cfg,
        )
    y = out.reshape(*lead, n)
    if bias is not None:
        y = y + bias
    return y
