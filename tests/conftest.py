"""Suite-wide settings."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Every in-process model here is tiny: with several OpenMP threads on a busy 2-core machine a forward takes
    up to 100x longer. Servers started by tests set OMP_NUM_THREADS=1 themselves (tests/live_server.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
