"""The memory plan's parameter count is the checkpoint's: a tiny checkpoint written in the real format, its
tensors counted from the safetensors files; and LLaDA2.1-mini's total matches its published size."""

from __future__ import annotations

import json

from safetensors import safe_open

from redraft.clients.memory_plan import PRESETS, parameter_parts, plan_row


def test_parameter_count_is_the_checkpoints(tiny_checkpoint) -> None:
    path = tiny_checkpoint(seed=0)
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
    assert 0.5 * one["weights_bf16_gib"] < two["weights_bf16_gib"] < 0.501 * one["weights_bf16_gib"]  # (+ norms, router)
    assert two["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"]
    assert one["weights_fp8_gib"] < 0.53 * one["weights_bf16_gib"]


def test_the_plan_is_what_a_rank_loads(tiny_checkpoint) -> None:
    """Weights per rank in the plan == the bytes a rank of that layout holds once loaded (bf16, EP = TP)."""
    from redraft.clients.memory_plan import GIB
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.engine.model.sharding import RankLayout
    from redraft.engine.runtime.tensor_parallel import weight_bytes

    path = tiny_checkpoint(seed=0)
    cfg_json = json.loads((path / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(path)
    for tp in (1, 2, 4):
        model = load_model(path, cfg, dtype="bfloat16", progress=False,
                           layout=RankLayout(0, tp, tp) if tp > 1 else None)
        planned = plan_row(cfg_json, tp, 80.0)["weights_bf16_gib"] * GIB
        assert abs(weight_bytes(model) - planned) / planned < 0.01, tp  # (expert_bias is fp32 in the model)


def test_redraft_plan_prints_the_tables(capsys) -> None:
    """`redraft plan` (the calculator as a subcommand): one table per preset, a row per --tp."""
    from redraft.cli import main

    assert main(["plan", "--tp", "1", "8"]) == 0
    out = capsys.readouterr().out
    assert "**LLaDA2.1-mini**" in out and "**LLaDA2.1-flash**" in out and "**LLaDA2.2-flash**" in out
    assert sum(line.startswith(("| 1 |", "| 8 |")) for line in out.splitlines()) == 2 * len(PRESETS)
    assert "Block routing: each 32-token routing block admits 48 of 256 experts" in out


def test_the_22_flash_preset_is_a_valid_block_routing_config() -> None:
    """LLaDA2.2-flash (the LLaDA2.2 page's values): a config redraft loads as block routing, 2.1-flash's weights
    (block routing adds no parameter), and full-context requests counted from the KV room of each layout."""
    from redraft.clients.memory_plan import context_line
    from redraft.engine.model.config import ModelConfig

    flash22, flash21 = PRESETS["LLaDA2.2-flash"], PRESETS["LLaDA2.1-flash"]
    cfg = ModelConfig.from_dict({**flash22, "intermediate_size": 9216})
    assert cfg.block_routing and cfg.structural_edits
    assert (cfg.expert_capacity, cfg.block_size, cfg.max_position_embeddings, cfg.rope_theta) == (48, 32, 131072, 3e6)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_experts) == (4096, 32, 256)
    assert parameter_parts(flash22) == parameter_parts(flash21)
    four = plan_row(flash22, 4, 80.0)
    assert four == plan_row(flash21, 4, 80.0)
    line = context_line(flash22, [4], 0.85)
    assert f"TP 4: {int(four['kv_tokens_bf16'] // 131072)} / {int(four['kv_tokens_fp8'] // 131072)}" in line
