"""The whole engine on a GPU: tokens/s of `redraft.Engine` with the overlap scheduler off and on, and the decision
from full logits against the fused lm_head + top-1 reduction, on one loaded model (dummy weights, real shape).

    python benchmarks/bench_gpu_engine.py                       # LLaDA2.1-mini shape, batches 1 8 32 64
    python benchmarks/bench_gpu_engine.py --dry-run             # no GPU: the flow on CPU at the tiny shape

Part 1 (overlap): each batch size runs `rounds` times with the serial loop and with the overlap scheduler
(engine/runtime/overlap.py), alternating; batches up to --cuda-graph-max-bs replay CUDA graphs. Part 2 (decision): a batch
above --cuda-graph-max-bs runs eagerly, so the decision can come from full [L, V] logits or from the fused
reduction (kernels/vocab_top1_triton.py); alternating again. Random weights spread each proposal's probability
over the whole vocabulary, so no threshold is met and every forward places one token per block: tokens per
forward is ~1 and the tables measure forwards per second. Prints markdown tables (medians over the rounds).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_gpu_step import write_model_dir  # noqa: E402


def _set_overlap(engine, on: bool) -> None:
    from redraft.engine.runtime.overlap import Overlap

    core = engine.core
    core.overlap.settle()
    core.overlap.shutdown()
    core.overlap = Overlap(core.runner, core.scheduler, None if on else "benchmark: serial loop")


def _run(engine, batch: int, new_tokens: int, prompt_len: int, vocab: int, sync) -> dict:
    prompts = [[(7 + 13 * i + 31 * j) % (vocab - 8) + 4 for j in range(prompt_len)] for i in range(batch)]
    params = {"max_new_tokens": new_tokens, "ignore_eos": True, "temperature": 0.0}
    used0, fwd0 = engine.core.num_overlapped_forwards, engine.core.num_forwards
    sync()
    t0 = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    sync()
    dt = time.perf_counter() - t0
    tokens = sum(len(o["output_ids"]) for o in outs)
    forwards = engine.core.num_forwards - fwd0
    return {"s": dt, "tokens": tokens, "tok_s": tokens / dt, "forwards": forwards,
            "ms_per_forward": 1e3 * dt / max(forwards, 1),
            "overlapped": engine.core.num_overlapped_forwards - used0}


def _parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mini", choices=("mini", "flash", "tiny"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--eager-batch", type=int, default=64, help="part 2's batch (above --cuda-graph-max-bs)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shape, torch kernels: checks the script")
    args = ap.parse_args()
    if args.dry_run:
        args.model, args.batches, args.eager_batch, args.new_tokens, args.prompt_len = "tiny", [1, 4], 8, 8, 16
        args.cuda_graph_max_bs, args.rounds = 4, 1
    return args


def _measure(engine: Any, args: argparse.Namespace, vocab: int, sync: Callable[[], None], rows: list[dict],
             part: str, batch: int, settings: list[tuple[str, Callable[[], None]]]) -> None:
    """One table row per setting: the median of `args.rounds` alternating timed runs, after an untimed one each
    (the graphs and kernels of this batch shape)."""
    for name, apply in settings:
        apply()
        _run(engine, batch, min(args.new_tokens, 16), args.prompt_len, vocab, sync)
    got: dict[str, list[dict]] = {name: [] for name, _ in settings}
    for _ in range(args.rounds):
        for name, apply in settings:
            apply()
            got[name].append(_run(engine, batch, args.new_tokens, args.prompt_len, vocab, sync))
    base = statistics.median(r["tok_s"] for r in got[settings[0][0]])
    for name, _ in settings:
        runs = got[name]
        tok_s = statistics.median(r["tok_s"] for r in runs)
        row = {"part": part, "batch": batch, "setting": name, "tok_s": tok_s,
               "ms_per_forward": statistics.median(r["ms_per_forward"] for r in runs),
               "forwards": runs[-1]["forwards"], "overlapped": runs[-1]["overlapped"],
               "speedup": tok_s / base}
        rows.append(row)
        print(f"| {part} | {batch} | {name} | {tok_s:.0f} | {row['ms_per_forward']:.2f} | {row['forwards']} "
              f"| {row['overlapped']} | {row['speedup']:.2f}x |", flush=True)


def main() -> None:
    args = _parse_args()
    import torch

    import redraft

    device = "cpu" if args.dry_run else "cuda"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model_dir = write_model_dir(Path(tempfile.mkdtemp()) / f"llada2-{args.model}-dummy", args.model)
    t0 = time.perf_counter()
    engine = redraft.Engine(str(model_dir), device=device, load_format="dummy",
                            kernel_backend="torch" if args.dry_run else "triton",
                            cuda_graph_max_bs=args.cuda_graph_max_bs,
                            max_running_requests=max(args.batches + [args.eager_batch]),
                            log_level="warning")  # (each setting installs its own overlap scheduler)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s on {device}"
          f" ({torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'})", flush=True)
    vocab = min(engine.tokenizer.vocab_size, 400)  # prompts of ordinary ids of the tokenizer (ids < 4 are special)
    _run(engine, 2, 8, args.prompt_len, vocab, sync)  # warm-up: compile kernels, capture graphs
    rows: list[dict] = []
    runner = engine.core.runner
    print("| part | batch | setting | tokens/s | ms/forward | forwards | overlapped | vs first |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batches:
        _measure(engine, args, vocab, sync, rows, "overlap", b,
                 [("serial", lambda: _set_overlap(engine, False)), ("overlap", lambda: _set_overlap(engine, True))])
    _set_overlap(engine, False)

    def reduce(on: bool) -> Callable[[], None]:
        def apply() -> None:
            runner.vocab_reduce = on
        return apply

    _measure(engine, args, vocab, sync, rows, "decision (eager)", args.eager_batch,
             [("full logits", reduce(False)), ("fused top-1", reduce(True))])
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"model": args.model, "device": device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
