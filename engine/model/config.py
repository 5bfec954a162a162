"""LLaDA2-MoE model configuration, read from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from redraft.protocol.sampling_params import BLOCK_SIZE  # noqa: F401 - defined once, re-exported for the model side


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int  # dense SwiGLU layers (layer < first_k_dense_replace)
    moe_intermediate_size: int  # per routed expert and per shared expert
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int = 1
    first_k_dense_replace: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    score_function: str = "sigmoid"
    moe_router_enable_expert_bias: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 600000.0
    partial_rotary_factor: float = 0.5
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    use_qk_norm: bool = True
    use_qkv_bias: bool = False
    use_bias: bool = False
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    # LLaDA2.2 (../docs/llada22.md): experts admitted per routing block of `block_size` absolute positions of one
    # request (0: LLaDA2.0/2.1's grouped routing), and the vocabulary rows of the structural edits
    expert_capacity: int = 0
    block_size: int = BLOCK_SIZE
    delete_token_id: int | None = None
    split_token_id: int | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def block_routing(self) -> bool:
        """LLaDA2.2's per-block expert routing (grouped routing otherwise)."""
        return self.expert_capacity > 0

    @property
    def structural_edits(self) -> bool:
        """Whether the checkpoint predicts DELETE and SPLIT, so the Levenshtein step can run on it."""
        return self.delete_token_id is not None and self.split_token_id is not None

    @property
    def edit_token_ids(self) -> tuple[int, ...]:
        """The ids that are edits, not text (LLaDA2.2's DELETE and SPLIT): outside logprobs and likelihoods."""
        return (self.delete_token_id, self.split_token_id) if self.structural_edits else ()  # type: ignore[return-value]

    @property
    def is_moe_layer(self) -> list[bool]:
        return [i >= self.first_k_dense_replace for i in range(self.num_hidden_layers)]

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        raw = dict(raw)
        if raw.get("model_type") not in (None, "llada2_moe"):
            raise ValueError(f"unsupported model_type {raw.get('model_type')!r}: redraft serves 'llada2_moe'")
        if "head_dim" not in raw or raw["head_dim"] is None:
            raw["head_dim"] = raw["hidden_size"] // raw["num_attention_heads"]
        if raw.get("score_function", "sigmoid") != "sigmoid":
            raise ValueError(f"unsupported score_function {raw['score_function']!r}: LLaDA2 uses 'sigmoid'")
        if raw.get("rope_scaling"):
            raise ValueError(f"rope_scaling={raw['rope_scaling']!r} is not supported")
        names = {f.name for f in fields(cls)} - {"extra"}
        missing = [n for n in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                               "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                               "num_experts", "num_experts_per_tok") if n not in raw]
        if missing:
            raise ValueError(f"config.json lacks required field(s): {', '.join(missing)}")
        known = {k: v for k, v in raw.items() if k in names}
        extra = {k: v for k, v in raw.items() if k not in names}
        cfg = cls(**known, extra=extra)
        cfg.validate()
        return cfg

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))

    def validate(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.block_routing:  # LLaDA2.2 keeps n_group / topk_group in its config but does not use them
            self._validate_groups()
        if self.expert_capacity and not self.num_experts_per_tok <= self.expert_capacity <= self.num_experts:
            raise ValueError("expert_capacity must be in num_experts_per_tok..num_experts (or 0: grouped routing)")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if (self.delete_token_id is None) != (self.split_token_id is None):
            raise ValueError("delete_token_id and split_token_id come together (LLaDA2.2) or not at all")
        if self.rotary_dim % 2:
            raise ValueError("rotary dim (head_dim * partial_rotary_factor) must be even")

    def _validate_groups(self) -> None:
        """Grouped routing's settings (LLaDA2.0/2.1)."""
        if self.num_experts % self.n_group:
            raise ValueError("num_experts must be a multiple of n_group")
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError("topk_group must be in 1..n_group")
        if self.num_experts_per_tok > (self.num_experts // self.n_group) * self.topk_group:
            raise ValueError("num_experts_per_tok exceeds the experts available in topk_group groups")

    def num_params(self) -> int:
        """Parameter count (all experts), for logs and benchmarks."""
        h, d = self.hidden_size, self.head_dim
        attn = h * (self.num_attention_heads + 2 * self.num_key_value_heads) * d + self.num_attention_heads * d * h
        dense_mlp = 3 * h * self.intermediate_size
        moe = 3 * h * self.moe_intermediate_size * (self.num_experts + self.num_shared_experts) + self.num_experts * h
        n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
        layers = self.num_hidden_layers * (attn + 2 * h) + n_dense * dense_mlp + (self.num_hidden_layers - n_dense) * moe
        return layers + 2 * self.vocab_size * h + h
