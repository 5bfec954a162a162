"""The memory plan's parameter count is the checkpoint's: a tiny checkpoint written in the real format, its
tensors counted from the safetensors files; and LLaDA2.1-mini's total matches its published size."""

from __future__ import annotations

import json

from safetensors import safe_open

from redraft.clients.memory_plan import PRESETS, parameter_parts, plan_row
from redraft.engine.tiny import make_tiny_checkpoint


def test_parameter_count_is_the_checkpoints(tmp_path) -> None:
    path = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    cfg = json.loads((path / "config.json").read_text())
    counted = 0
    for f in path.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                counted += _numel(st.get_slice(name).get_shape())
    assert parameter_parts(cfg).total == counted


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def test_mini_matches_its_published_size_and_ranks_split_it() -> None:
    mini = PRESETS["LLaDA2.1-mini"]
    assert abs(parameter_parts(mini).total * 2 - 32.5e9) / 32.5e9 < 0.01  # "32.5 GB in bf16" (facts file)
    one, two = plan_row(mini, 1, 80.0), plan_row(mini, 2, 80.0)
    assert two["weights_bf16_gib"] < 0.51 * one["weights_bf16_gib"]
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    assert one["weights_fp8_gib"] < 0.53 * one["weights_bf16_gib"]
