"""Tiny random checkpoints: Hugging Face layout, official tensor names and shapes, shards, determinism, and
weights that exercise every path of draft-and-edit decoding."""

from __future__ import annotations

import json
import random
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.tiny import TINY_CONFIG, TINY_TOKENIZER_FILE, make_tiny_checkpoint
from redraft.engine.text.tokenizer import Tokenizer
from redraft.training.bpe import tiny_corpus, train_tiny_tokenizer


def official_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape, written from the facts file's table (independent of the engine's loader)."""
    h, d, v = c["hidden_size"], c["head_dim"], c["vocab_size"]
    hq, hkv = c["num_attention_heads"], c["num_key_value_heads"]
    inter, moe_inter, experts = c["intermediate_size"], c["moe_intermediate_size"], c["num_experts"]
    shapes: dict[str, tuple[int, ...]] = {"model.word_embeddings.weight": (v, h), "model.norm.weight": (h,),
                                          "lm_head.weight": (v, h)}

    def swiglu(prefix: str, width: int) -> None:
        shapes[f"{prefix}.gate_proj.weight"] = (width, h)
        shapes[f"{prefix}.up_proj.weight"] = (width, h)
        shapes[f"{prefix}.down_proj.weight"] = (h, width)

    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}"
        shapes[f"{p}.input_layernorm.weight"] = (h,)
        shapes[f"{p}.attention.query_key_value.weight"] = ((hq + 2 * hkv) * d, h)
        shapes[f"{p}.attention.query_layernorm.weight"] = (d,)
        shapes[f"{p}.attention.key_layernorm.weight"] = (d,)
        shapes[f"{p}.attention.dense.weight"] = (h, hq * d)
        shapes[f"{p}.post_attention_layernorm.weight"] = (h,)
        if i < c["first_k_dense_replace"]:
            swiglu(f"{p}.mlp", inter)
        else:
            shapes[f"{p}.mlp.gate.weight"] = (experts, h)
            shapes[f"{p}.mlp.gate.expert_bias"] = (experts,)
            for e in range(experts):
                swiglu(f"{p}.mlp.experts.{e}", moe_inter)
            swiglu(f"{p}.mlp.shared_experts", moe_inter * c["num_shared_experts"])
    return shapes


def read_all(model_dir: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                assert name not in out, f"{name} stored twice"
                out[name] = st.get_tensor(name)
    return out


# `ckpt` (seed 0) comes from tests/conftest.py, built by make_tiny_checkpoint like `sharded`; the tests below
# that call make_tiny_checkpoint themselves are testing it (fresh folders, reruns, errors).
@pytest.fixture(scope="module")
def sharded(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0, shards=3)


def test_files_present(ckpt: Path) -> None:
    names = {p.name for p in ckpt.iterdir()}
    assert names == {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"}


def test_config_json(ckpt: Path) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["architectures"] == ["LLaDA2MoeModelLM"]
    assert raw["model_type"] == "llada2_moe"
    for key, value in TINY_CONFIG.items():
        assert raw[key] == value, key
    cfg = ModelConfig.from_pretrained(ckpt)
    for f in fields(ModelConfig):
        if f.name != "extra" and f.name not in LLADA22_FIELDS:  # a 2.1 checkpoint has none of 2.2's fields
            assert f.name in raw, f"config.json lacks {f.name}"
    assert not LLADA22_FIELDS & set(raw)
    tok = Tokenizer.from_pretrained(ckpt)
    assert cfg.vocab_size == tok.vocab_size
    assert 384 <= cfg.vocab_size <= 512
    assert cfg.pad_token_id == tok.eos_token_id == raw["eos_token_id"]
    assert cfg.rotary_dim == 8 and cfg.torch_dtype == "float32"
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tok.eos_token_id and gen["pad_token_id"] == tok.eos_token_id


LLADA22_FIELDS = {"expert_capacity", "block_size", "delete_token_id", "split_token_id"}


def test_llada22_checkpoint(tiny_checkpoint, ckpt: Path) -> None:
    """make_tiny_checkpoint(llada22=True): 2.2's fields in config.json, DELETE and SPLIT as the two added special
    tokens after the 2.1 vocabulary, the Levenshtein step's defaults in generation_config.json."""
    d = tiny_checkpoint(seed=0, llada22=True)
    raw = json.loads((d / "config.json").read_text())
    cfg = ModelConfig.from_pretrained(d)
    assert 0 < cfg.expert_capacity < cfg.num_experts and cfg.block_size == 32 and cfg.structural_edits
    tok, old = Tokenizer.from_pretrained(d), Tokenizer.from_pretrained(ckpt)
    assert (cfg.delete_token_id, cfg.split_token_id) == (old.vocab_size, old.vocab_size + 1) == \
        (tok.token_to_id("<|delete|>"), tok.token_to_id("<|split|>"))
    assert cfg.vocab_size == tok.vocab_size == old.vocab_size + 2 and raw["vocab_size"] == cfg.vocab_size
    assert tok.decode([cfg.delete_token_id, cfg.split_token_id]) == ""  # special: skipped in text
    gen = json.loads((d / "generation_config.json").read_text())
    assert {k: gen[k] for k in ("threshold", "edit_threshold", "steps", "max_post_steps", "max_steps_per_block")} == \
        {"threshold": 0.5, "edit_threshold": 0.0, "steps": 32, "max_post_steps": 16, "max_steps_per_block": 1000}


def test_tokenizer_files(ckpt: Path) -> None:
    tok = Tokenizer.from_pretrained(ckpt)
    assert tok.token_to_id("<|mask|>") == tok.mask_token_id
    assert tok.decode(tok.encode("The small cat sees a river.")) == "The small cat sees a river."
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]).endswith("<role>ASSISTANT</role>")


def test_tensor_names_and_shapes_match_the_official_layout(ckpt: Path) -> None:
    raw = json.loads((ckpt / "config.json").read_text())
    tensors = read_all(ckpt)
    expected = official_shapes(raw)
    assert set(tensors) == set(expected)
    for name, shape in expected.items():
        assert tuple(tensors[name].shape) == shape, name


def test_dtypes(ckpt: Path, tmp_path: Path) -> None:
    for name, t in read_all(ckpt).items():
        assert t.dtype == torch.float32, name
    bf16 = make_tiny_checkpoint(tmp_path, seed=0, dtype="bfloat16")
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    for name, t in read_all(bf16).items():
        expected = torch.float32 if name.endswith("mlp.gate.expert_bias") else torch.bfloat16
        assert t.dtype == expected, name


def test_shards_and_index_are_consistent(ckpt: Path, sharded: Path) -> None:
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    weight_map = index["weight_map"]
    tensors = read_all(sharded)
    assert set(weight_map) == set(tensors)
    for fname in files:
        with safe_open(str(sharded / fname), "pt") as st:
            assert set(st.keys()) == {n for n, f in weight_map.items() if f == fname}
            assert st.metadata() == {"format": "pt"}
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    # Same seed, same weights, however they are split.
    single = read_all(ckpt)
    assert set(single) == set(tensors)
    for name, t in single.items():
        assert torch.equal(t, tensors[name]), name


@pytest.mark.parametrize("shards", [2, 7, 82])
def test_every_shard_is_used(tmp_path: Path, shards: int) -> None:
    d = make_tiny_checkpoint(tmp_path, seed=0, shards=shards)
    weight_map = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(weight_map) == 82  # 3 layers of the tiny config
    assert sorted(set(weight_map.values())) == [f"model-{i:05d}-of-{shards:05d}.safetensors"
                                                 for i in range(1, shards + 1)]
    assert not (d / "model.safetensors").exists()


def test_too_many_shards(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shards"):
        make_tiny_checkpoint(tmp_path, shards=83)


def test_rerun_with_another_shard_count_leaves_no_stale_files(tmp_path: Path) -> None:
    make_tiny_checkpoint(tmp_path, seed=1, shards=2)
    make_tiny_checkpoint(tmp_path, seed=1)
    assert sorted(p.name for p in tmp_path.glob("model*")) == ["model.safetensors"]


def test_deterministic_per_seed(ckpt: Path, tmp_path: Path) -> None:
    again = read_all(make_tiny_checkpoint(tmp_path / "a", seed=0))
    first = read_all(ckpt)
    assert all(torch.equal(first[n], again[n]) for n in first)
    assert (tmp_path / "a" / "tokenizer.json").read_text() == (ckpt / "tokenizer.json").read_text()
    other = read_all(make_tiny_checkpoint(tmp_path / "b", seed=1))
    assert not torch.equal(first["lm_head.weight"], other["lm_head.weight"])
    assert not torch.equal(first["model.layers.1.mlp.gate.expert_bias"], other["model.layers.1.mlp.gate.expert_bias"])


def test_config_overrides(tmp_path: Path) -> None:
    d = make_tiny_checkpoint(tmp_path / "o", seed=0, config_overrides={"num_hidden_layers": 2, "vocab_size": 512})
    raw = json.loads((d / "config.json").read_text())
    assert raw["num_hidden_layers"] == 2 and raw["vocab_size"] == 512
    tensors = read_all(d)
    assert set(tensors) == set(official_shapes(raw))
    assert tensors["lm_head.weight"].shape == (512, 64)  # embedding padded beyond the tokenizer
    with pytest.raises(ValueError):
        make_tiny_checkpoint(tmp_path / "bad", config_overrides={"num_key_value_heads": 3})
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_checkpoint(tmp_path / "bad2", config_overrides={"vocab_size": 100})


def test_corpus_is_deterministic() -> None:
    assert tiny_corpus() == tiny_corpus()
    assert len(set(tiny_corpus())) > 100


def test_the_frozen_tiny_tokenizer_is_what_training_makes() -> None:
    """engine/model/tiny_tokenizer.json is the BPE trained on tiny_corpus (`python -m redraft.training.bpe --write-tiny`)."""
    assert TINY_TOKENIZER_FILE.read_text(encoding="utf-8") == train_tiny_tokenizer() + "\n"


# ----- the weights' behaviour, through the independent plain-torch reference -----

@pytest.fixture(scope="module")
def first_step(ckpt: Path) -> tuple[Tokenizer, list[torch.Tensor]]:
    """Final logits at 32 masked positions after each of 6 chat prompts: the first denoising step."""
    ref = pytest.importorskip("naive_llada2")
    model = ref.NaiveLLaDA2(ckpt, dtype=torch.float32)
    tok = Tokenizer.from_pretrained(ckpt)
    rng = random.Random(0)
    corpus = tiny_corpus(60, seed=7)
    out = []
    for _ in range(6):
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": rng.choice(corpus)}]))
        logits = model.forward_logits(torch.tensor(ids + [tok.mask_token_id] * 32))  # [L, V]
        out.append(logits[len(ids):])  # [32, V]
    return tok, out


def test_confidences_spread_over_the_thresholds(first_step) -> None:
    tok, logits = first_step
    p = torch.cat([torch.softmax(lg, -1).max(-1).values for lg in logits])  # top-1 confidence, [6 * 32]
    assert p.min() < 0.3 and p.max() > 0.95
    assert 0.2 < (p > 0.7).float().mean() < 0.9  # Q-mode threshold both met and missed
    assert 0.1 < (p < 0.5).float().mean() < 0.8  # S-mode threshold both met and missed


def test_mask_is_never_predicted_and_eos_is(first_step) -> None:
    tok, logits = first_step
    top = torch.cat([lg.argmax(-1) for lg in logits])
    assert not (top == tok.mask_token_id).any(), "unmasking to MASK would stall decoding"
    # EOS wins at some positions of several prompts, so generation can stop early.
    assert sum(bool((lg.argmax(-1) == tok.eos_token_id).any()) for lg in logits) >= 2
