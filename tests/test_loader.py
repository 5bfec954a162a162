"""Checkpoint loading: official names land in the right packed/stacked places, and every mismatch is an error
that names the tensor."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.loader import CheckpointError, expected_tensors, load_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=7)


def _copy_with(tmp_path: Path, src: Path, edit) -> Path:
    """A copy of the checkpoint whose single safetensors file went through `edit(dict) -> dict`."""
    dst = tmp_path / "edited"
    shutil.copytree(src, dst)
    tensors = edit(load_file(str(src / "model.safetensors")))
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_official_tensors_land_in_packed_and_stacked_parameters(tiny: Path):
    cfg = ModelConfig.from_pretrained(tiny)
    model = load_model(tiny, cfg, progress=False)
    raw = load_file(str(tiny / "model.safetensors"))
    i = cfg.moe_intermediate_size
    layer = cfg.first_k_dense_replace  # the first MoE layer
    mlp = model.layers[layer].mlp
    for e in range(cfg.num_experts):
        src = f"model.layers.{layer}.mlp.experts.{e}"
        assert torch.equal(mlp.w13[e, :i], raw[f"{src}.gate_proj.weight"])
        assert torch.equal(mlp.w13[e, i:], raw[f"{src}.up_proj.weight"])
        assert torch.equal(mlp.w2[e], raw[f"{src}.down_proj.weight"])
    assert torch.equal(mlp.router, raw[f"model.layers.{layer}.mlp.gate.weight"])
    assert mlp.expert_bias.dtype == torch.float32
    assert torch.equal(mlp.expert_bias, raw[f"model.layers.{layer}.mlp.gate.expert_bias"])
    dense = model.layers[0].mlp
    ii = cfg.intermediate_size
    assert torch.equal(dense.gate_up[:ii], raw["model.layers.0.mlp.gate_proj.weight"])
    assert torch.equal(dense.gate_up[ii:], raw["model.layers.0.mlp.up_proj.weight"])
    assert torch.equal(model.layers[0].attn.qkv.weight, raw["model.layers.0.attention.query_key_value.weight"])
    assert torch.equal(model.lm_head.weight, raw["lm_head.weight"])
    assert set(expected_tensors(cfg)) == set(raw)


def test_a_22_checkpoint_loads_with_the_21_tensor_names(tiny: Path, tiny_checkpoint):
    """A LLaDA2.2 config.json (expert_capacity, block_size, delete/split ids, a 128K context, rope_theta 3e6 and an
    n_group grouped routing could not take) over the same tensors: the loader takes it, every parameter lands
    where 2.1's does."""
    overrides = {"expert_capacity": 4, "block_size": 32, "delete_token_id": 440, "split_token_id": 441,
                 "max_position_embeddings": 131072, "rope_theta": 3e6, "n_group": 3, "topk_group": 5}
    path = tiny_checkpoint(seed=7, config_overrides=overrides)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.block_routing and cfg.structural_edits and (cfg.delete_token_id, cfg.split_token_id) == (440, 441)
    assert set(expected_tensors(cfg)) == set(load_file(str(path / "model.safetensors")))
    got = load_model(path, cfg, progress=False).state_dict()
    want = load_model(tiny, ModelConfig.from_pretrained(tiny), progress=False).state_dict()
    # (the tiny generator leans lm_head's DELETE and SPLIT rows so that a 2.2 checkpoint predicts them)
    assert torch.equal(got["lm_head.weight"], load_file(str(path / "model.safetensors"))["lm_head.weight"])
    got["lm_head.weight"][[440, 441]] = want["lm_head.weight"][[440, 441]]
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_checkpoints_load_into_any_dtype(tiny_checkpoint, dtype: str):
    path = tiny_checkpoint(seed=1, dtype=dtype)
    cfg = ModelConfig.from_pretrained(path)
    for target in ("float32", "bfloat16"):
        model = load_model(path, cfg, dtype=target, progress=False)
        assert model.embed.weight.dtype == getattr(torch, target)
        assert model.layers[1].mlp.expert_bias.dtype == torch.float32


def test_tied_embeddings_give_lm_head_the_embedding(tiny_checkpoint):
    """A checkpoint with tie_word_embeddings stores no lm_head.weight: the logits read the embedding matrix
    (a model allocated on the meta device and then materialised must be tied again)."""
    path = tiny_checkpoint(seed=2, config_overrides={"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_file(str(path / "model.safetensors"))
    model = load_model(path, ModelConfig.from_pretrained(path), progress=False)
    hidden = torch.randn(3, model.cfg.hidden_size)
    assert model.lm_head.weight is model.embed.weight
    assert torch.equal(model.logits(hidden), hidden @ model.embed.weight.t())


def test_sharded_checkpoint_equals_single_file(tiny_checkpoint):
    single = tiny_checkpoint(seed=3)
    sharded = tiny_checkpoint(seed=3, shards=3)
    assert (sharded / "model.safetensors.index.json").is_file()
    cfg = ModelConfig.from_pretrained(single)
    a, b = load_model(single, cfg, progress=False), load_model(sharded, cfg, progress=False)
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name


def test_missing_tensor_is_named(tmp_path: Path, tiny: Path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    path = _copy_with(tmp_path, tiny, lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointError, match=r"lacks tensor.*experts\.3\.up_proj"):
        load_model(path, ModelConfig.from_pretrained(path), progress=False)


def test_unexpected_tensor_is_named(tmp_path: Path, tiny: Path):
    path = _copy_with(tmp_path, tiny, lambda t: {**t, "model.layers.0.mlp.surprise.weight": torch.zeros(2)})
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.surprise\.weight'"):
        load_model(path, ModelConfig.from_pretrained(path), progress=False)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path: Path, tiny: Path):
    name = "model.layers.2.attention.dense.weight"
    path = _copy_with(tmp_path, tiny, lambda t: {**t, name: t[name][:, :-1].contiguous()})
    with pytest.raises(CheckpointError, match=r"dense\.weight' has shape \(64, 63\), expected \(64, 64\)"):
        load_model(path, ModelConfig.from_pretrained(path), progress=False)


def test_index_naming_a_missing_shard_is_an_error(tmp_path: Path, tiny_checkpoint):
    path = shutil.copytree(tiny_checkpoint(seed=0, shards=2), tmp_path / "s")  # a copy: this test deletes a shard
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard"):
        load_model(path, ModelConfig.from_pretrained(path), progress=False)


def test_config_errors_are_clear(tmp_path: Path, tiny: Path):
    raw = json.loads((tiny / "config.json").read_text())
    with pytest.raises(ValueError, match="model_type"):
        ModelConfig.from_dict({**raw, "model_type": "llama"})
    with pytest.raises(ValueError, match="lacks required field.*num_experts"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_experts"})
    with pytest.raises(FileNotFoundError):
        ModelConfig.from_pretrained(tmp_path)


def test_dummy_weights_need_no_safetensors(tmp_path: Path, tiny: Path):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((tiny / "config.json").read_text())
    model = load_model(bare, ModelConfig.from_pretrained(bare), load_format="dummy", progress=False)
    assert torch.isfinite(model.lm_head.weight).all()
    with pytest.raises(CheckpointError, match="no \\*\\.safetensors"):
        load_model(bare, ModelConfig.from_pretrained(bare), progress=False)
