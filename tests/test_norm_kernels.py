"""The fused norm kernels (kernels/norm_triton.py) against their torch twins (kernels/norm.py), interpreted on CPU.

Bit for bit where the variance's sum is exact in any order (inputs on a coarse grid: every partial sum of squares
is representable), so every other rounding (the residual add, the normalised row, the weight, the rotary's
products and sums, the casts) is checked exactly; within fp32's last bits on random data (the only difference
there is the order of the variance's sum)."""

from __future__ import annotations

import pytest
import torch

from redraft.kernels.norm import add_rms_norm_torch, qk_norm_rope_torch, rotary_table, rotary_torch

nt = pytest.importorskip("redraft.kernels.norm_triton")
pytestmark = pytest.mark.kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _grid(*shape, g):  # multiples of 1/4 in [-2, 2]: squares and their sums are exact in fp32
    return torch.randint(-8, 9, shape, generator=g) / 4


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(37, 64), (1, 2048), (5, 48)])
@pytest.mark.parametrize("with_delta", [True, False])
def test_add_rms_norm_is_the_twin_bit_for_bit(dtype, rows, n, with_delta):
    g = torch.Generator().manual_seed(rows * n)
    h, d = _grid(rows, n, g=g).to(dtype).to(DEVICE), _grid(rows, n, g=g).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(DEVICE)
    want, want_h = add_rms_norm_torch(h, d if with_delta else None, w, 1e-6)
    got, got_h = nt.add_rms_norm_triton(h, d if with_delta else None, w, 1e-6)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert torch.equal(got_h, want_h)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_on_random_data(dtype):
    g = torch.Generator().manual_seed(0)
    h, d = torch.randn(33, 256, generator=g).to(dtype), torch.randn(33, 256, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(256, generator=g)).to(dtype)
    want, want_h = add_rms_norm_torch(h, d, w, 1e-6)
    got, got_h = nt.add_rms_norm_triton(h.to(DEVICE), d.to(DEVICE), w.to(DEVICE), 1e-6)
    assert torch.equal(got_h.cpu(), want_h)  # the add has no reduction: exact
    ulp = {torch.float32: 1e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}[dtype]
    assert torch.allclose(got.cpu().float(), want.float(), rtol=ulp, atol=ulp)
    # a differing element is one ulp of the output dtype at most, and rare outside fp32
    if dtype != torch.float32:
        assert (got.cpu() != want).float().mean() < 0.01


def test_rotary_table_is_the_per_forward_angles_bit_for_bit():
    pos = torch.tensor([0, 1, 31, 32, 1000, 8191, 32767])
    cos, sin = rotary_table(64, 600000.0, 32768, "cpu")
    x = torch.randn(len(pos), 1, 64, dtype=torch.float64)
    # rotary_torch(x at pos) built from the table's rows must be the same: check the angles directly
    inv = 1.0 / 600000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    angles = pos.to(torch.float64)[:, None] * inv[None, :]
    assert torch.equal(cos[pos], angles.cos().float()) and torch.equal(sin[pos], angles.sin().float())
    assert rotary_table(64, 600000.0, 32768, "cpu")[0] is cos  # built once, shared
    assert rotary_torch(x, pos, 64, 600000.0).shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nq, nkv, d, rd", [(4, 2, 16, 8), (16, 4, 128, 64), (2, 1, 32, 32), (3, 1, 24, 8)])
@pytest.mark.parametrize("norm", [True, False])
def test_qk_norm_rope_is_the_twin_bit_for_bit(dtype, nq, nkv, d, rd, norm):
    g = torch.Generator().manual_seed(nq * d + rd)
    t = 40
    qkv = _grid(t, (nq + 2 * nkv) * d, g=g).to(dtype).to(DEVICE)
    pos = torch.cat([torch.arange(4), torch.randint(0, 4096, (t - 4,), generator=g)]).to(DEVICE)
    qw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    kw = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(DEVICE) if norm else None
    cos, sin = rotary_table(rd, 600000.0, 4096, DEVICE)
    want_q, want_k = qk_norm_rope_torch(qkv, pos, nq, nkv, d, rd, 600000.0, qw, kw, 1e-6)
    got_q, got_k = nt.qk_norm_rope_triton(qkv, pos, cos, sin, nq, nkv, d, rd, qw, kw, 1e-6)
    assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_qk_norm_rope_on_random_data():
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(33, 8 * 16, generator=g)
    pos = torch.randint(0, 4096, (33,), generator=g)
    qw, kw = 1 + 0.1 * torch.randn(16, generator=g), 1 + 0.1 * torch.randn(16, generator=g)
    cos, sin = rotary_table(8, 600000.0, 4096, "cpu")
    want_q, want_k = qk_norm_rope_torch(qkv, pos, 4, 2, 16, 8, 600000.0, qw, kw, 1e-6)
    got_q, got_k = nt.qk_norm_rope_triton(qkv.to(DEVICE), pos.to(DEVICE), cos.to(DEVICE), sin.to(DEVICE), 4, 2, 16,
                                          8, qw.to(DEVICE), kw.to(DEVICE), 1e-6)
    assert torch.allclose(got_q.cpu(), want_q, rtol=1e-6, atol=1e-6)
    assert torch.allclose(got_k.cpu(), want_k, rtol=1e-6, atol=1e-6)
