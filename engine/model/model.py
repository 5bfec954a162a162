"""The LLaDA2-MoE forward pass over a flat, ragged batch of query tokens with a paged block KV cache.

Reads in one sitting: RMSNorm -> packed QKV -> per-head QK RMSNorm -> partial NeoX rotary -> block-causal
paged attention -> output projection; then a dense SwiGLU (first layers) or the sigmoid MoE with a shared expert
(LLaDA2.0/2.1's grouped routing, or LLaDA2.2's block routing when the config has an `expert_capacity`: each
token's routing block comes from the attention metadata, `kernels/moe.py` `routing_blocks`). Parameter layout is
ours (packed/stacked at load); `engine/model/loader.py` maps official names.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from redraft.engine.model.config import ModelConfig
from redraft.kernels.attention import AttentionMetadata, paged_attention_torch
from redraft.kernels.moe import (compute_dtype, local_expert_ids, moe_experts_torch, route_layer_torch,
                                routing_blocks, swiglu)
from redraft.kernels.norm import add_rms_norm_torch, rotary_table, rotary_torch
from redraft.protocol.sampling_params import BLOCK_SIZE

AttentionFn = Callable[..., torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.kernel_backend = "torch"

    def set_kernel_backend(self, backend: str) -> None:
        self.kernel_backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_forward(x, None)[0]

    def add_forward(self, h: torch.Tensor, delta: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + delta), h + delta): the residual add folded into the norm (one launch on "triton")."""
        if self.kernel_backend == "triton":
            from redraft.kernels.norm_triton import add_rms_norm_triton

            return add_rms_norm_triton(h, delta, self.weight, self.eps)
        return add_rms_norm_torch(h, delta, self.weight, self.eps)


class Rotary(nn.Module):
    """Partial NeoX rotary: rotate-half within the first `rotary_dim` dims, absolute positions."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # x: [T, heads, D]
        return rotary_torch(x, positions, self.rotary_dim, self.theta)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_q, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        qkv_out = (self.n_q + 2 * self.n_kv) * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, qkv_out, bias=cfg.use_qkv_bias)
        self.o_proj = nn.Linear(self.n_q * self.head_dim, cfg.hidden_size, bias=cfg.use_bias)
        self.use_qk_norm = cfg.use_qk_norm
        if cfg.use_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.rotary = Rotary(self.head_dim, cfg.rotary_dim, cfg.rope_theta)
        self.eps, self.max_positions = cfg.rms_norm_eps, cfg.max_position_embeddings
        self.rope_table: tuple[torch.Tensor, torch.Tensor] | None = None  # (cos, sin): set on kernel_backend="triton"

    def set_kernel_backend(self, backend: str) -> None:
        """"triton": QK-norm and rotary in one launch (kernels/norm_triton.py) from a cos/sin table built here."""
        self.rope_table = None
        if backend == "triton":
            self.rope_table = rotary_table(self.rotary.rotary_dim, self.rotary.theta, self.max_positions,
                                           self.qkv.weight.device)

    def forward(self, x, meta: AttentionMetadata, k_cache, v_cache, attend: AttentionFn) -> torch.Tensor:
        t = x.shape[0]
        if self.rope_table is not None:
            from redraft.kernels.norm_triton import qk_norm_rope_triton

            qkv = self.qkv(x)  # [T, (Hq + 2 Hkv) D]
            q, k = qk_norm_rope_triton(qkv, meta.positions, *self.rope_table, self.n_q, self.n_kv, self.head_dim,
                                       self.rotary.rotary_dim, self.q_norm.weight if self.use_qk_norm else None,
                                       self.k_norm.weight if self.use_qk_norm else None, self.eps)
            v = qkv[:, (self.n_q + self.n_kv) * self.head_dim:].view(t, self.n_kv, self.head_dim)
            out = attend(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D]
            return self.o_proj(out.reshape(t, self.n_q * self.head_dim))
        q, k, v = self.qkv(x).split(
            [self.n_q * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1
        )
        q = q.view(t, self.n_q, self.head_dim)  # [T, Hq, D]
        k = k.view(t, self.n_kv, self.head_dim)  # [T, Hkv, D]
        v = v.view(t, self.n_kv, self.head_dim)
        if self.use_qk_norm:  # per-head RMSNorm BEFORE rotary
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self.rotary(q, meta.positions), self.rotary(k, meta.positions)
        out = attend(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D]
        return self.o_proj(out.reshape(t, self.n_q * self.head_dim))


class DenseMLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden))  # gate_proj | up_proj
        self.down = nn.Parameter(torch.empty(hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return swiglu(x, self.gate_up, self.down)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg = cfg
        self.router = nn.Parameter(torch.empty(e, h))
        self.register_buffer("expert_bias", torch.zeros(e, dtype=torch.float32))  # stays fp32
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))  # [E, 2I, H] gate | up
        self.w2 = nn.Parameter(torch.empty(e, h, i))  # [E, H, I]
        self.shared = DenseMLP(h, i * cfg.num_shared_experts) if cfg.num_shared_experts else None
        self.first_expert = 0  # expert parallelism: w13/w2 hold experts [first_expert, first_expert + len(w13))
        self.experts: Callable[..., torch.Tensor] = moe_experts_torch  # see LLaDA2Model.set_moe_experts
        # The whole layer (routing, experts, shared expert) as fn(moe, x, labels) when set, chosen by
        # set_kernel_backend: the fused Triton MoE for "triton" (kernels/moe_triton.py), the W8A8 twin for e4m3
        # weights on "torch". labels: each token's routing block (block routing), else None.
        self.impl: Callable[["MoE", torch.Tensor, torch.Tensor | None], torch.Tensor] | None = None
        self.router_f32: torch.Tensor | None = None  # the router weight in fp32 (kernel_backend="triton")

    def set_kernel_backend(self, backend: str) -> None:
        # the router GEMM runs in fp32: its weight converted once here, not in every forward
        self.router_f32 = self.router.detach().float() if backend == "triton" else None
        if backend == "triton":
            from redraft.kernels.moe_triton import moe_forward_triton  # imports triton lazily

            self.impl = moe_forward_triton
        elif self.w13.dtype == torch.float8_e4m3fn:
            from redraft.kernels.fp8 import moe_forward_fp8_torch

            self.impl = moe_forward_fp8_torch
        else:
            self.impl = None

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H]; labels [T]: each token's routing block (`routing_blocks`), needed by block routing only."""
        if self.impl is not None:
            return self.impl(self, x, labels)
        c = self.cfg
        topk_ids, topk_w = route_layer_torch(self, x, labels)
        topk_ids = local_expert_ids(topk_ids, self.first_expert, self.w13.shape[0], c.num_experts)
        out = self.experts(x, self.w13, self.w2, topk_ids, topk_w)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if moe else DenseMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, h, delta: torch.Tensor | None, meta, k_cache, v_cache, attend: AttentionFn,
                labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) -> (h', delta'): the residual stream and the previous layer's MLP output not yet added to it,
        so that each add is folded into the norm after it (the next layer's input norm, or the final norm)."""
        x, h = self.input_norm.add_forward(h, delta)  # h = h + delta; x = norm(h)
        x, h = self.post_norm.add_forward(h, self.attn(x, meta, k_cache, v_cache, attend))
        return h, (self.mlp(x, labels) if isinstance(self.mlp, MoE) else self.mlp(x))


class LLaDA2Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.block_routing and BLOCK_SIZE % cfg.block_size:
            # a forward computes whole blocks of BLOCK_SIZE positions; a routing block must never straddle two
            raise ValueError(f"block routing needs a block_size that divides {BLOCK_SIZE}, not {cfg.block_size}")
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, moe) for moe in cfg.is_moe_layer)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.attend: AttentionFn = paged_attention_torch
        self.kernel_backend = "torch"
        self.quantization: str | None = None  # "fp8": e4m3 weights (kernels/fp8.py convert_model_fp8)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] flat query tokens of the whole batch
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [L, P, B, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:  # [T, H] final-normed hidden states
        h = self.embed(input_ids)
        labels = routing_blocks(meta.positions, meta.cu_q, self.cfg.block_size) if self.cfg.block_routing else None
        delta = None  # the last layer's MLP output, added to h by the next norm
        for i, layer in enumerate(self.layers):
            h, delta = layer(h, delta, meta, k_cache[i], v_cache[i], self.attend, labels)
        return self.norm.add_forward(h, delta)[0]

    def logits(self, hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """[T, H] hidden states (or [..., H]) -> [..., V] logits in >= fp32 of hidden[rows] ([R...] indices into
        the last forward's T rows; None: all). Rows, not picked states, so that tensor-parallel ranks, which
        hold the same hidden states, can each give their vocabulary slice of the same rows."""
        picked = hidden if rows is None else hidden[rows]
        return self.lm_head(picked).to(compute_dtype(hidden.dtype))

    def set_kernel_backend(self, backend: str) -> None:
        if backend == "torch":
            self.attend = paged_attention_torch
        elif backend == "triton":
            from redraft.kernels.attention_triton import paged_attention_triton  # imports triton lazily

            self.attend = paged_attention_triton
        else:
            raise ValueError(f"unknown kernel backend {backend!r} (choose torch or triton)")
        self.kernel_backend = backend
        for module in self.modules():  # MoE layers and FP8 linears pick their implementation too
            if module is not self and hasattr(module, "set_kernel_backend"):
                module.set_kernel_backend(backend)

    def set_moe_experts(self, fn: Callable[..., torch.Tensor]) -> None:
        """Swap the routed-experts function of every MoE layer (signature of `moe_experts_torch`; model-dtype
        weights): the torch router and shared expert run around it, replacing any whole-layer `MoE.impl`."""
        for layer in self.layers:
            if isinstance(layer.mlp, MoE):
                layer.mlp.experts = fn
                layer.mlp.impl = None
