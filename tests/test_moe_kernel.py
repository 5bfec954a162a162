"""The Triton MoE (kernels/moe_triton.py) against its torch twins, and the engine with it.

On CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before anything imports triton);
with a CUDA device the same tests run compiled. Shapes stay tiny: the interpreter runs programs one at a time.
  - routing: ids equal to route_torch's exactly, weights to fp32 rounding;
  - the sort/alignment plan: every (token, expert) pair exactly once, in a tile of its own expert;
  - fused and unfused experts against moe_experts_torch + the shared expert (fp32, fp16), with the partial
    buffer poisoned; the combine's order and roundings exactly those of the torch path;
  - the engine with kernel_backend="triton" (fused MoE + Triton attention) gives the torch backend's tokens;
  - the layer's wrappers do no device->host sync (meta tensors, kernels recorded instead of run);
  - benchmarks/bench_moe.py --dry-run, and (slow) the sm_90 compile report.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from numerics import rel
from redraft.kernels.moe import moe_experts_torch, route_torch, swiglu  # noqa: E402

mt = pytest.importorskip("redraft.kernels.moe_triton")

pytestmark = pytest.mark.kernels

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and not mt.interpreting():
    pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module", allow_module_level=True)


# ---- routing ------------------------------------------------------------------------------------------
ROUTES = [  # tokens, hidden, experts, top_k, n_group, topk_group
    (37, 64, 8, 2, 4, 2),  # the tiny checkpoint's router
    (21, 32, 256, 8, 8, 4),  # LLaDA2.1's grouping (256 experts, 8 groups, 4 kept, top-8)
    (9, 16, 16, 3, 1, 1),  # ungrouped, non-power-of-two k
]


@pytest.mark.parametrize("t,h,e,k,ng,tg", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_route_matches_reference(t, h, e, k, ng, tg, dtype):
    g = torch.Generator().manual_seed(e + k)
    x = torch.randn(t, h, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(e, h, generator=g).to(dtype).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 0.05).to(DEVICE)  # fp32, as LLaDA2.1 keeps it
    kw = dict(top_k=k, n_group=ng, topk_group=tg, routed_scaling_factor=2.5)
    want_ids, want_w = route_torch(x, w, bias, **kw)
    got_ids, got_w = mt.route_triton(x, w, bias, **kw)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)  # same experts, same (descending biased score) order
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_w.sum(-1), torch.full((t,), 2.5, device=DEVICE), rtol=1e-5, atol=1e-5)


def test_route_bias_only_selects():
    """A large bias on one expert makes every token choose it, but its weight stays its unbiased score."""
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(6, 16, generator=g).to(DEVICE), torch.randn(8, 16, generator=g).to(DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    bias[5] = 10.0
    ids, wts = mt.route_triton(x, w, bias, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=1.0,
                               norm_topk_prob=False)
    assert (ids[:, 0] == 5).all()
    torch.testing.assert_close(wts[:, 0], torch.sigmoid(x @ w.t())[:, 5], rtol=1e-6, atol=1e-6)


# ---- block routing (LLaDA2.2) ---------------------------------------------------------------------------
BLOCK_ROUTES = [  # query lengths, first positions, hidden, experts, top_k, capacity, routing block
    ([20, 64, 7], [32, 0, 64], 64, 8, 2, 3, 32),  # the tiny checkpoints with expert_capacity 3
    ([33, 32], [0, 96], 32, 256, 8, 48, 32),  # LLaDA2.2-flash's router (256 experts, 48 per block, top-8)
    ([5, 40], [16, 0], 16, 16, 3, 16, 16),  # capacity = every expert (plain top-k), a 16-position block
]


@pytest.mark.parametrize("lens,starts,h,e,k,cap,r", BLOCK_ROUTES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_route_matches_reference(lens, starts, h, e, k, cap, r, dtype):
    """The Triton block router against route_blocks_torch on a packed, ragged batch: the same ids in the same
    order, weights to fp32 rounding."""
    from redraft.kernels.moe import route_blocks_torch, routing_blocks

    g = torch.Generator().manual_seed(e + cap)
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)])
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist())
    labels = routing_blocks(pos, cu, r).to(DEVICE)
    x = torch.randn(pos.numel(), h, generator=g).to(dtype).to(DEVICE)
    w = torch.randn(e, h, generator=g).to(dtype).to(DEVICE)
    bias = (torch.randn(e, generator=g) * 0.05).to(DEVICE)
    kw = dict(top_k=k, capacity=cap, routed_scaling_factor=2.5)
    want_ids, want_w = route_blocks_torch(x, w, bias, labels, **kw)
    got_ids, got_w = mt.route_blocks_triton(x, w, bias, labels, block_size=r, **kw)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-6, atol=1e-6)


def test_block_route_ties_and_isolation():
    """All-equal scores: every block admits experts 0..capacity-1, every token takes 0..k-1 (lower ids win ties).
    Then a request flooding experts 5-7 leaves the next request's routing alone (its own blocks)."""
    from redraft.kernels.moe import routing_blocks

    pos = torch.cat([torch.arange(20), torch.arange(44)])
    labels = routing_blocks(pos, torch.tensor([0, 20, 64]), 32).to(DEVICE)
    w = torch.eye(8, 16, device=DEVICE)
    x = torch.zeros(64, 16, device=DEVICE)
    bias = torch.zeros(8, device=DEVICE)
    kw = dict(top_k=2, capacity=3, block_size=32, routed_scaling_factor=1.0)
    ids, _ = mt.route_blocks_triton(x, w, bias, labels, **kw)
    assert ids.tolist() == [[0, 1]] * 64
    x[:20, 5:8] = 10.0
    ids, _ = mt.route_blocks_triton(x, w, bias, labels, **kw)
    assert ids[:20].tolist() == [[5, 6]] * 20 and ids[20:].tolist() == [[0, 1]] * 44


# ---- the plan -----------------------------------------------------------------------------------------
@contextmanager
def record_kernels():
    """Names of the Triton kernels launched inside (they still run)."""
    from triton.runtime.jit import KernelInterface

    names: list[str] = []
    getitem = KernelInterface.__getitem__

    def launch(self, grid):
        names.append(getattr(self, "__name__", None) or self.fn.__name__)
        return getitem(self, grid)

    KernelInterface.__getitem__ = launch
    try:
        yield names
    finally:
        KernelInterface.__getitem__ = getitem


@pytest.mark.parametrize("one_program", [True, False])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("t,e,k,block_m", [(37, 8, 2, 16), (5, 16, 3, 16), (70, 8, 2, 32)])
def test_align_plan(t, e, k, block_m, shared, one_program, monkeypatch):
    """Both alignments: one program (fill folded in) for small batches, and the fill + three parallel launches."""
    g = torch.Generator().manual_seed(t)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    ids[:4] = torch.arange(k)  # a popular set, and (with t small) experts nobody picks
    monkeypatch.setattr(mt, "ALIGN_ONE_PROGRAM_PAIRS", 10**6 if one_program else 0)
    real_empty = torch.empty

    def poisoned(*args, **kwargs):  # an int32 slot the alignment forgets to write shows as -7
        out = real_empty(*args, **kwargs)
        if out.dtype == torch.int32:
            out.fill_(-7)
        return out

    monkeypatch.setattr(torch, "empty", poisoned)
    with record_kernels() as names:
        plan = mt.moe_align(ids, e, block_m, shared=shared)
    assert names == (["_moe_align_kernel"] if one_program else
                     ["_moe_count_kernel", "_moe_scan_kernel", "_moe_scatter_kernel"])
    k_out = k + int(shared)
    assert plan.n_pairs == t * k_out and plan.k_out == k_out
    used = int(plan.num_post)
    assert used % block_m == 0 and used <= plan.max_tiles * block_m
    pairs = plan.sorted_pairs.cpu().tolist()
    tiles = plan.tile_expert.cpu().tolist()
    real = [p for p in pairs[:used] if p < plan.n_pairs]
    assert sorted(real) == list(range(plan.n_pairs))  # every pair exactly once
    assert all(p == plan.n_pairs for p in pairs[used:])  # nothing past the used slots
    flat = ids.cpu().tolist()
    expert_of = {p: (flat[p // k_out][p % k_out] if p % k_out < k else e) for p in range(plan.n_pairs)}
    last = -1
    for tile in range(used // block_m):
        rows = [p for p in pairs[tile * block_m:(tile + 1) * block_m] if p < plan.n_pairs]
        assert rows, "a used tile with no pair"
        assert {expert_of[p] for p in rows} == {tiles[tile]}
        assert rows == sorted(rows)  # stable: ascending pair (= token) order inside an expert
        assert tiles[tile] >= last  # experts in ascending order
        last = tiles[tile]
    assert all(x == -1 for x in tiles[used // block_m:])


# ---- experts ------------------------------------------------------------------------------------------
def _weights(t, h, i, e, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    sg, sd = torch.randn(2 * i, h, generator=g) / h**0.5, torch.randn(h, i, generator=g) / i**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:5] = torch.arange(k)
    wts = torch.rand(t, k, generator=g) * 2.5
    cast = lambda z: z.to(dtype).to(DEVICE)  # noqa: E731
    return cast(x), cast(w13), cast(w2), cast(sg), cast(sd), ids.to(DEVICE), wts.to(DEVICE)


@pytest.fixture
def poisoned_buffers(monkeypatch):
    """torch.empty hands out NaN for floating tensors: a partial or output row the kernels fail to write shows."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        out = real_empty(*args, **kwargs)
        if out.is_floating_point() and out.dtype not in (torch.float8_e4m3fn,):
            out.fill_(float("nan"))
        return out

    monkeypatch.setattr(torch, "empty", nan_empty)


TOL = {torch.float32: 2e-6, torch.float16: 3e-3}


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,h,i,e,k", [(37, 64, 32, 8, 2), (9, 48, 80, 6, 3)])
def test_experts_match_torch(t, h, i, e, k, dtype, method, poisoned_buffers):
    """fused / unfused (+ the shared expert folded in as expert E) == moe_experts_torch + swiglu(shared), with
    partial tiles on every axis (H 48, I 80, k 3: not powers of two), partials and output poisoned."""
    x, w13, w2, sg, sd, ids, wts = _weights(t, h, i, e, k, dtype, seed=t + i)
    want = moe_experts_torch(x, w13, w2, ids, wts) + swiglu(x, sg, sd)
    got = mt.fused_moe(x, w13, w2, ids, wts, shared=mt.SharedExpert(sg, sd), method=method)
    assert got.dtype == dtype and not got.isnan().any()
    assert rel(got, want) < TOL[dtype]
    alone = mt.fused_moe(x, w13, w2, ids, wts, method=method)  # no shared expert
    assert rel(alone, moe_experts_torch(x, w13, w2, ids, wts)) < TOL[dtype]


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_split_intermediate(dtype, swap, poisoned_buffers):
    """The GPU's small-token configuration forced here: 16-row tiles, the intermediate dim in 4 slices of 16
    (partials in fp32, summed in the combine), H in 32-column steps; both orientations of the dots (swap-AB:
    dot(w, a^T), the GPU's choice under 64 rows, and a @ w^T)."""
    x, w13, w2, sg, sd, ids, wts = _weights(20, 64, 64, 8, 2, dtype, seed=5)
    cfg = dict(BLOCK_M=16, BLOCK_I=16, BLOCK_K=32, BLOCK_N=32, SWAP=swap, num_warps=4, num_stages=1)
    want = moe_experts_torch(x, w13, w2, ids, wts) + swiglu(x, sg, sd)
    got = mt.fused_moe(x, w13, w2, ids, wts, shared=mt.SharedExpert(sg, sd), method="fused", config=cfg)
    assert not got.isnan().any()
    assert rel(got, want) < TOL[dtype]


@pytest.mark.parametrize("swap", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_unfused_16_row_tiles_both_orientations(dtype, swap, poisoned_buffers):
    """The unfused grouped GEMMs on 16-row tiles, swapped (the weight tile as M) and not, against the twin."""
    x, w13, w2, sg, sd, ids, wts = _weights(9, 48, 80, 6, 3, dtype, seed=8)
    want = moe_experts_torch(x, w13, w2, ids, wts) + swiglu(x, sg, sd)
    got = mt.fused_moe(x, w13, w2, ids, wts, shared=mt.SharedExpert(sg, sd), method="unfused",
                       config=dict(BLOCK_M=16, SWAP=swap))
    assert not got.isnan().any()
    assert rel(got, want) < TOL[dtype]


def test_combine_is_the_torch_order_exactly():
    """The combine alone: given each pair's expert output (the partials), its result is bit for bit what
    moe_experts_torch(...) + shared computes from those outputs: ascending expert id, fp32 accumulation of
    weight x output, one rounding, then + shared in the model dtype."""
    g = torch.Generator().manual_seed(11)
    t, k, e, h = 13, 3, 8, 40
    for dtype in (torch.float32, torch.bfloat16):
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)  # unsorted ids
        wts = (torch.rand(t, k, generator=g) * 2).to(DEVICE)
        y = torch.randn(1, t * (k + 1), h, generator=g).to(dtype).to(DEVICE)  # pair p = t * (k+1) + slot
        out = torch.empty(t, h, dtype=dtype, device=DEVICE)
        mt._reduce(y, ids, wts, out, k + 1, shared=True)
        pair = y[0].view(t, k + 1, h)
        acc = torch.zeros(t, h, dtype=torch.float32, device=DEVICE)
        order = ids.argsort(dim=1)  # ascending expert id, as moe_experts_torch's expert loop visits them
        for r in range(k):
            slot = order[:, r]
            yr = pair[torch.arange(t), slot].float()
            acc = acc + yr * wts[torch.arange(t), slot][:, None]
        want = acc.to(dtype) + pair[:, k]
        assert torch.equal(out, want), dtype


@pytest.mark.parametrize("method", ["fused", "unfused"])
@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_ranks_sum_to_the_whole(ep, method, poisoned_buffers):
    """Expert parallelism: each rank holds experts [r E / ep, (r + 1) E / ep) and sees the others' as id -1
    (local_expert_ids); those pairs are neither computed nor read (their partial rows stay NaN here), and the
    ranks' outputs add up to the one-process result. The plan holds exactly the rank's pairs."""
    from redraft.kernels.moe import local_expert_ids

    t, h, i, e, k = 37, 64, 32, 8, 2
    x, w13, w2, _, _, ids, wts = _weights(t, h, i, e, k, torch.float32, seed=3)
    want = moe_experts_torch(x, w13, w2, ids, wts)
    n = e // ep
    total = torch.zeros_like(want)
    for rank in range(ep):
        local = local_expert_ids(ids, rank * n, n, e)
        assert ((local == -1) == ((ids < rank * n) | (ids >= (rank + 1) * n))).all()
        plan = mt.moe_align(local, n, 16)
        used = int(plan.num_post)
        pairs = sorted(p for p in plan.sorted_pairs[:used].cpu().tolist() if p < plan.n_pairs)
        assert pairs == [p for p in range(t * k) if local.flatten()[p] >= 0]
        part = mt.fused_moe(x, w13[rank * n:(rank + 1) * n], w2[rank * n:(rank + 1) * n], local, wts, method=method)
        assert not part.isnan().any()
        torch_part = moe_experts_torch(x, w13[rank * n:(rank + 1) * n], w2[rank * n:(rank + 1) * n], local, wts)
        assert rel(part, torch_part) < TOL[torch.float32]  # the torch twin skips -1 slots the same way
        total += part
    assert rel(total, want) < TOL[torch.float32]


def test_fused_is_deterministic():
    x, w13, w2, sg, sd, ids, wts = _weights(33, 64, 32, 8, 2, torch.float32, seed=1)
    a = mt.fused_moe(x, w13, w2, ids, wts, shared=mt.SharedExpert(sg, sd), method="fused")
    b = mt.fused_moe(x, w13, w2, ids, wts, shared=mt.SharedExpert(sg, sd), method="fused")
    assert torch.equal(a, b)


# ---- the engine ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


@pytest.mark.slow
def test_engine_with_fused_moe_reproduces_torch_tokens(tiny):
    """kernel_backend="triton" (Triton attention + the fused Triton MoE, interpreted) vs the torch backend, in
    float32: the same tokens and the same number of forwards for prompts ending inside, on and past a block
    boundary and spanning several blocks, all in one batch. The fused path's combine runs in moe_experts_torch's
    order with its roundings; what differs is only the GEMMs' internal summation order (~1e-7)."""
    import redraft
    from redraft.kernels.moe_triton import moe_forward_triton

    kw = dict(device=DEVICE, dtype="float32", progress=False, max_total_tokens=4096, disable_cuda_graph=True)
    ref = redraft.Engine(str(tiny), kernel_backend="torch", **kw)
    tri = redraft.Engine(str(tiny), kernel_backend="triton", **kw)
    moes = [layer.mlp for layer in tri.core.model.layers if hasattr(layer.mlp, "impl")]
    assert moes and all(m.impl is moe_forward_triton for m in moes)
    calls = []
    for m in moes:
        m.impl = lambda moe, x, labels, _f=moe_forward_triton: calls.append(x.shape[0]) or _f(moe, x, labels)
    specials = {t["id"] for t in json.loads((tiny / "tokenizer.json").read_text())["added_tokens"]}
    rng = random.Random(1234)
    ordinary = [i for i in range(ref.model_config.vocab_size) if i not in specials]
    lengths = (1, 31, 33, 100)
    ids = [[rng.choice(ordinary) for _ in range(n)] for n in lengths]
    params = {"max_new_tokens": 4, "temperature": 0.0, "mode": "S"}
    want = ref.generate(input_ids=ids, sampling_params=params)
    got = tri.generate(input_ids=ids, sampling_params=params)
    assert calls, "the fused MoE never ran"
    for n, a, b in zip(lengths, want, got):
        assert b["output_ids"] == a["output_ids"], f"prompt of {n} tokens"
        assert b["meta_info"]["steps"] == a["meta_info"]["steps"], f"prompt of {n} tokens"
    ref.shutdown()
    tri.shutdown()


def test_block_routing_model_on_triton_equals_torch(tiny_checkpoint):
    """A block-routing checkpoint's forward on kernel_backend="triton" (Triton attention, block router and fused
    MoE, interpreted) against the torch backend, float32, on a packed batch of ragged prefills: the logits agree to
    fp32 rounding, and every MoE layer's inputs route to the same experts on both (so the small GEMM-order
    differences never flipped a choice: the comparison is at equal routing; the Triton router itself is checked
    against the torch one above); each request's logits are the float32 naive model's on that request alone."""
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.kernels.attention import AttentionMetadata
    from redraft.kernels.moe import route_layer_torch

    path = tiny_checkpoint(seed=0, config_overrides={"expert_capacity": 3})
    cfg = ModelConfig.from_pretrained(path)
    lens = [40, 64, 7]
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 300, (sum(lens),), generator=g).to(DEVICE)
    out, picked = {}, {}
    for backend in ("torch", "triton"):
        model = load_model(path, cfg, dtype=torch.float32, device=DEVICE, progress=False)
        model.set_kernel_backend(backend)
        meta = AttentionMetadata.build([0] * 3, lens, [[0, 1], [2, 3], [4]], 32, DEVICE,
                                       with_torch_plan=backend == "torch")
        shape = (cfg.num_hidden_layers, 5, 32, cfg.num_key_value_heads, cfg.head_dim)
        cache = [torch.zeros(shape, device=DEVICE), torch.zeros(shape, device=DEVICE)]
        seen = []
        for layer in model.layers:
            if hasattr(layer.mlp, "impl"):
                layer.mlp.register_forward_hook(
                    lambda m, args, _o: seen.append(route_layer_torch(m, args[0], args[1])[0]))
        with torch.inference_mode():
            out[backend] = model.logits(model(ids, meta, *cache))
        picked[backend] = seen
    assert len(picked["torch"]) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    for a, b in zip(picked["torch"], picked["triton"]):
        assert torch.equal(a, b)
    assert rel(out["triton"], out["torch"]) < 1e-5
    from naive_llada2 import NaiveLLaDA2  # and each request's rows against the naive model run on it alone

    naive = NaiveLLaDA2(path, dtype=torch.float32)
    for rows, seq in zip(out["triton"].cpu().split(lens), ids.cpu().split(lens)):
        assert rel(rows, naive.forward_logits(seq)) < 1e-4


def test_set_moe_experts_replaces_the_layer_impl(tiny):
    """model.set_moe_experts(fn) (what test_engine_triton uses to isolate attention) takes precedence over the
    fused layer; set_kernel_backend puts the fused layer back."""
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.kernels.moe_triton import moe_forward_triton

    model = load_model(tiny, ModelConfig.from_pretrained(tiny), progress=False)
    model.set_kernel_backend("triton")
    moe = model.layers[1].mlp
    assert moe.impl is moe_forward_triton
    model.set_moe_experts(moe_experts_torch)
    assert moe.impl is None and moe.experts is moe_experts_torch
    model.set_kernel_backend("torch")
    assert moe.impl is None
    model.set_kernel_backend("triton")
    assert moe.impl is moe_forward_triton


@pytest.mark.parametrize("routing", ["grouped", "block"])
@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_layer_has_no_host_sync_on_meta(quantization, routing):
    """CUDA-graph capturability of the MoE layer and the FP8 linears: the forward DecodeGraphs captures, at the
    real LLaDA2.1-mini shape in bf16, on the meta device (any .item()/.tolist()/nonzero raises there), with the
    Triton kernels recorded instead of launched (their grids must come from shapes alone). Attention is stubbed
    (its wrapper is checked by test_engine_triton)."""
    from types import SimpleNamespace

    from bench_scripts import bench_module
    from redraft.engine.runtime.cuda_graphs import DecodeGraphs
    from redraft.engine.model.loader import build_model

    record_launches = bench_module("bench_moe").record_launches
    cfg = bench_module("bench_gpu_step").model_config("mini")
    if routing == "block":  # LLaDA2.2's router on the same shape (routing blocks from the graph's metadata)
        cfg = dataclasses.replace(cfg, expert_capacity=48)
    model = build_model(cfg, torch.bfloat16, "meta", quantization)
    model.set_kernel_backend("triton")
    model.attend = lambda q, k, v, k_cache, v_cache, meta: torch.empty_like(q)
    cache = torch.empty(cfg.num_hidden_layers, 9, 32, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16,
                        device="meta")
    runner = SimpleNamespace(model=model, device=torch.device("meta"), block_size=32, scratch_page=8, mask_id=5,
                             k_cache=cache, v_cache=cache)
    graphs = DecodeGraphs(runner, max_bs=4, capture=False)
    import redraft.kernels.fp8_triton as ft

    import redraft.kernels.norm_triton as nt

    check = (mt.check_device, ft.check_device, nt.check_device)
    mt.check_device = ft.check_device = nt.check_device = lambda t: None  # meta tensors are fine here
    try:
        with torch.inference_mode(), record_launches() as log:
            for bs in (1, 4):
                graphs._pad_all(bs)
                logits = graphs._forward(bs)
                assert logits.shape == (bs, 32, cfg.vocab_size)
    finally:
        mt.check_device, ft.check_device, nt.check_device = check
    names = {kernel.__name__ for kernel, *_ in log}
    router = "_route_kernel" if routing == "grouped" else "_block_route_kernel"
    assert {router, "_fused_moe_kernel", "_moe_reduce_kernel", "_add_rms_norm_kernel", "_qk_norm_rope_kernel"} <= names
    assert "_moe_align_kernel" in names and "_moe_scan_kernel" not in names  # small batches: one align launch
    if quantization:
        assert "_block_gemm_kernel" in names  # the FP8 attention / dense linears
    fused = [(grid, kw) for kernel, grid, _, kw in log if kernel.__name__ == "_fused_moe_kernel"]
    assert all(kw["FP8"] == (quantization == "fp8") for _, kw in fused)


# ---- the benchmark script -----------------------------------------------------------------------------
@pytest.mark.skipif(DEVICE == "cuda", reason="the dry run interprets Triton on CPU tensors; a process that sees a GPU "
                    "compiles Triton instead (there the real benchmark runs: scripts/gpu_bringup.sh)")
@pytest.mark.slow  # (a script check: ~14 s interpreted)
def test_bench_moe_dry_run(tmp_path):
    from bench_scripts import bench_module

    bench_moe = bench_module("bench_moe")

    page = tmp_path / "gpu.md"
    page.write_text((REPO / "docs" / "gpu.md").read_text())
    before = page.read_text()
    out = tmp_path / "moe.json"
    assert bench_moe.main(["--dry-run", "--write-docs", "--docs-path", str(page), "--json-out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = result["moe"]
    assert {(r["weights"], r["method"]) for r in rows} == {(w, m) for w in ("bf16", "fp8") for m in bench_moe.METHODS}
    assert {r["tokens"] for r in rows} == {32, 64}
    assert all(r["rel_err_vs_fp32"] < 1e-5 for r in rows)  # fp32 in the dry run: the twins agree
    assert [s["weights"] for s in result["steps"]] == ["bf16", "fp8"]
    after = page.read_text()
    assert bench_moe.DOCS_BEGIN in after and "| weights | tokens | method |" in after
    assert after.split(bench_moe.DOCS_BEGIN)[0] == before.split(bench_moe.DOCS_BEGIN)[0]  # the rest is kept
    assert after.split(bench_moe.DOCS_END)[1] == before.split(bench_moe.DOCS_END)[1]


def test_bench_moe_without_cuda_says_so():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    from bench_scripts import bench_module

    bench_moe = bench_module("bench_moe")

    with pytest.raises(SystemExit, match="no CUDA device"):
        bench_moe.main([])


@pytest.mark.slow
def test_moe_kernels_compile_for_hopper_without_spills():
    """Every MoE/FP8 kernel launch (mini shape, 32/64/512/2048 tokens, bf16 and FP8) compiled ahead of time for
    sm_90 with the JIT's specialisations: no stack, no local memory; every GEMM on wgmma, the 16- and 32-row tiles
    included (swap-AB): HGMMA in bf16, QGMMA (e4m3 x e4m3, no conversion to fp16) in FP8, never mma.sync."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))  # this checkout's redraft
    from bench_scripts import bench_script

    proc = subprocess.run([sys.executable, bench_script("bench_moe"), "--compile-report"],
                          capture_output=True, text=True, env=env, timeout=600, cwd=REPO)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip() or proc.stderr.strip()[-300:])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sm_90")]
    assert len(lines) > 10, proc.stdout
    for line in lines:
        assert " local 0 " in line, line
        if "_moe_scan_kernel" not in line and "_moe_align_kernel" not in line:  # (the scans keep a 64-byte stack
            # frame, no local loads/stores)
            assert " stack 0 " in line, line
    gemms = [line for line in lines if "_fused_moe_kernel" in line or "_block_gemm_kernel" in line]
    for line in gemms:
        assert line.rsplit(" mma ", 1)[1] == ("QGMMA" if " fp8 " in line else "HGMMA"), line
    for tag in ("T=32 bf16 fused _fused_moe_kernel {'BLOCK_M': 16", "T=32 fp8 fused _fused_moe_kernel {'BLOCK_M': 16",
                "T=32 bf16 unfused _block_gemm_kernel {'BLOCK_M': 16", "T=32 fp8 unfused _block_gemm_kernel {'BLOCK_M': 16",
                "T=2048 fp8 fused _fused_moe_kernel {'BLOCK_M': 64", "T=2048 bf16 fused _fused_moe_kernel {'BLOCK_M': 64"):
        assert any(tag in line for line in gemms), tag


def test_one_block_grid_is_whole_waves_on_132_sms(monkeypatch):
    """The docstring's grid arithmetic (kernels/moe_triton.py), counted: a 32-token block under uniform routing
    (8 distinct random experts of 256 per token, + the shared expert's 32 pairs) gives ~165 live 16-row tiles;
    with the seeds' slices that is ~1320 bf16 programs (10 per SM of an H100/H200's 132) and ~660 FP8 ones (5)."""
    monkeypatch.setattr(mt, "_TABLES", {})
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the seeds, whatever device runs this
    g = torch.Generator().manual_seed(0)
    live = []
    for _ in range(20):
        ids = torch.stack([torch.randperm(256, generator=g)[:8] for _ in range(32)])
        counts = torch.bincount(ids.flatten(), minlength=256)
        live.append(int((-(-counts // 16)).sum()) + 2)  # + the shared expert: 32 pairs, two 16-row tiles
    mean = sum(live) / len(live)
    assert 160 <= mean <= 170 and max(live) - min(live) < 30, live
    for fp8, waves in ((False, 10), (True, 5)):
        cfg = mt.fused_config(32, 9, 257, 2048, 512, fp8, False)
        assert cfg["BLOCK_M"] == 16
        programs = mean * (512 // cfg["BLOCK_I"])
        assert abs(programs / 132 - waves) < 0.25, (fp8, programs)


def test_config_table_by_token_count(tmp_path, monkeypatch):
    """The fused kernel's launch options come from the device's sweep file when there is one, else the seeds, by the
    largest token key <= the batch's tokens."""
    monkeypatch.setattr(mt, "_TABLES", {})
    small = mt.fused_config(32, 9, 257, 2048, 512, False, False)
    assert (small["BLOCK_M"], small["BLOCK_K"], small["num_warps"], small["num_stages"]) == (16, 128, 4, 2)
    assert small["BLOCK_I"] == 64 and mt.fused_config(64, 9, 257, 2048, 512, False, False)["BLOCK_I"] == 128
    fp8 = mt.fused_config(32, 9, 257, 2048, 512, True, False)
    assert (fp8["BLOCK_I"], fp8["num_warps"]) == (128, 4)  # one activation group per slice, one warpgroup
    assert mt.fused_config(512, 9, 257, 2048, 512, False, False)["BLOCK_M"] == 32
    assert mt.fused_config(32, 9, 257, 2048, 512, True, False)["BLOCK_K"] == 128  # FP8: one activation group
    path = tmp_path / "NVIDIA_Test_GPU.json"
    path.write_text(json.dumps({"bf16": {"32": {"BLOCK_M": 32, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}}}))
    monkeypatch.setattr(mt, "_TABLES", {})
    monkeypatch.setattr(mt, "MOE_CONFIG_DIR", tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA Test GPU")
    tuned = mt.fused_config(40, 9, 257, 2048, 512, False, False)
    assert (tuned["BLOCK_M"], tuned["BLOCK_K"], tuned["num_warps"], tuned["num_stages"]) == (32, 64, 8, 3)
    assert mt.fused_config(16, 9, 257, 2048, 512, False, False)["BLOCK_M"] == 16  # under the file's keys: seeds
    assert mt.fused_config(512, 9, 257, 2048, 512, False, False)["BLOCK_K"] == 128  # a key the file lacks: seeds
    assert mt.fused_config(16, 9, 257, 2048, 512, True, False)["BLOCK_M"] == 16  # no fp8 entry: the seeds
    monkeypatch.setattr(mt, "_TABLES", {})
