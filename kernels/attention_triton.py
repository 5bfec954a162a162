"""Block-causal paged attention in Triton: the fast twin of `paged_attention_torch` (kernels/attention.py).

Same signature, same semantics:
    paged_attention_triton(q, k, v, k_cache, v_cache, meta) -> out
        q: [T, Hq, D] the flat ragged batch of query tokens (request r owns rows cu_q[r] .. cu_q[r+1]-1,
           positions q_starts[r] .. q_starts[r] + q_lens[r] - 1)
        k, v: [T, Hkv, D] the keys/values of those tokens, stored into their cache rows (slot_mapping)
        k_cache, v_cache: [P, B, Hkv, D] one page per block of B tokens
        out: [T, Hq, D]
    key k is visible to query q iff k // B <= horizon(q) and k < kv_len = q_start + q_len, where horizon(q)
    is the last block for a query in the request's open MBE window (q >= window_start) and q // B otherwise
    (the rule of kernels/attention.py `visible`).

One launch, `_block_causal_attn_kernel`, one program per (request, tile of BLOCK_M query tokens, KV head):
  1. it stores its tile's new K/V (head h) into their pages;
  2. it packs all GROUP = Hq / Hkv query heads of its KV head into one [BLOCK_M * GROUP, D] tile, so every K/V
     tile is read once for the whole group (GQA), and runs an online softmax in fp32 (exp2 domain) over
     a) the cached prefix [0, q_start), read through the page table BLOCK_N keys at a time, all visible;
     b) the window's own keys, read straight from k/v (no program waits for another's store), under the
        rule, up to the end of the tile's last query's horizon (later blocks are invisible to the whole tile,
        so they are never read).
It serves one-pass prompt prefill (a window of many blocks), the denoising step (one block) and multi-block
windows alike; nothing in it depends on the kind of forward. `write_kv_triton` is the store alone.

CPU: Triton's interpreter runs the same kernels on CPU tensors. Whether Triton interprets is decided once per
process, when `triton` is first imported (its own library functions are wrapped then), by TRITON_INTERPRET;
`redraft/kernels/__init__.py` sets it on machines without a CUDA device, early enough. Interpreted kernels
take CPU tensors; compiled ones need CUDA tensors (a clear error otherwise). The interpreter's `tl.dot` is
wrong on bfloat16 operands (Triton 3.9), so interpreted programs upcast the dot operands to fp32 (`INTERP`).
"""

from __future__ import annotations

import math

import torch

from redraft.kernels.attention import AttentionMetadata  # (importing redraft.kernels settles TRITON_INTERPRET)

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - the wrapper raises a clear error when called
    triton = tl = None
    HAS_TRITON = False

__all__ = ["paged_attention_triton", "write_kv_triton", "interpreting", "check_device", "next_pow2", "HAS_TRITON"]


def _triton_interprets() -> bool:
    """Did this process import triton in interpreter mode? (Its library functions were wrapped then.)"""
    if not HAS_TRITON:
        return False
    try:
        from triton.runtime.interpreter import InterpretedFunction

        return isinstance(tl.zeros, InterpretedFunction)
    except (ImportError, AttributeError):  # pragma: no cover - other Triton versions
        return bool(triton.knobs.runtime.interpret)


_INTERPRET = _triton_interprets()


def interpreting() -> bool:
    """True when this process runs Triton kernels in the interpreter."""
    return _INTERPRET


def check_device(t: torch.Tensor) -> None:
    """Every Triton wrapper's first check: triton is installed, and `t` lives where this process runs kernels."""
    if not HAS_TRITON:
        raise ImportError("kernel_backend='triton' needs the `triton` package (pip install 'redraft[triton]')")
    if t.device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"the Triton kernels got {t.device.type} tensors, but this process imported triton without "
            "TRITON_INTERPRET=1: set TRITON_INTERPRET=1 before anything imports triton to run them on CPU"
        )


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


_LOG2E = 1.4426950408889634


def _write_kv_kernel(
    K, V,  # [T, Hkv * D] rows (token stride given; each row contiguous)
    KC, VC,  # caches viewed as [P * B, Hkv * D] (contiguous)
    Slots,  # [T] int64 flat cache row of each token; < 0: skip
    n_tokens,
    stride_kt, stride_vt,
    ROW: tl.constexpr,  # Hkv * D
    BLOCK_T: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)  # [BLOCK_T] token index
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)  # [BLOCK_C] column in the [Hkv * D] row
    t_ok = t < n_tokens
    slot = tl.load(Slots + t, mask=t_ok, other=-1).to(tl.int64)
    ok = (t_ok & (slot >= 0))[:, None] & (c < ROW)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(K + t64[:, None] * stride_kt + c[None, :], mask=ok)
    v = tl.load(V + t64[:, None] * stride_vt + c[None, :], mask=ok)
    dst = slot[:, None] * ROW + c[None, :]
    tl.store(KC + dst, k.to(KC.dtype.element_ty), mask=ok)
    tl.store(VC + dst, v.to(VC.dtype.element_ty), mask=ok)


def _block_causal_attn_kernel(
    Q,  # [T, Hq, D]
    K, V,  # [T, Hkv, D] the window's new keys/values
    KC, VC,  # [P * B, Hkv, D] cache rows
    Out,  # [T, Hq, D]
    PartO, PartML,  # SPLITS > 1: [SPLITS, T, Hq, D] fp32 unnormalised partial outputs, [SPLITS, 2, T, Hq] fp32 (max, sum)
    Slots,  # [T] int64 cache row each new K/V goes to (< 0: not stored)
    PageTable,  # [N, max_pages] int64
    QStarts, QLens, CuQ,  # [N], [N], [N + 1] (kv_len = q_start + q_len)
    WinStarts,  # [N] first position of the open MBE window (kv_len: none)
    qk_scale,  # softmax scale * log2(e)
    stride_qt, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_ot, stride_oh,
    stride_cs, stride_ch,  # cache: per row (slot), per head
    stride_pt,  # page table: per request
    stride_ps, stride_pml,  # partials: per split (PartO), per split (PartML)
    n_rows,  # T * Hq: the partials' (token, head) rows
    SPLITS: tl.constexpr,  # key ranges of the cached prefix, one program each (split-KV); 1: no partials
    HQ: tl.constexpr,  # query heads
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_DIM rounded up to a power of two
    PAGE: tl.constexpr,  # tokens per page = the diffusion block size
    BLOCK_M: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # keys per iteration
    INTERP: tl.constexpr,  # interpreter: dot operands in fp32, builtin reductions
    IEEE: tl.constexpr,  # fp32 inputs: exact fp32 dot (no tf32)
):
    r = tl.program_id(0)  # request
    tile = tl.program_id(1)  # tile of BLOCK_M query tokens inside the request's window
    h = tl.program_id(2) // SPLITS  # KV head
    split = tl.program_id(2) % SPLITS  # which range of the cached prefix (the last one also does the window)
    q_len = tl.load(QLens + r)
    m0 = tile * BLOCK_M
    if m0 < q_len:  # the grid covers the longest window; shorter ones leave programs idle
        q_start = tl.load(QStarts + r)
        tok0 = tl.load(CuQ + r)  # int64, like every index tensor: addresses below are computed in int64
        d = tl.arange(0, BLOCK_D)
        cache_ty = KC.dtype.element_ty
        Kh = K + h * stride_kh
        Vh = V + h * stride_vh
        KCh = KC + h * stride_ch
        VCh = VC + h * stride_ch

        # 1) Store this tile's new keys/values (head h) into their pages. No program of this launch reads
        #    them back from the cache: the window's keys come straight from K/V below. (Split 0 stores.)
        wm = m0 + tl.arange(0, BLOCK_M)
        w_in = wm < tl.where(split == 0, q_len, 0)
        w_tok = tok0 + wm
        w_slot = tl.load(Slots + w_tok, mask=w_in, other=-1)
        w_mask = (w_in & (w_slot >= 0))[:, None]
        if BLOCK_D != HEAD_DIM:
            w_mask = w_mask & (d < HEAD_DIM)[None, :]
        k_new = tl.load(Kh + w_tok[:, None] * stride_kt + d[None, :], mask=w_mask)
        v_new = tl.load(Vh + w_tok[:, None] * stride_vt + d[None, :], mask=w_mask)
        tl.store(KCh + w_slot[:, None] * stride_cs + d[None, :], k_new.to(cache_ty), mask=w_mask)
        tl.store(VCh + w_slot[:, None] * stride_cs + d[None, :], v_new.to(cache_ty), mask=w_mask)

        # 2) Attention. Rows of the tile: token m (0..BLOCK_M-1) x head g of the group, row = m * BLOCK_G + g.
        rows = tl.arange(0, BLOCK_M * BLOCK_G)
        m = m0 + rows // BLOCK_G  # token of the row inside the window
        g = rows % BLOCK_G
        row_mask = (m < q_len)[:, None]
        if BLOCK_G != GROUP:
            row_mask = row_mask & (g < GROUP)[:, None]
        if BLOCK_D != HEAD_DIM:
            row_mask = row_mask & (d < HEAD_DIM)[None, :]
        tok = tok0 + m
        win_start = tl.load(WinStarts + r)
        last_blk = (q_start + q_len - 1) // PAGE  # the active block: the horizon of every window query
        q_hor = tl.where(q_start + m >= win_start, last_blk, (q_start + m) // PAGE)  # [ROWS] horizon of each query
        q_off = tok[:, None] * stride_qt + (h * GROUP + g)[:, None] * stride_qh + d[None, :]
        q = tl.load(Q + q_off, mask=row_mask, other=0.0)
        if INTERP:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_M * BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.full([BLOCK_M * BLOCK_G], 0.0, tl.float32)
        acc = tl.full([BLOCK_M * BLOCK_G, BLOCK_D], 0.0, tl.float32)
        pt_row = PageTable + r * stride_pt

        # 2a) The cached prefix, keys [0, q_start), read through the page table. Every one of them is visible
        #     to every query of the window (k < q_start <= q, so block(k) <= block(q)): no causal mask.
        #     (The online softmax below is written out twice on purpose: a helper function would cost a
        #     call per iteration in the interpreter.)
        #     Split-KV: split s takes keys [s * chunk, (s + 1) * chunk) of the prefix, chunk a multiple of BLOCK_N.
        lo = q_start * 0  # (the type of q_start in both branches)
        hi = q_start
        if SPLITS > 1:
            chunk = tl.cdiv(tl.cdiv(q_start, SPLITS), BLOCK_N) * BLOCK_N
            lo = tl.minimum(split * chunk, q_start)
            hi = tl.minimum(lo + chunk, q_start)
        for n0 in range(lo, hi, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] absolute key positions
            k_ok = k_pos < hi
            page = tl.load(pt_row + k_pos // PAGE, mask=k_ok, other=0)
            c_off = (page * PAGE + k_pos % PAGE)[:, None] * stride_cs + d[None, :]
            kv_mask = k_ok[:, None]
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (d < HEAD_DIM)[None, :]
            k = tl.load(KCh + c_off, mask=kv_mask, other=0.0)
            v = tl.load(VCh + c_off, mask=kv_mask, other=0.0)
            if INTERP:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [ROWS, BLOCK_N]
            else:
                s = tl.dot(q, tl.trans(k))
            s = tl.where(k_ok[None, :], s * qk_scale, float("-inf"))
            if INTERP:  # tl.max / tl.sum are interpreted calls costing milliseconds each: reduce directly
                m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            if INTERP:
                l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        # 2b) The window, keys [q_start, kv_end), straight from K/V (through the cache dtype, exactly as if
        #     read back from their pages), under the rule. The horizon grows with the query position, so keys
        #     past the tile's last query's horizon are invisible to the whole tile: never read.
        q_last = q_start + tl.minimum(m0 + BLOCK_M, q_len) - 1
        hor_last = tl.where(q_last >= win_start, last_blk, q_last // PAGE)
        kv_end = tl.minimum(q_start + q_len, (hor_last + 1) * PAGE)
        if SPLITS > 1:
            kv_end = tl.where(split == SPLITS - 1, kv_end, q_start)  # the window: the last split's
        w_base = tok0 - q_start  # K/V row of key position p is w_base + p
        for n0 in range(q_start, kv_end, BLOCK_N):
            k_pos = n0 + tl.arange(0, BLOCK_N)
            k_ok = k_pos < kv_end
            kv_mask = k_ok[:, None]
            if BLOCK_D != HEAD_DIM:
                kv_mask = kv_mask & (d < HEAD_DIM)[None, :]
            w_row = (w_base + k_pos)[:, None]
            k = tl.load(Kh + w_row * stride_kt + d[None, :], mask=kv_mask, other=0.0).to(cache_ty)
            v = tl.load(Vh + w_row * stride_vt + d[None, :], mask=kv_mask, other=0.0).to(cache_ty)
            if INTERP:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
            # THE rule (kernels/attention.py: visible): key k is visible to query q iff
            # block(k) <= horizon(q); keys at or past kv_len = q_start + q_len do not exist.
            visible = ((k_pos // PAGE)[None, :] <= q_hor[:, None]) & k_ok[None, :]
            s = tl.where(visible, s * qk_scale, float("-inf"))
            # Key q_start's block is visible to every row, so m_i is finite once a tile has been seen; a row
            # with nothing visible in a later tile only gets exp2(-inf) = 0.
            if INTERP:
                m_new = tl.maximum(m_i, tl.reduce(s, 1, tl.standard._elementwise_max))
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            if INTERP:
                l_i = l_i * alpha + tl.reduce(p, 1, tl.standard._sum_combine)
            else:
                l_i = l_i * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if SPLITS == 1:
            out = acc / l_i[:, None]
            o_off = tok[:, None] * stride_ot + (h * GROUP + g)[:, None] * stride_oh + d[None, :]
            tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=row_mask)
        else:  # this split's unnormalised output, running max and sum: `_split_kv_combine_kernel` folds them
            head = tok * HQ + h * GROUP + g  # [ROWS] flat (token, query head)
            tl.store(PartO + split * stride_ps + head[:, None] * HEAD_DIM + d[None, :], acc, mask=row_mask)
            ml_mask = m < q_len
            if BLOCK_G != GROUP:
                ml_mask = ml_mask & (g < GROUP)
            tl.store(PartML + split * stride_pml + head, m_i, mask=ml_mask)
            tl.store(PartML + split * stride_pml + n_rows + head, l_i, mask=ml_mask)


def _split_kv_combine_kernel(
    PartO, PartML, Out,  # [SPLITS, T * Hq, D] fp32, [SPLITS, 2, T * Hq] fp32, [T, Hq, D]
    n_rows, stride_ps, stride_pml, stride_ot, stride_oh,
    SPLITS: tl.constexpr, HQ: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
):
    """out = sum_s acc_s 2^(m_s - m) / sum_s l_s 2^(m_s - m), m = max_s m_s, summed in split order (deterministic:
    no atomics, the same bits every run). BLOCK_R (token, head) rows per program."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = rows < n_rows
    d = tl.arange(0, BLOCK_D)
    mask = r_ok[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    for s in range(SPLITS):
        m = tl.maximum(m, tl.load(PartML + s * stride_pml + rows, mask=r_ok, other=float("-inf")))
    m = tl.where(r_ok, m, 0.0)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    den = tl.zeros([BLOCK_R], dtype=tl.float32)
    for s in range(SPLITS):
        w = tl.exp2(tl.load(PartML + s * stride_pml + rows, mask=r_ok, other=float("-inf")) - m)  # 0: empty split
        den += tl.load(PartML + s * stride_pml + n_rows + rows, mask=r_ok, other=0.0) * w
        acc += tl.load(PartO + s * stride_ps + rows[:, None].to(tl.int64) * HEAD_DIM + d[None, :], mask=mask,
                       other=0.0) * w[:, None]
    out = acc / tl.where(r_ok, den, 1.0)[:, None]
    tok = rows // HQ
    o_off = tok.to(tl.int64)[:, None] * stride_ot + (rows % HQ)[:, None] * stride_oh + d[None, :]
    tl.store(Out + o_off, out.to(Out.dtype.element_ty), mask=mask)


_KERNELS: list = []


def _kernels(t: torch.Tensor) -> tuple:
    """(write_kv, attention, split-KV combine), jitted on first use (interpreted or compiled, as the process decided)."""
    check_device(t)
    if not _KERNELS:
        _KERNELS.extend([triton.jit(_write_kv_kernel), triton.jit(_block_causal_attn_kernel),
                         triton.jit(_split_kv_combine_kernel)])
    return tuple(_KERNELS)


def _check_dtype(t: torch.Tensor) -> None:
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"the Triton attention kernel takes float32/float16/bfloat16, got {t.dtype} "
                        "(use kernel_backend='torch' for other dtypes)")


def write_kv_triton(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    slots: torch.Tensor) -> None:
    """Scatter new keys/values [T, Hkv, D] into their cache rows (caches [P, B, Hkv, D]); slot < 0 skips."""
    t, hkv, d = k.shape
    if t == 0:
        return
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    # Each token's [Hkv, D] row must be contiguous; the token stride is free (q/k/v are views of one GEMM).
    if k.stride(2) != 1 or k.stride(1) != d:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != d:
        v = v.contiguous()
    write = _kernels(k)[0]
    row = hkv * d
    block_c = min(next_pow2(row), 1024)
    block_t = min(next_pow2(t), 64) if interpreting() else max(1, min(next_pow2(t), 4096 // block_c))
    grid = (triton.cdiv(t, block_t), triton.cdiv(row, block_c))
    write[grid](k, v, k_cache, v_cache, slots, t, k.stride(0), v.stride(0),
                ROW=row, BLOCK_T=block_t, BLOCK_C=block_c)


def paged_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] new keys of the window
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [P, B, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    out: torch.Tensor | None = None,  # [T, Hq, D]; allocated when None
    splits: int | None = None,  # split-KV ranges; None: `kv_splits` (by the batch shape)
) -> torch.Tensor:  # [T, Hq, D]
    """Drop-in for `paged_attention_torch` (one launch: stores the new K/V and attends). Launch-only on the
    host (no device->host sync), so it can be captured in a CUDA graph: the grid depends on `meta.max_q` and
    the batch size only. Requires kv_len = q_start + q_len for every request (as `AttentionMetadata` builds)."""
    _check_dtype(q)
    t, hq, d = q.shape
    hkv = k.shape[1]
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} KV heads")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("the KV cache must be contiguous")
    if not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype == q.dtype):
        raise TypeError(f"q, k, v and the caches must share one dtype (q {q.dtype}, cache {k_cache.dtype})")
    if out is None:
        out = torch.empty_like(q)
    if t == 0:
        return out
    # The innermost (head_dim) stride must be 1; token and head strides are free (views of one GEMM).
    q, k, v = (x if x.stride(2) == 1 else x.contiguous() for x in (q, k, v))
    _, attn, combine = _kernels(q)
    interp = interpreting()
    group = hq // hkv
    cfg = launch_config(group, d, meta.block_size, meta.max_q, interp)
    n_req = meta.q_lens.shape[0]
    tiles = triton.cdiv(meta.max_q, cfg["BLOCK_M"])
    n_splits = kv_splits(n_req, hkv, tiles, meta.max_q, interp) if splits is None else splits
    if n_splits > 1:  # smaller query tiles: more programs, and no spill with the partials' stores (sm_90 report)
        cfg = launch_config(group, d, meta.block_size, meta.max_q, interp, split=True)
        tiles = triton.cdiv(meta.max_q, cfg["BLOCK_M"])
    kc = k_cache.view(-1, hkv, d)
    vc = v_cache.view(-1, hkv, d)
    if n_splits > 1:  # partials in fp32: [SPLITS, T * Hq, D] outputs, [SPLITS, 2, T * Hq] (max, sum)
        part_o = torch.empty(n_splits, t * hq, d, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(n_splits, 2, t * hq, dtype=torch.float32, device=q.device)
    else:
        part_o = part_ml = out  # (not touched)
    grid = (n_req, tiles, hkv * n_splits)
    attn[grid](
        q, k, v, kc, vc, out, part_o, part_ml,
        meta.slot_mapping, meta.page_tables, meta.q_starts, meta.q_lens, meta.cu_q, meta.window_starts,
        _LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1),
        k.stride(0), k.stride(1),
        v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        kc.stride(0), kc.stride(1),
        meta.page_tables.stride(0),
        part_o.stride(0), part_ml.stride(0), t * hq,
        SPLITS=n_splits, HQ=hq,
        IEEE=q.dtype == torch.float32, **cfg,
    )
    if n_splits > 1:
        block_r = 64 if interp else 16
        combine[(triton.cdiv(t * hq, block_r),)](
            part_o, part_ml, out, t * hq, part_o.stride(0), part_ml.stride(0), out.stride(0), out.stride(1),
            SPLITS=n_splits, HQ=hq, HEAD_DIM=d, BLOCK_D=max(16, next_pow2(d)), BLOCK_R=block_r,
            **({} if interp else {"num_warps": 4}))
    return out


_SMS: list[int] = []


def kv_splits(n_req: int, hkv: int, tiles: int, max_q: int, interp: bool) -> int:
    """How many key ranges each (request, tile, KV head) program's prefix is cut into: enough programs for about
    one per multiprocessor at small batches, from the batch shape alone (so one CUDA graph serves every context).
    Only for denoising-size windows (max_q <= 64): a prefill window has programs enough. 1 in the interpreter
    (tests pass `splits=` to check the split path)."""
    if interp or max_q > 64:
        return 1
    if not _SMS:
        _SMS.append(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                    if torch.cuda.is_available() else 132)
    return max(1, min(MAX_KV_SPLITS, _SMS[0] // max(1, n_req * hkv * tiles)))


MAX_KV_SPLITS = 8  # each split adds T x Hq x D fp32 of partials (written, read): ~ 256 keys' K/V per request


def launch_config(group: int, head_dim: int, page: int, max_q: int, interp: bool, split: bool = False) -> dict:
    """Tile sizes and launch options of the attention kernel (shared with the compile report of
    benchmarks/bench_gpu_step.py, so what is inspected is what runs).

    GPU: ~128 rows (query tokens x heads of the group) per program and one page of keys per iteration;
    8 warps once the fp32 accumulator is 128 x 128 (at 4 warps the mini shape spills: 255 registers and a
    208-byte stack on sm_90; at 8 warps 193 registers, no stack, wgmma); split-KV programs take ~64 rows (with
    128 and the partials' stores the mini shape spilled: 255 registers, a 72-byte stack). Interpreter: larger
    programs, since
    its cost is per operation, not per element."""
    block_g = next_pow2(group)
    block_d = max(16, next_pow2(head_dim))
    if interp:
        block_m, block_n, warps, stages = max(16, min(64, next_pow2(max_q))), 128, 4, 1
    else:
        block_m, block_n = max(16, min(page, (64 if split else 128) // block_g)), 32
        warps = 8 if split or block_m * block_g * block_d >= 128 * 128 else 4
        stages = 2
    return dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=head_dim, BLOCK_D=block_d, PAGE=page, BLOCK_M=block_m,
                BLOCK_N=block_n, INTERP=interp, num_warps=warps, num_stages=stages)
