"""Tiny random LLaDA2 checkpoints in the exact Hugging Face layout, for tests and CPU demos.

The weights are random but shaped so that decoding exercises every path of draft-and-edit: the final logits'
top-1 probabilities at masked positions spread from ~0.1 to ~1.0 (about half above 0.5, a third above 0.7), so
the 0.5 / 0.7 unmasking thresholds, the single-token fallback, T2T edits, blocks that converge and blocks cut
at max_post_steps all happen; EOS ends generation within 100 tokens on a good share of prompts, and MASK is
never predicted. Measured with tests/naive_llada2.py over seeds 0-7; tests/test_tiny_checkpoint.py guards it.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as _HFTokenizer

from redraft.engine.model.config import ModelConfig
from redraft.engine.text.tokenizer import (BOS_TOKEN, EOS_TOKEN, MASK_TOKEN, load_default_chat_template,
                                      save_pretrained_tokenizer)

# The tiny checkpoints' byte-level BPE, trained once on a toy corpus (training/bpe.py, which rewrites this file)
# and frozen here, so that making a checkpoint trains nothing.
TINY_TOKENIZER_FILE = Path(__file__).resolve().parent / "tiny_tokenizer.json"
TINY_TOKENIZER_VOCAB = 448  # 256 bytes + 12 specials + ~180 merges

# The architecture of every tiny checkpoint; vocab_size and pad_token_id come from the tokenizer.
TINY_CONFIG: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 600000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
}

# Init scales, tuned by measuring decoding on the resulting models (see the module docstring).
_EMBED_STD = 1.0
_LM_HEAD_GAIN = 1.5  # logits std ~ gain * row scale (the final norm makes |h| = sqrt(H))
_LM_HEAD_ROW_LOGSTD = 0.6  # log-normal spread of row norms: a few tokens are "confident favourites"
_QK_NORM_GAIN = 2.0  # sharper attention, so neighbouring mask positions diverge
# Hidden coordinate 0 is a "bias unit": every embedding row holds the same value there and no layer writes to
# it, so after the final norm it is positive at every position (larger where the state is quieter). The EOS
# row of lm_head gets a positive weight on it, which makes EOS reachable whatever the seed.
_BIAS_COORD = 0
_BIAS_VALUE = 1.0
_EOS_BOOST = 13.0
_SELF_COPY = 20.0  # lm_head leans towards each token's own embedding: filled positions tend to keep their token
_MASK_EMBED_SCALE = 0.05  # a masked position's state should come from its context, not the mask embedding
_EXPERT_BIAS_STD = 0.05

# LLaDA2.2 tiny checkpoints (`llada22=True`): the two structural tokens, added as special tokens after the tiny
# vocabulary, block routing with half the experts admitted per 32-token block, and generation defaults. DELETE
# and SPLIT read the bias unit like EOS (a fixed lean, the same for every seed) on top of a random row, so they
# are proposed at some positions of most blocks without taking over: measured with tests/naive_llada22.py.
DELETE_TOKEN = "<|delete|>"
SPLIT_TOKEN = "<|split|>"
LLADA22_CONFIG: dict[str, Any] = {"expert_capacity": 4, "block_size": 32}
LLADA22_GENERATION: dict[str, Any] = {"threshold": 0.5, "edit_threshold": 0.0, "steps": 32, "max_post_steps": 16,
                                      "max_steps_per_block": 1000}
_DELETE_BOOST = 15.0
_SPLIT_BOOST = 16.5


@lru_cache(maxsize=1)
def _tiny_tokenizer_json() -> str:
    return TINY_TOKENIZER_FILE.read_text(encoding="utf-8")


def tiny_tokenizer() -> _HFTokenizer:
    """The tokenizer every tiny checkpoint ships (independent of the weight seed)."""
    return _HFTokenizer.from_str(_tiny_tokenizer_json())


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


class _Draws:
    """Random float32 tensors from one generator. Every tensor of a checkpoint is drawn in a fixed order (the
    order of the calls defines the stream, so reordering them would change every seed's weights)."""

    def __init__(self, gen: torch.Generator, hidden: int) -> None:
        self.gen, self.h = gen, hidden

    def normal(self, *shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen) * std

    def linear(self, out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        # Unit-variance outputs for unit-variance inputs: activations neither vanish nor explode with depth.
        return self.normal(out_f, in_f, std=gain / math.sqrt(in_f))

    def norm_weight(self, n: int, gain: float = 1.0) -> torch.Tensor:
        return gain * (1.0 + self.normal(n, std=0.1))

    def residual_out(self, out_f: int, in_f: int) -> torch.Tensor:
        # Weights that write into the residual stream leave the bias coordinate untouched.
        w = self.linear(out_f, in_f)
        w[_BIAS_COORD] = 0.0
        return w

    def swiglu(self, prefix: str, inter: int, out: dict[str, torch.Tensor]) -> None:
        out[f"{prefix}.gate_proj.weight"] = self.linear(inter, self.h)
        out[f"{prefix}.up_proj.weight"] = self.linear(inter, self.h)
        out[f"{prefix}.down_proj.weight"] = self.residual_out(self.h, inter)


def _layer_weights(cfg: ModelConfig, i: int, draw: _Draws, t: dict[str, torch.Tensor]) -> None:
    """Layer i's tensors into `t`: attention, then the dense MLP (first_k_dense_replace) or the MoE."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    p = f"model.layers.{i}"
    t[f"{p}.input_layernorm.weight"] = draw.norm_weight(h)
    t[f"{p}.attention.query_key_value.weight"] = draw.linear((nq + 2 * nkv) * d, h)
    t[f"{p}.attention.query_layernorm.weight"] = draw.norm_weight(d, _QK_NORM_GAIN)
    t[f"{p}.attention.key_layernorm.weight"] = draw.norm_weight(d, _QK_NORM_GAIN)
    t[f"{p}.attention.dense.weight"] = draw.residual_out(h, nq * d)
    t[f"{p}.post_attention_layernorm.weight"] = draw.norm_weight(h)
    if i < cfg.first_k_dense_replace:
        draw.swiglu(f"{p}.mlp", cfg.intermediate_size, t)
        return
    t[f"{p}.mlp.gate.weight"] = draw.linear(cfg.num_experts, h)
    t[f"{p}.mlp.gate.expert_bias"] = draw.normal(cfg.num_experts, std=_EXPERT_BIAS_STD)
    for e in range(cfg.num_experts):
        draw.swiglu(f"{p}.mlp.experts.{e}", cfg.moe_intermediate_size, t)
    # The shared expert(s) are one SwiGLU of width num_shared_experts * moe_intermediate_size.
    draw.swiglu(f"{p}.mlp.shared_experts", cfg.moe_intermediate_size * cfg.num_shared_experts, t)


def _lm_head(cfg: ModelConfig, draw: _Draws, embed: torch.Tensor, eos_id: int, mask_id: int) -> torch.Tensor:
    """[V, H]: random rows of log-normal norms, EOS and MASK wired to the bias unit, a lean to self-copy."""
    v, h = cfg.vocab_size, cfg.hidden_size
    row_scale = torch.exp(draw.normal(v, 1, std=_LM_HEAD_ROW_LOGSTD))
    lm_head = draw.linear(v, h, _LM_HEAD_GAIN) * row_scale
    # The decoder must never "unmask" to MASK itself: a strongly negative weight on the bias unit.
    lm_head[mask_id] = 0.0
    lm_head[mask_id, _BIAS_COORD] = -_EOS_BOOST
    # EOS reads only the bias unit: its logit is EOS_BOOST / rms(h), the same scale for every seed.
    lm_head[eos_id] = 0.0
    lm_head[eos_id, _BIAS_COORD] = _EOS_BOOST
    # Filled positions lean towards keeping their own token (EOS too, so an EOS tail is stable); without
    # this, T2T edits flip random tokens forever and no block ever converges before max_post_steps.
    copy = (_SELF_COPY / h) * embed
    copy[:, _BIAS_COORD] = 0.0  # the bias unit carries no token identity
    copy[mask_id] = 0.0
    for structural, boost in ((cfg.delete_token_id, _DELETE_BOOST), (cfg.split_token_id, _SPLIT_BOOST)):
        if structural is not None:  # LLaDA2.2: a lean towards the edits
            lm_head[structural, _BIAS_COORD] = boost
            copy[structural] = 0.0
    return lm_head + copy


def _random_weights(cfg: ModelConfig, gen: torch.Generator, eos_id: int, mask_id: int) -> dict[str, torch.Tensor]:
    """All tensors, official names, float32 (cast later). Creation order is fixed: it defines the stream."""
    draw = _Draws(gen, cfg.hidden_size)
    t: dict[str, torch.Tensor] = {}
    embed = draw.normal(cfg.vocab_size, cfg.hidden_size, std=_EMBED_STD)  # [V, H]
    embed[mask_id] *= _MASK_EMBED_SCALE
    embed[:, _BIAS_COORD] = _BIAS_VALUE
    t["model.word_embeddings.weight"] = embed
    for i in range(cfg.num_hidden_layers):
        _layer_weights(cfg, i, draw, t)
    final_norm = draw.norm_weight(cfg.hidden_size)
    final_norm[_BIAS_COORD] = 1.0  # keeps the EOS logit's scale the same for every seed
    t["model.norm.weight"] = final_norm
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = _lm_head(cfg, draw, embed, eos_id, mask_id)
    return t


def _shard(names: list[str], tensors: dict[str, torch.Tensor], shards: int) -> list[list[str]]:
    """Split names (in order) into `shards` contiguous groups of roughly equal bytes, none empty."""
    sizes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    total = max(1, sum(sizes))
    groups: list[list[str]] = [[] for _ in range(shards)]
    g, acc = -1, 0
    for idx, (name, size) in enumerate(zip(names, sizes)):
        by_bytes = min(shards - 1, acc * shards // total)
        must_reach = shards - (len(names) - idx)  # the names left must still fill the shards left
        g = min(g + 1, max(g, by_bytes, must_reach))  # never skip a shard, never go back
        groups[g].append(name)
        acc += size
    return groups


def _write_safetensors(out: Path, tensors: dict[str, torch.Tensor], shards: int) -> None:
    """model.safetensors, or `shards` model-0000i-of-0000N.safetensors files plus their index."""
    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a re-run with another shard count must not leave stale files
    meta = {"format": "pt"}
    names = list(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata=meta)
        return
    if shards > len(names):
        raise ValueError(f"cannot split {len(names)} tensors into {shards} shards")
    weight_map: dict[str, str] = {}
    for k, group in enumerate(_shard(names, tensors, shards), start=1):
        fname = f"model-{k:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in group}, str(out / fname), metadata=meta)
        weight_map.update({n: fname for n in group})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def _write_configs(out: Path, raw: dict[str, Any], eos_id: int, bos_id: int,
                   generation_extra: dict[str, Any] | None = None) -> None:
    """config.json (the architecture plus the fields Hugging Face's files carry) and generation_config.json."""
    config_json = {
        **raw,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "rope_scaling": None,
        "router_dtype": "fp32",
        "use_cache": False,
        "output_router_logits": False,
        "eos_token_id": eos_id,
        "bos_token_id": bos_id,
    }
    (out / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {"bos_token_id": bos_id, "eos_token_id": eos_id, "pad_token_id": eos_id, **(generation_extra or {})}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def make_tiny_checkpoint(out_dir: str | Path, seed: int = 0, *, dtype: str = "float32", shards: int = 1,
                         config_overrides: dict[str, Any] | None = None, llada22: bool = False) -> Path:
    """Write a tiny random LLaDA2 checkpoint to `out_dir` and return its path.

    llada22: a LLaDA2.2 checkpoint (docs/llada22.md): DELETE and SPLIT as two added special tokens (the last two
    vocabulary rows), `expert_capacity`, `block_size` and the two ids in config.json, the 2.2 decoding defaults
    in generation_config.json.

    Layout: config.json, generation_config.json, model.safetensors (or model-0000i-of-0000N.safetensors plus
    model.safetensors.index.json when shards > 1), tokenizer.json, tokenizer_config.json. Deterministic for a
    given (seed, dtype, shards, config_overrides). `expert_bias` is always float32, as in LLaDA2.1.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    if shards < 1:
        raise ValueError("shards must be >= 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = tiny_tokenizer()
    if llada22:
        tok.add_special_tokens([DELETE_TOKEN, SPLIT_TOKEN])
    save_pretrained_tokenizer(tok, out, load_default_chat_template(), model_max_length=TINY_CONFIG[
        "max_position_embeddings"])
    n_tok = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(EOS_TOKEN)
    bos_id = tok.token_to_id(BOS_TOKEN)
    mask_id = tok.token_to_id(MASK_TOKEN)

    raw: dict[str, Any] = {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe",
                           **TINY_CONFIG, "vocab_size": n_tok, "pad_token_id": eos_id, "torch_dtype": dtype}
    if llada22:
        raw.update(LLADA22_CONFIG, delete_token_id=tok.token_to_id(DELETE_TOKEN),
                   split_token_id=tok.token_to_id(SPLIT_TOKEN))
    raw.update(config_overrides or {})
    if raw["vocab_size"] < n_tok:
        raise ValueError(f"vocab_size {raw['vocab_size']} is smaller than the tokenizer ({n_tok} tokens)")
    cfg = ModelConfig.from_dict(raw)  # validates the overrides before any weight is drawn

    gen = torch.Generator(device="cpu").manual_seed(seed)
    tensors = _random_weights(cfg, gen, eos_id, mask_id)
    target = _DTYPES[dtype]
    tensors = {n: (t.float() if n.endswith(".expert_bias") else t.to(target)).contiguous()
               for n, t in tensors.items()}
    _write_safetensors(out, tensors, shards)
    _write_configs(out, raw, eos_id, bos_id, LLADA22_GENERATION if llada22 else None)
    return out
