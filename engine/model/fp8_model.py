"""FP8 on the LLaDA2 model: which parameters hold e4m3 weights, converting a model to them, and quantising
a checkpoint's tensors into them (numerics and kernels: kernels/fp8.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.model import DenseMLP, LLaDA2Model, MoE
from redraft.kernels.fp8 import (BLOCK, FP8_DTYPE, Fp8DenseMLP, Fp8Linear, cdiv, moe_forward_fp8_torch,
                                 quantize_weight)


# Parameter (model name suffix) -> rows per segment of its block grid (None: the whole weight is one segment).
def fp8_param_segments(cfg: ModelConfig) -> dict[str, int | None]:
    """Which parameters of LLaDA2Model hold e4m3 weights, by name suffix, and their segment size."""
    i = cfg.moe_intermediate_size
    return {
        "attn.qkv.weight": None, "attn.o_proj.weight": None,
        "mlp.gate_up": cfg.intermediate_size, "mlp.down": None,  # dense layers
        "mlp.w13": i, "mlp.w2": None,  # routed experts
        "mlp.shared.gate_up": i * cfg.num_shared_experts, "mlp.shared.down": None,
    }


def fp8_segment_rows(cfg: ModelConfig, param: str) -> int | None:
    """Segment size of an e4m3 parameter by its full name (e.g. 'layers.3.mlp.w13'), None for one segment;
    KeyError for a parameter that is not quantised."""
    for suffix, seg in sorted(fp8_param_segments(cfg).items(), key=lambda kv: -len(kv[0])):
        if param.endswith(suffix) and (param == suffix or param[: -len(suffix)].endswith(".")):
            return seg
    raise KeyError(param)


def scale_name(param: str) -> str:
    """The buffer holding a quantised parameter's block scales."""
    return param + "_scale"


def convert_model_fp8(model: "LLaDA2Model") -> "LLaDA2Model":
    """Give the model e4m3 weights (uninitialised) and block-scale buffers in place of the model-dtype ones:
    attention qkv/o_proj -> Fp8Linear, dense SwiGLUs (dense layers, shared experts) -> Fp8DenseMLP, MoE w13/w2 ->
    e4m3 with `w13_scale` / `w2_scale`. Meant for a model on the meta device (build_model), before allocation."""
    cfg = model.cfg
    for layer in model.layers:
        attn = layer.attn
        dev = attn.qkv.weight.device
        for name in ("qkv", "o_proj"):
            lin: nn.Linear = getattr(attn, name)
            new = Fp8Linear(lin.in_features, lin.out_features, lin.bias is not None, device=dev,
                            dtype=lin.weight.dtype)
            setattr(attn, name, new)
        mlp = layer.mlp
        if isinstance(mlp, DenseMLP):
            layer.mlp = Fp8DenseMLP(cfg.hidden_size, cfg.intermediate_size, device=dev)
        elif isinstance(mlp, MoE):
            e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
            mlp.w13 = nn.Parameter(torch.empty(e, 2 * i, h, dtype=FP8_DTYPE, device=dev), requires_grad=False)
            mlp.w2 = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE, device=dev), requires_grad=False)
            mlp.register_buffer("w13_scale", torch.empty(e, 2 * cdiv(i, BLOCK), cdiv(h, BLOCK), dtype=torch.float32,
                                                         device=dev))
            mlp.register_buffer("w2_scale", torch.empty(e, cdiv(h, BLOCK), cdiv(i, BLOCK), dtype=torch.float32,
                                                        device=dev))
            if mlp.shared is not None:
                mlp.shared = Fp8DenseMLP(h, i * cfg.num_shared_experts, device=dev)
            mlp.impl = moe_forward_fp8_torch  # the torch backend's FP8 layer until set_kernel_backend says otherwise
    model.quantization = "fp8"
    return model


def quantize_into(model: "LLaDA2Model", param: str, value: torch.Tensor, index: tuple = ()) -> None:
    """Quantise `value` (a source tensor [N, K] or a stack of them) into e4m3 parameter `param` at `index`, and
    its block scales into `param`_scale at the matching block index."""
    target = model.get_parameter(param)
    # a packed gate | up weight is two segments, whatever share of the intermediate this model (rank) holds
    seg = None if fp8_segment_rows(model.cfg, param) is None else target.shape[-2] // 2
    scales = model.get_buffer(scale_name(param))
    rows = value.shape[-2]
    q, s = quantize_weight(value.to(target.device), seg if seg is not None and rows % seg == 0 and rows > seg
                           else None)
    (target.data[index] if index else target.data).copy_(q)
    sidx = scale_index(index, seg)
    (scales[sidx] if sidx else scales).copy_(s)


def scale_index(index: tuple, seg_rows: int | None) -> tuple:
    """Map a weight index (expert ints and at most one row slice, as in loader Targets) to the block index of
    the scale tensor: a row slice covering segment j becomes block rows [j * nb, (j + 1) * nb)."""
    out = []
    for item in index:
        if isinstance(item, slice):
            r = item.stop - item.start
            if seg_rows is None or r != seg_rows or item.start % r:
                raise ValueError(f"row slice {item} is not one {seg_rows}-row segment")
            nb = cdiv(r, BLOCK)
            j = item.start // r
            out.append(slice(j * nb, (j + 1) * nb))
        else:
            out.append(item)
    return tuple(out)
