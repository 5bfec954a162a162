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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from redraft.clients.sse import StreamError, sse_events

try:
    import httpx
except ImportError:  # pragma: no cover - httpx comes with the dev extra
    httpx = None  # type: ignore[assignment]

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education river garden window market forest"
).split()
PERCENTILES = (50, 90, 99)
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
            body = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 24)))
        pad = rng.randint(*prefix_words)
        if pad:
            body = "Context: " + " ".join(rng.choice(_WORDS) for _ in range(pad)) + ".\n\n" + body
        out.append(Prompt(domain, body, rng.randint(*output_len)))
    return out


# ---- one request ------------------------------------------------------------------------------------------
@dataclass
class Result:
    domain: str
    mode: str
    ok: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float | None = None
    latency: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # seconds from start, each content chunk
    output_tokens: int = 0
    prompt_tokens: int = 0
    forwards: int | None = None  # redraft only: denoising forwards of this request


async def one_request(client: "httpx.AsyncClient", url: str, body: dict, headers: dict, domain: str,
                      mode: str) -> Result:
    res = Result(domain, mode, start=time.perf_counter())
    usage, diffusion, finished, chunks = None, None, False, 0
    try:
        async for event in sse_events(client, url, body, headers):
            now = time.perf_counter() - res.start
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    res.chunk_times.append(now)
                    if res.ttft is None:
                        res.ttft = now
                if choice.get("finish_reason"):
                    finished = True
            if event.get("usage"):
                usage = event["usage"]
                diffusion = event.get("diffusion") or diffusion
    except StreamError as exc:
        res.error = str(exc)
        return res
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - res.start
    if not finished:
        res.error = "the stream ended without a finish_reason"
        return res
    if usage:
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    else:  # a server that ignores stream_options: one token per content chunk is the best guess
        res.output_tokens = chunks
    if diffusion and diffusion.get("forwards"):
        res.forwards = int(diffusion["forwards"])
    res.ok = True
    return res


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

    def _send(self, i: int, prompt: Prompt) -> "asyncio.Future[Result]":
        mode = self.mode_of(i)
        return asyncio.ensure_future(one_request(self.client, self.url, self.body(prompt, mode), self.headers,
                                                 prompt.domain, mode))

    async def run(self, level: Level, prompts: list[Prompt]) -> tuple[list[Result], float]:
        t0 = time.perf_counter()
        stop_at = t0 + self.args.max_seconds
        tasks: list[tuple[int, asyncio.Future]] = []  # (prompt index, its request) in sending order
        if level.kind == "concurrency":
            next_idx = 0

            async def worker() -> None:
                nonlocal next_idx
                while next_idx < len(prompts) and time.perf_counter() < stop_at:
                    i = next_idx
                    next_idx += 1
                    task = self._send(i, prompts[i])
                    tasks.append((i, task))
                    await task

            workers = [asyncio.ensure_future(worker()) for _ in range(int(level.value))]
            await asyncio.wait(workers, timeout=self.args.max_seconds + self.args.grace_seconds)
            for w in workers:
                w.cancel()
        else:
            rng = random.Random(self.args.seed + 7)
            limit = asyncio.Semaphore(self.args.max_concurrency) if self.args.max_concurrency else None

            async def limited(i: int) -> Result:
                async with limit:  # type: ignore[union-attr]
                    return await self._send(i, prompts[i])

            next_at = t0
            for i in range(len(prompts)):
                next_at += rng.expovariate(level.value)  # Poisson process: exponential gaps
                if next_at >= stop_at:
                    break
                await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
                tasks.append((i, asyncio.ensure_future(limited(i)) if limit else self._send(i, prompts[i])))
            if tasks:
                await asyncio.wait([t for _, t in tasks],
                                   timeout=max(0.0, stop_at + self.args.grace_seconds - time.perf_counter()))
        duration = time.perf_counter() - t0
        results = []
        for i, task in tasks:
            if task.done() and not task.cancelled() and task.exception() is None:
                results.append(task.result())
            else:  # still running past the grace period: counted as failed, in its own domain and mode
                task.cancel()
                results.append(Result(prompts[i].domain, self.mode_of(i),
                                      error="cancelled (past --max-seconds + --grace-seconds)"))
        for _, task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        return results, duration


# ---- statistics -------------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default), without numpy."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = lambda v: None if v is None else round(v * 1000.0, 2)  # noqa: E731
    out_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.latency for r in ok if r.latency is not None]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.latency is not None and r.ttft is not None and r.output_tokens > 1]
    with_forwards = [r for r in ok if r.forwards]
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    row: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "output_tokens": out_tokens,
        "input_tokens": sum(r.prompt_tokens for r in ok),
        "output_tok_per_s": round(out_tokens / duration, 3) if duration > 0 else 0.0,
        "req_per_s": round(len(ok) / duration, 4) if duration > 0 else 0.0,
    }
    for name, values in (("ttft_ms", ttft), ("tpot_ms", tpot), ("e2e_ms", e2e)):
        row[f"{name}_mean"] = ms(sum(values) / len(values)) if values else None
        for q in PERCENTILES:
            row[f"{name}_p{q}"] = ms(percentile(values, q))
    row["tokens_per_forward"] = (round(sum(r.output_tokens for r in with_forwards)
                                       / sum(r.forwards for r in with_forwards), 4) if with_forwards else None)
    row["errors"] = errors
    return row


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
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    levels = ([Level("concurrency", c) for c in args.concurrency] if args.concurrency
              else [Level("request_rate", r) for r in args.request_rate])
    most = max(int(lv.value) if lv.kind == "concurrency" else (args.max_concurrency or 64) for lv in levels)
    limits = httpx.Limits(max_connections=most + 8, max_keepalive_connections=most + 8)
    timeout = httpx.Timeout(args.request_timeout, connect=10.0)
    # trust_env=False: the benchmark's traffic never goes through a proxy from the environment.
    async with httpx.AsyncClient(base_url=base_url, limits=limits, timeout=timeout, trust_env=False) as client:
        model, is_redraft, info = await detect(client, base_url, headers, args)
        runner = Runner(args, client, base_url, model, is_redraft, headers)
        if args.warmup:
            warm = make_prompts(args.domains, args.warmup, args.seed - 1, (0, 0), (16, 16))
            results = await asyncio.gather(*[runner._send(i, p) for i, p in enumerate(warm)])
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
                  f"{o['output_tok_per_s']:.1f} output tok/s, TTFT p50 {_f(o['ttft_ms_p50'])} ms, "
                  f"E2E p50 {_f(o['e2e_ms_p50'])} ms", file=sys.stderr)
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
def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def print_table(report: dict) -> None:
    print(f"\n{report['model']} at {report['base_url']} ({report['server_kind']})")
    print("| load | domain | mode | done/sent | output tok/s | TTFT p50/p99 ms | TPOT p50/p99 ms "
          "| E2E p50/p90/p99 ms | tokens/forward |")
    print("|---|---|---|---|---|---|---|---|---|")
    for lv in report["levels"]:
        for g in [{"domain": "all", "mode": "all", **lv["overall"]}, *lv["groups"]]:
            print(f"| {lv['label']} | {g['domain']} | {g['mode']} | {g['completed']}/{g['requests']} "
                  f"| {g['output_tok_per_s']:.1f} | {_f(g['ttft_ms_p50'])} / {_f(g['ttft_ms_p99'])} "
                  f"| {_f(g['tpot_ms_p50'], '{:.2f}')} / {_f(g['tpot_ms_p99'], '{:.2f}')} "
                  f"| {_f(g['e2e_ms_p50'])} / {_f(g['e2e_ms_p90'])} / {_f(g['e2e_ms_p99'])} "
                  f"| {_f(g['tokens_per_forward'], '{:.2f}')} |")
    for lv in report["levels"]:
        for err, count in lv["overall"]["errors"].items():
            print(f"{lv['label']}: {count} failed: {err}")


def plot(report: dict, path: Path) -> bool:
    """Four panels over the load levels; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
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
