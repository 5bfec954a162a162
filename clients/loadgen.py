"""The load-generation core that `redraft bench` (clients/bench.py, OpenAI chat) and
benchmarks/bench_serving.py (redraft's native /generate) share: random-word prompts, one streamed request timed
(the route's event shape is a `StreamReader`), the closed- and open-loop level runners, percentiles and the
per-level summary, and the small output helpers. Each tool keeps its own command line, request bodies, table
and JSON layout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from redraft.clients.sse import StreamError, sse_events

try:
    import httpx
except ImportError:  # pragma: no cover - httpx comes with the dev extra
    httpx = None  # type: ignore[assignment]

# Ordinary English words: prompts tokenize to plain tokens under any BPE tokenizer, specials never appear.
WORDS = tuple((
    "the a of and to in is it that for on with as was at by be this from or an are not but have one all were "
    "when we there can what your which their said if will each about how up out them then she many some so these "
    "would other into has more her two like him see time could no make than first been its who now people my made "
    "over did down only way find use may water long little very after words called just where most know get "
    "through back much before go good new write our used me man too any day same right look think also around "
    "another came come work three word must because does part even place well such here take why things help put "
    "years different away again off went old number great tell men say small every found still between name "
    "should home big give air line set own under read last never us left end along while might next sound below "
    "saw something thought both few those always looked show large often together asked house world going want "
    "school important until form food keep children feet land side without boy once animals life enough took "
    "sometimes four head above kind began almost live page got earth need far hand high year mother light parts "
    "country father let night following picture being study second eyes soon times story boys since white days "
    "ever paper hard near sentence better best across during today others sure means knew try told young miles "
    "sun ways thing whole hear example heard several change answer room sea against top turned learn point city "
    "play toward five using himself usually river garden machine teacher window market forest question tower"
).split())
PERCENTILES = (50, 90, 99)
CANCELLED = "cancelled (past --max-seconds + --grace-seconds)"


def random_words(rng: random.Random, count: int) -> str:
    """`count` words drawn from WORDS (the caller draws the count, so each tool keeps its own RNG sequence)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


# ---- one request ------------------------------------------------------------------------------------------
@dataclass
class Result:
    """One request as the client saw it; `domain` and `mode` group it in the report (bench_serving: one group)."""

    domain: str = ""
    mode: str = ""
    ok: bool = False
    error: str = ""
    start: float = 0.0  # perf_counter at send
    ttft: float | None = None  # seconds to the first event carrying output (a diffusion model: the first block)
    latency: float | None = None  # seconds to the end of the stream
    chunk_times: list[float] = field(default_factory=list)  # seconds from start, each event carrying output
    output_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    forwards: int | None = None  # redraft only: the denoising forwards this request took part in


class StreamReader(Protocol):
    """How one route's events read: which carry output, and what the stream said once it ended."""

    def see(self, event: dict) -> bool:
        """Take in one event; True when it carries output (its arrival is timed)."""
        ...

    def close(self, res: Result) -> str:
        """Fill res's counts from the events seen; an error message when the request did not finish, else ""."""
        ...


class ChatStream:
    """OpenAI streaming chat completions with stream_options.include_usage (redraft adds `diffusion`)."""

    def __init__(self) -> None:
        self.usage: dict | None = None
        self.diffusion: dict | None = None
        self.finished = False
        self.chunks = 0

    def see(self, event: dict) -> bool:
        content = False
        for choice in event.get("choices") or []:
            content = content or bool((choice.get("delta") or {}).get("content"))
            self.finished = self.finished or bool(choice.get("finish_reason"))
        if event.get("usage"):
            self.usage = event["usage"]
            self.diffusion = event.get("diffusion") or self.diffusion
        self.chunks += int(content)
        return content

    def close(self, res: Result) -> str:
        if not self.finished:
            return "the stream ended without a finish_reason"
        if self.usage:
            res.output_tokens = int(self.usage.get("completion_tokens") or 0)
            res.prompt_tokens = int(self.usage.get("prompt_tokens") or 0)
        else:  # a server that ignores stream_options: one token per content chunk is the best guess
            res.output_tokens = self.chunks
        if self.diffusion and self.diffusion.get("forwards"):
            res.forwards = int(self.diffusion["forwards"])
        return ""


class GenerateStream:
    """redraft's native /generate: cumulative output_ids per committed block, the figures in meta_info."""

    def __init__(self) -> None:
        self.last: dict | None = None

    def see(self, event: dict) -> bool:
        self.last = event
        return bool(event.get("output_ids"))

    def close(self, res: Result) -> str:
        if self.last is None:
            return "the stream ended without a chunk"
        meta = self.last.get("meta_info") or {}
        if meta.get("finish_reason") is None:
            return "the stream ended before the request finished"
        res.output_tokens = int(meta.get("completion_tokens", len(self.last.get("output_ids", []))))
        res.prompt_tokens = int(meta.get("prompt_tokens", 0))
        res.cached_tokens = int(meta.get("cached_tokens", 0))
        res.forwards = int(meta["steps"]) if meta.get("steps") else None
        return ""


async def timed_request(client: "httpx.AsyncClient", url: str, body: dict, headers: dict, reader: StreamReader,
                        domain: str = "", mode: str = "") -> Result:
    """POST one streaming request and time it: TTFT, each output event, the end; never raises for a bad answer."""
    res = Result(domain, mode, start=time.perf_counter())
    try:
        async for event in sse_events(client, url, body, headers):
            now = time.perf_counter() - res.start
            if reader.see(event):
                res.chunk_times.append(now)
                if res.ttft is None:
                    res.ttft = now
    except StreamError as exc:
        res.error = str(exc)
        return res
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.latency = time.perf_counter() - res.start
    res.error = reader.close(res)
    res.ok = not res.error
    return res


def http_client(max_in_flight: int, request_timeout: float) -> "httpx.AsyncClient":
    """A pooled client with room for every request of a level; `request_timeout` bounds the wait per chunk."""
    limits = httpx.Limits(max_connections=max_in_flight + 8, max_keepalive_connections=max_in_flight + 8)
    # trust_env=False: the benchmark's traffic never goes through a proxy from the environment.
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(request_timeout, connect=10.0), trust_env=False)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# ---- one load level ---------------------------------------------------------------------------------------
Send = Callable[[int], Awaitable[Result]]  # send request i (the index into the level's prompts)
Sent = list[tuple[int, "asyncio.Future[Result]"]]  # (request index, its task) in sending order


async def closed_loop(send: Send, n: int, concurrency: int, max_seconds: float, grace_seconds: float) -> Sent:
    """`concurrency` workers, one request in flight each, until `n` are sent or `max_seconds` pass; the workers
    (and the requests they wait on) are cancelled `grace_seconds` after that."""
    stop_at = time.perf_counter() + max_seconds
    sent: Sent = []

    async def worker() -> None:
        while len(sent) < n and time.perf_counter() < stop_at:
            i = len(sent)
            task = asyncio.ensure_future(send(i))
            sent.append((i, task))  # listed before it runs: a request cut at the deadline still counts as sent
            await task

    workers = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    await asyncio.wait(workers, timeout=max_seconds + grace_seconds)
    for w in workers:
        w.cancel()
    for w in workers:  # a worker ends with its request's error, which collect() raises
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await w
    return sent


async def open_loop(send: Send, n: int, rate: float, max_concurrency: int, max_seconds: float,
                    grace_seconds: float, seed: int) -> Sent:
    """Poisson arrivals at `rate` requests/s (at most `max_concurrency` in flight when > 0), until `n` are sent
    or `max_seconds` pass; then waits up to `grace_seconds` for the requests still running."""
    t0 = time.perf_counter()
    stop_at = t0 + max_seconds
    rng = random.Random(seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def limited(i: int) -> Result:
        async with limit:  # type: ignore[union-attr]
            return await send(i)

    sent: Sent = []
    next_at = t0
    for i in range(n):
        next_at += rng.expovariate(rate)  # Poisson process: exponential gaps
        if next_at >= stop_at:
            break
        await asyncio.sleep(max(0.0, next_at - time.perf_counter()))
        sent.append((i, asyncio.ensure_future(limited(i) if limit else send(i))))
    if sent:
        await asyncio.wait([t for _, t in sent], timeout=max(0.0, stop_at + grace_seconds - time.perf_counter()))
    return sent


async def collect(sent: Sent, cancelled: Callable[[int], Result]) -> list[Result]:
    """Every sent request's Result, in sending order; one still running is cancelled and `cancelled(i)` stands
    for it (a failure of its own group). A request that raised is a bug of the client: it is raised, not hidden."""
    done = [task.done() and not task.cancelled() for _, task in sent]
    for (_, task), finished in zip(sent, done):
        if not finished:
            task.cancel()
    for _, task in sent:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
    return [task.result() if finished else cancelled(i) for (i, task), finished in zip(sent, done)]


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


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 2)


def ms_stats(name: str, values: list[float], qs: tuple[int, ...], mean: bool = True) -> dict[str, float | None]:
    """`{name}_mean` (optional) and `{name}_p{q}` of `values` (seconds), in milliseconds."""
    row: dict[str, float | None] = {}
    if mean:
        row[f"{name}_mean"] = _ms(sum(values) / len(values)) if values else None
    for q in qs:
        row[f"{name}_p{q}"] = _ms(percentile(values, q))
    return row


def latencies(ok: list[Result]) -> dict[str, list[float]]:
    """Per-request seconds: TTFT, TPOT ((e2e - TTFT) / (tokens - 1)), end to end."""
    return {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok
                 if r.latency is not None and r.ttft is not None and r.output_tokens > 1],
        "e2e": [r.latency for r in ok if r.latency is not None],
    }


def summarize(results: list[Result], duration: float, metrics: tuple[str, ...] = ("ttft", "tpot", "e2e"),
              qs: tuple[int, ...] = PERCENTILES) -> dict[str, Any]:
    """Counts, rates, `{metric}_ms_*` and tokens per forward of one group of results over `duration` seconds."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
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
    values = latencies(ok)
    for name in metrics:
        row.update(ms_stats(f"{name}_ms", values[name], qs))
    # Only requests whose forwards the server reported: a plain OpenAI server leaves this None.
    with_forwards = [r for r in ok if r.forwards]
    row["tokens_per_forward"] = (round(sum(r.output_tokens for r in with_forwards)
                                       / sum(r.forwards for r in with_forwards), 4) if with_forwards else None)
    row["errors"] = errors
    return row


# ---- output -----------------------------------------------------------------------------------------------
def fmt(v: Any, spec: str = "{:.1f}") -> str:
    """A table cell: `-` for a figure that is missing."""
    return "-" if v is None else spec.format(v)


def print_errors(label: str, errors: dict[str, int]) -> None:
    for err, count in errors.items():
        print(f"{label}: {count} failed: {err}")


def pyplot() -> Any | None:
    """matplotlib.pyplot on the file-only Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt: Any, fig: Any, path: Any, dpi: int) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
