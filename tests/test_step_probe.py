"""The step benchmarks' honest parts (benchmarks/step_probe.py): the uniform routing replaces the router's ids by a
fixed assignment (the router still runs), experts touched are counted from ids, and the floor is a roofline per
kernel class, so batch 64's compute-bound lm_head is counted at its FLOPs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bench_scripts import bench_module

probe_mod = bench_module("step_probe")
H100_BW, H100_MM = 3.0e12, 798e12  # the copy bandwidth and bf16 matmul rate measured on the lent H100s


def _moe(e: int = 16, k: int = 4):
    return SimpleNamespace(cfg=SimpleNamespace(num_experts=e, num_experts_per_tok=k))


def test_uniform_routing_is_fixed_distinct_and_still_runs_the_router():
    calls = []

    def router(moe, x, labels):
        calls.append(x.shape[0])
        return torch.zeros(x.shape[0], 4, dtype=torch.long), torch.ones(x.shape[0], 4)

    probe = probe_mod.RoutingProbe("uniform", max_tokens=64, seed=3)
    routed = probe.wrap(router)
    moe = _moe()
    ids, w = routed(moe, torch.zeros(40, 8), None)
    assert calls == [40] and w.shape == (40, 4)
    assert ids.shape == (40, 4)
    assert all(len(set(row)) == 4 for row in ids.tolist())  # k distinct experts per token
    again, _ = routed(moe, torch.zeros(10, 8), None)
    assert torch.equal(again, ids[:10])  # the same table, sliced: every replay routes alike
    other, _ = routed(_moe(), torch.zeros(10, 8), None)
    assert not torch.equal(other, ids[:10])  # another layer draws its own
    with probe.recording() as rec:
        routed(moe, torch.zeros(5, 8), None)
        long, _ = routed(moe, torch.zeros(100, 8), None)  # longer than the largest batch: the model's routing
    assert len(rec) == 2 and torch.equal(long, torch.zeros(100, 4, dtype=torch.long))
    assert probe_mod.experts_touched(rec, 16) == [len(set(ids[:5].flatten().tolist())), 1]
    model = probe_mod.RoutingProbe("model", 64).wrap(router)
    assert torch.equal(model(moe, torch.zeros(3, 8), None)[0], torch.zeros(3, 4, dtype=torch.long))


def test_experts_touched_leaves_other_ranks_out():
    ids = torch.tensor([[0, 3, -1], [3, 5, -1]])
    assert probe_mod.experts_touched([ids], 8) == [3]


def test_roofline_counts_compute_bound_classes_at_their_flops():
    cfg = bench_module("bench_gpu_step").model_config("mini")
    one = probe_mod.step_roofline(cfg, 1, 1024, 110.0, bw=H100_BW, peak=H100_MM)
    assert all(one[c]["bound"] == "memory" for c in ("attention", "gemms", "moe", "lm_head"))
    # batch 1 is bytes: the weights (router in fp32) and the KV, within 1% of bytes / bandwidth
    assert one["total_ms"] == pytest.approx(one["total_bytes"] / H100_BW * 1e3, rel=0.01)
    many = probe_mod.step_roofline(cfg, 64, 1024, [256.0] * 19, bw=H100_BW, peak=H100_MM)
    head = many["lm_head"]
    assert head["bound"] == "compute"  # 2 * 2048 * 157184 * 2048 FLOPs: 1.65 ms at 798 TFLOP/s, 0.21 ms of bytes
    assert head["ms"] == pytest.approx(2 * 2048 * 157184 * 2048 / H100_MM * 1e3)
    assert many["total_ms"] > many["total_bytes"] / H100_BW * 1e3 + 1.0
    fp8 = probe_mod.step_roofline(cfg, 1, 1024, 110.0, bw=H100_BW, peak=H100_MM, fp8=True)
    assert fp8["moe"]["bytes"] == one["moe"]["bytes"] / 2 and fp8["lm_head"] == one["lm_head"]


@pytest.mark.parametrize("name, cls", [
    ("_block_causal_attn_kernel", "attention"), ("_split_kv_attn_kernel", "attention"),
    ("_fused_moe_kernel", "moe"), ("_moe_align_kernel", "moe"), ("_route_kernel", "moe"), ("_quant_act_kernel", "moe"),
    ("_add_rms_norm_kernel", "norms/rotary"), ("_qk_norm_rope_kernel", "norms/rotary"),
    ("_vocab_top1_kernel", "lm_head/top-1"), ("nvjet_tst_128x64_64x4_1x2_h_bz_TNT", "gemms"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32", "gemms"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
])
def test_kernel_classes(name, cls):
    assert probe_mod.kernel_class(name) == cls
