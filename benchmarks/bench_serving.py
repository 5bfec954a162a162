"""Online serving benchmark: drive a `redraft serve` server's native streaming POST /generate at fixed
concurrencies and report throughput and latency per level (SGLang's bench_serving, closed-loop, for redraft).

    python benchmarks/bench_serving.py --launch --tiny                      # start a tiny server, 1/8/32/64
    python benchmarks/bench_serving.py --launch --small --concurrency 1 32 --num-requests 32
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:30000 --concurrency 1 8 --json out.json

Either point it at a running server (`--base-url`) or let it start one (`--launch`: `redraft serve` on a free
127.0.0.1 port, stopped with SIGTERM at the end; `--tiny` / `--small` make a throw-away checkpoint first).

At each concurrency level C, C workers each keep exactly one request in flight until the level's
`--num-requests` have been sent or `--max-seconds` have passed (no new request starts after that; requests
still running `--grace-seconds` later are cancelled and counted as failed). Prompts are random words from a
seeded RNG, every request asks for `--max-new-tokens` with `ignore_eos`, so all requests do the same work.

TTFT is the time until the first SSE chunk, i.e. the first committed 32-token block (a diffusion model streams
whole blocks, not single tokens). Tokens per forward come from the server's meta_info (completion tokens over
the denoising forwards that request took part in). `x c=B` is output tokens/s over that of the lowest level.
Prints a markdown table; `--json` writes one row per level; `--plot` draws a PNG if matplotlib is installed.

On a small CPU machine shared with other work, a launched server inherits this process's environment: set
OMP_NUM_THREADS=1 for it there (torch's spinning intra-op threads slowed the tiny model ~30x under contention).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from redraft.clients.loadgen import (CANCELLED, GenerateStream, Result, auth_headers, closed_loop, collect, fmt,
                                     http_client, ms_stats, print_errors, pyplot, random_words,
                                     save_figure, summarize as summarize_results, timed_request)

try:
    import httpx
except ImportError:  # pragma: no cover - httpx comes with the dev extra
    httpx = None  # type: ignore[assignment]


# ---- prompts -------------------------------------------------------------------------------------------
def make_prompts(n: int, words: tuple[int, int], seed: int) -> list[str]:
    """`n` distinct random-word prompts, reproducible from `seed`."""
    rng = random.Random(seed)
    return [random_words(rng, rng.randint(*words)) for _ in range(n)]


# ---- one concurrency level ---------------------------------------------------------------------------------
async def run_level(client: "httpx.AsyncClient", base_url: str, concurrency: int, prompts: list[str], params: dict,
                    headers: dict, max_seconds: float, grace_seconds: float, desc: str) -> tuple[list[Result], float]:
    """Closed loop: `concurrency` workers, one request in flight each, until the prompts or the time run out."""
    url = f"{base_url}/generate"
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False)

    async def send(i: int) -> Result:
        body = {"text": prompts[i], "sampling_params": params, "stream": True}
        res = await timed_request(client, url, body, headers, GenerateStream())
        bar.update(1)
        return res

    t0 = time.perf_counter()
    sent = await closed_loop(send, len(prompts), concurrency, max_seconds, grace_seconds)
    duration = time.perf_counter() - t0
    bar.close()
    return await collect(sent, lambda i: Result(error=CANCELLED)), duration


def summarize(concurrency: int, results: list[Result], duration: float, max_new_tokens: int) -> dict:
    ok = [r for r in results if r.ok]
    forwards = sum(r.forwards or 0 for r in ok)
    # Time between consecutive committed blocks of a request (the streaming cadence after the first block).
    gaps = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    return {
        "concurrency": concurrency,
        "duration_s": round(duration, 3),
        **summarize_results(results, duration, metrics=("ttft", "e2e"), qs=(50, 99)),
        "all_full_length": all(r.output_tokens == max_new_tokens for r in ok),
        **ms_stats("inter_block_ms", gaps, (50, 99), mean=False),
        "forwards_per_request": forwards / len(ok) if ok else None,
        "cached_tokens": sum(r.cached_tokens for r in ok),
    }


# ---- the whole run ---------------------------------------------------------------------------------------
async def bench(args: argparse.Namespace, base_url: str) -> tuple[list[dict], dict]:
    headers = auth_headers(args.api_key)
    params: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "ignore_eos": True, "mode": args.mode,
                              "temperature": args.temperature}
    async with http_client(max(args.concurrency), args.request_timeout) as client:
        info_resp = await client.get(f"{base_url}/get_server_info", headers=headers)
        info = info_resp.json() if info_resp.status_code == 200 else {}
        if args.warmup:
            warm = make_prompts(args.warmup, tuple(args.prompt_words), seed=args.seed - 1)
            # Not bound by --max-seconds (a first request may be slow while the server warms up).
            results, _ = await run_level(client, base_url, min(args.warmup, max(args.concurrency)), warm, params,
                                         headers, args.request_timeout, 0.0, desc="warm-up")
            bad = [r.error for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"the warm-up request failed: {bad[0]}")
        rows = []
        for level, c in enumerate(args.concurrency):
            n = args.num_requests if args.num_requests else max(8, min(4 * c, 256))
            if n < c:
                tqdm.write(f"note: {n} requests at concurrency {c}: at most {n} run at once")
            if args.flush_cache:
                with contextlib.suppress(httpx.HTTPError):
                    await client.post(f"{base_url}/flush_cache", headers=headers)
            # Distinct prompts per level (seed + level), so the radix cache cannot carry one level into the next.
            prompts = make_prompts(n, tuple(args.prompt_words), seed=args.seed + 1000 * (level + 1))
            results, duration = await run_level(client, base_url, c, prompts, params, headers,
                                                args.max_seconds, args.grace_seconds, desc=f"concurrency {c}")
            row = summarize(c, results, duration, args.max_new_tokens)
            row.update(mode=args.mode, max_new_tokens=args.max_new_tokens, model=info.get("model_name"))
            rows.append(row)
            tqdm.write(f"concurrency {c}: {row['completed']}/{row['requests']} done in {duration:.1f}s, "
                       f"{row['output_tok_per_s']:.1f} output tok/s")
    base = rows[0]["output_tok_per_s"] if rows else 0.0
    for r in rows:
        r["speedup_vs_base"] = r["output_tok_per_s"] / base if base else None
        r["base_concurrency"] = rows[0]["concurrency"]
    return rows, info


# ---- launching a server ------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def prepare_checkpoint(args: argparse.Namespace, workdir: Path) -> tuple[str | None, str | None]:
    """(model dir, load format) for --tiny / --small; (None, None) otherwise."""
    if args.tiny or args.small:
        from redraft.engine.model.tiny import make_tiny_checkpoint  # torch: only when we make a checkpoint

        if args.tiny:
            return str(make_tiny_checkpoint(workdir / "tiny", seed=0)), None
        from bench_offline import SMALL_CONFIG

        # Tiny tensors for the files (tokenizer + config); the real ~50M shapes come from dummy weights.
        return str(make_tiny_checkpoint(workdir / "small", seed=0, config_overrides=SMALL_CONFIG)), "dummy"
    return None, None


class LaunchedServer:
    """`redraft serve` as a child process on a free loopback port; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, args: argparse.Namespace, workdir: Path, env: dict[str, str] | None = None):
        model, load_format = prepare_checkpoint(args, workdir)
        model = args.model or model
        load_format = args.load_format or load_format
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "redraft", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if model:
            cmd += ["--model", model]
        if load_format:
            cmd += ["--load-format", load_format]
        if args.max_running_requests:
            cmd += ["--max-running-requests", str(args.max_running_requests)]
        cmd += shlex.split(args.server_args or "")
        self.cmd = cmd
        self.log_path = Path(args.server_log) if args.server_log else workdir / "server.log"
        self._log = open(self.log_path, "w")
        tqdm.write(f"launching: {shlex.join(cmd)}  (log: {self.log_path})")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with code {self.proc.returncode}:\n{self.log_tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.base_url}/health").status_code == 200:
                        return
                time.sleep(0.5)
        raise RuntimeError(f"the server was not healthy after {timeout:.0f}s:\n{self.log_tail()}")

    def log_tail(self, n: int = 30) -> str:
        self._log.flush()
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        return ""

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                tqdm.write("the server did not stop within 30s of SIGTERM: killing it")
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


# ---- output ------------------------------------------------------------------------------------------------
def print_table(rows: list[dict], info: dict, args: argparse.Namespace) -> None:
    base = rows[0]["concurrency"] if rows else 1
    print(f"\nserver: {info.get('model_name')} ({fmt(info.get('num_params', 0) / 1e6, '{:.1f}')}M params, "
          f"{info.get('dtype')} on {info.get('device')}, kernels {info.get('kernel_backend')}, "
          f"max_running_requests {info.get('max_running_requests')}); client: {platform.machine()}, "
          f"{os.cpu_count()} cores; mode {args.mode}, {args.max_new_tokens} new tokens per request (ignore_eos), "
          f"prompts {args.prompt_words[0]}-{args.prompt_words[1]} random words\n")
    print(f"| concurrency | done/sent | req/s | output tok/s | x c={base} | TTFT p50 ms | TTFT p99 ms "
          f"| E2E p50 ms | E2E p99 ms | tokens/forward |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['completed']}/{r['requests']} | {r['req_per_s']:.2f} "
              f"| {r['output_tok_per_s']:.1f} | {fmt(r['speedup_vs_base'], '{:.2f}x')} | {fmt(r['ttft_ms_p50'])} "
              f"| {fmt(r['ttft_ms_p99'])} | {fmt(r['e2e_ms_p50'])} | {fmt(r['e2e_ms_p99'])} "
              f"| {fmt(r['tokens_per_forward'], '{:.2f}')} |")
    for r in rows:
        print_errors(f"concurrency {r['concurrency']}", r["errors"])
        if r["completed"] and not r["all_full_length"]:
            print(f"concurrency {r['concurrency']}: some requests returned fewer than {args.max_new_tokens} tokens")


def plot(rows: list[dict], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False
    cs = [r["concurrency"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(cs, [r["output_tok_per_s"] for r in rows], "o-")
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    b.plot(cs, [r["ttft_ms_p50"] for r in rows], "o-", label="TTFT p50")
    b.plot(cs, [r["e2e_ms_p50"] for r in rows], "s-", label="E2E p50")
    b.set(xscale="log", xlabel="concurrency", ylabel="ms", title="latency")
    b.legend()
    save_figure(plt, fig, path, dpi=120)
    return True


# ---- command line --------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--base-url", default=None, help="a running server (default: http://127.0.0.1:30000)")
    where.add_argument("--launch", action="store_true", help="start `redraft serve` on a free port, stop it at the end")
    srv = ap.add_argument_group("with --launch")
    srv.add_argument("--model", default=None, help="checkpoint directory (default: the server's default model)")
    srv.add_argument("--load-format", default=None, choices=["auto", "safetensors", "dummy"])
    srv.add_argument("--max-running-requests", type=int, default=None)
    size = srv.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="serve a fresh tiny random checkpoint")
    size.add_argument("--small", action="store_true", help="serve a ~50M-parameter config with dummy weights")
    srv.add_argument("--server-args", default="", help='more `redraft serve` flags, e.g. "--device cuda"')
    srv.add_argument("--server-log", default=None, help="where the server's output goes (default: a temp file)")
    srv.add_argument("--startup-timeout", type=float, default=300.0)
    load = ap.add_argument_group("load")
    load.add_argument("--concurrency", nargs="+", type=int, default=[1, 8, 32, 64])
    load.add_argument("--num-requests", type=int, default=0,
                      help="requests per level (default: 4 x concurrency, at least 8, at most 256)")
    load.add_argument("--max-seconds", type=float, default=300.0, help="no new request after this long in a level")
    load.add_argument("--grace-seconds", type=float, default=120.0,
                      help="then cancel what is still running after this long")
    load.add_argument("--request-timeout", type=float, default=300.0, help="seconds to wait for a chunk")
    load.add_argument("--max-new-tokens", type=int, default=64)
    load.add_argument("--mode", default="S", choices=["S", "Q"])
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--prompt-words", nargs=2, type=int, default=[16, 48], metavar=("MIN", "MAX"))
    load.add_argument("--seed", type=int, default=1)
    load.add_argument("--warmup", type=int, default=1, help="unmeasured requests before the first level")
    load.add_argument("--no-flush-cache", dest="flush_cache", action="store_false",
                      help="do not POST /flush_cache before each level")
    load.add_argument("--api-key", default=os.environ.get("REDRAFT_API_KEY"))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of tokens/s and latency (needs matplotlib)")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if httpx is None:
        ap.error("bench_serving needs httpx: pip install httpx")
    if not args.launch and (args.tiny or args.small or args.model or args.load_format or args.max_running_requests
                            or args.server_args):
        ap.error("--model/--load-format/--max-running-requests/--tiny/--small/--server-args go with --launch")
    if any(c < 1 for c in args.concurrency) or args.max_new_tokens < 1 or args.prompt_words[0] < 1 \
            or args.prompt_words[0] > args.prompt_words[1]:
        ap.error("concurrency and --max-new-tokens must be >= 1, and 1 <= --prompt-words MIN <= MAX")

    server: LaunchedServer | None = None
    base_url = args.base_url or "the server"
    with tempfile.TemporaryDirectory(prefix="redraft-bench-") as tmp:
        try:
            if args.launch:
                server = LaunchedServer(args, Path(tmp))
                server.wait_healthy(args.startup_timeout)
                base_url = server.base_url
            else:
                base_url = (args.base_url or "http://127.0.0.1:30000").rstrip("/")
            rows, info = asyncio.run(bench(args, base_url))
        except KeyboardInterrupt:
            print("interrupted", file=sys.stderr)
            return 130
        except RuntimeError as exc:
            print(f"bench_serving: error: {exc}", file=sys.stderr)
            return 1
        except httpx.HTTPError as exc:
            print(f"bench_serving: error: {type(exc).__name__} talking to {base_url}: {exc}", file=sys.stderr)
            return 1
        finally:
            if server is not None:
                server.stop()
    print_table(rows, info, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    if args.plot:
        if plot(rows, args.plot):
            print(f"plot: {args.plot}")
        else:
            print("--plot: matplotlib is not installed, no plot drawn", file=sys.stderr)
    return 0 if all(r["failed"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
