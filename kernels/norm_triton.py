"""RMSNorm with the residual add folded in, and QK-norm + partial NeoX rotary in one launch: the Triton twins of
kernels/norm.py (`add_rms_norm_torch`, `qk_norm_rope_torch`).

    add_rms_norm_triton(h, delta, weight, eps) -> (rms_norm(h + delta), h + delta)     one launch
    qk_norm_rope_triton(qkv, positions, cos, sin, ...) -> q [T, Hq, D], k [T, Hkv, D]   one launch

Same arithmetic as the twins, rounding for rounding: the residual add in the model dtype, the variance in fp32, the
normalised row rounded to the model dtype before the weight multiplies it, the rotary's products and sums each
rounded in fp32 (no fused multiply-add: compiled with enable_fp_fusion=False), 1 / sqrt and the mean divided
correctly rounded. The only difference is the order of the variance's sum (a tree here, torch's own order
there): a last-bit difference in fp32 at most; on inputs whose squares sum exactly the results are bit for bit
the twins' (tests/test_norm_kernels.py). The rotary reads a cos/sin table built once at load (`rotary_table`:
the twin's float64 angles for every position).
"""

from __future__ import annotations

import torch

from redraft.kernels.fp8_triton import HAS_TRITON, _cast, _jit, _sum_fn, check_device, interpreting, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl
else:  # pragma: no cover
    triton = tl = None

__all__ = ["add_rms_norm_triton", "qk_norm_rope_triton"]

_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def _launch_opts(interp: bool) -> dict:
    return {} if interp else {"enable_fp_fusion": False, "num_warps": 4}


@_jit
def _rms_scale(ss, n_cols, eps):
    """1 / sqrt(ss / n + eps), each step correctly rounded (as torch's mean and rsqrt on the CPU)."""
    return tl.math.div_rn(1.0, tl.math.sqrt_rn(tl.math.div_rn(ss, n_cols * 1.0) + eps))


@_jit
def _add_rms_norm_kernel(
    X, Delta, W, Out, Res,  # [R, N] h, [R, N] delta, [N] weight, [R, N] out, [R, N] h + delta
    n_rows, n_cols, stride_x, stride_d, stride_o, stride_r, eps,
    HAS_DELTA: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    r64 = rows.to(tl.int64)[:, None]
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + r64 * stride_x + cols[None, :], mask=mask, other=0.0)
    dt: tl.constexpr = X.dtype.element_ty
    if HAS_DELTA:  # the residual add in the model dtype (computed in fp32, rounded once, as torch's add)
        d = tl.load(Delta + r64 * stride_d + cols[None, :], mask=mask, other=0.0)
        h = _cast(x.to(tl.float32) + d.to(tl.float32), dt, INTERP)
        tl.store(Res + r64 * stride_r + cols[None, :], h, mask=mask)
    else:
        h = x
    hf = h.to(tl.float32)
    r = _rms_scale(tl.reduce(hf * hf, 1, _sum_fn), n_cols, eps)  # [BLOCK_R]
    y = _cast(hf * r[:, None], dt, INTERP).to(tl.float32)
    w = tl.load(W + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    out_dt: tl.constexpr = Out.dtype.element_ty
    tl.store(Out + r64 * stride_o + cols[None, :], _cast(w[None, :] * y, out_dt, INTERP), mask=mask)


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta) in one launch; delta None: (rms_norm(h), h). h: [..., N]."""
    check_device(h)
    if h.dtype not in _SUPPORTED:
        raise TypeError(f"the Triton norm takes float32/float16/bfloat16, got {h.dtype}")
    shape, n = h.shape, h.shape[-1]
    x = h.reshape(-1, n)
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(shape, dtype=torch.promote_types(weight.dtype, h.dtype), device=h.device)
    res = torch.empty(shape, dtype=h.dtype, device=h.device) if delta is not None else h
    rows = x.shape[0]
    if rows == 0:
        return out, res
    d = x if delta is None else delta.reshape(-1, n)
    d = d if d.stride(-1) == 1 else d.contiguous()
    interp = interpreting()
    block_n = next_pow2(n)
    block_r = max(1, min(next_pow2(rows), 64 if interp else max(1, 2048 // block_n)))
    o2, r2 = out.view(-1, n), res.view(-1, n) if delta is not None else x
    _add_rms_norm_kernel[(triton.cdiv(rows, block_r),)](
        x, d, weight, o2, r2, rows, n, x.stride(0), d.stride(0), o2.stride(0), r2.stride(0), float(eps),
        HAS_DELTA=delta is not None, BLOCK_R=block_r, BLOCK_N=block_n, INTERP=interp, **_launch_opts(interp))
    return out, res


@_jit
def _norm_part(x, w, r, dt: tl.constexpr, NORM: tl.constexpr, INTERP: tl.constexpr):
    """One slice of a head's row, normalised as rms_norm_torch does (w * (x * r rounded)), in fp32."""
    if NORM:
        return _cast(w[None, :] * _cast(x * r[:, None], dt, INTERP).to(tl.float32), dt, INTERP).to(tl.float32)
    return x


@_jit
def _qk_norm_rope_kernel(
    QKV, Pos, Cos, Sin, QW, KW, QOut, KOut,  # [T, (Hq+2Hkv) D], [T], [P, HALF] x2, [D] x2, [T, Hq, D], [T, Hkv, D]
    n_tok, stride_t, stride_qo, stride_ko, eps,
    NQ: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, REST: tl.constexpr,
    BLOCK_REST: tl.constexpr, NORM: tl.constexpr, BLOCK_T: tl.constexpr, INTERP: tl.constexpr,
):
    head = tl.program_id(1)  # q heads first, then k heads, as they sit in the packed qkv row
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < n_tok
    t64 = t.to(tl.int64)[:, None]
    c = tl.arange(0, BLOCK_H)
    cr = tl.arange(0, BLOCK_REST)
    m1 = t_ok[:, None] & (c < HALF)[None, :]
    mr = t_ok[:, None] & (cr < REST)[None, :]
    row = QKV + t64 * stride_t + head * HEAD_DIM
    dt: tl.constexpr = QKV.dtype.element_ty
    x1 = tl.load(row + c[None, :], mask=m1, other=0.0).to(tl.float32)  # rotated first half
    x2 = tl.load(row + HALF + c[None, :], mask=m1, other=0.0).to(tl.float32)  # rotated second half
    xr = tl.load(row + 2 * HALF + cr[None, :], mask=mr, other=0.0).to(tl.float32)  # not rotated
    if head < NQ:
        wp = QW
        out = QOut + t64 * stride_qo + head * HEAD_DIM
    else:
        wp = KW
        out = KOut + t64 * stride_ko + (head - NQ) * HEAD_DIM
    r = tl.zeros([BLOCK_T], dtype=tl.float32)
    if NORM:
        ss = tl.reduce(x1 * x1, 1, _sum_fn) + tl.reduce(x2 * x2, 1, _sum_fn) + tl.reduce(xr * xr, 1, _sum_fn)
        r = _rms_scale(ss, HEAD_DIM, eps)
    w1 = tl.load(wp + c, mask=c < HALF, other=0.0).to(tl.float32)
    w2 = tl.load(wp + HALF + c, mask=c < HALF, other=0.0).to(tl.float32)
    wr = tl.load(wp + 2 * HALF + cr, mask=cr < REST, other=0.0).to(tl.float32)
    y1 = _norm_part(x1, w1, r, dt, NORM, INTERP)
    y2 = _norm_part(x2, w2, r, dt, NORM, INTERP)
    yr = _norm_part(xr, wr, r, dt, NORM, INTERP)
    pos = tl.load(Pos + t, mask=t_ok, other=0).to(tl.int64)[:, None]
    cos = tl.load(Cos + pos * HALF + c[None, :], mask=m1, other=0.0)
    sin = tl.load(Sin + pos * HALF + c[None, :], mask=m1, other=0.0)
    tl.store(out + c[None, :], _cast(y1 * cos - y2 * sin, dt, INTERP), mask=m1)
    tl.store(out + HALF + c[None, :], _cast(y2 * cos + y1 * sin, dt, INTERP), mask=m1)
    tl.store(out + 2 * HALF + cr[None, :], _cast(yr, dt, INTERP), mask=mr)


def qk_norm_rope_triton(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        n_q: int, n_kv: int, head_dim: int, rotary_dim: int, q_weight: torch.Tensor | None,
                        k_weight: torch.Tensor | None, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Twin of `qk_norm_rope_torch` in one launch: q [T, Hq, D], k [T, Hkv, D] (new, contiguous) from the packed
    qkv [T, (Hq + 2 Hkv) D]; cos, sin: `rotary_table`'s [max_positions, rotary_dim / 2] fp32."""
    check_device(qkv)
    if qkv.dtype not in _SUPPORTED:
        raise TypeError(f"the Triton QK-norm/rotary takes float32/float16/bfloat16, got {qkv.dtype}")
    if (q_weight is not None and q_weight.dtype != qkv.dtype) or cos.dtype != torch.float32:
        raise TypeError("the norm weights must have the activations' dtype and the rotary table must be fp32")
    t = qkv.shape[0]
    q = torch.empty(t, n_q, head_dim, dtype=qkv.dtype, device=qkv.device)
    k = torch.empty(t, n_kv, head_dim, dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q, k
    qkv = qkv if qkv.stride(-1) == 1 else qkv.contiguous()
    half = rotary_dim // 2
    rest = head_dim - rotary_dim
    interp = interpreting()
    block_t = max(1, min(next_pow2(t), 64 if interp else 16))
    norm = q_weight is not None
    _qk_norm_rope_kernel[(triton.cdiv(t, block_t), n_q + n_kv)](
        qkv, positions, cos, sin, q_weight if norm else cos, k_weight if norm else cos, q, k,
        t, qkv.stride(0), q.stride(0), k.stride(0), float(eps),
        NQ=n_q, HEAD_DIM=head_dim, HALF=half, BLOCK_H=max(1, next_pow2(half)), REST=rest,
        BLOCK_REST=max(1, next_pow2(max(rest, 1))), NORM=norm, BLOCK_T=block_t, INTERP=interp,
        **_launch_opts(interp))
    return q, k
