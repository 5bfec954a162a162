"""The decision inside the CUDA graph on a GPU (scripts/gpu_probe.sh's `graph-decision` phase; about a minute):

1. tokens and forward counts of greedy threshold requests with CUDA graphs (decided inside the graph) against
   the same engine's without graphs (the eager path, whose greedy rows use the same fused top-1 and step), reported
   (bf16 GEMMs may pick other kernels for the graph's padded batch shape, so a near-tie may differ: docs/gpu.md);
2. in steady-state steps (the same rows as the step before, seen from the outside) the profiler counts no
   host -> device memcpy and exactly one device -> host memcpy per step, and torch.cuda.set_sync_debug_mode
   reports one synchronizing call per step (the packed read).
Tiny shape, bf16, dummy weights: the counts do not depend on the shape. Writes --json-out; exit 1 when the counts
do not hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

REQS = [(f"g{k}", [11 + (7 * k + 3 * i) % 200 for i in range(5 + 20 * k)],
         {"max_new_tokens": 64, "ignore_eos": True, "mode": "Q", "threshold": 0.99}) for k in range(3)]


def make_engine(model_dir: Path, graphs: bool):
    import redraft

    return redraft.Engine(str(model_dir), device="cuda", dtype="bfloat16", kernel_backend="triton",
                          load_format="dummy", seed=0, max_total_tokens=8192, cuda_graph_max_bs=8,
                          disable_cuda_graph=not graphs, progress=False)


def tokens_equal(model_dir: Path) -> dict:
    prompts = [ids for _, ids, _ in REQS]
    params = {"max_new_tokens": 64, "temperature": 0.0, "mode": "S"}
    outs = {}
    for graphs in (False, True):
        with make_engine(model_dir, graphs) as eng:
            assert not graphs or eng.core.runner.graphs is not None, eng.core.runner.graph_error
            got = eng.generate(input_ids=prompts, sampling_params=params)
            outs[graphs] = [(o["output_ids"], o["meta_info"]["steps"]) for o in got]
            reads = eng.core.runner.graphs.inputs.reads if graphs else 0
    return {"equal": outs[True] == outs[False], "in_graph_steps": reads}


def memcpys(prof) -> tuple[int, int]:
    """(host -> device, device -> host) memcpy events of a profile."""
    h2d = d2h = 0
    for e in prof.events():
        name = e.name
        h2d += "Memcpy HtoD" in name
        d2h += "Memcpy DtoH" in name
    return h2d, d2h


def count_step(core) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                core.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()  # (outside the sync count: the step's own kernels into the profile)
    h2d, d2h = memcpys(prof)
    syncs = sum("synchronizing" in str(w.message) for w in caught)
    return {"h2d": h2d, "d2h": d2h, "syncs": syncs}


def steady_counts(model_dir: Path, steps: int) -> list[dict]:
    from redraft.protocol.sampling_params import SamplingParams

    rows = []
    with make_engine(model_dir, True) as eng:
        core, runner = eng.core, eng.core.runner
        core.add_requests([(rid, ids, SamplingParams.from_dict(p)) for rid, ids, p in REQS])
        last = None
        for _ in range(steps):
            items = core.scheduler.running
            sig = tuple((r.rid, r.state.active_block, r.book.slot, tuple(r.book.pages)) for r in items)
            counts = count_step(core)
            counts["steady"] = sig == last and bool(sig)
            rows.append(counts)
            last = sig
        assert runner.graphs is not None and runner.graphs.inputs.reads > 0, "the in-graph decision never ran"
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json-out", default="graph_decision.json")
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_graph_decision_check: no CUDA device")
    import bench_gpu_step

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = bench_gpu_step.write_model_dir(Path(tmp) / "tiny", "tiny")
        result = {"tokens": tokens_equal(model_dir), "steps": steady_counts(model_dir, args.steps)}
    steady = [s for s in result["steps"] if s["steady"]]
    result["steady_steps"] = len(steady)
    result["holds"] = bool(steady and all((s["h2d"], s["d2h"], s["syncs"]) == (0, 1, 1) for s in steady))
    Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "steps"}), [
        (s["h2d"], s["d2h"], s["syncs"], s["steady"]) for s in result["steps"]])
    return 0 if result["holds"] else 1


if __name__ == "__main__":
    sys.exit(main())
