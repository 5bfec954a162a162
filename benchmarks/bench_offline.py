"""Offline engine benchmark: tokens/s and tokens per forward of `redraft.Engine`, against the official loop
without a KV cache (full recompute of the prefix every forward, one request at a time), in the same process.

    python benchmarks/bench_offline.py                # tiny + ~50M configs, batch 1 and 16
    python benchmarks/bench_offline.py --configs tiny --batches 1 4 16 --new-tokens 96
    python benchmarks/bench_offline.py --decoders --batches 1 16   # LLaDA2.2: Levenshtein vs the 2.1 step
    python benchmarks/bench_offline.py --overlap --rounds 3   # also the overlap scheduler on, alternating

Prints a markdown table. The baseline runs the same model code, so the ratio isolates what the paged
block cache and batching buy.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from redraft.engine.runtime.engine import Engine
from redraft.engine.model.tiny import make_tiny_checkpoint

# ~50M parameters: the LLaDA2 shape at a width a CPU runs in seconds (weights random: load_format=dummy).
SMALL_CONFIG = {
    "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
    "head_dim": 64, "intermediate_size": 2048, "moe_intermediate_size": 256, "num_experts": 16,
    "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
}


def prepare(name: str, workdir: Path) -> tuple[Path, str]:
    """A checkpoint directory and its load format."""
    out = workdir / name
    if name == "tiny":
        make_tiny_checkpoint(out, seed=0)
        return out, "auto"
    if name == "small":
        # Tiny layers for the files (tokenizer + config), then the real shapes come from dummy weights.
        make_tiny_checkpoint(out, seed=0, config_overrides=SMALL_CONFIG)
        return out, "dummy"
    raise ValueError(f"unknown config {name!r}: tiny or small")


def make_prompts(n: int, vocab: int, special: set[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    ordinary = [t for t in range(vocab) if t not in special]
    return [[rng.choice(ordinary) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def timed(engine: Engine, prompts: list[list[int]], params: dict, one_at_a_time: bool) -> tuple[float, list[dict]]:
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [engine.generate(input_ids=p, sampling_params=params) for p in prompts]
    else:
        outs = engine.generate(input_ids=prompts, sampling_params=[params] * len(prompts))
    return time.perf_counter() - t0, outs


def overlap_columns(on: Engine, off: Engine, prompts: list[list[int]], params: dict, t_first: float,
                    outs: list[dict], rounds: int) -> dict:
    """The overlap scheduler off (`off`, the default engine on CPU, already timed once: t_first) against on (`on`),
    alternating for `rounds` rounds: median seconds of each, and whether both gave the same tokens."""
    timed(on, prompts[:1], params, one_at_a_time=False)  # warm-up
    t_off, t_on, same = [t_first], [], True
    for r in range(rounds):
        t, outs_on = timed(on, prompts, params, one_at_a_time=False)
        t_on.append(t)
        same &= [o["output_ids"] for o in outs_on] == [o["output_ids"] for o in outs]
        if r < rounds - 1:
            t_off.append(timed(off, prompts, params, one_at_a_time=False)[0])
    return {"t_on": statistics.median(t_on), "t_off": statistics.median(t_off), "overlap_identical": same}


def run(args: argparse.Namespace) -> list[dict]:
    torch.set_num_threads(args.threads) if args.threads else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [(c, b) for c in args.configs for b in args.batches]
        bar = tqdm(jobs, desc="bench", unit="case")
        engines: dict[str, tuple[Engine, Engine, Engine | None]] = {}
        for config, batch in bar:
            bar.set_postfix(config=config, batch=batch)
            if config not in engines:
                path, load_format = prepare(config, Path(tmp))
                kw = dict(load_format=load_format, dtype="float32", progress=False)
                overlapped = Engine(str(path), enable_overlap=True, **kw) if args.overlap else None
                engines[config] = (Engine(str(path), **kw), Engine(str(path), recompute_prefix=True, **kw), overlapped)
            fast, naive, overlapped = engines[config]
            tok = fast.tokenizer
            prompts = make_prompts(batch, fast.model_config.vocab_size,
                                   {tok.mask_token_id, tok.eos_token_id, *tok.special_token_ids}, seed=batch)
            params = {"max_new_tokens": args.new_tokens, "mode": args.mode, "ignore_eos": True}
            timed(fast, prompts[:1], params, one_at_a_time=False)  # warm-up
            t_fast, outs = timed(fast, prompts, params, one_at_a_time=False)
            row = overlap_columns(overlapped, fast, prompts, params, t_fast, outs, args.rounds) if overlapped else {}
            t_fast = row.pop("t_off", t_fast)
            t_naive, ref = timed(naive, prompts, params, one_at_a_time=True)
            tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
            forwards = sum(o["meta_info"]["steps"] for o in outs)
            rows.append({
                "config": config,
                "params_M": round(fast.model_config.num_params() / 1e6, 1),
                "batch": batch,
                "tokens": tokens,
                "tok_per_s": tokens / t_fast,
                "tok_per_forward": tokens / forwards,
                "naive_tok_per_s": tokens / t_naive,
                "speedup": t_naive / t_fast,
                "identical": all(a["output_ids"] == b["output_ids"] for a, b in zip(outs, ref)),
                **({"overlap_tok_per_s": tokens / row["t_on"], "overlap_identical": row["overlap_identical"]}
                   if row else {}),
            })
    return rows


def run_decoders(args: argparse.Namespace) -> list[dict]:
    """A tiny LLaDA2.2 checkpoint: the Levenshtein step against the 2.1 step (decoder "threshold", DELETE and
    SPLIT never proposed) on the same engine and prompts, and the step's host time per batch forward
    (ModelRunner.step_seconds: the decoding step after the logits, device syncs included)."""
    torch.set_num_threads(args.threads) if args.threads else None
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_checkpoint(Path(tmp) / "tiny22", seed=0, llada22=True)
        # no prefix cache: every run of the same prompts does the same work
        engine = Engine(str(path), dtype="float32", progress=False, enable_prefix_cache=False)
        tok = engine.tokenizer
        special = {tok.mask_token_id, tok.eos_token_id, *tok.special_token_ids}
        for batch in args.batches:
            prompts = make_prompts(batch, engine.model_config.vocab_size, special, seed=batch)
            runs: dict[str, list[dict]] = {"levenshtein": [], "threshold": []}
            for _ in range(args.repeat):  # the two decoders interleaved: a busy machine slows both alike
                for decoder in runs:
                    runs[decoder].append(_decoder_run(engine, prompts, args, decoder))
            for decoder, rs in runs.items():
                mid = sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2]  # the median run
                rows.append({"batch": batch, "decoder": decoder, **mid,
                             "step_ms": sorted(r["step_ms"] for r in rs)[len(rs) // 2]})
        engine.shutdown()
    return rows


def _decoder_run(engine: Engine, prompts: list[list[int]], args: argparse.Namespace, decoder: str) -> dict:
    params = {"max_new_tokens": args.new_tokens, "mode": args.mode, "ignore_eos": True, "decoder": decoder}
    timed(engine, prompts[:1], params, one_at_a_time=False)  # warm-up
    core = engine.core
    step0, fwd0 = core.runner.step_seconds, core.num_forwards
    elapsed, outs = timed(engine, prompts, params, one_at_a_time=False)
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    batch_forwards = core.num_forwards - fwd0
    return {"tokens": tokens, "tok_per_s": tokens / elapsed,
            "tok_per_forward": tokens / sum(o["meta_info"]["steps"] for o in outs), "batch_forwards": batch_forwards,
            "step_ms": 1e3 * (core.runner.step_seconds - step0) / max(batch_forwards, 1),
            "deletions": sum(o["meta_info"]["deletions"] for o in outs),
            "insertions": sum(o["meta_info"]["insertions"] for o in outs)}


def print_decoders(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"\nmachine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; tiny LLaDA2.2 checkpoint (seed 0), mode {args.mode}, {args.new_tokens} new "
          f"tokens per request (ignore_eos), float32; medians of {args.repeat} interleaved runs\n")
    print("| batch | decoder | tokens/s | tokens/forward | batch forwards | step host ms/forward | deletions "
          "| insertions |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['decoder']} | {r['tok_per_s']:.1f} | {r['tok_per_forward']:.2f} | "
              f"{r['batch_forwards']} | {r['step_ms']:.2f} | {r['deletions']} | {r['insertions']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=["tiny", "small"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mode", default="S", choices=["S", "Q"])
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--overlap", action="store_true",
                    help="also run with the overlap scheduler on (--enable-overlap on CPU), alternating with the default")
    ap.add_argument("--rounds", type=int, default=3, help="with --overlap: timed runs of each (medians)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--repeat", type=int, default=3, help="--decoders: runs per case (the median is shown)")
    ap.add_argument("--decoders", action="store_true",
                    help="a tiny LLaDA2.2 checkpoint: the Levenshtein step against the 2.1 step (--configs ignored)")
    args = ap.parse_args()
    if args.decoders:
        rows = run_decoders(args)
        print_decoders(rows, args)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=2))
        return
    rows = run(args)
    print(f"\nmachine: {platform.machine()} {platform.processor() or ''}, {torch.get_num_threads()} torch threads, "
          f"torch {torch.__version__}; mode {args.mode}, {args.new_tokens} new tokens per request, float32\n")
    print("| config | params | batch | tokens/s | tokens/forward | naive tokens/s | speed-up | identical |"
          + (" tokens/s, overlap on | overlap gain | same tokens |" if args.overlap else ""))
    print("|---|---|---|---|---|---|---|---|" + ("---|---|---|" if args.overlap else ""))
    for r in rows:
        extra = (f" {r['overlap_tok_per_s']:.1f} | {r['overlap_tok_per_s'] / r['tok_per_s']:.2f}x | "
                 f"{'yes' if r['overlap_identical'] else 'NO'} |") if args.overlap else ""
        print(f"| {r['config']} | {r['params_M']}M | {r['batch']} | {r['tok_per_s']:.1f} | {r['tok_per_forward']:.2f} "
              f"| {r['naive_tok_per_s']:.1f} | {r['speedup']:.2f}x | {'yes' if r['identical'] else 'NO'} |" + extra)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
