"""Counting the kernels a forward launches without a GPU: run it on the meta device (no data, any host sync
raises), with every Triton launch recorded instead of run and every ATen op that would launch a CUDA kernel
counted by a dispatch mode. Views, allocations and shape queries launch nothing and are not counted."""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ATen ops that launch no kernel: views, allocations, metadata.
_FREE = {
    "view", "_unsafe_view", "reshape", "split", "split_with_sizes", "slice", "select", "t", "transpose", "permute",
    "expand", "as_strided", "unsqueeze", "squeeze", "detach", "alias", "empty", "empty_like", "empty_strided",
    "new_empty", "new_empty_strided", "unbind", "chunk", "narrow", "lift_fresh", "_reshape_alias", "unflatten",
    "flatten", "view_as", "promote_types", "expand_as", "is_same_size", "_local_scalar_dense", "sym_size", "sym_stride",
}


class _AtenCounter(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in _FREE:
            self.log.append(("aten." + name, None))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_launches():
    """Yields a list that fills with (name, detail) per launch: Triton kernels by function name, ATen ops as
    `aten.<op>`. Triton kernels are recorded, not run (their wrappers see any tensors, meta included)."""
    from triton.runtime.jit import KernelInterface

    from redraft.kernels import attention_triton as at
    from redraft.kernels import fp8_triton as ft
    from redraft.kernels import moe_triton as mt
    from redraft.kernels import norm_triton as nt

    log: list = []
    saved_getitem = KernelInterface.__getitem__

    def record(self, grid):
        def launch(*args, **kwargs):
            log.append((getattr(self, "__name__", None) or self.fn.__name__, grid))
        return launch

    checks = [(m, m.check_device) for m in (at, ft, mt, nt) if hasattr(m, "check_device")]
    KernelInterface.__getitem__ = record
    for m, _ in checks:
        m.check_device = lambda t: None  # meta tensors are fine here
    try:
        with _AtenCounter(log):
            yield log
    finally:
        KernelInterface.__getitem__ = saved_getitem
        for m, fn in checks:
            m.check_device = fn


def by_name(log: list) -> Counter:
    return Counter(name for name, _ in log)
