"""What watching the decoding costs (docs/denoise.md): `redraft.Engine` on a tiny model decodes a batch of greedy
requests without the flags, with `return_step_maps`, and with `stream_denoise` (events built and passed to a
callback), rounds alternating; output tokens per CPU second of this process (one thread: what other processes
on a shared machine do barely moves it), median over the rounds, and wall-clock tokens/s beside it.

    python benchmarks/bench_denoise.py                       # batch 16, 64 new tokens, 5 rounds, one thread
    python benchmarks/bench_denoise.py --plain-only          # the no-flag row alone: runs on a tree before them

A request without the flags pays nothing when no request of its batch asked: no extra device read, no recorder;
run `--plain-only` against the tree before the feature (PYTHONPATH) and this one to compare.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time

import torch

from redraft.engine.runtime.engine import Engine
from redraft.engine.model.tiny import make_tiny_checkpoint

VARIANTS = {"no flags": {}, "return_step_maps": {"return_step_maps": True}, "stream_denoise": {"stream_denoise": True}}


def run_round(engine: Engine, prompts: list[list[int]], params: dict) -> tuple[float, float, int]:
    """(CPU seconds, wall seconds, output tokens) of one batch."""
    events: list[dict] = []
    c0, t0 = time.process_time(), time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params,
                           **({"on_event": events.append} if params.get("stream_denoise") else {}))
    return time.process_time() - c0, time.perf_counter() - t0, sum(len(o["output_ids"]) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--plain-only", action="store_true", help="only the no-flag row")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    variants = {"no flags": {}} if args.plain_only else VARIANTS
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(tmp, seed=0)
        engine = Engine(model_path=str(ckpt), device="cpu", dtype="float32", progress=False)
        prompts = [[(7 * i + j) % 300 + 5 for j in range(12 + i % 5)] for i in range(args.batch)]
        base = {"mode": "Q", "max_new_tokens": args.new_tokens, "temperature": 0.0, "ignore_eos": True}
        run_round(engine, prompts, base)  # warm-up
        rates: dict[str, list[float]] = {name: [] for name in variants}
        walls: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, extra in variants.items():
                cpu, wall, tokens = run_round(engine, prompts, {**base, **extra})
                rates[name].append(tokens / cpu)
                walls[name].append(tokens / wall)
        engine.shutdown()
    print(f"tiny model, batch {args.batch}, {args.new_tokens} new tokens, greedy Q, {args.rounds} rounds "
          f"alternating, {args.threads} thread(s), {platform.processor() or platform.machine()}, torch "
          f"{torch.__version__}\n")
    print("| requests | tokens per CPU s (median) | min | max | vs no flags | wall tokens/s (median) |")
    print("|---|---:|---:|---:|---:|---:|")
    plain = statistics.median(rates["no flags"])
    for name, r in rates.items():
        med = statistics.median(r)
        print(f"| {name} | {med:.0f} | {min(r):.0f} | {max(r):.0f} | {med / plain - 1:+.1%} | "
              f"{statistics.median(walls[name]):.0f} |")


if __name__ == "__main__":
    main()
