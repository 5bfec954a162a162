"""RMSNorm, residual-add + RMSNorm, QK-norm + partial NeoX rotary in plain torch: the model's own arithmetic and
the twins of kernels/norm_triton.py.

The rotary angles are computed in float64 (position x inverse frequency), then cast to the compute dtype, so every
dtype rotates by the same angles; `rotary_table` computes the same angles for every position once (elementwise in
float64, the same ops: bit-identical to computing them per forward).
"""

from __future__ import annotations

import torch

from redraft.kernels.moe import compute_dtype


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # x: [..., N]
    """weight * (x / sqrt(mean(x^2) + eps)), the variance in fp32 (or higher), the normalised x rounded to x's
    dtype before the weight multiplies it."""
    xf = x.to(compute_dtype(x.dtype))
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_torch(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta): the residual add (in h's dtype) then the norm; delta None: no add."""
    if delta is not None:
        h = h + delta
    return rms_norm_torch(h, weight, eps), h


def inv_freq(rotary_dim: int, theta: float, device) -> torch.Tensor:  # [rd/2] float64
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device=device) / rotary_dim
    return 1.0 / theta**exponent


def rotary_torch(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """Partial NeoX rotary (rotate-half within the first `rotary_dim` dims) at absolute positions. x: [T, heads, D]."""
    cdt = compute_dtype(x.dtype)
    angles = positions.to(torch.float64)[:, None] * inv_freq(rotary_dim, theta, x.device)[None, :]  # [T, rd/2]
    cos, sin = angles.cos().to(cdt)[:, None, :], angles.sin().to(cdt)[:, None, :]
    half = rotary_dim // 2
    xr = x[..., :rotary_dim].to(cdt)
    x1, x2 = xr[..., :half], xr[..., half:]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return torch.cat([rotated, x[..., rotary_dim:]], dim=-1)


_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def rotary_table(rotary_dim: int, theta: float, max_positions: int, device, dtype: torch.dtype = torch.float32
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [max_positions, rd/2] in `dtype`: rotary_torch's angles for every position, computed once per
    (shape, device, dtype) and shared by every layer."""
    key = (rotary_dim, float(theta), max_positions, str(torch.device(device)), dtype)
    if key not in _TABLES:
        pos = torch.arange(max_positions, dtype=torch.float64, device=device)
        angles = pos[:, None] * inv_freq(rotary_dim, theta, device)[None, :]
        _TABLES[key] = (angles.cos().to(dtype).contiguous(), angles.sin().to(dtype).contiguous())
    return _TABLES[key]


def qk_norm_rope_torch(qkv: torch.Tensor, positions: torch.Tensor, n_q: int, n_kv: int, head_dim: int,
                       rotary_dim: int, theta: float, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] from the packed qkv [T, (Hq + 2 Hkv) D]: per-head RMSNorm (when weights are
    given), then the rotary, as the model's attention does."""
    t = qkv.shape[0]
    q = qkv[:, : n_q * head_dim].view(t, n_q, head_dim)
    k = qkv[:, n_q * head_dim: (n_q + n_kv) * head_dim].view(t, n_kv, head_dim)
    if q_weight is not None:
        q, k = rms_norm_torch(q, q_weight, eps), rms_norm_torch(k, k_weight, eps)
    return rotary_torch(q, positions, rotary_dim, theta), rotary_torch(k, positions, rotary_dim, theta)
