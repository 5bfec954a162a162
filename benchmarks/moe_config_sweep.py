"""Sweep the fused MoE kernel's launch configurations on this GPU and write its config table.

    python benchmarks/moe_config_sweep.py --write      # kernels/moe_configs/<device>.json (+ --out copy)
    python benchmarks/moe_config_sweep.py --full       # every combination, not the short list (minutes)
    python benchmarks/moe_config_sweep.py --dry-run    # no GPU: the flow on CPU at the tiny shape, one candidate

For each token count and weight format (bf16, FP8) at the LLaDA2.1-mini MoE shape, with uniform routing (k distinct
random experts per token, the router left out: only the experts and the combine are timed), every candidate
(BLOCK_M, BLOCK_I, BLOCK_K, SWAP, warps, stages) is checked against the seed configuration's output (within bf16
rounding: a different tiling sums in another order) and timed as CUDA-graph replays (median); the fastest per token
count goes into the table that `kernels/moe_triton.py` `config_table` reads. The short list (the default) is four
candidates per cell around the seeds, one of them the unswapped 16-row tile (swap-AB's A/B on the device); the
results, the table and the device's config file are written after every cell, so a run cut short by a time limit
keeps what it measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

TOKENS = [32, 64, 128, 256, 512, 1024, 2048]


def _c(m, k, w, s, i=None, swap=None) -> dict:
    c = dict(BLOCK_M=m, BLOCK_K=k, num_warps=w, num_stages=s)
    if i is not None:
        c["BLOCK_I"] = i
    if swap is not None:
        c["SWAP"] = swap
    return c


SHORT = {  # (format, smallest token count) -> candidates; the seeds first
    ("bf16", 1): [_c(16, 128, 4, 2, 64), _c(16, 128, 4, 2, 128), _c(16, 128, 4, 3, 64), _c(16, 64, 4, 2, 64, False)],
    ("bf16", 64): [_c(16, 128, 4, 2, 128), _c(16, 128, 4, 2, 64), _c(32, 128, 4, 2, 128), _c(16, 128, 4, 3, 128)],
    ("bf16", 256): [_c(32, 128, 4, 2, 128), _c(32, 128, 8, 2, 128), _c(64, 64, 8, 2, 128), _c(32, 128, 4, 2, 64)],
    ("bf16", 1024): [_c(64, 64, 8, 2, 128), _c(64, 128, 8, 2, 128), _c(64, 64, 4, 3, 128), _c(32, 128, 4, 2, 128)],
    ("fp8", 1): [_c(16, 128, 4, 3), _c(16, 128, 4, 2), _c(16, 128, 4, 3, swap=False), _c(32, 128, 4, 3)],
    ("fp8", 64): [_c(16, 128, 4, 3), _c(32, 128, 4, 3), _c(16, 128, 4, 2), _c(16, 128, 8, 3)],
    ("fp8", 256): [_c(32, 128, 4, 3), _c(32, 128, 8, 3), _c(64, 128, 8, 2), _c(32, 128, 4, 2)],
    ("fp8", 1024): [_c(64, 128, 8, 2), _c(64, 128, 4, 3), _c(64, 128, 8, 3), _c(32, 128, 4, 3)],
}


def candidates(fmt: str, tokens: int, full: bool = False, quick: bool = False) -> list[dict]:
    if full:
        rows = [16, 32] if tokens <= 256 else [32, 64]
        ks = [128] if fmt == "fp8" else [64, 128]
        slices = [None] if fmt == "fp8" else [64, 128]
        out = [_c(m, k, w, s, i) for m, k, w, s, i in itertools.product(rows, ks, (4, 8), (2, 3), slices)]
        out += [dict(c, SWAP=False) for c in out if c["BLOCK_M"] < 64]
    else:
        key = max(t for f, t in SHORT if f == fmt and t <= tokens)
        out = SHORT[(fmt, key)]
    return out[:1] if quick else out


def sweep(args) -> dict:
    import bench_moe as bm
    from redraft.kernels import moe_triton as mt

    bm.DEVICE = torch.device("cpu" if args.dry_run else "cuda")
    cfg = bm.model_config("tiny" if args.dry_run else "mini")
    act = torch.float32 if args.dry_run else torch.bfloat16
    table: dict[str, dict[str, dict]] = {}
    results: list[dict] = []
    res = {"device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name(), "table": table,
           "results": results, "date": time.strftime("%Y-%m-%d")}
    layers = {fmt: bm.Layer(cfg, act, args.seed, fp8=fmt == "fp8") for fmt in args.formats}
    uniform = bm.uniform_ids(cfg, max(args.tokens), args.seed)
    for t in args.tokens:  # token counts outer: a run cut short has both formats at the smallest batches
        for fmt, layer in layers.items():
            best = sweep_cell(args, bm, mt, cfg, layer, fmt, t, uniform[:t], act, results)
            if best:
                table.setdefault(fmt, {})[str(t)] = best
            save(args, res)  # after every cell: a run cut short keeps what it measured
    return res


def sweep_cell(args, bm, mt, cfg, layer, fmt: str, t: int, ids: torch.Tensor, act: torch.dtype,
               results: list) -> dict | None:
    """Every candidate at one (format, token count); the fastest one within tolerance of the seed's output."""
    x = bm.layer_input(cfg, t, "random", args.seed + t, act)
    w = torch.full((t, cfg.num_experts_per_tok), 1.0 / cfg.num_experts_per_tok, device=x.device)
    shared = mt.SharedExpert(layer.sg, layer.sd, layer.sg_s, layer.sd_s)

    def run(c=None):
        return mt.fused_moe(x, layer.w13, layer.w2, ids, w, w13_scale=layer.w13_s, w2_scale=layer.w2_s,
                            shared=shared, method="fused", config=c)

    ref = run().float()
    best = None
    for cand in candidates(fmt, t, args.full, args.dry_run):
        full = dict(mt.fused_config(t, cfg.num_experts_per_tok + 1, cfg.num_experts + 1, cfg.hidden_size,
                                    cfg.moe_intermediate_size, fmt == "fp8", args.dry_run), **cand)
        full.pop("path", None)
        if args.dry_run:
            full.update(num_stages=1)
        try:
            err = float((run(full).float() - ref).norm() / ref.norm())
            ms = bm.time_in_graph(lambda: run(full), args.iters, 3) if not args.dry_run else \
                bm._time(lambda: run(full), 1, 0)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile or fit: skip, say so
            print(f"  {fmt} T={t} {cand}: failed ({type(exc).__name__}: {str(exc)[:120]})", flush=True)
            continue
        ok = err < (2e-2 if fmt == "fp8" else 1e-2)
        results.append({"format": fmt, "tokens": t, **cand, "ms": ms, "rel_err_vs_seed": err, "ok": ok})
        print(f"  {fmt} T={t} {cand}: {ms:.3f} ms, err {err:.1e}{'' if ok else ' (REJECTED)'}", flush=True)
        if ok and (best is None or ms < best[0]):
            best = (ms, cand)
    return best[1] if best else None


def save(args, res: dict) -> None:
    """The sweep so far into --out, and (with --write, on a GPU) the table into the device's config file."""
    from redraft.kernels import moe_triton as mt

    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))
    if args.write and not args.dry_run and res["table"]:
        path = mt.device_config_path(res["device"])
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res["table"], indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moe_config_sweep", description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--formats", default="bf16,fp8")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--write", action="store_true", help="write kernels/moe_configs/<device>.json")
    p.add_argument("--full", action="store_true", help="every combination instead of the short list")
    p.add_argument("--out", default=None, help="also write the sweep (table and every timing) to this JSON file")
    p.add_argument("--dry-run", action="store_true", help="no GPU: CPU, tiny shape, one candidate, nothing timed")
    args = p.parse_args(argv)
    args.tokens = [int(t) for t in args.tokens.split(",") if t]
    args.formats = [f for f in args.formats.split(",") if f]
    if args.dry_run:
        args.tokens = args.tokens[:2]
    elif not torch.cuda.is_available():
        raise SystemExit("moe_config_sweep: no CUDA device (`--dry-run` runs without one)")
    import redraft.kernels  # noqa: F401 - settles TRITON_INTERPRET before triton is imported
    from redraft.kernels import moe_triton as mt

    res = sweep(args)
    save(args, res)
    if args.write and not args.dry_run:
        print(f"wrote {mt.device_config_path(res['device'])}")
    print(json.dumps(res["table"], indent=2))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
