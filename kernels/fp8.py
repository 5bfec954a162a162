"""FP8 (e4m3) weights in DeepSeek-V3's block format, W8A8 matmuls, and their plain-torch twins.

Formats (the same whether the weights were quantised at load or came from an FP8 checkpoint):
    weight  [..., N, K] float8_e4m3fn
    scale   [..., ceil(N/128), ceil(K/128)] float32, one per 128 x 128 block; it is the multiplier that
            dequantises (`w ~= q * scale`; DeepSeek checkpoints call it `<name>_scale_inv`).
    Blocks at the right/bottom edge are partial (dims need not be multiples of 128; the tiny config has 64).
    Stacked weights (gate|up of a SwiGLU, [E, 2I, H] experts) keep each source tensor's own blocks: a weight
    made of segments of `seg_rows` rows has ceil(seg_rows/128) scale rows per segment, so weight row r uses
    scale row (r // seg_rows) * ceil(seg_rows/128) + (r % seg_rows) // 128 (= r // 128 when seg_rows % 128 == 0).
    Activations are quantised on the fly per token per 128-channel group along K: scale = amax / 448
    (amax floored at ACT_EPS), q = clamp(x / scale, -448, 448) rounded to e4m3 (nearest even).

What is quantised (engine/model/fp8_model.py `convert_model_fp8`): attention qkv and output projections, the dense SwiGLU, the routed
experts and the shared expert. Embeddings, lm_head, norms and the router stay in the model dtype.

Torch twins (`fp8_linear_torch`, `moe_experts_fp8_torch`) quantise activations exactly as the kernels do and
then multiply dequantised operands in fp32; the Triton kernels (kernels/fp8_triton.py, kernels/moe_triton.py)
multiply e4m3 operands on the tensor cores and apply the scales per 128-deep K step.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from redraft.kernels.moe import combine_experts_torch, compute_dtype, local_expert_ids, route_layer_torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # weight blocks are BLOCK x BLOCK; activation groups are BLOCK channels
ACT_EPS = 1e-10  # amax floor of an activation group (an all-zero group gets a tiny, finite scale)
WEIGHT_EPS = 1e-12

QUANT_CONFIG_KEYS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                     "weight_block_size": [128, 128]}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


# ---- quantisation (torch) -------------------------------------------------------------------------------
def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    extra = (-x.shape[dim]) % multiple
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return F.pad(x, pad)


def quantize_weight(w: torch.Tensor, seg_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (q [..., N, K] e4m3, scale [..., S * ceil(R/128), ceil(K/128)] fp32),
    one scale per 128 x 128 block of each R = seg_rows-row segment (default: one segment, R = N)."""
    *lead, n, k = w.shape
    r = seg_rows or n
    if n % r:
        raise ValueError(f"{n} rows are not a whole number of {r}-row segments")
    segs = w.reshape(*lead, n // r, r, k).float()
    padded = _pad_to(_pad_to(segs, -1, BLOCK), -2, BLOCK)  # [..., S, Rp, Kp]
    rb, kb = padded.shape[-2] // BLOCK, padded.shape[-1] // BLOCK
    blocks = padded.reshape(*lead, n // r, rb, BLOCK, kb, BLOCK)
    amax = blocks.abs().amax(dim=(-3, -1))  # [..., S, rb, kb]
    scale = amax.clamp(min=WEIGHT_EPS) / FP8_MAX
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, n // r, rb * BLOCK, kb * BLOCK)[..., :r, :k].reshape(*lead, n, k)
    return q.contiguous(), scale.reshape(*lead, (n // r) * rb, kb).contiguous()


def scale_rows(n: int, seg_rows: int | None = None) -> torch.Tensor:
    """Scale row of each of the n weight rows (int64 [n])."""
    r = seg_rows or n
    rows = torch.arange(n)
    return (rows // r) * cdiv(r, BLOCK) + (rows % r) // BLOCK


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, seg_rows: int | None = None,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse map: q * scale of its block, [..., N, K] in `dtype`."""
    n, k = q.shape[-2:]
    rows = scale_rows(n, seg_rows).to(scale.device)
    cols = torch.arange(k, device=scale.device) // BLOCK
    s = scale.index_select(-2, rows).index_select(-1, cols)  # [..., N, K]
    return (q.to(dtype) * s.to(dtype)).to(dtype)


def quantize_act(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [M, ceil(K/128)] fp32): per token, per 128-channel group."""
    m, k = x.shape
    xf = _pad_to(x.float(), -1, BLOCK).view(m, -1, BLOCK)
    scale = xf.abs().amax(-1).clamp(min=ACT_EPS) / FP8_MAX  # [M, G]
    q = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(m, -1)[:, :k].contiguous(), scale


def dequantize_act(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    cols = torch.arange(q.shape[-1], device=q.device) // BLOCK
    return q.to(dtype) * scale.to(dtype).index_select(-1, cols)


def fp8_linear_torch(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, seg_rows: int | None = None,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 linear, the twin of `fp8_linear_triton`: y = dequant(quant(x)) @ dequant(W)^T in fp32 (float64 for
    float64 x), returned in x.dtype. x [..., K], weight [N, K] e4m3, scale [blocks]."""
    lead, k = x.shape[:-1], x.shape[-1]
    acc = compute_dtype(x.dtype)
    xq, xs = quantize_act(x.reshape(-1, k))
    y = dequantize_act(xq, xs, acc) @ dequantize_weight(weight, scale, seg_rows, acc).t()
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype).reshape(*lead, weight.shape[0])


def swiglu_fp8_torch(x: torch.Tensor, gate_up: torch.Tensor, gate_up_scale: torch.Tensor, down: torch.Tensor,
                     down_scale: torch.Tensor) -> torch.Tensor:
    """down(silu(gate(x)) * up(x)) with W8A8 linears; gate_up [2I, H] holds two I-row segments."""
    inter = down.shape[1]
    gate, up = fp8_linear_torch(x, gate_up, gate_up_scale, inter).chunk(2, dim=-1)
    return fp8_linear_torch(F.silu(gate) * up, down, down_scale)


def moe_experts_fp8_torch(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w13_scale: torch.Tensor,  # [E, 2 * ceil(I/128), ceil(H/128)]
    w2: torch.Tensor,  # [E, H, I] e4m3
    w2_scale: torch.Tensor,  # [E, ceil(H/128), ceil(I/128)]
    topk_ids: torch.Tensor,  # [T, k]
    topk_weights: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H] in x.dtype
    """`moe_experts_torch` with W8A8 experts: the same per-token accumulation (fp32, ascending expert order)."""
    return combine_experts_torch(
        x, topk_ids, topk_weights, w13.shape[0],
        lambda e, xs: swiglu_fp8_torch(xs, w13[e], w13_scale[e], w2[e], w2_scale[e]),
    )


# ---- modules ------------------------------------------------------------------------------------------
class Fp8Linear(nn.Module):
    """A bias-optional linear layer with an e4m3 weight [N, K] and its block scales (`weight_scale`).
    Replaces nn.Linear in attention (qkv, o_proj); the backend follows LLaDA2Model.set_kernel_backend."""

    def __init__(self, in_features: int, out_features: int, bias: bool, device: Any = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
                                   requires_grad=False)
        self.register_buffer("weight_scale", torch.empty(cdiv(out_features, BLOCK), cdiv(in_features, BLOCK),
                                                         dtype=torch.float32, device=device))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        self.kernel_backend = "torch"

    def set_kernel_backend(self, backend: str) -> None:
        self.kernel_backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_backend == "triton":
            from redraft.kernels.fp8_triton import fp8_linear_triton

            return fp8_linear_triton(x, self.weight, self.weight_scale, bias=self.bias)
        return fp8_linear_torch(x, self.weight, self.weight_scale, bias=self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


class Fp8DenseMLP(nn.Module):
    """SwiGLU with e4m3 weights: `gate_up` [2I, H] (gate | up, one block grid per segment) and `down` [H, I],
    with `gate_up_scale` / `down_scale`. Same parameter names as engine.model.DenseMLP."""

    def __init__(self, hidden: int, inter: int, device: Any = None):
        super().__init__()
        self.hidden, self.inter = hidden, inter
        self.gate_up = nn.Parameter(torch.empty(2 * inter, hidden, dtype=FP8_DTYPE, device=device),
                                    requires_grad=False)
        self.down = nn.Parameter(torch.empty(hidden, inter, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.register_buffer("gate_up_scale", torch.empty(2 * cdiv(inter, BLOCK), cdiv(hidden, BLOCK),
                                                          dtype=torch.float32, device=device))
        self.register_buffer("down_scale", torch.empty(cdiv(hidden, BLOCK), cdiv(inter, BLOCK),
                                                       dtype=torch.float32, device=device))
        self.kernel_backend = "torch"

    def set_kernel_backend(self, backend: str) -> None:
        self.kernel_backend = backend

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel_backend == "triton":
            from redraft.kernels.fp8_triton import fp8_linear_triton

            gate, up = fp8_linear_triton(x, self.gate_up, self.gate_up_scale, seg_rows=self.inter).chunk(2, dim=-1)
            return fp8_linear_triton(F.silu(gate) * up, self.down, self.down_scale)
        return swiglu_fp8_torch(x, self.gate_up, self.gate_up_scale, self.down, self.down_scale)


def moe_forward_fp8_torch(moe: nn.Module, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE layer with e4m3 experts on kernel_backend="torch" (`MoE.impl`): the torch router (grouped, or block
    routing by `labels`), the W8A8 experts twin, the shared expert (an Fp8DenseMLP)."""
    c = moe.cfg
    topk_ids, topk_w = route_layer_torch(moe, x, labels)
    topk_ids = local_expert_ids(topk_ids, moe.first_expert, moe.w13.shape[0], c.num_experts)
    out = moe_experts_fp8_torch(x, moe.w13, moe.w13_scale, moe.w2, moe.w2_scale, topk_ids, topk_w)
    if moe.shared is not None:
        out = out + moe.shared(x)
    return out


def check_quantization_config(qc: dict | None) -> str | None:
    """'fp8' for a DeepSeek-style block-FP8 `quantization_config`, None for none; ValueError otherwise."""
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method={method!r} is not supported (redraft reads block FP8)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported (only e4m3)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"quantization_config.activation_scheme={scheme!r} is not supported (only dynamic)")
    block = list(qc.get("weight_block_size") or [])
    if block != [BLOCK, BLOCK]:
        raise ValueError(f"quantization_config.weight_block_size={block!r} is not supported (only [128, 128])")
    return "fp8"


__all__ = [
    "FP8_DTYPE", "FP8_MAX", "BLOCK", "QUANT_CONFIG_KEYS", "Fp8Linear", "Fp8DenseMLP", "cdiv", "check_quantization_config",
    "dequantize_act", "dequantize_weight", "fp8_linear_torch", "is_fp8", "moe_experts_fp8_torch",
    "moe_forward_fp8_torch", "quantize_act", "quantize_weight", "scale_rows", "swiglu_fp8_torch",
]

