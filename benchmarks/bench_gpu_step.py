"""GPU benchmark of redraft's denoising step at LLaDA2.1-mini scale (dummy weights, bf16, Triton attention).

    python benchmarks/bench_gpu_step.py                  # the whole table (needs a CUDA device)
    python benchmarks/bench_gpu_step.py --write-docs     # ... and write it into docs/gpu.md
    python benchmarks/bench_gpu_step.py --compile-report # no GPU needed: compile the attention kernel
                                                              # for sm_90 and print registers / spills / wgmma

The model directory is built on the spot: config.json with the real 2.1-mini (or -flash) shape and the tiny
tokenizer (the tokenizer plays no part in the timings); the weights are random (`load_format="dummy"`),
drawn on the GPU. What it measures, each against a floor computed here from bytes and a bandwidth measured
here (a large device-to-device copy) and, for prefill, FLOPs and a measured bf16 matmul rate:
  1. the denoising step (forward + draft-and-edit step for every request, one 32-token block each, behind a
     context of --context tokens) at each batch size, eager vs CUDA graph; bytes a step must move: the
     weights it touches (attention, dense layer, router, shared experts, the experts the batch's tokens route
     to: E * (1 - (1 - k/E)^T) per MoE layer for T tokens, lm_head) + the KV cache it reads and writes;
  2. the attention kernel alone (one layer, one denoising block per request) vs torch SDPA on pre-gathered
     contiguous K/V, vs the paged torch twin, and vs its memory floor (K/V read once, q read, out and the
     new K/V written);
  3. one-pass prefill of a 4k and a 16k-token prompt (tokens per second).
Timings: CUDA events, warm-up first, medians; inputs that would fit in L2 are rotated among several copies.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import step_probe

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "gpu.md"
DOCS_BEGIN, DOCS_END = "<!-- bench_gpu_step:begin -->", "<!-- bench_gpu_step:end -->"

# The architecture tables of inclusionAI/LLaDA2.1-mini and -flash (config.json fields).
_COMMON = {
    "architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", "head_dim": 128,
    "first_k_dense_replace": 1, "num_experts": 256, "num_experts_per_tok": 8, "num_shared_experts": 1,
    "n_group": 8, "topk_group": 4, "routed_scaling_factor": 2.5, "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "norm_topk_prob": True, "use_qkv_bias": False, "use_bias": False,
    "partial_rotary_factor": 0.5, "rope_theta": 600000.0, "vocab_size": 157184, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "pad_token_id": 156892, "torch_dtype": "bfloat16",
}
MODEL_CONFIGS = {
    "mini": {**_COMMON, "hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
             "num_key_value_heads": 4, "intermediate_size": 5120, "moe_intermediate_size": 512},
    "flash": {**_COMMON, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 4, "intermediate_size": 9216, "moe_intermediate_size": 1024},
}



def _tiny_raw() -> dict:
    from redraft.engine.model.tiny import TINY_CONFIG, TINY_TOKENIZER_VOCAB

    return {"architectures": ["LLaDA2MoeModelLM"], "model_type": "llada2_moe", **TINY_CONFIG,
            "vocab_size": TINY_TOKENIZER_VOCAB, "torch_dtype": "float32"}


# Datasheet HBM bandwidths, only to print the facts' reference floors beside the measured ones.
NOMINAL_BW = {"H100": 3.35e12, "H200": 4.8e12, "B200": 8.0e12, "A100": 2.0e12}
BLOCK = 32


def _raw_config(name: str) -> dict:
    return _tiny_raw() if name == "tiny" else MODEL_CONFIGS[name]


def model_config(name: str):
    from redraft.engine.model.config import ModelConfig

    return ModelConfig.from_dict(_raw_config(name))


def write_model_dir(path: str | Path, name: str = "mini") -> Path:
    """config.json (the real shape) + the tiny tokenizer; no weights (load_format='dummy' draws them)."""
    from redraft.engine.model.tiny import tiny_tokenizer
    from redraft.engine.text.tokenizer import load_default_chat_template, save_pretrained_tokenizer

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    raw = _raw_config(name)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_pretrained_tokenizer(tiny_tokenizer(), path, load_default_chat_template(),
                              model_max_length=raw["max_position_embeddings"])
    return path


def step_bytes(cfg, batch: int, context: int, dtype_bytes: int = 2) -> dict:
    """The fewest bytes one denoising forward moves: weights read once (only the experts the batch's tokens
    route to, in expectation under uniform routing), KV of the context read once, the new block's KV written.
    Small terms (norms, embedding rows, activations) are left out."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = cfg.num_hidden_layers
    n_dense = min(cfg.first_k_dense_replace, layers)
    e, k = cfg.num_experts, cfg.num_experts_per_tok
    tokens = batch * BLOCK
    touched = e * (1 - (1 - k / e) ** tokens)
    attn = layers * (h * (nq + 2 * nkv) * d + nq * d * h)
    dense = n_dense * 3 * h * cfg.intermediate_size
    expert = 3 * h * cfg.moe_intermediate_size
    moe = (layers - n_dense) * (e * h + expert * cfg.num_shared_experts + touched * expert)
    head = cfg.vocab_size * h
    weights = (attn + dense + moe + head) * dtype_bytes
    kv_token = 2 * layers * nkv * d * dtype_bytes
    kv = batch * (context + BLOCK) * kv_token + tokens * kv_token  # read all keys/values, write the new block's
    return {"weights": weights, "kv": kv, "total": weights + kv, "experts_touched": touched}


def prefill_flops(cfg, tokens: int) -> float:
    """Matmul FLOPs of a one-pass prefill of `tokens` tokens (block-causal attention ~ half the square)."""
    h, d = cfg.hidden_size, cfg.head_dim
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    layers = cfg.num_hidden_layers
    n_dense = min(cfg.first_k_dense_replace, layers)
    per_token = layers * (h * (nq + 2 * nkv) * d + nq * d * h)
    per_token += n_dense * 3 * h * cfg.intermediate_size
    per_token += (layers - n_dense) * (cfg.num_experts * h
                                       + 3 * h * cfg.moe_intermediate_size * (cfg.num_experts_per_tok
                                                                             + cfg.num_shared_experts))
    attn = layers * 2 * 2 * nq * d * tokens * tokens / 2  # QK^T and PV over the visible half
    return 2 * per_token * tokens + attn + 2 * cfg.vocab_size * h * BLOCK


# ---- argument parsing ---------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_gpu_step", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=sorted(MODEL_CONFIGS) + ["tiny"], default="mini")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--batches", type=_ints, default=[1, 8, 32, 64], help="denoising batch sizes")
    p.add_argument("--context", type=int, default=1024, help="prompt tokens behind each request's active block")
    p.add_argument("--prefill", type=_ints, default=[4096, 16384], help="prompt lengths for one-pass prefill")
    p.add_argument("--attn-contexts", type=_ints, default=[1024, 8192], help="contexts for the attention table")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--routing", choices=step_probe.ROUTINGS, default="uniform",
                   help="model: the model's router decides; uniform: a fixed random top-k assignment per token "
                        "(the router still runs; capturable)")
    p.add_argument("--block", choices=step_probe.BLOCKS, default="random",
                   help="the active block's tokens: mask (all MASK, as the engine opens it) or random tokens")
    p.add_argument("--profile", action="store_true", help="also break the replayed step down by kernel class "
                   "(torch.profiler)")
    p.add_argument("--skip-attention", action="store_true", help="skip the attention table")
    p.add_argument("--skip-prefill", action="store_true", help="skip the prefill table")
    p.add_argument("--skip-steps", action="store_true", help="skip the engine (step and prefill tables)")
    p.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOCS.relative_to(REPO)}")
    p.add_argument("--docs-path", default=str(DOCS), help="the page --write-docs updates")
    p.add_argument("--json-out", default=None, help="also write every number to this JSON file")
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU needed: the whole flow on CPU at the tiny shape (Triton interpreted, the CUDA graphs "
                        "replaced by their static-buffer eager twin, tiny sizes); checks the script, measures nothing")
    p.add_argument("--compile-report", action="store_true",
                   help="no GPU needed: compile the attention kernel for sm_90 and report registers/spills/wgmma")
    p.add_argument("--report-shapes", default=None,
                   help="with --compile-report: name:dtype,... out of " +
                        ",".join(f"{n}:{t}" for n, t, *_ in REPORT_SHAPES) + " (default: all)")
    return p.parse_args(argv)


# ---- compile report (CPU) -----------------------------------------------------------------------------
REPORT_SHAPES = [  # name, dtype, Hq, Hkv, D
    ("mini", "bfloat16", 16, 4, 128),
    ("flash", "bfloat16", 32, 4, 128),
    ("mini", "float16", 16, 4, 128),
    ("tiny", "float32", 4, 2, 16),
]


def _arg_type(name: str, constexprs: dict, dtype: str) -> str:
    """The Triton signature type of `_block_causal_attn_kernel`'s argument `name` (dtype: its tensors' element)."""
    if name in constexprs:
        return "constexpr"
    if name in ("Q", "K", "V", "KC", "VC", "Out"):
        return f"*{dtype}"
    if name in ("PartO", "PartML"):
        return "*fp32"
    if name in ("Slots", "PageTable", "QStarts", "QLens", "CuQ", "WinStarts"):
        return "*i64"
    return "fp32" if name == "qk_scale" else "i32"


def compile_report(shapes: str | None = None) -> int:
    """Compile `_block_causal_attn_kernel` ahead of time for sm_90 at the shapes the engine launches and print
    the resource report from the cubin. Exit 3 when this Triton has no CUDA toolchain."""
    wanted = REPORT_SHAPES if not shapes else [s for s in REPORT_SHAPES if f"{s[0]}:{s[1]}" in shapes.split(",")]
    if "triton" in sys.modules:  # imported already (maybe interpreted): do it in a fresh process
        env = dict(os.environ, TRITON_INTERPRET="0")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--compile-report"]
        return subprocess.run(cmd + (["--report-shapes", shapes] if shapes else []), env=env).returncode
    os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before triton is imported)
    import inspect
    import warnings

    warnings.filterwarnings("ignore")
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        print(f"compile report unavailable: {exc}")
        return 3
    from redraft.kernels import attention_triton as at

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    cuobjdump = tools / "cuobjdump"
    if not cuobjdump.exists():
        print(f"compile report unavailable: no {cuobjdump}")
        return 3
    names = list(inspect.signature(at._block_causal_attn_kernel).parameters)
    ty = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}
    fn = triton.jit(at._block_causal_attn_kernel)
    for (name, dtype, hq, hkv, d), splits in [(w, s) for w in wanted for s in (1, 8)]:
        cfg = at.launch_config(hq // hkv, d, BLOCK, BLOCK, interp=False, split=splits > 1)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        const = {**cfg, "IEEE": dtype == "float32", "SPLITS": splits, "HQ": hq}
        sig = {n: _arg_type(n, const, ty[dtype]) for n in names}
        src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()})
        try:
            kern = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": warps, "num_stages": stages})
        except Exception as exc:  # noqa: BLE001 - report, fail
            print(f"sm_90 {name} {dtype}: COMPILE FAILED: {exc}")
            return 1
        use = cubin_usage(kern, cuobjdump)
        wgmma = "yes" if "HGMMA" in use["mma"] else "no"
        print(f"sm_90 {name} {dtype} G={hq // hkv} D={d} BLOCK_M={cfg['BLOCK_M']} BLOCK_N={cfg['BLOCK_N']} "
              f"splits={splits} warps={warps} stages={stages}: regs {use['regs']} stack {use['stack']} local {use['local']} "
              f"shared {use['shared']} wgmma {wgmma}")
    return 0


def cubin_usage(kern, cuobjdump: Path) -> dict:
    """What a compiled kernel's cubin uses, read with cuobjdump: registers and stack per thread (-1 when
    unreadable), local-memory instructions (spills), shared memory, and its MMA instructions ("none" if any)."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kern.asm["cubin"])
        res = subprocess.run([str(cuobjdump), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
        sass = subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+)", res)
    return {"regs": int(m.group(1)) if m else -1, "stack": int(m.group(2)) if m else -1,
            "local": len(re.findall(r"\b(?:LDL|STL)\b", sass)), "shared": kern.metadata.shared,
            "mma": "+".join(sorted(set(re.findall(r"\b(HGMMA|QGMMA|HMMA)\b", sass)))) or "none"}


# ---- timing helpers -----------------------------------------------------------------------------------
DEVICE = torch.device("cuda")  # main() switches to cpu for --dry-run


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, iters: int, warmup: int, sets: int = 1) -> float:
    """Median milliseconds of fn(i % sets) over `iters` calls (CUDA events around each call on a GPU)."""
    for i in range(warmup):
        fn(i % sets)
    _sync()
    times = []
    for i in range(iters):
        if DEVICE.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(i % sets)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn(i % sets)
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure_copy_bandwidth(iters: int, n: int = 1 << 29) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted); n bf16 elements (1 GiB)."""
    src = torch.randn(n, device=DEVICE, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    ms = _time(lambda _: dst.copy_(src), iters, 3)
    return 2 * n * 2 / (ms / 1e3)


def measure_matmul_rate(dtype: torch.dtype, iters: int, n: int = 8192) -> float:
    a = torch.randn(n, n, device=DEVICE, dtype=dtype)
    b = torch.randn(n, n, device=DEVICE, dtype=dtype)
    ms = _time(lambda _: a @ b, iters, 3)
    return 2 * n**3 / (ms / 1e3)


def build_engine(args, model_dir: Path, max_tokens: int):
    import redraft

    kw = dict(device=DEVICE.type, dtype=args.dtype, kernel_backend="triton", load_format="dummy", seed=args.seed,
              max_total_tokens=max_tokens, max_running_requests=max(args.batches),
              cuda_graph_max_bs=max(args.batches), chunked_prefill_size=max(args.prefill + [8192]) + 4 * BLOCK,
              progress=False)
    engine = redraft.Engine(str(model_dir), **kw)  # dummy weights drawn on the GPU (engine/model/loader.py)
    if args.dry_run:  # CPU: no CUDA graphs; run their static-buffer twin eagerly so the flow is the same
        from redraft.engine.runtime.cuda_graphs import DecodeGraphs

        engine.core.runner.graphs = DecodeGraphs(engine.core.runner, max(args.batches), capture=False)
    return engine


def _prompt(rng: torch.Generator, n: int, vocab: int, avoid: set[int]) -> list[int]:
    ids = torch.randint(0, min(vocab, 150000), (n,), generator=rng).tolist()
    out = []
    for t in ids:
        while t in avoid:  # (t + 1 may be avoided too: eos 1, mask 2 in the tiny tokenizer)
            t += 1
        out.append(t)
    return out


def _decode_items(engine, n: int, context: int, rng):
    """Admit n requests with `context`-token prompts and step them until the batch is n plain denoising steps
    (one block each). Returns the WorkItems; timing runner.run(items) repeatedly leaves their state as is."""
    from redraft.protocol.sampling_params import SamplingParams

    avoid = {engine.tokenizer.mask_token_id, engine.tokenizer.eos_token_id}
    params = SamplingParams.from_dict({"max_new_tokens": 8 * BLOCK, "temperature": 0.0, "mode": "S"})
    sched = engine.core.scheduler
    for i in range(n):
        engine.core.add_request(f"bench-{i}", _prompt(rng, context, engine.model_config.vocab_size, avoid), params)
    for _ in range(10_000):
        items = sched.schedule()
        if len(items) == n and all(it.decodes and it.first == it.last for it in items):
            return items
        sched.update(items, engine.core.runner.run(items))
    raise RuntimeError("the batch never reached plain denoising steps")


def _clear(engine) -> None:
    sched = engine.core.scheduler
    for req in list(sched.running) + list(sched.waiting):
        engine.core.abort(req.rid)
    engine.core.step()  # nothing runs: reports (and forgets) the aborted requests
    sched.flush_cache()


def bench_steps(engine, args, bw: float, mm: float, cfg, probe) -> list[dict]:
    from redraft.engine.runtime.batch import build_forward_batch
    from redraft.engine.runtime.forward import eager_forward

    runner = engine.core.runner
    graphs = runner.graphs
    if graphs is None:
        raise SystemExit(f"bench_gpu_step: no CUDA graphs were captured: {runner.graph_error}")
    rng = torch.Generator().manual_seed(args.seed)
    avoid = {engine.tokenizer.mask_token_id, engine.tokenizer.eos_token_id}
    esz = torch.finfo(getattr(torch, args.dtype)).bits // 8
    rows = []
    for n in args.batches:
        items = _decode_items(engine, n, args.context, rng)
        if args.block == "random":
            step_probe.randomize_blocks(items, min(cfg.vocab_size, 150000), avoid, args.seed + n)
        batch = build_forward_batch(items, BLOCK)
        with torch.inference_mode(), probe.recording() as ids:
            hidden, window_rows = eager_forward(runner, runner.plan(items, batch))
            eager_logits = runner.model.logits(hidden, window_rows)  # [N, B, V], what the graph captures
        touched = step_probe.experts_touched(ids, cfg.num_experts)  # this batch's routing, per MoE layer
        with torch.inference_mode():
            graph_logits = graphs.run(batch).clone()
        identical = bool(torch.equal(eager_logits, graph_logits))
        max_diff = float((eager_logits - graph_logits).abs().max())
        del eager_logits, graph_logits, hidden
        runner.graphs = None
        eager = _time(lambda _: runner.run(items), args.iters, args.warmup)
        runner.graphs = graphs
        graphs.decide_on = False  # the old decision: full logits out of the graph, the step on the host
        graph_old = _time(lambda _: runner.run(items), args.iters, args.warmup)
        graphs.decide_on = True  # the new one: the decision inside the graph (greedy threshold rows: all here)
        graph = _time(lambda _: _step_in_place(runner, items), args.iters, args.warmup)
        fwd = _time(lambda _: graphs.run(batch), args.iters, args.warmup)
        roof = step_probe.step_roofline(cfg, n, args.context, touched, bw=bw, peak=mm, wbytes=esz)
        row = {"batch": n, "context": args.context, "routing": args.routing, "block": args.block,
               "eager_ms": eager, "graph_ms": graph, "graph_forward_ms": fwd, "speedup": eager / graph,
               "graph_old_decision_ms": graph_old, "decision_in_graph": graphs.decides,
               "floor_ms": roof["total_ms"], "bytes": roof["total_bytes"], "experts_touched": roof["experts_touched"],
               "experts_touched_per_layer": touched, "roofline": roof,
               "replay_identical": identical, "replay_max_abs_diff": max_diff}
        if args.profile:
            iters = max(1, min(args.iters, 10))
            fwd_cls = step_probe.profile_classes(lambda: graphs.run(batch), iters, DEVICE)
            step_cls = step_probe.profile_classes(lambda: _step_in_place(runner, items), iters, DEVICE)
            row["breakdown_forward"] = fwd_cls
            row["breakdown_decision"] = step_probe.subtract(step_cls, fwd_cls)
        rows.append(row)
        _clear(engine)
        print(f"  step batch {n} ({args.routing} routing, {args.block} block): eager {eager:.2f} ms, graph "
              f"{graph:.2f} ms (old decision {graph_old:.2f}, forward {fwd:.2f}), floor {roof['total_ms']:.2f} ms, experts touched "
              f"{roof['experts_touched']:.1f}/layer, replay identical: {identical}", flush=True)
    return rows


def _step_in_place(runner, items) -> None:
    """One step of `items` whose tokens go back into the requests (the window the graph also wrote into its input
    buffer), so that the next timed step has the same rows: the steady state, with no upload (repeating
    runner.run alone would restage every row whose tokens the step changed). No block ends: the batch stays."""
    out = runner.run(items)
    for it, tokens in zip(items, out.tokens):
        start = it.first * BLOCK
        it.req.state.tokens[start : start + BLOCK] = tokens


def bench_attention(cfg, args, bw: float, l2_bytes: int) -> list[dict]:
    import torch.nn.functional as F

    from redraft.kernels.attention import AttentionMetadata, paged_attention_torch
    from redraft.kernels.attention_triton import paged_attention_triton

    dtype = getattr(torch, args.dtype)
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    esz = torch.finfo(dtype).bits // 8
    rows = []
    for context in args.attn_contexts:
        for n in args.batches:
            q_start = context // BLOCK * BLOCK
            kv_len = q_start + BLOCK
            pages_per = kv_len // BLOCK
            kv_bytes = 2 * n * kv_len * hkv * d * esz
            sets = max(1, min(8, math.ceil(2 * l2_bytes / kv_bytes)))  # rotate inputs that would sit in L2
            num_pages = n * pages_per
            perm = torch.randperm(num_pages * sets)
            data = []
            for s in range(sets):
                pages = perm[s * num_pages:(s + 1) * num_pages].view(n, pages_per).tolist()
                meta = AttentionMetadata.build([q_start] * n, [BLOCK] * n, pages, BLOCK, DEVICE,
                                               with_torch_plan=True)
                data.append((meta,))
            kc = torch.randn(num_pages * sets, BLOCK, hkv, d, device=DEVICE, dtype=dtype)
            vc = torch.randn_like(kc)
            q = torch.randn(n * BLOCK, hq, d, device=DEVICE, dtype=dtype)
            k = torch.randn(n * BLOCK, hkv, d, device=DEVICE, dtype=dtype)
            v = torch.randn_like(k)
            dense = [(torch.randn(n, hkv, kv_len, d, device=DEVICE, dtype=dtype),
                      torch.randn(n, hkv, kv_len, d, device=DEVICE, dtype=dtype)) for _ in range(sets)]
            qd = q.view(n, BLOCK, hq, d).transpose(1, 2)
            t_triton = _time(lambda i: paged_attention_triton(q, k, v, kc, vc, data[i][0]), args.iters,
                             args.warmup, sets)
            t_one = _time(lambda i: paged_attention_triton(q, k, v, kc, vc, data[i][0], splits=1), args.iters,
                          args.warmup, sets)  # the kernel without split-KV, for comparison
            t_twin = _time(lambda i: paged_attention_torch(q, k, v, kc, vc, data[i][0]), args.iters, args.warmup,
                           sets)
            # A denoising block sees all of its keys (every key is in a block <= its own): no mask needed.
            t_sdpa = _time(lambda i: F.scaled_dot_product_attention(qd, dense[i][0], dense[i][1], enable_gqa=True),
                           args.iters, args.warmup, sets)
            # Correctness at this shape too: the kernel against the twin.
            out_t = paged_attention_triton(q, k, v, kc.clone(), vc.clone(), data[0][0])
            out_r = paged_attention_torch(q.float(), k.float(), v.float(), kc.float(), vc.float(), data[0][0])
            err = float((out_t.float() - out_r).norm() / out_r.norm())
            need = kv_bytes + 2 * q.numel() * esz + 2 * k.numel() * esz  # K/V read, q read, out + new K/V written
            rows.append({"context": context, "batch": n, "triton_us": t_triton * 1e3, "triton_nosplit_us": t_one * 1e3,
                         "sdpa_us": t_sdpa * 1e3,
                         "twin_us": t_twin * 1e3, "floor_us": need / bw * 1e6, "rel_err_vs_fp32": err,
                         "rotated_sets": sets})
            print(f"  attention ctx {context} batch {n}: triton {t_triton * 1e3:.1f} us, sdpa {t_sdpa * 1e3:.1f} us, "
                  f"twin {t_twin * 1e3:.1f} us, floor {rows[-1]['floor_us']:.1f} us, err {err:.1e}", flush=True)
            if DEVICE.type == "cuda":  # the next shape allocates afresh (these buffers are rebound then)
                torch.cuda.empty_cache()
    return rows


def bench_prefill(engine, args, cfg, mm_rate: float, bw: float) -> list[dict]:
    from redraft.protocol.sampling_params import SamplingParams

    rng = torch.Generator().manual_seed(args.seed + 1)
    avoid = {engine.tokenizer.mask_token_id, engine.tokenizer.eos_token_id}
    rows = []
    for tokens in args.prefill:
        params = SamplingParams.from_dict({"max_new_tokens": BLOCK, "temperature": 0.0, "mode": "S"})
        engine.core.add_request(f"prefill-{tokens}", _prompt(rng, tokens, cfg.vocab_size, avoid), params)
        items = engine.core.scheduler.schedule()
        assert len(items) == 1 and items[0].first == 0 and items[0].decodes, "prefill did not fit one pass"
        window = (items[0].last + 1) * BLOCK
        ms = _time(lambda _: engine.core.runner.run(items), max(3, args.iters // 6), 2) if DEVICE.type == "cuda" else \
            _time(lambda _: engine.core.runner.run(items), 1, 0)
        flops = prefill_flops(cfg, window)
        weights = step_bytes(cfg, 64, 0)["weights"]  # every expert is touched
        floor = max(flops / mm_rate, weights / bw) * 1e3
        rows.append({"prompt_tokens": tokens, "window_tokens": window, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
                     "floor_ms": floor, "tflops": flops / ms / 1e9})
        print(f"  prefill {tokens}: {ms:.1f} ms, {tokens / ms * 1e3:,.0f} tok/s, floor {floor:.1f} ms", flush=True)
        _clear(engine)
    return rows


# ---- report -------------------------------------------------------------------------------------------
def render(info: dict, steps: list[dict], attn: list[dict], prefill: list[dict]) -> str:
    lines = [
        f"Device: **{info['device']}** ({info['sms']} SMs, {info['memory_gb']:.0f} GB), torch {info['torch']}, "
        f"triton {info['triton']}, CUDA {info['cuda']}; {info['date']}.",
        f"Model: LLaDA2.1-{info['model']} shape, dummy weights, {info['dtype']}, kernel_backend=triton.",
        f"Measured: device copy bandwidth **{info['copy_bw'] / 1e12:.2f} TB/s** (read + write), "
        f"{info['dtype']} matmul **{info['mm_rate'] / 1e12:.0f} TFLOP/s** (8192^3).",
        "",
        f"### Denoising step (context {steps[0]['context'] if steps else '-'} tokens per request, one 32-token "
        f"block each; forward + draft-and-edit step; {steps[0]['routing'] if steps else '-'} routing, "
        f"{steps[0]['block'] if steps else '-'} block)",
        "",
        "The floor is a roofline per kernel class (attention, projections, router, routed experts, lm_head): "
        "max(bytes / copy bandwidth, FLOPs / matmul rate) each, summed; routed experts are those the timed "
        "batch's routing touched, counted per layer.",
        "",
        "The CUDA graph step decides inside the graph (greedy threshold rows: one packed read, no upload in steady "
        "state); \"old decision\" is the same graphs with the full-logits variant and the step on the host.",
        "",
        "| batch | eager ms | CUDA graph ms | graph speed-up | graph forward ms | roofline floor ms | step / floor "
        "| experts touched / layer (measured) | replay == eager | old decision ms | step - forward: old / new ms |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|",
    ]
    for r in steps:
        old, fwd = r.get("graph_old_decision_ms", float("nan")), r["graph_forward_ms"]
        lines.append(f"| {r['batch']} | {r['eager_ms']:.2f} | {r['graph_ms']:.2f} | {r['speedup']:.2f}x | "
                     f"{fwd:.2f} | {r['floor_ms']:.2f} | {r['graph_ms'] / r['floor_ms']:.2f}x | "
                     f"{r['experts_touched']:.0f} | {'bitwise' if r['replay_identical'] else 'max diff %.1e' % r['replay_max_abs_diff']} | "
                     f"{old:.2f} | {old - fwd:.2f} / {r['graph_ms'] - fwd:.2f} |")
    lines += render_breakdown(steps)
    nominal = info.get("nominal_floor_ms")
    if steps and nominal:
        lines += ["", f"Batch-1 floor at the datasheet bandwidth of this GPU ({info['nominal_bw'] / 1e12:.2f} TB/s): "
                      f"{nominal:.2f} ms (the facts file: 6.2 ms on an H100, 4.3 ms on an H200, weights only)."]
    lines += ["", "### Attention kernel (one layer, one denoising block per request, bf16)", "",
              "| context | batch | Triton us (split-KV) | Triton us (no split) | torch SDPA (contiguous K/V) us "
              "| paged torch twin us | memory floor us | Triton / floor | rel. err vs fp32 |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in attn:
        lines.append(f"| {r['context']} | {r['batch']} | {r['triton_us']:.1f} | {r['triton_nosplit_us']:.1f} | "
                     f"{r['sdpa_us']:.1f} | {r['twin_us']:.1f} | "
                     f"{r['floor_us']:.1f} | {r['triton_us'] / r['floor_us']:.2f}x | {r['rel_err_vs_fp32']:.1e} |")
    lines += ["", "### One-pass prefill", "", "| prompt tokens | ms | tokens/s | floor ms (max of FLOPs, bytes) "
              "| achieved TFLOP/s |", "|---:|---:|---:|---:|---:|"]
    for r in prefill:
        lines.append(f"| {r['prompt_tokens']} | {r['ms']:.1f} | {r['tokens_per_s']:,.0f} | {r['floor_ms']:.1f} | "
                     f"{r['tflops']:.0f} |")
    return "\n".join(lines) + "\n"


def render_breakdown(steps: list[dict]) -> list[str]:
    """The replayed forward and the decision (step minus forward) by kernel class, one column pair per batch."""
    prof = [r for r in steps if "breakdown_forward" in r]
    if not prof:
        return []
    classes = sorted({c for r in prof for c in r["breakdown_forward"] if c != "total"})
    head = "| kernel class | " + " | ".join(f"batch {r['batch']} us | kernels" for r in prof) + " |"
    lines = ["", "### Where the step goes (torch.profiler over replays; us and kernels per step)", "", head,
             "|---|" + "---:|---:|" * len(prof)]
    for cls in classes + ["total"]:
        cells = [f"{r['breakdown_forward'].get(cls, {}).get('us', 0):.0f} | "
                 f"{r['breakdown_forward'].get(cls, {}).get('kernels', 0):.0f}" for r in prof]
        lines.append(f"| {cls} | " + " | ".join(cells) + " |")
    cells = [f"{r['breakdown_decision']['total']['us']:.0f} | {r['breakdown_decision']['total']['kernels']:.0f}"
             for r in prof]
    lines.append("| decision and host-launched (step - forward) | " + " | ".join(cells) + " |")
    return lines


def write_docs(text: str, path: Path = DOCS) -> None:
    """Replace the results section (between the markers) of docs/gpu.md; the rest of the page is kept."""
    doc = path.read_text() if path.exists() else f"# redraft on a GPU\n\n{DOCS_BEGIN}\n{DOCS_END}\n"
    if DOCS_BEGIN not in doc:
        doc += f"\n{DOCS_BEGIN}\n{DOCS_END}\n"
    head, rest = doc.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1] if DOCS_END in rest else "\n"
    path.write_text(f"{head}{DOCS_BEGIN}\n{text}{DOCS_END}{tail}")
    print(f"wrote {path}")


DRY_RUN = dict(model="tiny", dtype="float32", batches=[1, 3], context=40, prefill=[70], attn_contexts=[64], iters=1,
               warmup=0, profile=True)


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    args = parse_args(argv)
    if args.compile_report:
        return compile_report(args.report_shapes)
    if args.dry_run:
        DEVICE = torch.device("cpu")
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    elif not torch.cuda.is_available():
        raise SystemExit(f"bench_gpu_step: no CUDA device (torch {torch.__version__}, built with CUDA "
                         f"{torch.version.cuda}): this benchmark needs a GPU; `--compile-report` and `--dry-run` "
                         "run without one")
    import redraft.kernels  # noqa: F401 - settles TRITON_INTERPRET before triton is imported
    import triton

    cfg = model_config(args.model)
    if DEVICE.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        name, sms, memory = torch.cuda.get_device_name(0), props.multi_processor_count, props.total_memory
        l2 = getattr(props, "L2_cache_size", 50 << 20)
        bw_elems, mm_n = 1 << 29, 8192
    else:
        name, sms, memory, l2 = "CPU (dry run: these numbers mean nothing)", os.cpu_count(), 0, 1 << 20
        bw_elems, mm_n = 1 << 20, 256
    print(f"{name}: measuring bandwidth and matmul rate", flush=True)
    bw = measure_copy_bandwidth(args.iters, bw_elems)
    mm = measure_matmul_rate(getattr(torch, args.dtype), args.iters, mm_n)
    nominal_bw = next((v for k, v in NOMINAL_BW.items() if k in name), None)
    esz = torch.finfo(getattr(torch, args.dtype)).bits // 8
    info = {"device": name, "sms": sms, "memory_gb": memory / 1e9,
            "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d"), "model": args.model, "dtype": args.dtype, "copy_bw": bw,
            "mm_rate": mm, "nominal_bw": nominal_bw,
            "nominal_floor_ms": step_bytes(cfg, 1, 0, esz)["weights"] / nominal_bw * 1e3 if nominal_bw else None}
    print(f"  copy {bw / 1e12:.2f} TB/s, matmul {mm / 1e12:.0f} TFLOP/s", flush=True)

    attn = [] if args.skip_attention else bench_attention(cfg, args, bw, l2)
    prefills = [] if args.skip_prefill else args.prefill
    if args.skip_steps:
        return report(info, [], attn, [], args)
    with tempfile.TemporaryDirectory() as tmp, \
            step_probe.routing(args.routing, max(args.batches) * BLOCK, args.seed) as probe:
        model_dir = write_model_dir(Path(tmp) / f"llada2.1-{args.model}-dummy", args.model)
        max_tokens = max(args.batches) * (args.context + 10 * BLOCK) + max(prefills + [0]) + 8 * BLOCK
        t0 = time.perf_counter()
        engine = build_engine(args, model_dir, max_tokens)
        print(f"  engine ready in {time.perf_counter() - t0:.0f} s (dummy weights, CUDA graphs captured)", flush=True)
        steps = bench_steps(engine, args, bw, mm, cfg, probe)
        probe.mode = "model"  # prefill: the model's own routing (a prompt's tokens are real tokens)
        args.prefill = prefills
        prefill = bench_prefill(engine, args, cfg, mm, bw)
    return report(info, steps, attn, prefill, args)


def report(info: dict, steps: list[dict], attn: list[dict], prefill: list[dict], args) -> int:
    text = render(info, steps, attn, prefill)
    print()
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"info": info, "steps": steps, "attention": attn,
                                                   "prefill": prefill}, indent=2))
    if args.write_docs:
        write_docs(text, Path(args.docs_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
