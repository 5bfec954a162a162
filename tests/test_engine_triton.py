"""The engine with kernel_backend="triton" against the torch backend, and the GPU path's CPU-checkable parts.

On CPU the Triton kernels run interpreted (TRITON_INTERPRET=1, set before anything imports triton). The engine
must produce exactly the torch backend's tokens on a tiny checkpoint in float32, for prompts that end inside,
on and just past a block boundary and span several blocks, in modes S and Q. The static-buffer denoising
step (what the CUDA graphs replay) runs here eagerly over the same buffers, padding rows and scratch page.
"""

from __future__ import annotations

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

import redraft  # noqa: E402
from redraft.engine.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from redraft.kernels.moe import moe_experts_torch  # noqa: E402
from bench_scripts import bench_module, bench_script  # noqa: E402

# A sync-free torch MoE the engine no longer runs (bench_moe.py's "torch" contender): capturable, so it stands in
# for the fused Triton MoE in the meta-device check below, where Triton cannot run.
moe_sync_free = bench_module("moe_sync_free")

triton_attn = pytest.importorskip("redraft.kernels.attention_triton")

pytestmark = pytest.mark.kernels

REPO = Path(__file__).resolve().parents[1]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled Triton needs CUDA tensors
PROMPT_LENGTHS = (1, 31, 32, 33, 100)
MAX_NEW_TOKENS = 4  # the whole block is still decoded; few tokens keep the interpreter's work small


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=0)


def engine(path: Path, backend: str) -> redraft.Engine:
    eng = redraft.Engine(str(path), device=DEVICE, dtype="float32", kernel_backend=backend, progress=False,
                         max_total_tokens=4096, disable_cuda_graph=True)
    eng.core.model.set_moe_experts(moe_experts_torch)  # on CUDA too: attention is the only difference under test
    return eng


def prompts(vocab: int, specials: set[int]) -> list[list[int]]:
    rng = random.Random(1234)
    ordinary = [i for i in range(vocab) if i not in specials]
    return [[rng.choice(ordinary) for _ in range(n)] for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def engines(tiny):
    if not torch.cuda.is_available() and not triton_attn.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module")
    ref, tri = engine(tiny, "torch"), engine(tiny, "triton")
    specials = {t["id"] for t in json.loads((tiny / "tokenizer.json").read_text())["added_tokens"]}
    ids = prompts(ref.model_config.vocab_size, specials)
    yield ref, tri, ids
    ref.shutdown()
    tri.shutdown()


def count_static_steps(graphs: DecodeGraphs, used: list[int]) -> None:
    """Append each static step's batch size to `used`: full-logits steps (`run`) and steps decided inside the
    graph (`decide`, the greedy threshold batches') alike."""
    run, decide = graphs.run, graphs.decide
    graphs.run = lambda batch: used.append(len(batch.q_starts)) or run(batch)
    graphs.decide = lambda items, rule: used.append(len(items)) or decide(items, rule)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["S", "Q"])
def test_triton_backend_reproduces_torch_tokens(engines, mode):
    """All five prompts in one batch (ragged prefill windows, then denoising steps). In mode S the denoising
    steps take the static-buffer path that the CUDA graphs replay (run eagerly here): buckets 1, 2, 4, 6, so
    the five requests start in the 6-bucket with a padding row on the scratch page, decided inside the graph
    (greedy threshold rows); mode Q runs plain eager."""
    ref, tri, ids = engines
    assert tri.core.model.kernel_backend == "triton"
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "mode": mode}
    want = ref.generate(input_ids=ids, sampling_params=params)
    used = []
    if mode == "S":
        graphs = DecodeGraphs(tri.core.runner, max_bs=6, capture=False)
        assert graphs.buckets == [1, 2, 4, 6]
        count_static_steps(graphs, used)
        tri.core.runner.graphs = graphs
    try:
        got = tri.generate(input_ids=ids, sampling_params=params)
    finally:
        tri.core.runner.graphs = None
    for n, a, b in zip(PROMPT_LENGTHS, want, got):
        assert b["output_ids"] == a["output_ids"], f"prompt of {n} tokens, mode {mode}"
        assert b["meta_info"]["steps"] == a["meta_info"]["steps"], f"prompt of {n} tokens, mode {mode}"
    if mode == "S":
        assert used and max(used) == len(ids), "the static step never ran"
        # the scratch page: beyond the pool's pages
        assert tri.core.runner.k_cache.shape[1] == tri.core.scheduler.pool.num_pages + 1


@pytest.mark.slow
def test_triton_backend_with_mbe_windows(engines):
    """Multi-block editing on the Triton kernel (bidirectional windows, prefill rows of committed blocks in the
    same launch): the torch backend's tokens, W = 2 and 3 mixed in one batch."""
    ref, tri, ids = engines
    params = [{"max_new_tokens": 48, "temperature": 0.0, "mode": "S", "mbe_window": 2 + k % 2, "ignore_eos": True}
              for k in range(len(ids))]
    want = ref.generate(input_ids=ids, sampling_params=params)
    got = tri.generate(input_ids=ids, sampling_params=params)
    for n, a, b in zip(PROMPT_LENGTHS, want, got):
        assert (b["output_ids"], b["meta_info"]["steps"]) == (a["output_ids"], a["meta_info"]["steps"]), n
    assert sum(a["meta_info"]["mbe_edits"] for a in want) > 0, "no multi-block edit happened: nothing was tested"


@pytest.mark.slow
def test_llada22_on_the_triton_backend(tiny_checkpoint):
    """A LLaDA2.2 checkpoint (block routing: the Triton block router and fused MoE here; the Levenshtein step
    and the 2.1 step) gives the torch backend's ids and step counts. (scripts/gpu_llada22_check.py runs the same
    comparison on a GPU against the CPU.)"""
    if not torch.cuda.is_available() and not triton_attn.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module")
    path = tiny_checkpoint(seed=0, llada22=True)
    engines = {b: redraft.Engine(str(path), device=DEVICE, dtype="float32", kernel_backend=b, progress=False,
                                 max_total_tokens=4096, disable_cuda_graph=True) for b in ("torch", "triton")}
    try:
        assert engines["triton"].core.model_config.block_routing
        ids = [list(range(5, 5 + n)) for n in (7, 32, 45)]
        structural = 0
        for decoder in ("levenshtein", "threshold"):
            params = {"max_new_tokens": 40, "temperature": 0.0, "decoder": decoder, "ignore_eos": True}
            want, got = (engines[b].generate(input_ids=ids, sampling_params=params) for b in ("torch", "triton"))
            for a, b in zip(want, got):
                assert b["output_ids"] == a["output_ids"] and b["meta_info"]["steps"] == a["meta_info"]["steps"]
                edits = [(o["meta_info"].get("deletions", 0), o["meta_info"].get("insertions", 0)) for o in (a, b)]
                assert edits[0] == edits[1]
                structural += sum(edits[0])
        assert structural > 0  # the comparison covered deletions/insertions, not only M2T and T2T
    finally:
        for e in engines.values():
            e.shutdown()


@pytest.mark.slow
def test_cli_generate_with_triton_backend(tiny, capsys):
    """`redraft generate --kernel-backend triton` (in-process: this process already runs Triton interpreted)."""
    from redraft.cli import main

    rc = main(["generate", "--model", str(tiny), "--device", DEVICE, "--kernel-backend", "triton", "--raw",
               "--max-new-tokens", "4", "--max-total-tokens", "2048", "--json", "the cat"])
    assert rc == 0
    assert len(json.loads(capsys.readouterr().out)["output_ids"]) == 4


@pytest.mark.parametrize("fn", [moe_sync_free.moe_experts_grouped, moe_sync_free.moe_experts_dense],
                         ids=["grouped", "dense"])
def test_sync_free_moe_matches_reference(fn):
    """The sync-free torch MoE (capturable: fixed shapes, no host sync; the engine itself runs the fused Triton
    MoE on CUDA, kernels/moe_triton.py) against `moe_experts_torch`."""
    g = torch.Generator().manual_seed(0)
    t, h, i, e, k = 37, 32, 16, 8, 2
    x = torch.randn(t, h, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    w2 = torch.randn(e, h, i, generator=g) / i**0.5
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    ids[:5] = torch.tensor([0, 1])  # a popular pair, and some experts nobody picks
    w = torch.rand(t, k, generator=g)
    want = moe_experts_torch(x, w13, w2, ids, w)
    got = fn(x, w13, w2, ids, w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_captured_forward_has_no_host_sync_on_meta():
    """A CPU proxy for CUDA-graph capturability: the exact functions DecodeGraphs captures (the full-logits forward
    and the decision inside the graph), at the real
    LLaDA2.1-mini shape in bf16 with the sync-free torch MoE (the engine's fused Triton MoE cannot run on the
    meta device), run on the meta device, where any data-dependent host sync (.item(), .tolist(), nonzero,
    bincount's output size) raises; torch._grouped_mm's meta kernel also enforces the CUDA kernel's dtype and
    16-byte stride rules. Attention is stubbed: the Triton wrapper only launches (its grid depends on the batch
    size and max_q alone)."""
    from types import SimpleNamespace

    model_config = bench_module("bench_gpu_step").model_config
    from redraft.engine.decoding.registry import DECODER_CLASSES
    from redraft.engine.decoding.slots import SlotState
    from redraft.engine.model.loader import build_model

    cfg = model_config("mini")
    model = build_model(cfg, torch.bfloat16, "meta")  # no memory: meta tensors have shapes only
    model.attend = lambda q, k, v, k_cache, v_cache, meta: torch.empty_like(q)
    model.set_moe_experts(moe_sync_free.moe_experts_grouped)
    cache = torch.empty(cfg.num_hidden_layers, 17, 32, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16,
                        device="meta")
    slots = SlotState(5, 32, torch.device("meta"))  # (4 slots + the scratch slot)
    runner = SimpleNamespace(model=model, device=torch.device("meta"), block_size=32, scratch_page=16, mask_id=5,
                             k_cache=cache, v_cache=cache, slots=slots, scratch_slot=4,
                             decoders={name: cls(slots, cfg, 5) for name, cls in DECODER_CLASSES.items()
                                       if cls.runs_on(cfg)})
    graphs = DecodeGraphs(runner, max_bs=8, capture=False)
    assert graphs.rules  # the decision inside the graph: the fused top-1, the rule's step, the packing
    with torch.inference_mode():
        for bs in (1, 8):
            graphs._pad_all(bs)
            logits = graphs._forward(bs)
            assert logits.shape == (bs, 32, cfg.vocab_size) and logits.dtype == torch.float32
            for rule in graphs.rules.values():
                graphs._decide(bs, rule)
        model.set_moe_experts(moe_experts_torch)  # the reference MoE syncs (bincount().tolist()): caught here
        with pytest.raises((RuntimeError, NotImplementedError)):
            graphs._forward(1)


# ---- the GPU benchmark script: what can be checked without a GPU ---------------------------------------
def test_bench_gpu_step_smoke(tmp_path):
    bench = bench_module("bench_gpu_step")
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.text.tokenizer import Tokenizer

    cfg = bench.model_config("mini")
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.head_dim, cfg.num_experts, cfg.vocab_size, cfg.rotary_dim) == (2048, 20, 16, 4, 128, 256, 157184, 64)
    assert 15e9 < cfg.num_params() < 17e9  # "16B"
    path = bench.write_model_dir(tmp_path / "mini", "mini")  # config.json + the tiny tokenizer, no weights
    assert ModelConfig.from_pretrained(path) == cfg
    assert not list(path.glob("*.safetensors"))
    tok = Tokenizer.from_pretrained(path)
    assert tok.mask_token_id < cfg.vocab_size
    # Bytes a denoising forward must read: the facts' 6.2 ms (H100, 3.35 TB/s) and 4.3 ms (H200, 4.8 TB/s).
    floor = bench.step_bytes(cfg, batch=1, context=0, dtype_bytes=2)
    assert 6.0e-3 < floor["total"] / 3.35e12 < 6.4e-3
    assert 4.2e-3 < floor["total"] / 4.8e12 < 4.5e-3
    args = bench.parse_args(["--batches", "1,8", "--prefill", "4096", "--write-docs"])
    assert args.batches == [1, 8] and args.prefill == [4096] and args.write_docs
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit) as exc:
            bench.main(["--batches", "1"])
        assert "no CUDA device" in str(exc.value)
    # found on the first GPU run: a prompt drew EOS (1), whose "+ 1" was MASK (2), and the engine refused it
    avoid = {1, 2}
    rng = torch.Generator().manual_seed(0)
    ids = bench._prompt(rng, 20_000, 3, avoid)  # a vocabulary of 3: most draws hit an avoided id
    assert ids and not set(ids) & avoid


def test_a_second_cuda_engine_counts_freed_memory_as_free(monkeypatch):
    """Found on the first GPU run: an engine made after another one was shut down in the same process was refused
    a KV cache, because the first one's freed memory stays reserved by torch's caching allocator (and the device
    reports it in use). That reserve is free to the new engine. (The CUDA calls are stood in for here.)"""
    from redraft.engine.runtime import startup
    from redraft.protocol.server_args import ServerArgs

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * gib, 80 * gib))  # 70 GiB in use ...
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 66 * gib)  # ... 66 of them reserved by us,
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: 2 * gib)  # of which 2 GiB hold tensors
    cfg = bench_module("bench_gpu_step").model_config("mini")
    args = ServerArgs(device="cuda", dtype="bfloat16", mem_fraction_static=0.85)
    per_token = startup.ModelRunner.kv_bytes_per_token(cfg, torch.bfloat16)
    budget = int(80 * gib * 0.85) - (80 * gib - (10 + 64) * gib)  # in use: 6 GiB (70 - the 64 freed)
    assert startup.default_kv_tokens(args, cfg) == budget // per_token
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a: 2 * gib)  # nothing freed: 70 GiB in use
    with pytest.raises(ValueError, match="leaves no room for the KV cache .*max_total_tokens"):
        startup.default_kv_tokens(args, cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine runs the real benchmark instead")
@pytest.mark.slow  # (a script check: ~10 s interpreted)
def test_bench_gpu_step_dry_run(tmp_path):
    """The whole benchmark flow on CPU at the tiny shape (`--dry-run`): engine with dummy weights, decode batches
    reached through the scheduler, eager vs static-step timing and the replay == eager check, the attention
    table, prefill, rendering, and --write-docs into a copy of docs/gpu.md (the rest of the page kept)."""
    bench = bench_module("bench_gpu_step")

    page = tmp_path / "gpu.md"
    page.write_text((REPO / "docs" / "gpu.md").read_text())
    before = page.read_text()
    assert bench.main(["--dry-run", "--write-docs", "--docs-path", str(page), "--json-out", str(tmp_path / "b.json")]) == 0
    after = page.read_text()
    assert after.split(bench.DOCS_BEGIN)[0] == before.split(bench.DOCS_BEGIN)[0]
    assert after.split(bench.DOCS_END)[1] == before.split(bench.DOCS_END)[1]
    assert "| batch | eager ms | CUDA graph ms" in after and "dry run" in after
    result = json.loads((tmp_path / "b.json").read_text())
    assert [r["batch"] for r in result["steps"]] == [1, 3]
    assert all(r["replay_identical"] for r in result["steps"])
    # the old decision (full logits out of the graph) beside the new one (inside it), on the same graphs
    assert all(r["decision_in_graph"] and r["graph_old_decision_ms"] > 0 for r in result["steps"])
    assert "step - forward: old / new ms" in after
    # the default is the honest one: uniform routing over a random block, experts counted from the timed batch's
    # ids in each of the tiny model's two MoE layers (8 experts, top-2: a 32-token block touches all 8)
    assert all(r["routing"] == "uniform" and r["block"] == "random" for r in result["steps"])
    assert all(r["experts_touched_per_layer"] == [8, 8] for r in result["steps"])
    assert "experts touched / layer (measured)" in after and "roofline floor ms" in after
    assert all(r["breakdown_forward"]["total"]["kernels"] > 0 for r in result["steps"])  # the profiler flow ran
    assert all(r["rel_err_vs_fp32"] < 1e-4 for r in result["attention"])


def test_kernel_compiles_for_hopper_without_spills():
    """Compile the kernel ahead of time for sm_90 (no GPU needed) at the mini shape: wgmma, no local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, bench_script("bench_gpu_step"), "--compile-report",
                           "--report-shapes", "mini:bfloat16,tiny:float32"],
                          capture_output=True, text=True, env=env, timeout=300, cwd=REPO)
    if proc.returncode == 3:
        pytest.skip(proc.stdout.strip() or proc.stderr.strip()[-300:])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("sm_90")]
    assert lines, proc.stdout
    for line in lines:
        assert "stack 0 " in line and "local 0 " in line, line
        if "bfloat16" in line:
            assert "wgmma yes" in line, line


@pytest.mark.slow
def test_block_routing_static_step_with_padding_rows(tiny_checkpoint):
    """A LLaDA2.2 block-routing checkpoint on kernel_backend="triton" (Triton attention, block router and fused MoE,
    interpreted), its denoising steps on the static buffers the CUDA graphs replay: five requests in the 6-bucket,
    so a padding row (positions 0..31 on the scratch page) shares every step; each padding row must be a routing
    block of its own. Tokens and forward counts equal the torch backend's, which runs no padding at all."""
    if not torch.cuda.is_available() and not triton_attn.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module")
    path = tiny_checkpoint(seed=0, config_overrides={"expert_capacity": 3})
    kw = dict(device=DEVICE, dtype="float32", progress=False, max_total_tokens=4096, disable_cuda_graph=True)
    ref = redraft.Engine(str(path), kernel_backend="torch", **kw)
    tri = redraft.Engine(str(path), kernel_backend="triton", **kw)
    specials = {t["id"] for t in json.loads((path / "tokenizer.json").read_text())["added_tokens"]}
    ids = prompts(ref.model_config.vocab_size, specials)
    params = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0.0, "mode": "S"}
    try:
        want = ref.generate(input_ids=ids, sampling_params=params)
        graphs = DecodeGraphs(tri.core.runner, max_bs=6, capture=False)
        used: list[int] = []
        count_static_steps(graphs, used)
        tri.core.runner.graphs = graphs
        got = tri.generate(input_ids=ids, sampling_params=params)
    finally:
        ref.shutdown()
        tri.shutdown()
    assert used and max(used) == len(ids) < graphs.bucket(len(ids)), "the padded static step never ran"
    for n, a, b in zip(PROMPT_LENGTHS, want, got):
        assert (b["output_ids"], b["meta_info"]["steps"]) == (a["output_ids"], a["meta_info"]["steps"]), n
