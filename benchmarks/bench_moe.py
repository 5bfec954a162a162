"""GPU benchmark of the MoE layer (router + routed experts + shared expert) at LLaDA2.1-mini shape, bf16 and FP8.

    python benchmarks/bench_moe.py                   # the tables (needs a CUDA device)
    python benchmarks/bench_moe.py --write-docs      # ... and write them into docs/gpu.md
    python benchmarks/bench_moe.py --dry-run         # no GPU: the whole flow on CPU, tiny shape, interpreted
    python benchmarks/bench_moe.py --compile-report  # no GPU: compile every MoE/FP8 kernel for sm_90 and
                                                          # print registers / spills / MMA instructions
    python benchmarks/bench_moe.py --fp8-agreement   # CPU: FP8 vs unquantised tokens on the tiny checkpoint

What it measures (CUDA events, warm-up, medians):
  1. the device's copy bandwidth (1 GiB device-to-device, read + write counted);
  2. one MoE layer at 32, 128, 512 and 2048 tokens, bf16 and FP8 weights, for
       torch    route_torch + the engine's former sync-free MoE (torch._grouped_mm, moe_sync_free.py)
                + the shared expert; FP8: the dequantising twin (moe_experts_fp8_torch: a reference, not a
                contender);
       unfused  Triton router + sort + grouped gate_up GEMM, activation, grouped down GEMM, combine;
       fused    Triton router + sort + the fused expert kernel + combine (fused_moe(method="fused"));
       auto     what the engine runs (fused below a partial-buffer budget, unfused above);
     against the bytes the layer must read: the router, the experts this batch's routing actually touches
     (counted from the ids), the shared expert, x and the output; achieved bandwidth = bytes / time, as a
     share of the measured copy bandwidth; and the relative error against an fp32 evaluation of the same
     weights (bf16: upcast; FP8: the dequantised weights with quantised activations);
  3. the end-to-end denoising step (forward + draft-and-edit step, CUDA graph) at batch 1, bf16 vs FP8
     engines with dummy weights at the same shape.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

import step_probe

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs" / "gpu.md"
DOCS_BEGIN, DOCS_END = "<!-- bench_moe:begin -->", "<!-- bench_moe:end -->"
DEVICE = torch.device("cuda")  # main() switches to cpu for --dry-run
TOKENS = [32, 128, 512, 2048]
METHODS = ["torch", "unfused", "fused", "auto"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="bench_moe", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["mini", "flash", "tiny"], default="mini")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="MoE layer batch sizes (tokens)")
    p.add_argument("--weights", default="bf16,fp8", help="bf16 and/or fp8")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--context", type=int, default=1024, help="prompt tokens behind the active block (step bench)")
    p.add_argument("--routing", choices=["model", "uniform"], default="uniform",
                   help="model: the layer's router decides; uniform: a fixed random top-k assignment per token (the "
                        "router still runs)")
    p.add_argument("--block", choices=["mask", "random"], default="random",
                   help="the layer's input rows: random, or mask (each 32-token block's rows one repeated vector: "
                        "the collapsed routing of an all-MASK block with dummy weights)")
    p.add_argument("--skip-step", action="store_true", help="skip the end-to-end denoising-step comparison")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write-docs", action="store_true", help=f"write the tables into {DOCS.relative_to(REPO)}")
    p.add_argument("--docs-path", default=str(DOCS))
    p.add_argument("--json-out", default=None)
    p.add_argument("--dry-run", action="store_true",
                   help="no GPU: the whole flow on CPU at the tiny shape (Triton interpreted), measures nothing")
    p.add_argument("--compile-report", action="store_true",
                   help="no GPU: compile the MoE/FP8 kernels for sm_90 at the launch configurations the engine uses")
    p.add_argument("--fp8-agreement", action="store_true",
                   help="CPU: token agreement of the FP8 tiny model with the unquantised one over a fixed prompt set")
    p.add_argument("--agreement-model", default=None, metavar="DIR",
                   help="with --fp8-agreement: this checkpoint (a demo model: its held-out task prompts) instead "
                        "of a tiny random one")
    p.add_argument("--threads", type=int, default=None, help="with --fp8-agreement: torch CPU threads")
    p.add_argument("--prompts", type=int, default=32, help="with --fp8-agreement: number of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64, help="with --fp8-agreement")
    return p.parse_args(argv)


# ---- shapes -------------------------------------------------------------------------------------------
def model_config(name: str):
    from bench_gpu_step import model_config as _cfg

    return _cfg(name)


def moe_bytes(cfg, touched: int, tokens: int, fp8: bool, act_bytes: int = 2) -> int:
    """Bytes one MoE layer must move: router weight, the touched experts + the shared one (weights and block
    scales), x read, out written."""
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    w_bytes = 1 if fp8 else act_bytes
    per_expert = 3 * h * i * w_bytes
    if fp8:
        blocks = lambda n, k: -(-n // 128) * -(-k // 128)  # noqa: E731
        per_expert += 4 * (2 * blocks(i, h) + blocks(h, i))
    experts = (touched + cfg.num_shared_experts) * per_expert
    return experts + cfg.num_experts * h * act_bytes + 2 * tokens * h * act_bytes


# ---- timing -------------------------------------------------------------------------------------------
def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _time(fn, iters: int, warmup: int) -> float:
    import bench_gpu_step

    bench_gpu_step.DEVICE = DEVICE
    return bench_gpu_step._time(lambda _: fn(), iters, warmup)


# ---- the MoE layer ------------------------------------------------------------------------------------
class Layer:
    """One MoE layer's weights (random, LLaDA2 router), bf16 and/or FP8, on DEVICE."""

    def __init__(self, cfg, dtype: torch.dtype, seed: int, fp8: bool):
        from redraft.kernels.fp8 import quantize_weight

        g = torch.Generator(device=DEVICE).manual_seed(seed)
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.cfg, self.dtype, self.fp8 = cfg, dtype, fp8
        self.uniform: torch.Tensor | None = None  # [T_max, k] fixed ids (--routing uniform), set by the benchmark

        def rnd(*shape, std):
            return (torch.randn(*shape, generator=g, device=DEVICE) * std).to(dtype)

        self.router = rnd(e, h, std=h**-0.5)
        self.bias = (torch.randn(e, generator=g, device=DEVICE) * 0.01).float()
        w13, w2 = rnd(e, 2 * i, h, std=h**-0.5), rnd(e, h, i, std=i**-0.5)
        sg, sd = rnd(2 * i, h, std=h**-0.5), rnd(h, i, std=i**-0.5)
        if fp8:
            self.w13, self.w13_s = quantize_weight(w13, i)
            self.w2, self.w2_s = quantize_weight(w2)
            self.sg, self.sg_s = quantize_weight(sg, i)
            self.sd, self.sd_s = quantize_weight(sd)
            del w13, w2
        else:
            self.w13, self.w2, self.sg, self.sd = w13, w2, sg, sd
            self.w13_s = self.w2_s = self.sg_s = self.sd_s = None

    def route_kwargs(self) -> dict:
        c = self.cfg
        return dict(top_k=c.num_experts_per_tok, n_group=c.n_group, topk_group=c.topk_group,
                    routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob)

    def route(self, x: torch.Tensor, triton_router: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """The router (always run), then the fixed uniform ids when `self.uniform` ([T_max, k], sliced)."""
        from redraft.kernels import moe_triton as mt
        from redraft.kernels.moe import route_torch

        fn = mt.route_triton if triton_router else route_torch
        ids, w = fn(x, self.router, self.bias, **self.route_kwargs())
        if self.uniform is not None:
            ids = self.uniform[: x.shape[0]]
        return ids, w

    def run(self, x: torch.Tensor, method: str) -> torch.Tensor:
        from redraft.kernels.moe import swiglu
        from redraft.kernels import moe_triton as mt

        if method == "torch":
            ids, w = self.route(x, triton_router=False)
            if self.fp8:
                from redraft.kernels.fp8 import moe_experts_fp8_torch, swiglu_fp8_torch

                out = moe_experts_fp8_torch(x, self.w13, self.w13_s, self.w2, self.w2_s, ids, w)
                return out + swiglu_fp8_torch(x, self.sg, self.sg_s, self.sd, self.sd_s)
            from moe_sync_free import moe_experts_static

            return moe_experts_static(x, self.w13, self.w2, ids, w) + swiglu(x, self.sg, self.sd)
        ids, w = self.route(x)
        shared = mt.SharedExpert(self.sg, self.sd, self.sg_s, self.sd_s)
        return mt.fused_moe(x, self.w13, self.w2, ids, w, w13_scale=self.w13_s, w2_scale=self.w2_s, shared=shared,
                            method=method)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 evaluation of the same weights (FP8: dequantised weights, activations quantised as the kernels do)."""
        from redraft.kernels.fp8 import moe_experts_fp8_torch, swiglu_fp8_torch
        from redraft.kernels.moe import moe_experts_torch, route_torch, swiglu

        xf = x.float()
        ids, w = route_torch(xf, self.router.float(), self.bias, **self.route_kwargs())
        if self.uniform is not None:
            ids = self.uniform[: x.shape[0]]
        if self.fp8:
            out = moe_experts_fp8_torch(xf, self.w13, self.w13_s, self.w2, self.w2_s, ids, w)
            return out + swiglu_fp8_torch(xf, self.sg, self.sg_s, self.sd, self.sd_s)
        out = moe_experts_torch(xf, self.w13.float(), self.w2.float(), ids, w)
        return out + swiglu(xf, self.sg.float(), self.sd.float())


def layer_input(cfg, t: int, block: str, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, H] activations: random rows, or (block="mask") each 32-token block's rows one repeated random vector."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if block == "random":
        return torch.randn(t, cfg.hidden_size, generator=g, device=DEVICE).to(dtype)
    blocks = -(-t // 32)
    rows = torch.randn(blocks, cfg.hidden_size, generator=g, device=DEVICE).to(dtype)
    return rows.repeat_interleave(32, dim=0)[:t].contiguous()


def uniform_ids(cfg, max_tokens: int, seed: int) -> torch.Tensor:
    """[max_tokens, k] int64: k distinct random experts per token, drawn on the CPU (the same on every device)."""
    g = torch.Generator().manual_seed(seed)
    order = torch.rand(max_tokens, cfg.num_experts, generator=g).argsort(dim=1)
    return order[:, : cfg.num_experts_per_tok].contiguous().to(DEVICE)


def time_in_graph(fn, iters: int, warmup: int) -> float | None:
    """Median ms of fn() captured once in a CUDA graph and replayed (None on CPU: no graphs there)."""
    if DEVICE.type != "cuda":
        return None
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = _time(graph.replay, iters, warmup)
    del graph
    return ms


def bench_layer(cfg, args, bw: float) -> list[dict]:
    from redraft.kernels import moe_triton as mt

    rows = []
    act_dtype = torch.bfloat16 if DEVICE.type == "cuda" else torch.float32
    for weights in args.weights:
        layer = Layer(cfg, act_dtype, args.seed, fp8=weights == "fp8")
        if args.routing == "uniform":
            layer.uniform = uniform_ids(cfg, max(args.tokens), args.seed)
        for t in args.tokens:
            x = layer_input(cfg, t, args.block, args.seed + t, act_dtype)
            ids, _ = layer.route(x)
            touched = int(torch.unique(ids).numel())  # measured: the experts this batch's routing touches
            need = moe_bytes(cfg, touched, t, weights == "fp8", x.element_size())
            ref = layer.reference(x)
            k_out = cfg.num_experts_per_tok + 1
            fused_cfg = mt.fused_config(t, k_out, cfg.num_experts + 1, cfg.hidden_size, cfg.moe_intermediate_size,
                                        weights == "fp8", DEVICE.type != "cuda")
            auto = "fused" if mt.use_fused(t, k_out, cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size,
                                           weights == "fp8", x.element_size()) else "unfused"
            for method in args.methods:
                out = layer.run(x, method)
                err = float((out.float() - ref).norm() / ref.norm())
                ms = _time(lambda: layer.run(x, method), args.iters, args.warmup)
                # the torch contender syncs on the host (FP8 twin) or may: graphs for the Triton paths only
                graph_ms = None if method == "torch" else time_in_graph(lambda: layer.run(x, method), args.iters,
                                                                         args.warmup)
                best = min(ms, graph_ms) if graph_ms else ms
                rows.append({"weights": weights, "tokens": t, "method": method, "ms": ms, "graph_ms": graph_ms,
                             "bytes": need, "routing": args.routing, "block": args.block,
                             "experts_touched": touched, "achieved_bw": need / (best / 1e3),
                             "bw_share": need / (best / 1e3) / bw,
                             "rel_err_vs_fp32": err, "fused_path": fused_cfg.get("path"),
                             "auto_picks": auto})
                gtxt = f", graph {graph_ms:.3f} ms" if graph_ms else ""
                print(f"  moe {weights} T={t} {method}: {ms:.3f} ms{gtxt}, {touched} experts, "
                      f"{need / (best / 1e3) / 1e12:.2f} TB/s ({100 * need / (best / 1e3) / bw:.0f}% of copy), "
                      f"err {err:.1e}", flush=True)
        layer = None  # free this format's weights before the next
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- the denoising step, bf16 vs FP8 ------------------------------------------------------------------
def build_engine(model_dir: Path, dtype: str, quantization: str | None, args, max_tokens: int):
    import redraft

    # dummy weights are drawn on the GPU (engine/model/loader.py)
    engine = redraft.Engine(str(model_dir), device=DEVICE.type, dtype=dtype, kernel_backend="triton",
                            quantization=quantization, load_format="dummy", seed=args.seed,
                            max_total_tokens=max_tokens, max_running_requests=1, cuda_graph_max_bs=1,
                            progress=False)
    if args.dry_run:  # CPU: the CUDA graph's static-buffer twin, run eagerly
        from redraft.engine.runtime.cuda_graphs import DecodeGraphs

        engine.core.runner.graphs = DecodeGraphs(engine.core.runner, 1, capture=False)
    return engine


def bench_step(args, cfg_name: str, rows: list[dict] | None = None, on_row=None) -> list[dict]:
    import bench_gpu_step as gs

    gs.DEVICE = DEVICE
    rows = [] if rows is None else rows
    dtype = "bfloat16" if DEVICE.type == "cuda" else "float32"
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = gs.write_model_dir(Path(tmp) / f"llada2.1-{cfg_name}-dummy", cfg_name)
        for quant in (None, "fp8"):
            t0 = time.perf_counter()
            with step_probe.routing(args.routing, gs.BLOCK, args.seed):
                row = _one_step(args, model_dir, dtype, quant, t0)
            rows.append(row)
            if on_row:
                on_row()
    return rows


def _one_step(args, model_dir: Path, dtype: str, quant: str | None, t0: float) -> dict:
    """One engine (bf16 or FP8 weights) at batch 1: the CUDA-graph step and forward, then freed."""
    import bench_gpu_step as gs
    from redraft.engine.runtime.batch import build_forward_batch

    engine = build_engine(model_dir, dtype, quant, args, args.context + 12 * gs.BLOCK)
    print(f"  engine ({quant or dtype}) ready in {time.perf_counter() - t0:.0f} s", flush=True)
    if engine.core.runner.graphs is None:
        raise SystemExit(f"bench_moe: no CUDA graphs were captured: {engine.core.runner.graph_error}")
    rng = torch.Generator().manual_seed(args.seed)
    items = gs._decode_items(engine, 1, args.context, rng)
    if args.block == "random":
        avoid = {engine.tokenizer.mask_token_id, engine.tokenizer.eos_token_id}
        step_probe.randomize_blocks(items, min(engine.model_config.vocab_size, 150000), avoid, args.seed)
    runner = engine.core.runner
    batch = build_forward_batch(items, gs.BLOCK)
    step = _time(lambda: runner.run(items), args.iters, args.warmup)
    fwd = _time(lambda: runner.graphs.run(batch), args.iters, args.warmup)
    weight_bytes = sum(t.numel() * t.element_size() for t in
                       list(engine.core.model.parameters()) + list(engine.core.model.buffers()))
    row = {"weights": quant or "bf16", "batch": 1, "context": args.context, "step_ms": step,
           "forward_ms": fwd, "model_gb": weight_bytes / 1e9, "routing": args.routing, "block": args.block}
    print(f"  step ({quant or 'bf16'}) batch 1: {step:.2f} ms (forward {fwd:.2f} ms)", flush=True)
    gs._clear(engine)
    engine.shutdown()
    engine = runner = items = None
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
    return row


# ---- the FP8 token agreement on the tiny checkpoint (CPU) --------------------------------------------------
def fp8_agreement(n_prompts: int = 32, max_new_tokens: int = 64, seed: int = 7, modes=("S", "Q"),
                  path: str | Path | None = None, backend: str = "torch") -> dict:
    """Greedy generation of the tiny checkpoint with quantization="fp8" against the unquantised model (and, for
    scale, bf16 against fp32) over a fixed prompt set: the share of output positions with the same token
    (positions past the shorter output count as different), and the share of identical outputs."""
    import random

    import redraft
    from redraft.engine.model.tiny import make_tiny_checkpoint

    if path is None:
        path = make_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny-seed0", seed=0)
    tasks = None
    if (Path(path) / "generation_config.json").is_file() and "redraft_train_step" in _metadata(path):
        from redraft.training.tasks import eval_set, is_correct, render_prompt

        tasks = eval_set(seed + 1000, max(1, n_prompts // 5))  # a demo model: its own held-out problems

    def engine(dtype: str, quant: str | None):
        return redraft.Engine(str(path), device="cpu", dtype=dtype, kernel_backend=backend, quantization=quant,
                              progress=False, max_total_tokens=16384)

    engines = {"fp32": engine("float32", None), "fp8": engine("float32", "fp8"), "bf16": engine("bfloat16", None)}
    tok = engines["fp32"].tokenizer
    specials = {tok.mask_token_id, tok.eos_token_id}
    rng = random.Random(seed)
    vocab = engines["fp32"].model_config.vocab_size
    ordinary = [i for i in range(vocab) if i not in specials and i >= 12]
    if tasks is None:
        prompts = [[rng.choice(ordinary) for _ in range(rng.randint(1, 100))] for _ in range(n_prompts)]
    else:
        prompts = [tok.encode(render_prompt(ex, tok)) for ex in tasks]
    result = {"model": str(path), "prompts": len(prompts), "max_new_tokens": max_new_tokens, "backend": backend}
    for mode in modes:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, "mode": mode}
        outs = {k: e.generate(input_ids=prompts, sampling_params=params) for k, e in engines.items()}
        # "fp8" and "bf16" are against fp32; "fp8_vs_bf16" is issue 7's criterion (FP8 tokens against bf16's)
        for name, base, other in (("fp8", "fp32", "fp8"), ("bf16", "fp32", "bf16"), ("fp8_vs_bf16", "bf16", "fp8")):
            same = total = identical = 0
            for a, b in zip(outs[base], outs[other]):
                x, y = a["output_ids"], b["output_ids"]
                total += max(len(x), len(y))
                same += sum(u == v for u, v in zip(x, y))
                identical += x == y
            result[f"{mode}:{name}"] = {"agreement": same / max(1, total), "positions": total,
                                        "identical_outputs": identical,
                                        "tokens": sum(len(o["output_ids"]) for o in outs[other])}
        if tasks is not None:  # and what it costs in answers
            result[f"{mode}:exact_match"] = {k: sum(is_correct(ex, o["text"]) for ex, o in zip(tasks, v)) / len(tasks)
                                             for k, v in outs.items()}
        if mode == modes[-1]:
            result["teacher_forced"] = teacher_forced_agreement(path, prompts, outs["fp32"],
                                                                engines["fp32"].tokenizer.mask_token_id)
    for e in engines.values():
        e.shutdown()
    return result


def fp8_layer_errors(path: str | Path, prompts: list[list[int]]) -> list[dict]:
    """Every FP8 layer (attention qkv and o_proj, dense MLP, MoE with its shared expert) against the unquantised
    layer on the same real inputs: the fp32 model's own activations over `prompts` (one prefill forward each),
    fed to both. Per layer: cosine and relative L2 of the outputs over all tokens."""
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.kernels.attention import AttentionMetadata

    cfg = ModelConfig.from_pretrained(path)
    ref = load_model(path, cfg, dtype="float32", progress=False)
    fp8 = load_model(path, cfg, dtype="float32", progress=False, quantization="fp8")
    names = []
    for i, layer in enumerate(ref.layers):
        names += [f"layers.{i}.attn.qkv", f"layers.{i}.attn.o_proj", f"layers.{i}.mlp"]
    inputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    hooks = [ref.get_submodule(n).register_forward_hook(
        lambda mod, args, out, n=n: inputs[n].append(args[0].detach())) for n in names]
    try:
        for seq in prompts:
            n = len(seq)
            pages = list(range(-(-n // 32)))
            meta = AttentionMetadata.build([0], [n], [pages], 32, "cpu", with_torch_plan=True)
            shape = (cfg.num_hidden_layers, len(pages), 32, cfg.num_key_value_heads, cfg.head_dim)
            with torch.inference_mode():
                ref(torch.tensor(seq), meta, torch.zeros(shape), torch.zeros(shape))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    with torch.inference_mode():
        for name in names:
            x = torch.cat(inputs[name])  # [tokens, in]
            want, got = ref.get_submodule(name)(x).double(), fp8.get_submodule(name)(x).double()
            cos = float(torch.nn.functional.cosine_similarity(want.flatten(), got.flatten(), dim=0))
            rel = float((got - want).norm() / want.norm())
            rows.append({"layer": name, "kind": type(fp8.get_submodule(name)).__name__, "tokens": x.shape[0],
                         "cosine": cos, "rel_l2": rel})
    return rows


def _metadata(path: str | Path) -> dict:
    """The safetensors header metadata of the first shard (the demo exporter records its training step)."""
    from safetensors import safe_open

    shard = sorted(Path(path).glob("*.safetensors"))[0]
    with safe_open(str(shard), framework="pt") as f:
        return f.metadata() or {}


def teacher_forced_agreement(path, prompts, outputs, mask_id: int, seed: int = 0,
                             fractions=(0.3, 0.7, 1.0)) -> dict:
    """Per-decision agreement without the decoding cascade: the fp32 model's final sequences with a share of
    each generated block masked again (as during decoding), one forward each, and the argmax at the masked
    positions of bf16 / FP8 models against fp32's, with the logits' relative error (median)."""
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.kernels.attention import AttentionMetadata

    cfg = ModelConfig.from_pretrained(path)
    models = {"fp32": load_model(path, cfg, dtype="float32", progress=False),
              "bf16": load_model(path, cfg, dtype="bfloat16", progress=False),
              "fp8": load_model(path, cfg, dtype="float32", progress=False, quantization="fp8")}

    def logits(model, seq, dtype):
        n = len(seq)
        pages = list(range(-(-n // 32)))
        meta = AttentionMetadata.build([0], [n], [pages], 32, "cpu", with_torch_plan=True)
        shape = (cfg.num_hidden_layers, len(pages), 32, cfg.num_key_value_heads, cfg.head_dim)
        kc, vc = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
        with torch.inference_mode():
            return model.logits(model(torch.tensor(seq), meta, kc, vc)).float()

    g = torch.Generator().manual_seed(seed)
    same = {"bf16": 0, "fp8": 0}
    errs: dict[str, list[float]] = {"bf16": [], "fp8": []}
    total = 0
    for prompt, out in zip(prompts, outputs):
        full = list(prompt) + out["output_ids"]
        end = -(-len(full) // 32) * 32
        gen = torch.arange(len(prompt), end)
        for frac in fractions:
            masked = gen[torch.rand(len(gen), generator=g) < frac]
            if not len(masked):
                continue
            seq = torch.tensor(full + [mask_id] * (end - len(full)))
            seq[masked] = mask_id
            ref = logits(models["fp32"], seq.tolist(), torch.float32)[masked]
            total += len(masked)
            for name, dt in (("bf16", torch.bfloat16), ("fp8", torch.float32)):
                lg = logits(models[name], seq.tolist(), dt)[masked]
                same[name] += int((lg.argmax(-1) == ref.argmax(-1)).sum())
                errs[name].append(float((lg - ref).norm() / ref.norm()))
    return {name: {"argmax_agreement": same[name] / max(1, total), "positions": total,
                   "logits_rel_err_median": statistics.median(errs[name]) if errs[name] else None}
            for name in same}


# ---- compile report (no GPU) --------------------------------------------------------------------------
class _Recorder:
    """Stands in for a Triton kernel: records launches (grid, args) instead of running them."""

    def __init__(self, kernel, log: list):
        self.kernel, self.log = kernel, log

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.log.append((self.kernel, grid, args, kwargs))
        return launch


@contextmanager
def record_launches():
    """Replace every MoE/FP8/norm kernel by a recorder; yields the list of recorded launches. The wrappers then run
    on any tensors (meta included) without executing a kernel."""
    from redraft.kernels import fp8_triton as ft
    from redraft.kernels import moe_triton as mt
    from redraft.kernels import norm_triton as nt

    names = {mt: ["_route_kernel", "_block_route_kernel", "_moe_count_kernel", "_moe_scan_kernel",
                  "_moe_scatter_kernel", "_moe_align_kernel", "_fused_moe_kernel", "_silu_mul_kernel",
                  "_moe_reduce_kernel", "_block_gemm_kernel"],
             ft: ["_block_gemm_kernel", "_quant_act_kernel"], nt: ["_add_rms_norm_kernel", "_qk_norm_rope_kernel"]}
    log: list = []
    saved = []
    for mod, ks in names.items():
        for k in ks:
            saved.append((mod, k, getattr(mod, k)))
            setattr(mod, k, _Recorder(getattr(mod, k), log))
    try:
        yield log
    finally:
        for mod, k, v in saved:
            setattr(mod, k, v)


_TY = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32", torch.int64: "i64",
       torch.float8_e4m3fn: "fp8e4nv", torch.uint8: "u8"}


def _signature(kernel, args, kwargs):
    names = kernel.arg_names
    const_names = {p.name for p in kernel.params if p.is_constexpr}
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    sig, const, attrs = {}, {}, {}
    for idx, n in enumerate(names):
        v = values[n]
        if n in const_names:
            sig[n] = "constexpr"
            const[n] = v
        elif isinstance(v, torch.Tensor):
            sig[n] = "*" + _TY[v.dtype]
            attrs[(idx,)] = [["tt.divisibility", 16]]  # the JIT's specialisation: 16-byte aligned pointers
        elif isinstance(v, bool):
            sig[n] = "i1"
        elif isinstance(v, int):
            sig[n] = "i64" if abs(v) >= 2**31 else "i32"
            if v % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]  # ... and integers divisible by 16
        else:
            sig[n] = "fp32"
    opts = {k: v for k, v in kwargs.items() if k in ("num_warps", "num_stages")}
    return sig, const, opts, attrs


def _report_cases():
    """(label, thunk) pairs: the wrappers at the mini shape, on meta tensors, as the engine launches them."""
    from redraft.kernels import fp8_triton as ft
    from redraft.kernels import moe_triton as mt
    from redraft.kernels.fp8 import FP8_DTYPE

    cfg = model_config("mini")
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts_per_tok
    meta = torch.device("meta")
    cases = []
    for t in (32, 64, 512, 2048):
        for fp8 in (False, True):
            wdt = FP8_DTYPE if fp8 else torch.bfloat16
            x = torch.empty(t, h, dtype=torch.bfloat16, device=meta)
            w13, w2 = torch.empty(e, 2 * i, h, dtype=wdt, device=meta), torch.empty(e, h, i, dtype=wdt, device=meta)
            s13 = torch.empty(e, 2 * (i // 128), h // 128, device=meta) if fp8 else None
            s2 = torch.empty(e, h // 128, i // 128, device=meta) if fp8 else None
            sh = mt.SharedExpert(w13[0], w2[0], s13[0] if fp8 else None, s2[0] if fp8 else None)
            ids = torch.empty(t, k, dtype=torch.int64, device=meta)
            w = torch.empty(t, k, dtype=torch.float32, device=meta)
            tag = f"T={t} {'fp8' if fp8 else 'bf16'}"
            for method in ("fused", "unfused"):
                cases.append((f"{tag} {method}", lambda x=x, w13=w13, w2=w2, ids=ids, w=w, s13=s13, s2=s2, sh=sh,
                              method=method: mt.fused_moe(x, w13, w2, ids, w, w13_scale=s13, w2_scale=s2, shared=sh,
                                                          method=method)))
        logits = torch.empty(t, e, dtype=torch.float32, device=meta)
        cases.append((f"T={t} route", lambda logits=logits: mt.route_logits_triton(
            logits, torch.empty(e, device=meta), top_k=k, n_group=cfg.n_group, topk_group=cfg.topk_group,
            routed_scaling_factor=cfg.routed_scaling_factor)))
        cases.append((f"T={t} block route", lambda t=t: mt.route_blocks_triton(  # LLaDA2.2's router, same shape
            torch.empty(t, h, dtype=torch.bfloat16, device=meta), torch.empty(e, h, dtype=torch.bfloat16, device=meta),
            torch.empty(e, device=meta), torch.empty(t, dtype=torch.int64, device=meta), top_k=k, capacity=48,
            block_size=32, routed_scaling_factor=cfg.routed_scaling_factor)))
        xq = torch.empty(t, h, dtype=torch.bfloat16, device=meta)
        wq = torch.empty((cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * cfg.head_dim, h, dtype=FP8_DTYPE,
                         device=meta)
        cases.append((f"T={t} fp8 linear qkv", lambda xq=xq, wq=wq: ft.fp8_linear_triton(
            xq, wq, torch.empty(wq.shape[0] // 128, h // 128, device=meta))))
    return cases


def _toolchain():
    """(triton, GPUTarget, ASTSource, cuobjdump path) or an error string (no compiler in this Triton)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as exc:
        return f"compile report unavailable: {exc}"
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not cuobjdump.exists():
        return f"compile report unavailable: no {cuobjdump}"
    return triton, GPUTarget, ASTSource, cuobjdump


def compile_launch(kernel, args, kwargs, tools) -> dict:
    """Compile one recorded launch for sm_90; the cubin's registers, stack, local-memory instructions, shared
    memory and MMA instructions."""
    from bench_gpu_step import cubin_usage

    triton, GPUTarget, ASTSource, cuobjdump = tools
    sig, const, opts, attrs = _signature(kernel, args, kwargs)
    names = kernel.arg_names
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()},
                    attrs=attrs)
    kern = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    return {**cubin_usage(kern, cuobjdump),
            "blocks": {n: const[n] for n in const if n.startswith("BLOCK")},
            "warps": opts.get("num_warps", 4), "stages": opts.get("num_stages", 3)}


def _gpu_launch_configs() -> None:
    """Make the wrappers choose their GPU launch configurations and accept meta tensors (compile report)."""
    import redraft.kernels.fp8_triton as ft
    import redraft.kernels.moe_triton as mt

    ft.interpreting = mt.interpreting = lambda: False
    ft.check_device = mt.check_device = lambda t: None


def compile_report() -> int:
    """Compile every kernel launch of the MoE layer and the FP8 linear (mini shape, T = 32 and 512, bf16 and
    FP8) for sm_90 and print the cubin's resource usage and MMA instructions. Exit 3 without a toolchain."""
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        env = dict(os.environ, TRITON_INTERPRET="0")
        return subprocess.run([sys.executable, str(Path(__file__).resolve()), "--compile-report"],
                              env=env).returncode
    os.environ["TRITON_INTERPRET"] = "0"  # compile, never interpret (set before triton is imported)
    import warnings

    warnings.filterwarnings("ignore")
    tools = _toolchain()
    if isinstance(tools, str):
        print(tools)
        return 3
    _gpu_launch_configs()
    seen: set = set()
    failed = 0
    for label, thunk in _report_cases():
        with record_launches() as log:
            thunk()
        for kernel, grid, args, kwargs in log:
            sig, const, opts, attrs = _signature(kernel, args, kwargs)
            key = (kernel.__name__, tuple(sorted(sig.items())), tuple(sorted((k, str(v)) for k, v in const.items())),
                   tuple(sorted(opts.items())), tuple(sorted(attrs)))
            if key in seen:
                continue
            seen.add(key)
            try:
                r = compile_launch(kernel, args, kwargs, tools)
            except Exception as exc:  # noqa: BLE001 - report and go on
                print(f"sm_90 {label} {kernel.__name__}: COMPILE FAILED: {str(exc).splitlines()[0][:300]}")
                failed += 1
                continue
            print(f"sm_90 {label} {kernel.__name__} {r['blocks']} warps={r['warps']} stages={r['stages']}: "
                  f"regs {r['regs']} stack {r['stack']} local {r['local']} shared {r['shared']} mma {r['mma']}",
                  flush=True)
    return 1 if failed else 0


# ---- report -------------------------------------------------------------------------------------------
def render(info: dict, layer: list[dict], steps: list[dict]) -> str:
    lines = [
        f"Device: **{info['device']}**, torch {info['torch']}, triton {info['triton']}, CUDA {info['cuda']}; "
        f"{info['date']}. Measured copy bandwidth **{info['copy_bw'] / 1e12:.2f} TB/s** (read + write).",
        f"MoE layer at the LLaDA2.1-{info['model']} shape (H {info['hidden']}, I {info['inter']}, "
        f"{info['experts']} experts, top-{info['top_k']}, + 1 shared), activations {info['act_dtype']}; "
        f"{info.get('routing', 'model')} routing, {info.get('block', 'random')} rows.",
        "",
        "### MoE layer (router + experts + shared expert)",
        "",
        "Experts touched: counted from the ids of the timed batch. TB/s and share from the faster of eager and "
        "CUDA-graph replay.",
        "",
        "| weights | tokens | method | ms | graph ms | experts touched | MB moved | TB/s | share of copy BW "
        "| rel. err vs fp32 |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in layer:
        meth = r["method"] + (f" (={r['auto_picks']})" if r["method"] == "auto" else "")
        meth += f" [{r['fused_path']}]" if r["method"] == "fused" else ""
        graph = f"{r['graph_ms']:.3f}" if r.get("graph_ms") else "-"
        lines.append(f"| {r['weights']} | {r['tokens']} | {meth} | {r['ms']:.3f} | {graph} | {r['experts_touched']} | "
                     f"{r['bytes'] / 1e6:.0f} | {r['achieved_bw'] / 1e12:.2f} | {100 * r['bw_share']:.0f}% | "
                     f"{r['rel_err_vs_fp32']:.1e} |")
    if steps:
        lines += ["", f"### Denoising step, batch 1 (context {steps[0]['context']}, CUDA graph, dummy weights)", "",
                  "| weights | step ms | forward ms | weights + scales GB |", "|---|---:|---:|---:|"]
        for r in steps:
            lines.append(f"| {r['weights']} | {r['step_ms']:.2f} | {r['forward_ms']:.2f} | {r['model_gb']:.1f} |")
        if len(steps) == 2:
            lines += ["", f"FP8 / bf16 step speed-up: **{steps[0]['step_ms'] / steps[1]['step_ms']:.2f}x** "
                          "(target >= 1.6x)."]
    return "\n".join(lines) + "\n"


def write_docs(text: str, path: Path = DOCS) -> None:
    doc = path.read_text() if path.exists() else "# redraft on a GPU\n"
    if DOCS_BEGIN not in doc:
        doc = doc.rstrip("\n") + f"\n\n{DOCS_BEGIN}\n{DOCS_END}\n"
    head, rest = doc.split(DOCS_BEGIN, 1)
    tail = rest.split(DOCS_END, 1)[1] if DOCS_END in rest else "\n"
    path.write_text(f"{head}{DOCS_BEGIN}\n{text}{DOCS_END}{tail}")
    print(f"wrote {path}")


DRY_RUN = dict(model="tiny", tokens=[32, 64], iters=1, warmup=0, context=40)


def agreement_main(args) -> int:
    """--fp8-agreement: token agreement (and, on a demo model, per-layer errors) printed as JSON."""
    torch.set_num_threads(args.threads or min(4, torch.get_num_threads()))
    res = fp8_agreement(args.prompts, args.max_new_tokens, path=args.agreement_model)
    if args.agreement_model:  # per layer, on the model's own activations
        from redraft.engine.text.tokenizer import Tokenizer
        from redraft.training.tasks import eval_set, render_prompt

        tok = Tokenizer.from_pretrained(args.agreement_model)
        prompts = [tok.encode(render_prompt(ex, tok)) for ex in eval_set(7, 4)]
        res["layers"] = fp8_layer_errors(args.agreement_model, prompts)
    print(json.dumps(res, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    args = parse_args(argv)
    if args.compile_report:
        return compile_report()
    if args.fp8_agreement:
        return agreement_main(args)
    args.tokens = [int(t) for t in str(args.tokens).split(",") if t]
    args.weights = [w for w in args.weights.split(",") if w]
    args.methods = [m for m in args.methods.split(",") if m]
    if args.dry_run:
        DEVICE = torch.device("cpu")
        for key, value in DRY_RUN.items():
            setattr(args, key, value)
    elif not torch.cuda.is_available():
        raise SystemExit(f"bench_moe: no CUDA device (torch {torch.__version__}, built with CUDA {torch.version.cuda}): "
                         "this benchmark needs a GPU; `--dry-run`, `--compile-report` and `--fp8-agreement` run "
                         "without one")
    import redraft.kernels  # noqa: F401 - settles TRITON_INTERPRET before triton is imported
    import triton

    import bench_gpu_step as gs

    gs.DEVICE = DEVICE
    cfg = model_config(args.model)
    if DEVICE.type == "cuda":
        name = torch.cuda.get_device_name(0)
        bw = gs.measure_copy_bandwidth(args.iters)
    else:
        name = "CPU (dry run: these numbers mean nothing)"
        bw = gs.measure_copy_bandwidth(args.iters, 1 << 20)
    print(f"{name}: copy bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    info = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "date": time.strftime("%Y-%m-%d"), "model": args.model, "copy_bw": bw, "hidden": cfg.hidden_size,
            "inter": cfg.moe_intermediate_size, "experts": cfg.num_experts, "top_k": cfg.num_experts_per_tok,
            "act_dtype": "bfloat16" if DEVICE.type == "cuda" else "float32", "routing": args.routing,
            "block": args.block}
    layer = bench_layer(cfg, args, bw)
    steps: list[dict] = []

    def dump() -> None:  # after the layer table and after each step: a phase cut short keeps what it measured
        if args.json_out:
            Path(args.json_out).write_text(json.dumps({"info": info, "moe": layer, "steps": steps}, indent=2))

    dump()
    if not args.skip_step:
        bench_step(args, args.model, steps, dump)
    text = render(info, layer, steps)
    print()
    print(text)
    dump()
    if args.write_docs:
        write_docs(text, Path(args.docs_path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
