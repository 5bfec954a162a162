"""Error measures the kernel and FP8 tests compare tensors with (computed in float64)."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative L2 error of `a` against the reference `b`."""
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double().flatten(), b.double().flatten(), dim=0))
