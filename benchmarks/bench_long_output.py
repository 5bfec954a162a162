"""Does the cost of a committed block grow with the output's length? One long streamed generation, the time
between consecutive blocks early and late in it, for this checkout and (optionally) an older one, in one run.

    python benchmarks/bench_long_output.py                                    # this checkout only
    git worktree add /tmp/before <commit>
    python benchmarks/bench_long_output.py --baseline-src /tmp/before         # before vs after

Each source serves the same tiny random checkpoint (`redraft serve`, one engine thread) and answers the same
`/v1/completions` streams: `--new-tokens` tokens (4096 by default) with `ignore_eos`, plain text, then with
logprobs (5 alternatives) and a stop string that never matches, decoded with threshold 0, editing off and
max_post_steps 0, so that every block takes exactly one forward and the forward's own cost (which grows with
the context, in both sources alike) stays small beside the output path under test: the engine's message per
block, the HTTP side's detokenization and stop-string matching, the logprobs. Reported per source: the median
gap between blocks over the first and the last `--window` blocks, and their ratio.

An older checkout runs from its own source tree, made importable as `redraft` through a folder of symlinks
(its pyproject.toml's package mapping), with this Python's installed packages.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_serving import LaunchedServer
from redraft.clients.sse import sse_events

NEVER = "\u2603never\u2603matches\u2603"  # a stop string the tiny model will not produce


def package_dir(src: Path, into: Path) -> Path:
    """A folder where `import redraft` finds `src`'s code: redraft/ with symlinks per its package mapping."""
    text = (src / "pyproject.toml").read_text()
    mapping = dict(re.findall(r'"redraft(?:\.(\w+))?" = "(\w+)"', text))
    pkg = into / "redraft"
    pkg.mkdir(parents=True)
    for entry in (src / mapping.get("", "redraft")).iterdir():
        (pkg / entry.name).symlink_to(entry)
    for sub, folder in mapping.items():
        if sub:
            (pkg / sub).symlink_to(src / folder)
    return into


VARIANTS = {
    "text": {},
    "text + logprobs 5 + stop string": {"logprobs": 5, "stop": [NEVER]},
}


async def one_stream(base_url: str, new_tokens: int, extra: dict) -> list[float]:
    import httpx

    body = {"prompt": "the long answer", "max_tokens": new_tokens, "stream": True, "ignore_eos": True,
            "threshold": 0.0, "edit_threshold": 1.0, "max_post_steps": 0, "temperature": 0.0, **extra}
    times: list[float] = []
    async with httpx.AsyncClient(timeout=600.0, trust_env=False) as client:
        async for event in sse_events(client, base_url + "/v1/completions", body, {}):
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.perf_counter())
    return times


def measure(name: str, ckpt: Path, pythonpath: str | None, args: argparse.Namespace, workdir: Path
            ) -> dict[str, tuple[list[float], list[float], int]]:
    """Per variant: (early gaps, late gaps, blocks) of `args.runs` streams from one server of this source."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if pythonpath:
        env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
    srv_args = argparse.Namespace(tiny=False, small=False, model=str(ckpt), load_format=None, max_running_requests=None,
                                  server_args="--cpu-threads 1", server_log=str(workdir / f"{name.split()[0]}.log"))
    server = LaunchedServer(srv_args, workdir, env=env)
    try:
        server.wait_healthy(300.0)
        out: dict[str, tuple[list[float], list[float], int]] = {}
        for variant, extra in VARIANTS.items():
            gaps_early: list[float] = []
            gaps_late: list[float] = []
            blocks = 0
            for _ in range(args.runs):
                times = asyncio.run(one_stream(server.base_url, args.new_tokens, extra))
                gaps = [b - a for a, b in zip(times, times[1:])]
                blocks = len(times)
                w = min(args.window, len(gaps) // 2)
                gaps_early += gaps[1 : 1 + w]  # the first gap can include warm-up
                gaps_late += gaps[-w:]
            out[variant] = (gaps_early, gaps_late, blocks)
    finally:
        server.stop()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_long_output.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline-src", type=Path, default=None, help="an older checkout to measure beside this one")
    p.add_argument("--new-tokens", type=int, default=4096)
    p.add_argument("--window", type=int, default=16, help="blocks at each end (default 16)")
    p.add_argument("--runs", type=int, default=3, help="streams per server (default 3)")
    p.add_argument("--rounds", type=int, default=2,
                   help="servers per source, started in turn (before, after, before, ...) so drift hits both alike")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from redraft.engine.model.tiny import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        ckpt = make_tiny_checkpoint(work / "tiny", seed=0,
                                    config_overrides={"max_position_embeddings": args.new_tokens + 128})
        sources: list[tuple[str, str | None]] = []
        if args.baseline_src is not None:
            sources.append(("before", str(package_dir(args.baseline_src.resolve(), work / "baseline-pkg"))))
        sources.append(("after (this checkout)", None))
        gaps = {(name, v): ([], []) for name, _ in sources for v in VARIANTS}
        blocks = 0
        for _ in range(args.rounds):
            for name, path in sources:
                for variant, (early, late, blocks) in measure(name, ckpt, path, args, work).items():
                    gaps[name, variant][0].extend(early)
                    gaps[name, variant][1].extend(late)
        rows = []
        for (name, variant), (early, late) in gaps.items():
            e, l = statistics.median(early) * 1e3, statistics.median(late) * 1e3
            rows.append({"source": name, "stream": variant, "blocks": blocks, "early_ms": e, "late_ms": l,
                         "late_over_early": l / e})
    print(f"\none /v1/completions stream of {args.new_tokens} tokens (1 forward per block), "
          f"median gap between blocks over the first and last {args.window} blocks, {args.rounds} servers x "
          f"{args.runs} streams per source\n")
    print("| source | stream | blocks | early ms/block | late ms/block | late / early |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['source']} | {r['stream']} | {r['blocks']} | {r['early_ms']:.2f} | {r['late_ms']:.2f} | "
              f"{r['late_over_early']:.2f}x |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
