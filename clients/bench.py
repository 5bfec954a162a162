"""`redraft bench`: load-test any OpenAI-compatible server (redraft, vLLM, SGLang, ...) through streaming
/v1/chat/completions, and report latency and throughput per domain and mode, as JSON and a PNG.

    redraft bench --base-url http://127.0.0.1:30000 --concurrency 1 8 --num-requests 64 --json out.json --plot out.png
    redraft bench --base-url http://127.0.0.1:8000 --request-rate 2 8 --max-seconds 120 --model meta-llama/Llama-3.1-8B

Load: `--concurrency C...` (closed loop: C requests in flight at all times) or `--request-rate R...` (open
loop: Poisson arrivals, R requests/s on average, optionally capped by `--max-concurrency`). Each value is one
level; a level ends when `--num-requests` have been sent or `--max-seconds` have passed (then requests still
running after `--grace-seconds` are cancelled and counted as failed).

Prompts: one set per domain (`--domains code,math,chat`). With redraft's demo task suite available
(`redraft.training.tasks`), a domain that names a task family (math, reverse, sort, code, chat) draws held-out
problems of that family; other domains get random English words. `--prefix-words MIN MAX` prepends that many
random words (random prompt lengths) and `--output-len MIN MAX` draws each request's max_tokens (random output
lengths). Requests cycle through domains and `--modes` so every (domain, mode) pair gets its share.

Reported per level, for all requests and per (domain, mode): TTFT (first streamed content; for a diffusion
model the first committed block), TPOT (time per output token after the first: (e2e - TTFT) / (tokens - 1)),
end-to-end latency (p50/p90/p99), output tokens/s and requests/s over the level, and tokens per forward when
the server reports it (redraft's `diffusion` object in the usage chunk).

Servers: with `--server-kind auto` (default) a server whose /v1/models says owned_by "redraft" gets the redraft
request fields (`mode`, `domain`); any other server gets plain OpenAI requests (the domain is still used to
group results; its mode is reported as "-"). `--extra-body JSON` adds fields to every request.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redraft.clients.loadgen import (CANCELLED, ChatStream, Result, auth_headers, closed_loop, collect, fmt,
                                     http_client, open_loop, print_errors, pyplot, random_words, save_figure,
                                     summarize, timed_request)

try:
    import httpx
except ImportError:  # pragma: no cover - httpx comes with the dev extra
    httpx = None  # type: ignore[assignment]

NO_MODE = "-"


# ---- prompts ----------------------------------------------------------------------------------------------
@dataclass
class Prompt:
    domain: str
    text: str
    max_tokens: int


def _task_prompts(family: str, n: int, seed: int) -> list[str] | None:
    """Held-out problems of a demo task family, or None when the task suite is not available."""
    try:
        from redraft.training.tasks import FAMILIES, TaskGenerator
    except ImportError:
        return None
    if family not in FAMILIES:
        return None
    gen = TaskGenerator(seed, split="eval", weights={family: 1.0})
    return [ex.user for ex in gen.batch(n)]


def make_prompts(domains: list[str], n: int, seed: int, prefix_words: tuple[int, int],
                 output_len: tuple[int, int]) -> list[Prompt]:
    """`n` prompts, domains in turn, reproducible from `seed`."""
    rng = random.Random(seed)
    per_domain = {d: _task_prompts(d, math.ceil(n / len(domains)), seed + i) for i, d in enumerate(domains)}
    out = []
    for i in range(n):
        domain = domains[i % len(domains)]
        tasks = per_domain[domain]
        if tasks:
            body = tasks[i // len(domains)]
        else:
            body = random_words(rng, rng.randint(8, 24))
        pad = rng.randint(*prefix_words)
        if pad:
            body = "Context: " + random_words(rng, pad) + ".\n\n" + body
        out.append(Prompt(domain, body, rng.randint(*output_len)))
    return out


# ---- one load level ---------------------------------------------------------------------------------------
@dataclass
class Level:
    kind: str  # "concurrency" | "request_rate"
    value: float

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.kind == "concurrency" else f"{self.value:g} req/s"


class Runner:
    def __init__(self, args: argparse.Namespace, client: "httpx.AsyncClient", base_url: str, model: str,
                 redraft: bool, headers: dict):
        self.args, self.client, self.model, self.redraft, self.headers = args, client, model, redraft, headers
        self.url = f"{base_url}/v1/chat/completions"
        self.modes = list(args.modes) if redraft else [NO_MODE]

    def body(self, prompt: Prompt, mode: str) -> dict:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt.text}],
            "max_tokens": prompt.max_tokens,
            "temperature": self.args.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.args.ignore_eos:
            body["ignore_eos"] = True
        if self.redraft:
            body["mode"] = mode
            body["domain"] = prompt.domain
        body.update(self.args.extra_body)
        return body

    def mode_of(self, i: int) -> str:
        """Request i's mode: every domain gets each mode in turn."""
        return self.modes[(i // len(self.args.domains)) % len(self.modes)]

    async def send(self, i: int, prompt: Prompt) -> Result:
        mode = self.mode_of(i)
        return await timed_request(self.client, self.url, self.body(prompt, mode), self.headers, ChatStream(),
                                   prompt.domain, mode)

    async def run(self, level: Level, prompts: list[Prompt]) -> tuple[list[Result], float]:
        args = self.args
        t0 = time.perf_counter()
        if level.kind == "concurrency":
            sent = await closed_loop(lambda i: self.send(i, prompts[i]), len(prompts), int(level.value),
                                     args.max_seconds, args.grace_seconds)
        else:
            sent = await open_loop(lambda i: self.send(i, prompts[i]), len(prompts), level.value,
                                   args.max_concurrency, args.max_seconds, args.grace_seconds, args.seed + 7)
        duration = time.perf_counter() - t0
        # A request still running past the grace period fails in its own domain and mode.
        results = await collect(sent, lambda i: Result(prompts[i].domain, self.mode_of(i), error=CANCELLED))
        return results, duration


# ---- statistics -------------------------------------------------------------------------------------------
def summarize_level(level: Level, results: list[Result], duration: float) -> dict:
    groups = sorted({(r.domain, r.mode) for r in results})
    return {
        "load": {level.kind: level.value},
        "label": level.label,
        "duration_s": round(duration, 3),
        "overall": summarize(results, duration),
        "groups": [{"domain": d, "mode": m, **summarize([r for r in results if (r.domain, r.mode) == (d, m)],
                                                        duration)} for d, m in groups],
    }


# ---- the run ----------------------------------------------------------------------------------------------
async def detect(client: "httpx.AsyncClient", base_url: str, headers: dict, args: argparse.Namespace
                 ) -> tuple[str, bool, dict]:
    """(model name, is redraft, server info) from /v1/models (and redraft's /get_server_info)."""
    r = await client.get(f"{base_url}/v1/models", headers=headers)
    if r.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {r.status_code}: {r.text[:200]}")
    models = r.json().get("data") or []
    if not models and not args.model:
        raise RuntimeError("the server lists no model; name one with --model")
    model = args.model or models[0]["id"]
    owner = next((m.get("owned_by") for m in models if m.get("id") == model), None)
    is_redraft = args.server_kind == "redraft" or (args.server_kind == "auto" and owner == "redraft")
    info: dict = {"owned_by": owner}
    if is_redraft:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            resp = await client.get(f"{base_url}/get_server_info", headers=headers)
            if resp.status_code == 200:
                keep = ("model_name", "device", "dtype", "kernel_backend", "num_params", "max_running_requests",
                        "default_mode", "block_size")
                info.update({k: v for k, v in resp.json().items() if k in keep})
    return model, is_redraft, info


async def bench(args: argparse.Namespace) -> dict:
    base_url = args.base_url.rstrip("/")
    if base_url.endswith("/v1"):  # an OpenAI SDK habit; the routes are appended here
        print(f"bench: --base-url {base_url} ends with /v1: using {base_url[:-3]} (the server's root)",
              file=sys.stderr)
        base_url = base_url[:-3]
    headers = auth_headers(args.api_key)
    levels = ([Level("concurrency", c) for c in args.concurrency] if args.concurrency
              else [Level("request_rate", r) for r in args.request_rate])
    most = max(int(lv.value) if lv.kind == "concurrency" else (args.max_concurrency or 64) for lv in levels)
    async with http_client(most, args.request_timeout) as client:
        model, is_redraft, info = await detect(client, base_url, headers, args)
        runner = Runner(args, client, base_url, model, is_redraft, headers)
        if args.warmup:
            warm = make_prompts(args.domains, args.warmup, args.seed - 1, (0, 0), (16, 16))
            results = await asyncio.gather(*[runner.send(i, p) for i, p in enumerate(warm)])
            bad = [r.error for r in results if not r.ok]
            if bad:
                raise RuntimeError(f"the warm-up failed: {bad[0]}")
        out_levels = []
        for n, level in enumerate(levels):
            prompts = make_prompts(args.domains, args.num_requests, args.seed + 1000 * (n + 1),
                                   tuple(args.prefix_words), tuple(args.output_len))
            results, duration = await runner.run(level, prompts)
            row = summarize_level(level, results, duration)
            out_levels.append(row)
            o = row["overall"]
            print(f"{level.label}: {o['completed']}/{o['requests']} done in {duration:.1f}s, "
                  f"{o['output_tok_per_s']:.1f} output tok/s, TTFT p50 {fmt(o['ttft_ms_p50'])} ms, "
                  f"E2E p50 {fmt(o['e2e_ms_p50'])} ms", file=sys.stderr)
    return {
        "base_url": base_url,
        "model": model,
        "server_kind": "redraft" if is_redraft else "openai",
        "server": info,
        "client": {"machine": platform.machine(), "cpus": os.cpu_count()},
        "config": {
            "domains": args.domains, "modes": runner.modes, "num_requests": args.num_requests,
            "max_seconds": args.max_seconds, "output_len": list(args.output_len),
            "prefix_words": list(args.prefix_words), "temperature": args.temperature,
            "ignore_eos": args.ignore_eos, "seed": args.seed, "max_concurrency": args.max_concurrency,
        },
        "levels": out_levels,
    }


# ---- output -----------------------------------------------------------------------------------------------
def print_table(report: dict) -> None:
    print(f"\n{report['model']} at {report['base_url']} ({report['server_kind']})")
    print("| load | domain | mode | done/sent | output tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
          "| E2E p50/p90/p99 ms | tokens/forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lv in report["levels"]:
        for g in [{"domain": "all", "mode": "all", **lv["overall"]}, *lv["groups"]]:
            print(f"| {lv['label']} | {g['domain']} | {g['mode']} | {g['completed']}/{g['requests']} "
                  f"| {g['output_tok_per_s']:.1f} | {fmt(g['ttft_ms_p50'])} / {fmt(g['ttft_ms_p99'])} "
                  f"| {fmt(g['tpot_ms_p50'], '{:.2f}')} / {fmt(g['tpot_ms_p99'], '{:.2f}')} "
                  f"| {fmt(g['e2e_ms_p50'])} / {fmt(g['e2e_ms_p90'])} / {fmt(g['e2e_ms_p99'])} "
                  f"| {fmt(g['tokens_per_forward'], '{:.2f}')} |")
    for lv in report["levels"]:
        print_errors(lv["label"], lv["overall"]["errors"])


def plot(report: dict, path: Path) -> bool:
    """Four panels over the load levels; False when matplotlib is not installed."""
    plt = pyplot()
    if plt is None:
        return False
    levels = report["levels"]
    xs = list(range(len(levels)))
    names = [lv["label"] for lv in levels]
    groups = sorted({(g["domain"], g["mode"]) for lv in levels for g in lv["groups"]})

    def group_series(key: str) -> dict[tuple[str, str], list]:
        out = {}
        for dm in groups:
            row = []
            for lv in levels:
                g = next((g for g in lv["groups"] if (g["domain"], g["mode"]) == dm), None)
                row.append(g[key] if g else None)
            out[dm] = row
        return out

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    (tput, ttft), (e2e, tpf) = axes
    for (d, m), ys in group_series("output_tok_per_s").items():
        tput.plot(xs, [y if y is not None else float("nan") for y in ys], "o-", label=f"{d} {m}")
    tput.plot(xs, [lv["overall"]["output_tok_per_s"] for lv in levels], "k--", lw=2, label="all")
    tput.set(title="output tokens/s", ylabel="tokens/s")
    for key, style in (("ttft_ms_p50", "o-"), ("ttft_ms_p99", "s--")):
        ttft.plot(xs, [lv["overall"][key] for lv in levels], style, label=key.replace("ttft_ms_", "TTFT "))
    ttft.set(title="time to first token (first block)", ylabel="ms")
    for key, style in (("e2e_ms_p50", "o-"), ("e2e_ms_p90", "^-"), ("e2e_ms_p99", "s--")):
        e2e.plot(xs, [lv["overall"][key] for lv in levels], style, label=key.replace("e2e_ms_", "E2E "))
    e2e.set(title="end-to-end latency", ylabel="ms")
    drew = False
    for (d, m), ys in group_series("tokens_per_forward").items():
        if any(y is not None for y in ys):
            tpf.plot(xs, [y if y is not None else float("nan") for y in ys], "o-", label=f"{d} {m}")
            drew = True
    tpf.set(title="tokens per forward" if drew else "tokens per forward (not reported by this server)")
    for ax in axes.flat:
        ax.set_xticks(xs, names)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.suptitle(f"redraft bench: {report['model']} ({report['server_kind']})")
    save_figure(plt, fig, path, dpi=110)
    return True


# ---- command line -----------------------------------------------------------------------------------------
def add_bench_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    ap.add_argument("--model", default=None, help="model name to request (default: the first of /v1/models)")
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("REDRAFT_API_KEY"),
                    help="the server's key (default: $OPENAI_API_KEY, else $REDRAFT_API_KEY)")
    ap.add_argument("--server-kind", default="auto", choices=["auto", "redraft", "openai"],
                    help="redraft: send mode/domain fields; openai: plain requests; auto: ask /v1/models")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--concurrency", nargs="+", type=int, default=None, help="closed-loop levels (default: 1 8)")
    load.add_argument("--request-rate", nargs="+", type=float, default=None, help="Poisson arrival rates, req/s")
    ap.add_argument("--max-concurrency", type=int, default=0, help="with --request-rate: at most this many in flight")
    ap.add_argument("--num-requests", type=int, default=64, help="requests per level (default: %(default)s)")
    ap.add_argument("--max-seconds", type=float, default=120.0, help="no new request after this long in a level")
    ap.add_argument("--grace-seconds", type=float, default=60.0, help="then cancel what still runs after this long")
    ap.add_argument("--request-timeout", type=float, default=300.0, help="seconds to wait for the next chunk")
    ap.add_argument("--domains", default="code,math,chat", help="prompt sets, comma-separated (default: %(default)s)")
    ap.add_argument("--modes", nargs="+", default=["S", "Q"], choices=["S", "Q", "auto"],
                    help="redraft modes to cycle through (default: S Q)")
    ap.add_argument("--output-len", nargs=2, type=int, default=[32, 128], metavar=("MIN", "MAX"),
                    help="max_tokens drawn per request (default: 32 128)")
    ap.add_argument("--prefix-words", nargs=2, type=int, default=[0, 32], metavar=("MIN", "MAX"),
                    help="random words before each prompt (default: 0 32)")
    ap.add_argument("--temperature", type=float, default=0.0, help="of every request (default: %(default)s)")
    ap.add_argument("--ignore-eos", action="store_true", help="ask for exactly max_tokens (redraft, vLLM, SGLang)")
    ap.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request")
    ap.add_argument("--seed", type=int, default=1, help="seed of the prompts and lengths drawn (default: %(default)s)")
    ap.add_argument("--warmup", type=int, default=2, help="unmeasured requests first (default: %(default)s)")
    ap.add_argument("--json", type=Path, default=None, help="write the report here")
    ap.add_argument("--plot", type=Path, default=None, help="draw a PNG here (needs matplotlib)")


def run_cli(args: argparse.Namespace) -> int:
    def fail(msg: str) -> int:
        print(f"redraft bench: error: {msg}", file=sys.stderr)
        return 2

    if httpx is None:
        return fail("needs httpx: pip install httpx")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request otherwise
    if isinstance(args.domains, str):
        args.domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    if not args.domains:
        return fail("--domains names no domain")
    if not args.concurrency and not args.request_rate:
        args.concurrency = [1, 8]
    if any(c < 1 for c in args.concurrency or []) or any(r <= 0 for r in args.request_rate or []):
        return fail("concurrency levels must be >= 1 and request rates > 0")
    if args.num_requests < 1 or args.max_seconds <= 0:
        return fail("--num-requests must be >= 1 and --max-seconds > 0")
    if not 1 <= args.output_len[0] <= args.output_len[1] or not 0 <= args.prefix_words[0] <= args.prefix_words[1]:
        return fail("need 1 <= --output-len MIN <= MAX and 0 <= --prefix-words MIN <= MAX")
    if not isinstance(args.extra_body, dict):
        return fail("--extra-body must be a JSON object")
    try:
        report = asyncio.run(bench(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:
        return fail(str(exc))
    except httpx.HTTPError as exc:
        return fail(f"{type(exc).__name__} talking to {args.base_url}: {exc}")
    print_table(report)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"json: {args.json}")
    if args.plot:
        if plot(report, args.plot):
            print(f"plot: {args.plot}")
        else:
            print("--plot: matplotlib is not installed (pip install matplotlib), no plot drawn", file=sys.stderr)
    return 0 if all(lv["overall"]["failed"] == 0 for lv in report["levels"]) else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="redraft bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_bench_args(ap)
    return run_cli(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
