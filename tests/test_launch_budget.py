"""The launch budget of a decoding forward on kernel_backend="triton": at most 16 kernel launches per layer.

A graph node costs ~2 us whatever it does, so at ~89 launches per layer (one RMSNorm was 8 ATen kernels, the rotary
~21) the launches alone were ~3.5 ms of an 8.3 ms forward. The forward is recorded on the meta device at the
LLaDA2.1-mini shape (three layers: the dense one and two MoE), Triton kernels recorded instead of launched and every
ATen op that would launch a CUDA kernel counted (tests/launch_count.py), for the batch sizes of the smallest
CUDA-graph buckets."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from bench_scripts import bench_module
from launch_count import by_name, count_launches

pytestmark = pytest.mark.kernels

BUDGET_PER_LAYER = 16


def _forward_launches(quantization: str | None, routing: str, bs: int):
    from redraft.engine.model.loader import build_model
    from redraft.kernels.attention import AttentionMetadata

    cfg = dataclasses.replace(bench_module("bench_gpu_step").model_config("mini"), num_hidden_layers=3)
    if routing == "block":
        cfg = dataclasses.replace(cfg, expert_capacity=48)
    model = build_model(cfg, torch.bfloat16, "meta", quantization)
    model.set_kernel_backend("triton")
    b = 32
    cache = torch.empty(cfg.num_hidden_layers, bs + 1, b, cfg.num_key_value_heads, cfg.head_dim,
                        dtype=torch.bfloat16, device="meta")
    meta = AttentionMetadata(
        block_size=b, positions=torch.empty(bs * b, dtype=torch.long, device="meta"),
        slot_mapping=torch.empty(bs * b, dtype=torch.long, device="meta"),
        page_tables=torch.empty(bs, 4, dtype=torch.long, device="meta"),
        kv_lens=torch.empty(bs, dtype=torch.long, device="meta"), q_starts=torch.empty(bs, dtype=torch.long,
                                                                                        device="meta"),
        q_lens=torch.empty(bs, dtype=torch.long, device="meta"), window_starts=torch.empty(bs, dtype=torch.long,
                                                                                            device="meta"),
        cu_q=torch.empty(bs + 1, dtype=torch.long, device="meta"), max_q=b, max_kv=4 * b)
    ids = torch.empty(bs * b, dtype=torch.long, device="meta")
    with torch.no_grad(), count_launches() as log:  # (no_grad, not inference_mode: ops reach the counter decomposed)
        hidden = model(ids, meta, cache, cache)
    assert hidden.shape == (bs * b, cfg.hidden_size)
    return log, cfg


@pytest.mark.parametrize("bs", [1, 4])
@pytest.mark.parametrize("quantization, routing", [(None, "grouped"), (None, "block"), ("fp8", "grouped")])
def test_decoding_forward_fits_the_launch_budget(quantization, routing, bs):
    log, cfg = _forward_launches(quantization, routing, bs)
    names = by_name(log)
    per_layer = (len(log) - 2) / cfg.num_hidden_layers  # (the embedding and the final norm are the model's)
    assert per_layer <= BUDGET_PER_LAYER, f"{per_layer:.1f} launches per layer: {sorted(names.items())}"
    # one fused norm launch per norm (two per layer + the final one), one QK-norm/rotary launch per layer
    assert names["_add_rms_norm_kernel"] == 2 * cfg.num_hidden_layers + 1
    assert names["_qk_norm_rope_kernel"] == cfg.num_hidden_layers
    assert names["_moe_align_kernel"] == 2 and "_moe_count_kernel" not in names  # one alignment launch
    for op in ("aten.pow", "aten.rsqrt", "aten.cos", "aten.sin", "aten.cat"):  # the unfused norm and rotary
        assert op not in names, op
    # the router GEMM: its weight converted to fp32 once at load, only the activations per forward
    assert names["aten._to_copy"] <= 2
    if quantization == "fp8":  # the experts' input quantised once per token, in the launch that gives the router
        # its fp32 input (so no conversion of its own): one per MoE layer, nothing added
        assert names["_quant_act_kernel"] == 2 and "aten._to_copy" not in names
