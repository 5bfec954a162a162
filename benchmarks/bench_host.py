"""Where a denoising step's time goes, and what the decision costs in memory without full logits.

    python benchmarks/bench_host.py                       # batches 1 16 64 128, tiny model, one thread
    python benchmarks/bench_host.py --batches 64 --steps 40
    python benchmarks/bench_host.py --skip-split --skip-memory --rounds 5   # only the overlap table
    python benchmarks/bench_host.py --device cuda --batches 1 32 --skip-memory  # GPU: LLaDA2.1-mini shape, dummy

Part 1 (time): `redraft.Engine` on a tiny model decodes `batch` greedy requests; every engine step is split into
the model forward, the decision (lm_head and the draft-and-edit step), and the host's parts: scheduling, the
update of the requests, their outputs, and the rest (batch building, attention metadata). Each configuration runs
twice per batch size, alternating, with the decision from full logits ("full") and from vocabulary chunks
("chunked", kernels/vocab_top1.py); medians over the steps of the steady state. The split is of the serial loop
(--disable-overlap): with overlap on, the forward runs on a worker thread and its time would land in other parts.
With --device cuda the model is LLaDA2.1-mini's shape with random weights (Triton kernels, CUDA graphs up to the
largest batch), and each timed part synchronizes the device before and after, so the GPU time a part queued is
counted in it (the forward of a replayed graph includes its lm_head; a step decided inside the graph, every
greedy threshold batch with graphs on, counts as forward whole).

Part 2 (overlap): the same steady state with the overlap scheduler off and on (engine/runtime/overlap.py: forward k+1 runs
on a worker thread while the host updates, reports and schedules iteration k), alternating off/on for `rounds`
rounds per batch size; the median step time of each setting over all its rounds' steps, the speed-up, and the
share of forwards that ran overlapped. The engine's torch threads stay at one, so that the forward and the host
each have a core (on a machine with two).

Part 3 (memory): the peak memory a decision adds at batch 64 x 32 positions with LLaDA2's 157,184-token
vocabulary, full logits + softmax/argmax against the chunked reduction, each measured in a fresh process
(the peak resident set size, reset once the inputs exist, minus the size then; Linux).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from redraft.engine.runtime.engine import Engine
from redraft.engine.model.tiny import make_tiny_checkpoint
from redraft.protocol.sampling_params import SamplingParams

PARTS = ("forward", "decide", "schedule", "update", "outputs")
DEVICE = "cpu"  # --device
LLADA2_VOCAB = 157_184


def _timed(obj: object, name: str, bucket: dict[str, float], part: str) -> None:
    """Wrap obj.name so that its time adds to bucket[part] (a benchmark's instrument, never the engine's). On a
    GPU the device is synchronized around it: the part owns the device time it queued."""
    fn = getattr(obj, name)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)

    def wrapper(*args, **kwargs):
        sync()
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            sync()
            bucket[part] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def _steady(engine: Engine, batch: int, steps: int) -> None:
    """Queue `batch` greedy requests that outlive `steps` steps (plus the warm-up)."""
    params = SamplingParams(max_new_tokens=32 * (steps + 4), ignore_eos=True, mode="Q")
    for i in range(batch):
        engine.core.add_request(f"r{i}", [5 + i % 50, 6, 7, 8 + i % 7], params)


def _engine(path: Path, batch: int, **kw) -> Engine:
    """The engine of one measurement: the tiny checkpoint on one CPU thread, or on CUDA the mini shape's random
    weights (Triton kernels, graphs up to `batch`, a fixed KV cache so that engines made one after another fit)."""
    if DEVICE == "cuda":
        return Engine(str(path), device="cuda", load_format="dummy", kernel_backend="triton", progress=False,
                      max_running_requests=max(batch, 1), cuda_graph_max_bs=max(batch, 1),
                      max_total_tokens=32 * 1024, **kw)
    return Engine(str(path), max_running_requests=max(batch, 1), cpu_threads=1, progress=False, **kw)


def step_split(path: Path, batch: int, chunked: bool, steps: int) -> dict[str, float]:
    """Median milliseconds per engine step of each part (and the whole step), batch requests in flight."""
    engine = _engine(path, batch, disable_overlap=True)
    core = engine.core
    core.runner.vocab_reduce = chunked
    bucket: dict[str, float] = defaultdict(float)
    _timed(core.runner.model, "forward", bucket, "forward")
    if core.runner.graphs is not None:
        _timed(core.runner.graphs, "run", bucket, "forward")  # a replayed step: the forward and its lm_head
        # a step decided inside the graph (greedy threshold rows): forward, top-1, the step and the packed read in
        # one replay, counted as forward (its decision has no host part left to split off)
        _timed(core.runner.graphs, "decide", bucket, "forward")
    _timed(core.runner.model, "logits", bucket, "decide")  # the lm_head of rows that need full logits
    _timed(core.runner, "top1", bucket, "decide")  # the lm_head of the others, in vocabulary chunks
    _timed(core.runner, "decide", bucket, "decide")  # the draft-and-edit step
    _timed(core.scheduler, "schedule", bucket, "schedule")
    _timed(core.scheduler, "update", bucket, "update")
    _timed(core, "_output_guarded", bucket, "outputs")
    _steady(engine, batch, steps)
    rows: dict[str, list[float]] = defaultdict(list)
    for k in range(steps + 3):
        bucket.clear()
        t0 = time.perf_counter()
        core.step()
        total = time.perf_counter() - t0
        if k < 3:  # admission and prefill: not the steady state
            continue
        rows["step"].append(total * 1e3)
        for part in PARTS:
            rows[part].append(bucket[part] * 1e3)
        rows["other"].append((total - sum(bucket[p] for p in PARTS)) * 1e3)
    engine.shutdown()
    return {name: statistics.median(vals) for name, vals in rows.items()}


def step_times(path: Path, batch: int, overlap: bool, steps: int) -> tuple[list[float], float]:
    """Milliseconds of each steady-state engine step, and the share of forwards that ran overlapped."""
    engine = _engine(path, batch, disable_overlap=not overlap, enable_overlap=overlap)
    sync = torch.cuda.synchronize if DEVICE == "cuda" else (lambda: None)
    core = engine.core
    _steady(engine, batch, steps)
    times = []
    for k in range(steps + 3):
        if k == 3:  # admission and prefill: not the steady state
            forwards, used = core.num_forwards, core.num_overlapped_forwards
        sync()
        t0 = time.perf_counter()
        core.step()
        sync()
        if k >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    share = (core.num_overlapped_forwards - used) / max(core.num_forwards - forwards, 1)
    engine.shutdown()
    return times, share


def overlap_table(path: Path, batches: list[int], steps: int, rounds: int) -> None:
    print("\n| batch | step ms, overlap off | step ms, overlap on | speed-up | forwards overlapped |")
    print("|---:|---:|---:|---:|---:|")
    for batch in batches:
        times: dict[bool, list[float]] = {False: [], True: []}
        shares = []
        for _ in range(rounds):  # alternating, so that a noisy spell hits both
            for overlap in (False, True):
                t, share = step_times(path, batch, overlap, steps)
                times[overlap] += t
                if overlap:
                    shares.append(share)
        off, on = statistics.median(times[False]), statistics.median(times[True])
        print(f"| {batch} | {off:.2f} | {on:.2f} | {off / on:.2f}x | {statistics.median(shares):.0%} |", flush=True)


_MEMORY_PROBE = r"""
import sys, torch
from redraft.engine.decoding.decoding import propose
from redraft.kernels.vocab_top1 import lm_head_top1_torch
torch.set_num_threads(1)
mode, rows, hidden_size, vocab = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
g = torch.Generator().manual_seed(0)
hidden = torch.randn(rows, hidden_size, generator=g, dtype=torch.bfloat16)
weight = torch.randn(vocab, hidden_size, generator=g, dtype=torch.bfloat16) / hidden_size ** 0.5
def rss_kib(field):
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith(field))
open("/proc/self/clear_refs", "w").write("5")  # the peak (VmHWM) starts again from the current size
before = rss_kib("VmRSS:")
if mode == "full":
    logits = torch.nn.functional.linear(hidden, weight).float()  # what LLaDA2Model.logits returns
    logits[:, 156_895 % vocab] = float("-inf")
    ids, prob = propose(logits[None], None)
else:
    top = lm_head_top1_torch(hidden, weight, 156_895 % vocab).combine()
print(rss_kib("VmHWM:") - before)
"""


def decision_peak_mib(mode: str, rows: int, hidden_size: int, vocab: int) -> float:
    out = subprocess.run([sys.executable, "-c", _MEMORY_PROBE, mode, str(rows), str(hidden_size), str(vocab)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1]) / 1024  # /proc reports KiB


def split_table(path: Path, batches: list[int], steps: int) -> None:
    print("| batch | decision | step ms | forward | decide | schedule | update | outputs | other | host share |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for batch in batches:
        for chunked in (False, True):
            r = step_split(path, batch, chunked, steps)
            host = r["schedule"] + r["update"] + r["outputs"] + r["other"]
            print(f"| {batch} | {'chunked' if chunked else 'full'} | {r['step']:.2f} | "
                  + " | ".join(f"{r[p]:.2f}" for p in (*PARTS, "other")) + f" | {host / r['step']:.0%} |",
                  flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--steps", type=int, default=30, help="steady-state steps measured per configuration")
    ap.add_argument("--rounds", type=int, default=3, help="alternating overlap off/on rounds per batch size")
    ap.add_argument("--skip-split", action="store_true")
    ap.add_argument("--skip-overlap", action="store_true")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: LLaDA2.1-mini's shape with random weights instead of the tiny checkpoint")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    where = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "1 thread, tiny checkpoint"
    print(f"# bench_host: {platform.processor() or platform.machine()}, torch {torch.__version__}, {where}\n")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        if DEVICE == "cuda":
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from bench_gpu_step import write_model_dir

            write_model_dir(path, "mini")
        else:
            make_tiny_checkpoint(path, seed=0)
        if not args.skip_split:
            split_table(path, args.batches, args.steps)
        if not args.skip_overlap:
            overlap_table(path, args.batches, args.steps, args.rounds)
    if args.skip_memory:
        return
    rows, hidden_size = 64 * 32, 64  # the added memory does not depend on the hidden size; the CPU time does
    full_gb = rows * LLADA2_VOCAB * 4 / 1e9
    print(f"\nPeak memory a decision adds, batch 64 x 32 positions, vocabulary {LLADA2_VOCAB:,}, hidden "
          f"{hidden_size} (bf16); full fp32 logits alone are {full_gb:.2f} GB:\n")
    print("| decision | added peak (MiB) |")
    print("|---|---:|")
    for mode in ("full", "chunked"):
        print(f"| {mode} | {decision_peak_mib(mode, rows, hidden_size, LLADA2_VOCAB):,.0f} |", flush=True)


if __name__ == "__main__":
    main()
