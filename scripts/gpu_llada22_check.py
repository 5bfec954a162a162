"""LLaDA2.2 on a GPU: a tiny 2.2 checkpoint (block routing + the Levenshtein step) decoded on CUDA with the torch
and the Triton kernel backends, in float32, against the same engine on CPU (torch backend). Prints one line per
configuration: equal ids and forward counts, or where they part.

    python scripts/gpu_llada22_check.py            # needs a CUDA device
    python scripts/gpu_llada22_check.py --cpu-only # no GPU: the CPU rows alone (Triton interpreted)
"""
from __future__ import annotations

import argparse
import sys
import tempfile

PROMPTS = [list(range(5, 5 + n)) for n in (7, 31, 32, 45)]


def run(path: str, device: str, backend: str, decoder: str) -> list[tuple[list[int], int]]:
    import redraft

    engine = redraft.Engine(path, device=device, dtype="float32", kernel_backend=backend, log_level="warning",
                            max_total_tokens=16384)
    params = [{"max_new_tokens": 64, "temperature": 0.0, "decoder": decoder, "ignore_eos": True}] * len(PROMPTS)
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    engine.shutdown()
    return [(o["output_ids"], o["meta_info"]["steps"]) for o in outs]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cpu-only", action="store_true")
    args = ap.parse_args()
    from redraft.engine.model.tiny import make_tiny_checkpoint

    path = str(make_tiny_checkpoint(tempfile.mkdtemp() + "/tiny22", llada22=True))
    bad = 0
    for decoder in ("levenshtein", "threshold"):
        want = run(path, "cpu", "torch", decoder)
        rows = [("cpu", "triton")] if args.cpu_only else [("cuda", "torch"), ("cuda", "triton")]
        for device, backend in rows:
            got = run(path, device, backend, decoder)
            same = [g == w for g, w in zip(got, want)]
            bad += not all(same)
            print(f"{decoder:11s} {device}/{backend:6s}: {sum(same)}/{len(same)} requests equal to cpu/torch "
                  f"(ids and steps); tokens {sum(len(g[0]) for g in got)}", flush=True)
            for i, (g, w) in enumerate(zip(got, want)):
                if g != w:
                    first = next((j for j, (a, b) in enumerate(zip(g[0], w[0])) if a != b), None)
                    print(f"  request {i}: first differing position {first}, steps {g[1]} vs {w[1]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
