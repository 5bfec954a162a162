"""The Triton block-causal paged attention kernel against its plain-torch twin (and a float64 reference).

On CPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before anything imports triton;
`redraft.kernels` would set it too); on a machine with a CUDA device the same tests run compiled on it.
Shapes stay tiny (head_dim 16, a few blocks) because the interpreter runs programs one by one in Python.

Every check poisons what the kernel must not read or must write: the output starts as NaN, cache rows that
belong to no request (and rows past a request's keys) hold NaN, and the window's own cache rows hold NaN
until the kernel stores the new K/V. Page tables are shuffled, non-contiguous page ids.
"""

from __future__ import annotations

import os
import random
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from numerics import rel
from redraft.kernels.attention import AttentionMetadata, paged_attention_torch, visible  # noqa: E402

triton_attn = pytest.importorskip("redraft.kernels.attention_triton")

pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not triton_attn.interpreting():
    pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module", allow_module_level=True)

B = 32  # tokens per block = per page
HKV, D = 2, 16
TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1.5e-2}  # relative L2 error vs float64


class Batch:
    """A random ragged batch: per request (q_start, q_len) and a shuffled page table; caches poisoned."""

    def __init__(self, windows: list[tuple[int, int]], hq: int, dtype: torch.dtype, seed: int,
                 num_pages: int = 40, pad_rows: int = 0, window_starts: list[int] | None = None):
        g = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.windows = list(windows)
        free = list(range(1, num_pages - 1))  # page 0: finite (the torch twin pads its gathers with row 0)
        rng.shuffle(free)
        self.scratch = num_pages - 1  # a page shared by padding rows (like the CUDA-graph scratch page)
        tables = []
        for q_start, q_len in self.windows:
            n = -(-(q_start + q_len) // B)
            tables.append([free.pop() for _ in range(n)])
        self.n_real = len(self.windows)
        for _ in range(pad_rows):  # padding requests as DecodeGraphs builds them: a block at 0 on the scratch page
            self.windows.append((0, B))
            tables.append([self.scratch])
        if window_starts is not None:
            window_starts = list(window_starts) + [B] * pad_rows
        self.meta = AttentionMetadata.build([w[0] for w in self.windows], [w[1] for w in self.windows], tables, B,
                                            DEVICE, window_starts=window_starts)
        t = sum(w[1] for w in self.windows)

        def rnd(*shape):
            return torch.randn(*shape, generator=g).to(dtype)

        self.q, self.k, self.v = rnd(t, hq, D), rnd(t, HKV, D), rnd(t, HKV, D)
        self.k_cache = torch.full((num_pages, B, HKV, D), float("nan"), dtype=dtype)
        self.v_cache = torch.full((num_pages, B, HKV, D), float("nan"), dtype=dtype)
        self.k_cache[0], self.v_cache[0] = rnd(B, HKV, D), rnd(B, HKV, D)
        for (q_start, _), pages in zip(self.windows, tables):  # the cached prefix is finite
            for p in range(q_start):
                self.k_cache[pages[p // B], p % B] = rnd(HKV, D)
                self.v_cache[pages[p // B], p % B] = rnd(HKV, D)
        self.real_rows = int(self.meta.cu_q[self.n_real])
        for name in ("q", "k", "v", "k_cache", "v_cache"):
            setattr(self, name, getattr(self, name).to(DEVICE))

    def run_triton(self, splits: int | None = None):
        kc, vc = self.k_cache.clone(), self.v_cache.clone()
        out = torch.full_like(self.q, float("nan"))
        ret = triton_attn.paged_attention_triton(self.q, self.k, self.v, kc, vc, self.meta, out=out, splits=splits)
        assert ret is out
        return out, kc, vc

    def run_torch(self, dtype: torch.dtype | None = None):
        cast = (lambda x: x.to(dtype)) if dtype else (lambda x: x)
        kc, vc = cast(self.k_cache.clone()), cast(self.v_cache.clone())
        out = paged_attention_torch(cast(self.q), cast(self.k), cast(self.v), kc, vc, self.meta)
        return out, kc, vc


# Windows (q_start, q_len): prompt prefill ending mid-block, prefill of whole blocks, denoising steps of one
# block at various depths, multi-block windows (MBE / a stale block + the active one), a prefill chunk
# continuing a cached prefix, and a window ending mid-block after a prefix.
WINDOWS = [(0, 45), (0, 64), (96, 32), (0, 32), (64, 96), (32, 64), (128, 32), (160, 21)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_torch_twin(dtype, group):
    seed = 100 * group + list(TOL).index(dtype)
    rng = random.Random(seed)
    windows = rng.sample(WINDOWS, 5)
    batch = Batch(windows, hq=HKV * group, dtype=dtype, seed=seed)
    out, kc, vc = batch.run_triton()
    assert not out.isnan().any(), "the kernel left output elements unwritten (or read poisoned rows)"
    ref64, kc64, vc64 = batch.run_torch(torch.float64)
    err = rel(out, ref64)
    assert err < TOL[dtype], f"relative error {err:.2e} vs float64"
    twin, kc_twin, vc_twin = batch.run_torch()
    assert err <= max(TOL[dtype] / 3, 3 * rel(twin, ref64)), "much less accurate than the torch twin"
    # The caches after the call: the same new K/V rows stored, every other row (NaN poison included) untouched.
    torch.testing.assert_close(kc, kc_twin, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(vc, vc_twin, rtol=0, atol=0, equal_nan=True)


# Multi-block-editing queries (q_start, q_len) with the first position of their open window: prefill rows of
# committed blocks then the window (bidirectional inside), a window alone, a window starting mid-prompt-block,
# a W = 1 step, and a request with no window (a prefill chunk).
MBE = [((32, 128), 64), ((64, 96), 64), ((0, 96), 0), ((96, 32), 96), ((0, 64), 64)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_mbe_windows_match_torch_twin(dtype):
    batch = Batch([w for w, _ in MBE], hq=HKV * 2, dtype=dtype, seed=7, window_starts=[s for _, s in MBE])
    out, kc, vc = batch.run_triton()
    assert not out.isnan().any()
    ref64, _, _ = batch.run_torch(torch.float64)
    assert rel(out, ref64) < TOL[dtype]
    twin, kc_twin, vc_twin = batch.run_torch()
    torch.testing.assert_close(kc, kc_twin, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_rule_matches_visible(impl):
    """Read the visibility pattern off each implementation: with q = 0 every visible key gets the same weight,
    and with one-hot values (value of key j = e_j) the output row of query q is 1/|visible(q)| on exactly its
    visible keys. That must be `visible` (block-causal, and bidirectional inside an open MBE window)
    restricted to the request's keys."""
    d = 192
    windows = [(32, 96), (0, 45), (64, 32), (32, 128), (0, 96)]
    starts = [128, 45, 64, 64, 0]  # no window, no window, W = 1, 3-block window after a prefill row, from 0
    tables = [[7, 3, 9, 5], [2, 11], [4, 8, 1], [12, 13, 14, 15, 16], [17, 18, 19]]
    meta = AttentionMetadata.build([w[0] for w in windows], [w[1] for w in windows], tables, B, DEVICE,
                                   window_starts=starts)
    t = sum(w[1] for w in windows)
    q = torch.zeros(t, 2, d)
    k = torch.randn(t, 1, d)
    v = torch.zeros(t, 1, d)
    k_cache = torch.randn(20, B, 1, d)
    v_cache = torch.zeros(20, B, 1, d)
    for (q_start, q_len), pages, off in zip(windows, tables, meta.cu_q.tolist()):
        for p in range(q_start):  # cached keys: one-hot at their position
            v_cache[pages[p // B], p % B, 0, p] = 1.0
        for i in range(q_len):  # new keys of the window
            v[off + i, 0, q_start + i] = 1.0
    attend = triton_attn.paged_attention_triton if impl == "triton" else paged_attention_torch
    out = attend(*(x.to(DEVICE) for x in (q, k, v, k_cache, v_cache)), meta).cpu()
    for (q_start, q_len), start, off in zip(windows, starts, meta.cu_q.tolist()):
        q_pos = torch.arange(q_start, q_start + q_len)
        k_pos = torch.arange(d)
        last = (q_start + q_len - 1) // B
        expect = visible(q_pos[:, None], k_pos[None, :], B, start, last) & (k_pos < q_start + q_len)[None, :]
        for head in range(2):
            got = out[off : off + q_len, head]  # [q_len, d]
            assert torch.equal(got > 1e-6, expect), f"window {q_start, q_len}: visibility differs from the rule"
            torch.testing.assert_close(got.sum(-1), torch.ones(q_len), rtol=1e-5, atol=1e-5)


def test_padding_rows_on_a_shared_scratch_page():
    """CUDA-graph padding: extra one-block requests whose page table and slots all point at one scratch page
    (several programs store to the same rows). Real requests must be unaffected."""
    batch = Batch([(96, 32), (0, 45), (32, 32)], hq=4, dtype=torch.float32, seed=7, pad_rows=3)
    out, kc, vc = batch.run_triton()
    ref, kc_ref, vc_ref = batch.run_torch(torch.float64)
    n = batch.real_rows
    assert not out[:n].isnan().any()
    assert rel(out[:n], ref[:n]) < TOL[torch.float32]
    keep = torch.ones(kc.shape[0], dtype=torch.bool)
    keep[batch.scratch] = False
    torch.testing.assert_close(kc[keep].double(), kc_ref[keep], rtol=0, atol=0, equal_nan=True)
    assert not kc[batch.scratch].isnan().any()  # every padding row stored something finite


def test_write_kv_triton_skips_negative_slots():
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(10, HKV, D, generator=g), torch.randn(10, HKV, D, generator=g)
    kc = torch.full((6, B, HKV, D), float("nan"))
    vc = kc.clone()
    slots = torch.tensor([5, 40, -1, 33, 100, -1, 0, 191, 64, 65])
    kc_d, vc_d = kc.to(DEVICE), vc.to(DEVICE)
    triton_attn.write_kv_triton(kc_d, vc_d, k.to(DEVICE), v.to(DEVICE), slots.to(DEVICE))
    flat_k, flat_v = kc_d.cpu().view(-1, HKV, D), vc_d.cpu().view(-1, HKV, D)
    written = slots >= 0
    assert torch.equal(flat_k[slots[written]], k[written]) and torch.equal(flat_v[slots[written]], v[written])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool)
    untouched[slots[written]] = False
    assert flat_k[untouched].isnan().all() and flat_v[untouched].isnan().all()


def test_rejects_mixed_dtypes_and_float64():
    batch = Batch([(0, 32)], hq=2, dtype=torch.float32, seed=1)
    with pytest.raises(TypeError):
        triton_attn.paged_attention_triton(batch.q.double(), batch.k.double(), batch.v.double(),
                                           batch.k_cache.double(), batch.v_cache.double(), batch.meta)
    with pytest.raises(TypeError):
        triton_attn.paged_attention_triton(batch.q, batch.k, batch.v, batch.k_cache.half(), batch.v_cache.half(),
                                           batch.meta)


# ---- split-KV (small batches: the prefix cut into key ranges, partials combined in split order) ----------
def _check_split(batch: Batch, dtype: torch.dtype, splits: int) -> None:
    out, kc, vc = batch.run_triton(splits=splits)
    assert not out.isnan().any(), "unwritten output (or a poisoned row read)"
    ref64, _, _ = batch.run_torch(torch.float64)
    err = rel(out[: batch.real_rows], ref64[: batch.real_rows])
    assert err < TOL[dtype], f"{splits} splits: relative error {err:.2e} vs float64"
    twin, kc_twin, vc_twin = batch.run_torch()
    torch.testing.assert_close(kc, kc_twin, rtol=0, atol=0, equal_nan=True)  # split 0 stored the new K/V, once
    torch.testing.assert_close(vc, vc_twin, rtol=0, atol=0, equal_nan=True)
    again, _, _ = batch.run_triton(splits=splits)
    assert torch.equal(again, out)  # deterministic: no atomics, the combine in split order


# Denoising blocks behind an empty, 31-, 32- and 1000-token prefix (and a window ending mid-block), with padding
# rows on the scratch page as the CUDA graphs add them.
SHORT = [(0, 32), (31, 33), (32, 32), (1000, 24), (96, 21)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("splits", [2, 3, 8])
def test_split_kv_matches_torch_twin(dtype, splits):
    batch = Batch(SHORT, hq=HKV * 2, dtype=dtype, seed=11 + splits, num_pages=48, pad_rows=2)
    _check_split(batch, dtype, splits)


@pytest.mark.parametrize("splits", [1, 4])
def test_split_kv_mbe_windows(splits):
    batch = Batch([w for w, _ in MBE], hq=HKV * 2, dtype=torch.float32, seed=5, window_starts=[s for _, s in MBE])
    _check_split(batch, torch.float32, splits)


@pytest.mark.slow  # (the interpreter walks 8k keys per program)
def test_split_kv_long_prefix():
    batch = Batch([(8191, 33), (0, 32)], hq=HKV * 4, dtype=torch.bfloat16, seed=3, num_pages=264, pad_rows=1)
    _check_split(batch, torch.bfloat16, 8)


def test_split_count_follows_the_batch_shape_only():
    """One CUDA graph per batch bucket serves every context: the split count is a function of the batch shape."""
    ks = triton_attn.kv_splits
    assert ks(1, 4, 1, 32, interp=True) == 1  # interpreted: tests choose
    assert ks(1, 4, 1, 4096, interp=False) == 1  # a prefill window: programs enough
    if not torch.cuda.is_available():
        triton_attn._SMS[:] = [132]
    sms = triton_attn._SMS[0] if triton_attn._SMS else 132
    assert ks(1, 4, 1, 32, interp=False) == min(triton_attn.MAX_KV_SPLITS, sms // 4)
    assert ks(64, 4, 1, 32, interp=False) == 1
