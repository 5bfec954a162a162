"""Which part of every weight a tensor-/expert-parallel rank holds (docs/scaling.md), written once and used
twice: `shard_model_` cuts a model's parameters to the rank's shapes (on the meta device, before anything is
allocated), and `RankLayout.cut` tells the loader which rows or columns of each checkpoint tensor to read, so a
rank never holds more than its shard plus the replicated tensors.

Megatron-style layout, one all-reduce after attention and one after the MLP of every layer:
- attention: rank r keeps num_attention_heads / tp query heads and num_key_value_heads / tp KV heads (the
  packed qkv rows of its heads, the o_proj columns of its heads); with more ranks than KV heads, the one KV
  head its query heads read (each KV head then lives on tp / nkv ranks);
- dense MLP and shared expert: intermediate / tp of the SwiGLU (gate and up rows, down columns);
- routed experts: ep 1 cuts every expert's intermediate the same way; ep == tp places whole experts
  [r E / ep, (r + 1) E / ep) on rank r;
- embedding and lm_head: vocabulary-parallel when tp divides vocab_size (rank r holds token rows
  [r V / tp, (r + 1) V / tp): its embedding looks up only those ids and the ranks' rows are summed, its lm_head
  gives those logits and the ranks' slices are gathered); replicated otherwise;
- norms and router are replicated.
FP8 block scales follow their weights in units of 128-row/column blocks, so an FP8 layout must cut on block
boundaries (`check_layout`); quantising at load then gives each rank exactly the blocks one process has.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from redraft.engine.model.config import ModelConfig
from redraft.kernels.fp8 import BLOCK

Ranges = list[tuple[int, int]]  # [start, stop) pieces of one dimension, concatenated in order


@dataclasses.dataclass(frozen=True)
class Cut:
    """The part of a tensor a rank reads: the `ranges` of dimension `dim`, concatenated."""

    dim: int
    ranges: Ranges

    def apply(self, t: Any) -> torch.Tensor:
        """Cut a tensor (or a safetensors slice, reading only these ranges)."""
        if self.dim == 0:
            parts = [t[a:b] for a, b in self.ranges]
        elif self.dim == 1:
            parts = [t[:, a:b] for a, b in self.ranges]
        else:
            parts = [t[:, :, a:b] for a, b in self.ranges]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=self.dim)

    def in_blocks(self) -> "Cut":
        """The same cut on a block-scale grid (every range on 128 boundaries: check_layout)."""
        return Cut(self.dim, [(a // BLOCK, b // BLOCK) for a, b in self.ranges])


SKIP = Cut(-1, [])  # a tensor this rank does not hold at all (another rank's expert)

# official tensor names of the weights that are cut (and of their FP8 block scales)
_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_SWIGLU = re.compile(r"model\.layers\.\d+\.mlp\.(?:shared_experts\.)?(gate_proj|up_proj|down_proj)\.weight(_scale_inv)?$")
_ATTN = re.compile(r"model\.layers\.\d+\.attention\.(query_key_value|dense)\.weight(_scale_inv)?$")
_VOCAB = ("model.word_embeddings.weight", "lm_head.weight")


@dataclasses.dataclass(frozen=True)
class RankLayout:
    """Rank `rank` of `tp` tensor-parallel ranks, `ep` (1 or tp) of them expert-parallel."""

    rank: int
    tp: int
    ep: int = 1

    def part(self, size: int) -> tuple[int, int]:
        """This rank's [start, stop) of a dimension cut in tp equal parts."""
        chunk = size // self.tp
        return self.rank * chunk, (self.rank + 1) * chunk

    def experts(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the routed experts this rank holds."""
        if self.ep == 1:
            return 0, num_experts
        n = num_experts // self.ep
        return self.rank * n, n

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        """(first, count) of the KV heads this rank keeps: nkv / tp of them, or, with more ranks than KV heads,
        the one its query heads read (replicated on tp / nkv ranks, as in SGLang)."""
        nkv = cfg.num_key_value_heads
        if self.tp <= nkv:
            return self.rank * nkv // self.tp, nkv // self.tp
        return self.rank * nkv // self.tp, 1

    def vocab_rows(self, cfg: ModelConfig) -> tuple[int, int] | None:
        """[start, stop) of the token rows of the embedding and lm_head this rank holds; None when tp does not
        divide the vocabulary (both are then replicated; LLaDA2's 157184 divides 2, 4, 8)."""
        return None if cfg.vocab_size % self.tp else self.part(cfg.vocab_size)

    def qkv_rows(self, cfg: ModelConfig) -> Ranges:
        d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        first, n = self.kv_heads(cfg)
        q, k = self.part(nq * d), (first * d, (first + n) * d)
        return [q, (nq * d + k[0], nq * d + k[1]), ((nq + nkv) * d + k[0], (nq + nkv) * d + k[1])]

    def cut(self, name: str, cfg: ModelConfig) -> Cut | None:
        """The part of checkpoint tensor `name` (official name, full shape) this rank reads: None for all of it (replicated),
        SKIP for none. A `_scale_inv` block grid is cut like its weight, in blocks."""
        if m := _EXPERT.match(name):
            expert, proj, scale = int(m.group(1)), m.group(2), m.group(3)
            if self.ep > 1:
                first, n = self.experts(cfg.num_experts)
                return None if first <= expert < first + n else SKIP
            return self._swiglu_cut(proj, scale, cfg.moe_intermediate_size)
        if m := _SWIGLU.match(name):
            shared = ".shared_experts." in name
            inter = cfg.moe_intermediate_size * cfg.num_shared_experts if shared else cfg.intermediate_size
            return self._swiglu_cut(m.group(1), m.group(2), inter)
        if m := _ATTN.match(name):
            proj, scale = m.group(1), m.group(2)
            full = Cut(0, self.qkv_rows(cfg)) if proj == "query_key_value" else \
                Cut(1, [self.part(cfg.num_attention_heads * cfg.head_dim)])
            return full.in_blocks() if scale else full
        if name in _VOCAB:
            rows = self.vocab_rows(cfg)
            return None if rows is None else Cut(0, [rows])
        if name.endswith(".bias") and ".attention." in name:
            raise ValueError("tensor parallelism does not support checkpoints with linear biases yet")
        return None

    def _swiglu_cut(self, proj: str, scale: str | None, inter: int) -> Cut:
        full = Cut(1, [self.part(inter)]) if proj == "down_proj" else Cut(0, [self.part(inter)])
        return full.in_blocks() if scale else full

    def local_index(self, index: tuple, cut: Cut | None, num_experts: int) -> tuple:
        """A loader target index (expert ints, a gate|up row slice) in the rank's parameter: experts renumbered
        from the rank's first, a row slice of a packed gate|up cut in tp when the rows were cut."""
        first = self.experts(num_experts)[0]
        rows_cut = cut is not None and cut.dim == 0
        return tuple((slice(i.start // self.tp, i.stop // self.tp) if rows_cut else i) if isinstance(i, slice)
                     else i - first for i in index)


def check_layout(cfg: ModelConfig, tp: int, ep: int, quantization: str | None = None) -> None:
    """Clear errors for a layout the model cannot take."""
    if tp < 1 or ep not in (1, tp):
        raise ValueError(f"ep_size must be 1 or equal to tp_size ({tp}), not {ep}")
    cut = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
           "moe_intermediate_size": cfg.moe_intermediate_size}
    for name, n in cut.items():
        if n % tp:
            raise ValueError(f"tp_size {tp} does not divide {name} = {n}")
    nkv = cfg.num_key_value_heads
    if nkv % tp and tp % nkv:  # split the KV heads, or replicate each on tp / nkv ranks
        raise ValueError(f"tp_size {tp} neither divides num_key_value_heads = {nkv} nor is a multiple of it")
    if cfg.num_experts % ep:
        raise ValueError(f"ep_size {ep} does not divide num_experts = {cfg.num_experts}")
    if cfg.use_qkv_bias or cfg.use_bias:
        raise ValueError("tensor parallelism does not support checkpoints with linear biases yet")
    if quantization == "fp8" and tp > 1:
        widths = {"query heads x head_dim": cfg.num_attention_heads * cfg.head_dim,
                  "KV heads x head_dim": max(nkv, tp) * cfg.head_dim,
                  "intermediate_size": cfg.intermediate_size,
                  "moe_intermediate_size x num_shared_experts": cfg.moe_intermediate_size * cfg.num_shared_experts}
        if ep == 1:
            widths["moe_intermediate_size"] = cfg.moe_intermediate_size
        for name, n in widths.items():
            if n and (n // tp) % BLOCK:
                raise ValueError(f"FP8 with tp_size {tp}: each rank's share of {name} ({n} / {tp} = {n // tp}) must be "
                                 f"whole {BLOCK}-wide blocks (block scales cannot be split); use a smaller tp_size"
                                 + (" or ep_size = tp_size" if name == "moe_intermediate_size" else ""))


# ---- the model side ----------------------------------------------------------------------------------------
def shard_model_(model: nn.Module, layout: RankLayout) -> nn.Module:
    """Cut `model` (an LLaDA2Model, FP8 or not, on any device: meta before allocation in load_model) down to
    `layout`'s shard in place; model.cfg becomes the rank's view (its heads and intermediate sizes; vocab_size
    stays whole: the logits are gathered whole)."""
    from redraft.engine.model.model import MoE  # the model imports no parallelism; this module knows the model

    cfg = model.cfg
    tp = layout.tp
    check_layout(cfg, tp, layout.ep, getattr(model, "quantization", None))
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.attn
            _cut_(attn.qkv, "weight", Cut(0, layout.qkv_rows(cfg)))
            _cut_(attn.o_proj, "weight", Cut(1, [layout.part(cfg.num_attention_heads * cfg.head_dim)]))
            attn.n_q, attn.n_kv = cfg.num_attention_heads // tp, layout.kv_heads(cfg)[1]
            mlp = layer.mlp
            if isinstance(mlp, MoE):
                if mlp.shared is not None:
                    _cut_swiglu_(mlp.shared, layout)
                _cut_experts_(mlp, layout)
            else:
                _cut_swiglu_(mlp, layout)
        if (rows := layout.vocab_rows(cfg)) is not None:
            tied = model.lm_head.weight is model.embed.weight
            model.embed = VocabShardEmbedding(Cut(0, [rows]).apply(model.embed.weight), rows[0])
            model.lm_head.weight = model.embed.weight if tied else \
                nn.Parameter(Cut(0, [rows]).apply(model.lm_head.weight), requires_grad=False)
            model.lm_head.out_features = rows[1] - rows[0]
    model.cfg = dataclasses.replace(cfg, num_attention_heads=cfg.num_attention_heads // tp,
                                    num_key_value_heads=layout.kv_heads(cfg)[1],
                                    intermediate_size=cfg.intermediate_size // tp,
                                    moe_intermediate_size=cfg.moe_intermediate_size // tp)
    return model


class VocabShardEmbedding(nn.Module):
    """The embedding rows [start, start + len(weight)) of a vocabulary-parallel rank: ids outside them give zero
    rows, so the sum over the ranks (an all-reduce, engine/runtime/tensor_parallel.py) is the full lookup, exactly."""

    def __init__(self, weight: torch.Tensor, start: int):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [V / tp, H]
        self.start = start

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return out.masked_fill_(outside[..., None], 0.0)


def is_vocab_parallel(model: nn.Module) -> bool:
    return isinstance(getattr(model, "embed", None), VocabShardEmbedding)


def _cut_(module: nn.Module, name: str, cut: Cut, whole_experts: bool = False) -> None:
    """Cut parameter `name` of `module`, and its block scales `<name>_scale` (FP8) the same way: in blocks, or
    as they are when the cut picks whole experts."""
    setattr(module, name, nn.Parameter(cut.apply(getattr(module, name)).contiguous(), requires_grad=False))
    scale = getattr(module, name + "_scale", None)
    if scale is not None:
        setattr(module, name + "_scale", (cut if whole_experts else cut.in_blocks()).apply(scale).contiguous())
    if hasattr(module, "out_features"):  # nn.Linear / Fp8Linear describe themselves by these
        module.out_features, module.in_features = module.weight.shape


def _cut_swiglu_(mlp: nn.Module, layout: RankLayout) -> None:
    """A dense SwiGLU (DenseMLP / Fp8DenseMLP, also the shared expert): gate and up rows, down columns."""
    inter = mlp.down.shape[1]
    part = layout.part(inter)
    _cut_(mlp, "gate_up", Cut(0, [part, (inter + part[0], inter + part[1])]))
    _cut_(mlp, "down", Cut(1, [part]))
    if hasattr(mlp, "inter"):
        mlp.inter = inter // layout.tp


def _cut_experts_(moe: nn.Module, layout: RankLayout) -> None:
    e, inter = moe.w13.shape[0], moe.w2.shape[2]
    if layout.ep > 1:  # whole experts [first, first + n)
        first, n = layout.experts(e)
        _cut_(moe, "w13", Cut(0, [(first, first + n)]), whole_experts=True)
        _cut_(moe, "w2", Cut(0, [(first, first + n)]), whole_experts=True)
        moe.first_expert = first
        return
    part = layout.part(inter)  # every expert, the rank's slice of its intermediate
    _cut_(moe, "w13", Cut(1, [part, (inter + part[0], inter + part[1])]))
    _cut_(moe, "w2", Cut(2, [part]))
