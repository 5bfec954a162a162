"""Memory plan for serving a LLaDA2-MoE checkpoint with tensor parallelism (TP) and expert parallelism (EP = TP):
weights per rank in bf16 and FP8, KV-cache bytes per token per rank, and how many tokens of KV fit next to the
weights in a fraction of a GPU's memory. Computed from a config alone (no weights are read).

    redraft plan                                # LLaDA2.1-mini, -flash and LLaDA2.2-flash, TP 1/2/4/8, H100 and H200
    redraft plan --config path/to/config.json --tp 1 2
    redraft plan --measure path/to/checkpoint --tp 1 2 4        # load rank 0 of each layout

The layout it assumes (the one docs/scaling.md describes): attention heads split over the TP ranks (KV heads
too; with more ranks than KV heads each rank keeps one KV head, replicated), the dense MLP and the shared expert
split column/row-wise, routed experts placed whole (EP = TP), embedding and lm_head vocabulary-parallel when TP
divides the vocabulary (replicated otherwise), norms and the router replicated (engine/model/sharding.py). FP8 is
W8A8 block FP8 as redraft's Fp8Linear: every projection and expert weight at 1 byte plus one fp32 scale per
128 x 128 block; embeddings, lm_head, norms and the router stay bf16/fp32.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 1024**3

# From the published config.json files (shared/reference/llada2-facts.md).
PRESETS: dict[str, dict[str, Any]] = {
    "LLaDA2.1-mini": {"hidden_size": 2048, "num_hidden_layers": 20, "num_attention_heads": 16,
                      "num_key_value_heads": 4, "head_dim": 128, "first_k_dense_replace": 1,
                      "intermediate_size": 5120, "moe_intermediate_size": 512, "num_experts": 256,
                      "num_shared_experts": 1, "vocab_size": 157184, "tie_word_embeddings": False},
    "LLaDA2.1-flash": {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                       "num_key_value_heads": 4, "head_dim": 128, "first_k_dense_replace": 1,
                       "intermediate_size": 9216, "moe_intermediate_size": 1024, "num_experts": 256,
                       "num_shared_experts": 1, "vocab_size": 157184, "tie_word_embeddings": False},
}
# LLaDA2.2-flash (shared/reference/llada22-decoding.md, "Checkpoint"): 2.1-flash's architecture with block routing
# (48 of 256 experts admitted per 32-token routing block), a 128K context and rope_theta 3e6.
PRESETS["LLaDA2.2-flash"] = {**PRESETS["LLaDA2.1-flash"], "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4,
                             "routed_scaling_factor": 2.5, "expert_capacity": 48, "block_size": 32,
                             "max_position_embeddings": 131072, "rope_theta": 3e6, "delete_token_id": 156930,
                             "split_token_id": 156931}
GPUS_GIB = {"H100": 80.0, "H200": 141.0}  # HBM per GPU (GiB as nvidia-smi's MiB / 1024, rounded)
FP8_BLOCK = 128


@dataclass
class Parts:
    """Parameter counts by how they shard."""

    projections: int  # attention q/o, dense MLP, shared experts: split over TP, FP8-able
    kv_projections: int  # attention k/v: split over TP while TP <= KV heads, then one KV head per rank; FP8-able
    experts: int  # routed experts: placed whole over EP, FP8-able
    vocab: int  # embedding + lm_head: split over TP by token rows when TP divides the vocabulary; bf16
    replicated: int  # norms, router (+ bias): on every rank

    @property
    def total(self) -> int:
        return self.projections + self.kv_projections + self.experts + self.vocab + self.replicated


def parameter_parts(cfg: dict[str, Any]) -> Parts:
    h, layers, d = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]
    hq, hkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dense_layers = min(cfg.get("first_k_dense_replace", 0), layers)
    moe_layers = layers - dense_layers
    e, im = cfg["num_experts"], cfg["moe_intermediate_size"]
    attn = 2 * hq * d * h  # q rows of qkv, o_proj
    dense_mlp = 3 * h * cfg["intermediate_size"]
    shared = 3 * h * im * cfg.get("num_shared_experts", 0)
    projections = layers * attn + dense_layers * dense_mlp + moe_layers * shared
    experts = moe_layers * e * 3 * h * im
    vocab = cfg["vocab_size"] * h * (1 if cfg.get("tie_word_embeddings") else 2)
    norms = layers * (2 * h + 2 * d) + h  # input / post-attention norms, q/k norms, final norm
    router = moe_layers * (e * h + e)
    return Parts(projections, layers * 2 * hkv * d * h, experts, vocab, norms + router)


def _fp8_bytes(params: int) -> float:
    return params * (1 + 4 / (FP8_BLOCK * FP8_BLOCK))  # 1 byte + an fp32 scale per 128 x 128 block


def plan_row(cfg: dict[str, Any], tp: int, gpu_gib: float, fraction: float = 0.85) -> dict[str, float]:
    """One layout: weights per rank (bf16, FP8), KV bytes per token per rank, tokens of KV that fit."""
    p = parameter_parts(cfg)
    if cfg["num_experts"] % tp:
        raise ValueError(f"{cfg['num_experts']} experts do not split over {tp} ranks")
    kv_heads = max(1, math.ceil(cfg["num_key_value_heads"] / tp))  # more ranks than KV heads: replicate
    split = (p.projections + p.experts) / tp + p.kv_projections * kv_heads / cfg["num_key_value_heads"]
    vocab = p.vocab if cfg["vocab_size"] % tp else p.vocab / tp
    bf16 = (split + vocab + p.replicated) * 2
    fp8 = _fp8_bytes(split) + (vocab + p.replicated) * 2
    kv_per_token = cfg["num_hidden_layers"] * 2 * kv_heads * cfg["head_dim"] * 2  # K and V, bf16
    budget = gpu_gib * GIB * fraction
    return {"tp": tp, "weights_bf16_gib": bf16 / GIB, "weights_fp8_gib": fp8 / GIB,
            "kv_bytes_per_token": kv_per_token,
            "kv_tokens_bf16": max(0.0, (budget - bf16) / kv_per_token),
            "kv_tokens_fp8": max(0.0, (budget - fp8) / kv_per_token)}


def _tokens(n: float) -> str:
    if n <= 0:
        return "does not fit"
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def markdown(name: str, cfg: dict[str, Any], tps: list[int], fraction: float) -> str:
    p = parameter_parts(cfg)
    lines = [f"**{name}**: {p.total / 1e9:.2f}B parameters ({p.experts / p.total:.0%} in routed experts), "
             f"{p.total * 2 / GIB:.1f} GiB in bf16.", "",
             "| TP (= EP) | weights/rank bf16 | weights/rank FP8 | KV bytes/token/rank | "
             + " | ".join(f"KV tokens at {fraction:.2f} x {g} ({v:.0f} GiB), bf16 / FP8" for g, v in GPUS_GIB.items())
             + " |",
             "|---|---|---|---|" + "---|" * len(GPUS_GIB)]
    for tp in tps:
        rows = {g: plan_row(cfg, tp, v, fraction) for g, v in GPUS_GIB.items()}
        r = next(iter(rows.values()))
        lines.append(f"| {tp} | {r['weights_bf16_gib']:.1f} GiB | {r['weights_fp8_gib']:.1f} GiB | "
                     f"{r['kv_bytes_per_token'] / 1024:.0f} KiB | "
                     + " | ".join(f"{_tokens(x['kv_tokens_bf16'])} / {_tokens(x['kv_tokens_fp8'])}" for x in rows.values())
                     + " |")
    return "\n".join(lines)


def context_line(cfg: dict[str, Any], tps: list[int], fraction: float) -> str | None:
    """How many requests of the model's whole context (max_position_embeddings) the KV room of each layout holds,
    on the first GPU of GPUS_GIB; None when the config does not say its context."""
    ctx = cfg.get("max_position_embeddings")
    if not ctx:
        return None
    gpu, gib = next(iter(GPUS_GIB.items()))
    cells = []
    for tp in tps:
        r = plan_row(cfg, tp, gib, fraction)
        cells.append(f"TP {tp}: {int(r['kv_tokens_bf16'] // ctx)} / {int(r['kv_tokens_fp8'] // ctx)}")
    return f"Requests of the whole {ctx}-token context whose KV fits per {gpu} layout, bf16 / FP8: {', '.join(cells)}."


def routing_line(cfg: dict[str, Any], tps: list[int]) -> str | None:
    """Block routing (expert_capacity > 0): the routed-expert weights one routing block reads per MoE layer, and
    the most of them one expert-parallel rank can be asked to read (the block's experts all on it)."""
    cap, e = cfg.get("expert_capacity", 0), cfg["num_experts"]
    if not cap:
        return None
    per_expert = 3 * cfg["hidden_size"] * cfg["moe_intermediate_size"] * 2  # bf16 bytes
    worst = ", ".join(f"TP {tp}: {min(cap, e // tp)} of {e // tp}" for tp in tps)
    return (f"Block routing: each {cfg.get('block_size', 32)}-token routing block admits {cap} of {e} experts, so a "
            f"block reads at most {cap * per_expert / GIB:.2f} GiB of routed-expert weights per MoE layer in bf16 "
            f"(under grouped routing its {cfg.get('block_size', 32)} tokens x top-{cfg['num_experts_per_tok']} may "
            f"touch up to {min(e, cfg.get('block_size', 32) * cfg['num_experts_per_tok'])}); at most this many of one "
            f"rank's experts serve one block: {worst}.")


def _load_rank0(path: str, tp: int, dtype: str, out: Any) -> None:
    """In a fresh process: load rank 0's shard; report its weight bytes and the process's peak memory."""
    import time

    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model
    from redraft.engine.model.sharding import RankLayout
    from redraft.engine.runtime.tensor_parallel import peak_memory_bytes, weight_bytes

    before = peak_memory_bytes("cpu")  # torch and redraft imported, nothing loaded
    t0 = time.perf_counter()
    model = load_model(path, ModelConfig.from_pretrained(path), dtype=dtype, progress=False,
                       layout=RankLayout(0, tp, tp) if tp > 1 else None)
    out.put((weight_bytes(model), peak_memory_bytes("cpu") - before, time.perf_counter() - t0))


def measure(path: Path, tps: list[int], dtype: str) -> str:
    """What rank 0 of each layout holds and the peak memory its loading added (one fresh process each)."""
    import multiprocessing as mp

    cfg = json.loads((path / "config.json").read_text())
    ctx = mp.get_context("spawn")
    lines = [f"**{path.name}** ({dtype}, rank 0 of each layout, EP = TP)", "",
             "| TP | weights held | planned | peak memory added by loading | load time |", "|---|---|---|---|---|"]
    for tp in tps:
        out = ctx.Queue()
        proc = ctx.Process(target=_load_rank0, args=(str(path), tp, dtype, out))
        proc.start()
        held, peak, seconds = out.get()
        proc.join()
        planned = plan_row(cfg, tp, 80.0)["weights_bf16_gib"] * GIB * (2.0 if dtype in ("float32", "fp32") else 1.0)
        lines.append(f"| {tp} | {held / 2**20:.0f} MiB | {planned / 2**20:.0f} MiB | {peak / 2**20:.0f} MiB | "
                     f"{seconds:.1f} s |")
    return "\n".join(lines)


def add_plan_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", type=Path, action="append", help="a config.json (default: mini and flash)")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2, 4, 8],
                    help="tensor-parallel sizes to plan for (default: 1 2 4 8)")
    ap.add_argument("--fraction", type=float, default=0.85, help="share of GPU memory for weights + KV")
    ap.add_argument("--measure", type=Path, metavar="CHECKPOINT",
                    help="load rank 0 of each --tp layout of this checkpoint and report what it holds")
    ap.add_argument("--dtype", default="bfloat16", help="with --measure: the model dtype")


def run_cli(args: argparse.Namespace) -> int:
    if args.measure:
        print(measure(args.measure, args.tp, args.dtype))
        return 0
    models = ({str(c): json.loads(c.read_text()) for c in args.config} if args.config else PRESETS)
    for name, cfg in models.items():
        print(markdown(name, cfg, args.tp, args.fraction))
        for line in (context_line(cfg, args.tp, args.fraction), routing_line(cfg, args.tp)):
            if line:
                print()
                print(line)
        print()
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="redraft plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_plan_args(ap)
    return run_cli(ap.parse_args(argv))

if __name__ == "__main__":
    sys.exit(main())
