"""Prometheus metrics on /metrics, named as SGLang names them (so its dashboards work unchanged), plus
redraft's own for diffusion decoding.

Engine-wide gauges (label `model_name`) mirror the scheduler and are refreshed from the engine on every
scrape. Per-request metrics carry `model_name`, `mode` (the resolved preset, S or Q) and `domain` (the
request's `domain`, kept only if it is one of the configured domains, else "other", so that a client cannot
grow the label set). They are recorded in the HTTP process from the engine's messages:

    submitted      -> start of the request's clock (TTFT and end-to-end latency are measured from here)
    first block    -> sglang:time_to_first_token_seconds (a diffusion model streams whole committed blocks)
    each block     -> redraft:tokens_committed_total, redraft:inter_block_latency_seconds,
                      sglang:inter_token_latency_seconds (the block's gap spread over its tokens, as SGLang
                      does for a chunk of several tokens), redraft:block_steps (forwards the block took)
    finished       -> token/request counters, forwards, edits, blocks, tokens per forward, end-to-end latency,
                      queue time (the engine reports when it admitted the request)

Several HTTP workers: set PROMETHEUS_MULTIPROC_DIR to an empty directory before the server starts (every
worker then writes its values there and any worker's /metrics merges them), and call
`mark_process_dead(pid)` when a worker exits; see docs/observability.md. The collector code below works
either way: gauges declare how workers' values merge, and `render` switches to the multiprocess collector
when the variable is set.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from redraft.protocol.errors import INVALID_REQUEST
from redraft.protocol.messages import Accepted, Rejected, RequestOutput
from redraft.protocol.server_args import DEFAULT_DOMAINS

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST", "DEFAULT_DOMAINS", "OTHER_DOMAIN", "parse_domains"]

log = logging.getLogger("redraft.metrics")

# No `*_created` series (SGLang exposes none either; they double every counter's series for little use).
disable_created_metrics()

OTHER_DOMAIN = "other"
MODES: tuple[str, ...] = ("S", "Q")
ENGINE_LABELS = ("model_name",)
REQUEST_LABELS = ("model_name", "mode", "domain")
MAX_TRACKED = 100_000  # requests in flight we keep timing state for (a dead engine must not leak memory)

# Buckets: a block of 32 tokens takes one to a few dozen forwards; CPU demo models are slow, GPUs fast.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BLOCK_GAP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
BLOCK_STEPS_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
REQUEST_FORWARDS_BUCKETS = (1, 4, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
TPF_BUCKETS = (0.25, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0, 24.0, 32.0)
MBE_WINDOW_BUCKETS = (1, 2, 3, 4, 5, 6, 7, 8)  # every window size a request can ask for (mbe_window 1..8)


def parse_domains(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """`code,math,chat` -> ("code", "math", "chat"): lower-cased, stripped, de-duplicated, in order."""
    if spec is None:
        return DEFAULT_DOMAINS
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    out: list[str] = []
    for item in items:
        d = str(item).strip().lower()
        if not d:
            continue
        if d == OTHER_DOMAIN:
            raise ValueError(f"{OTHER_DOMAIN!r} is what unlisted domains are counted as; it cannot be listed")
        if not all(c.isalnum() or c in "-_." for c in d) or len(d) > 64:
            raise ValueError(f"domain {d!r}: use letters, digits, '-', '_' or '.', at most 64 characters")
        if d not in out:
            out.append(d)
    return tuple(out)


@dataclass
class _Track:
    """Timing state of one request in flight."""

    labels: tuple[str, str, str]  # model_name, mode, domain
    start: float  # monotonic, when it was sent to the engine
    last: float | None = None  # monotonic, when its latest block arrived
    tokens: int = 0  # output tokens seen so far
    steps: int = 0  # forwards reported so far
    blocks: int = 0  # blocks reported so far


class ServerMetrics:
    def __init__(self, model_name: str, domains: Iterable[str] | str | None = None):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.domains = parse_domains(domains)
        self._domain_set = frozenset(self.domains)
        self._client: Any = None
        self._inflight: dict[str, _Track] = {}
        self._callback_errors = 0
        self._declare_engine_gauges()
        self._declare_request_counters()
        self._declare_histograms()
        self._zero_series()

    # ---- the metrics -----------------------------------------------------------------------------------
    def _gauge(self, name: str, doc: str) -> Gauge:
        # One engine behind every worker: the most recent value of a live worker is the truth.
        return Gauge(name, doc, ENGINE_LABELS, registry=self.registry, multiprocess_mode="livemostrecent")

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = REQUEST_LABELS) -> Counter:
        return Counter(name, doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        return Histogram(name, doc, REQUEST_LABELS, registry=self.registry, buckets=buckets)

    def _declare_engine_gauges(self) -> None:
        gauge = self._gauge
        # ---- SGLang's names ----
        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests being decoded.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting for admission.")
        self.num_used_tokens = gauge("sglang:num_used_tokens",
                                     "KV cache tokens in use (requests and prefix cache).")
        self.token_usage = gauge("sglang:token_usage", "Fraction of the KV cache in use.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate",
                                    "Prefix cache hit rate (matched / looked-up prompt tokens).")
        self.max_total_num_tokens = gauge("sglang:max_total_num_tokens", "KV cache capacity in tokens.")
        # ---- redraft's ----
        self.engine_up = gauge("redraft:engine_up",
                               "1 when the engine process answered the last scrape's ping, else 0.")
        self.cached_tokens = gauge("redraft:cached_tokens", "Tokens held by the prefix cache (whole blocks).")
        self.num_preemptions = gauge("redraft:num_preemptions",
                                     "Requests preempted since the engine started (monotonic).")
        self.max_running_requests = gauge("redraft:max_running_requests", "The engine's limit on running requests.")
        self.max_queued_requests = gauge("redraft:max_queued_requests",
                                         "The engine's limit on waiting requests (0: unlimited).")

    def _declare_request_counters(self) -> None:
        counter = self._counter
        # ---- SGLang's names ----
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens of finished requests.")
        self.cached_prompt_tokens = counter("sglang:cached_tokens",
                                            "Prompt tokens of finished requests read from the prefix cache.")
        self.num_requests = counter("sglang:num_requests", "Finished requests (aborted and failed ones included).")
        self.num_aborted = counter("sglang:num_aborted_requests", "Requests that ended by abort or client disconnect.")
        self.num_failed = counter("redraft:failed_requests", "Requests that a failure inside the engine ended "
                                  "(finish_reason error; the engine log has the request id and the reason).")
        # ---- redraft's ----
        self.forwards = counter("redraft:forwards", "Denoising forwards of finished requests "
                                                    "(a batched forward counts once per request in it).")
        self.tokens_committed = counter("redraft:tokens_committed",
                                        "Output tokens of committed blocks, counted as each block is committed.")
        self.blocks_committed = counter("redraft:blocks_committed",
                                        "Blocks committed (final), counted when the request finishes.")
        self.edits = counter("redraft:edits", "Token-to-token edits (T2T) of finished requests.")
        self.mbe_edits = counter("redraft:mbe_edits", "T2T edits of finished requests that landed in an open block "
                                 "before the active one (multi-block editing).")
        # structured output (engine/decoding/constrained.py), from finished constrained requests
        self.constrained = counter("redraft:constrained_requests", "Finished requests whose output a grammar "
                                   "constrained (json_schema, regex, ebnf, lark, forced tool calls).")
        self.grammar_rejected = counter("redraft:grammar_rejected_tokens", "Tokens the model placed that the "
                                        "grammar refused (they took an allowed candidate or were re-masked).")
        self.grammar_remasked = counter("redraft:grammar_remasked_positions", "Positions the grammar put back to "
                                        "MASK for a later forward.")
        self.grammar_forced = counter("redraft:grammar_forced_tokens", "Tokens the grammar placed itself "
                                      "(fast-forward of forced text, closing runs).")
        # LLaDA2.2's Levenshtein step (docs/llada22.md): DELETEs (op="delete") and SPLITs (op="insert") applied
        self.structural_edits = counter("redraft:structural_edits", "Structural edits of finished requests "
                                        "(LLaDA2.2's Levenshtein step): op=delete removed a position, op=insert "
                                        "inserted a mask.", (*REQUEST_LABELS, "op"))
        self.rejected = counter("redraft:rejected_requests", "Requests the engine refused at admission, by code.",
                                ("model_name", "code"))

    def _declare_histograms(self) -> None:
        histogram = self._histogram
        self.ttft = histogram("sglang:time_to_first_token_seconds",
                              "Time to the first committed block, from the request's submission.", TTFT_BUCKETS)
        self.itl = histogram("sglang:inter_token_latency_seconds",
                             "Time between committed blocks divided by the block's tokens (per token).", ITL_BUCKETS)
        self.inter_block = histogram("redraft:inter_block_latency_seconds",
                                     "Time between two committed blocks of a request.", BLOCK_GAP_BUCKETS)
        self.e2e = histogram("sglang:e2e_request_latency_seconds",
                             "End-to-end latency of a request, from submission to its last block.", E2E_BUCKETS)
        self.queue_time = histogram("sglang:queue_time_seconds",
                                    "Time a request waited in the engine's queue before admission.", QUEUE_BUCKETS)
        self.block_steps = histogram("redraft:block_steps", "Denoising forwards a committed block took.",
                                     BLOCK_STEPS_BUCKETS)
        self.mbe_window = histogram("redraft:mbe_window", "Multi-block-editing window (open blocks) of finished "
                                    "requests; 1 = the official single-block loop.", MBE_WINDOW_BUCKETS)
        self.request_forwards = histogram("redraft:request_forwards", "Denoising forwards a finished request took.",
                                          REQUEST_FORWARDS_BUCKETS)
        self.tokens_per_forward = histogram("redraft:tokens_per_forward",
                                            "Output tokens per forward of a finished request.", TPF_BUCKETS)

    def _zero_series(self) -> None:
        # Zero series for every (mode, domain) from the start: a series that first appears with its first
        # request already counted would be lost to rate() and histogram_quantile(). Bounded: the label values
        # are the configured domains + "other" times the two modes.
        for mode in MODES:
            for domain in (*self.domains, OTHER_DOMAIN):
                for metric in (self.prompt_tokens, self.generation_tokens, self.cached_prompt_tokens,
                               self.num_requests, self.num_aborted, self.num_failed, self.forwards,
                               self.tokens_committed, self.blocks_committed, self.edits, self.mbe_edits,
                               self.mbe_window, self.ttft, self.itl,
                               self.constrained, self.grammar_rejected, self.grammar_remasked, self.grammar_forced,
                               self.inter_block, self.e2e, self.queue_time, self.block_steps, self.tokens_per_forward,
                               self.request_forwards):
                    metric.labels(self.model_name, mode, domain)
                for op in ("delete", "insert"):
                    self.structural_edits.labels(self.model_name, mode, domain, op)
        for code in ("queue_full", INVALID_REQUEST):  # the engine's admission refusals
            self.rejected.labels(self.model_name, code)

    # ---- wiring --------------------------------------------------------------------------------------
    def attach(self, client: Any) -> None:
        """Follow an EngineClient: its submissions and every message the engine sends back."""
        self._client = client
        client.on_submit.append(self.on_submit)
        client.on_message.append(self.on_message)
        if hasattr(client, "on_down"):
            client.on_down.append(self.set_engine_down)

    def domain_label(self, domain: str | None) -> str:
        d = (domain or "").strip().lower()
        return d if d in self._domain_set else OTHER_DOMAIN

    def _labels(self, mode: str, domain: str | None) -> tuple[str, str, str]:
        return self.model_name, mode if mode in MODES else "Q", self.domain_label(domain)

    # ---- events --------------------------------------------------------------------------------------
    def on_submit(self, rid: str, params: Any) -> None:
        try:
            if len(self._inflight) >= MAX_TRACKED:  # requests that never finished (a dead engine): oldest first
                for stale in list(self._inflight)[: MAX_TRACKED // 10]:
                    del self._inflight[stale]
            # the mode is the engine's to resolve: the labels are final once it accepts (Accepted.mode)
            self._inflight[rid] = _Track(self._labels(params.mode or "Q", params.domain), time.monotonic())
        except Exception:  # noqa: BLE001 - metrics must never break serving
            self._callback_failed()

    def on_message(self, msg: Any) -> None:
        try:
            if isinstance(msg, RequestOutput):
                self._on_output(msg)
            elif isinstance(msg, Rejected):
                self._inflight.pop(msg.rid, None)
                self.rejected.labels(self.model_name, msg.code or "unknown").inc()
            elif isinstance(msg, Accepted):
                track = self._inflight.get(msg.rid)
                if track is not None:
                    track.labels = (track.labels[0], msg.mode if msg.mode in MODES else "Q", track.labels[2])
        except Exception:  # noqa: BLE001
            self._callback_failed()

    def _callback_failed(self) -> None:
        self._callback_errors += 1
        if self._callback_errors <= 3:
            log.exception("recording a metric failed (serving goes on)")

    def _on_output(self, out: RequestOutput) -> None:
        track = self._inflight.get(out.rid)
        if track is None:  # not submitted through this process (or forgotten): nothing to time against
            return
        now = time.monotonic()
        labels = track.labels
        new_tokens = len(out.new_ids)
        tokens = track.tokens + new_tokens
        steps = int(out.meta.get("steps", track.steps))
        blocks = int(out.meta.get("blocks", track.blocks))
        new_blocks = max(blocks - track.blocks, 0)
        committed = new_blocks > 0 or new_tokens > 0
        if committed:
            if track.last is None:
                self.ttft.labels(*labels).observe(now - track.start)
            else:
                gap = now - track.last
                self.inter_block.labels(*labels).observe(gap)
                if new_tokens:
                    per_token = gap / new_tokens
                    itl = self.itl.labels(*labels)
                    for _ in range(new_tokens):
                        itl.observe(per_token)
            track.last = now
            if new_tokens:
                self.tokens_committed.labels(*labels).inc(new_tokens)
            if new_blocks:  # forwards since the previous commit, shared by the blocks committed since
                per_block = max(steps - track.steps, 0) / new_blocks
                hist = self.block_steps.labels(*labels)
                for _ in range(new_blocks):
                    hist.observe(per_block)
        track.tokens, track.steps, track.blocks = max(tokens, track.tokens), steps, blocks
        if out.finished:
            self._inflight.pop(out.rid, None)
            self._on_finished(out, track, now)

    def _on_finished(self, out: RequestOutput, track: _Track, now: float) -> None:
        labels, meta = track.labels, out.meta
        completion = int(meta.get("completion_tokens", track.tokens))
        steps = int(meta.get("steps", 0))
        self.prompt_tokens.labels(*labels).inc(int(meta.get("prompt_tokens", 0)))
        self.generation_tokens.labels(*labels).inc(completion)
        self.cached_prompt_tokens.labels(*labels).inc(int(meta.get("cached_tokens", 0)))
        self.forwards.labels(*labels).inc(steps)
        self.edits.labels(*labels).inc(int(meta.get("edits", 0)))
        self.mbe_edits.labels(*labels).inc(int(meta.get("mbe_edits", 0)))
        self.structural_edits.labels(*labels, "delete").inc(int(meta.get("deletions", 0)))
        self.structural_edits.labels(*labels, "insert").inc(int(meta.get("insertions", 0)))
        if meta.get("mbe_window"):
            self.mbe_window.labels(*labels).observe(int(meta["mbe_window"]))
        grammar = meta.get("grammar")
        if isinstance(grammar, dict):
            self.constrained.labels(*labels).inc()
            self.grammar_rejected.labels(*labels).inc(int(grammar.get("rejected", 0)))
            self.grammar_remasked.labels(*labels).inc(int(grammar.get("remasked", 0)))
            self.grammar_forced.labels(*labels).inc(int(grammar.get("forced", 0)))
        self.blocks_committed.labels(*labels).inc(int(meta.get("blocks", 0)))
        self.num_requests.labels(*labels).inc()
        finish = (out.finish_reason or {}).get("type")
        if finish == "abort":
            self.num_aborted.labels(*labels).inc()
        elif finish == "error":
            self.num_failed.labels(*labels).inc()
        self.request_forwards.labels(*labels).observe(steps)
        if steps and completion:
            self.tokens_per_forward.labels(*labels).observe(completion / steps)
        if finish not in ("abort", "error"):  # (a latency only for requests that ran to their end)
            self.e2e.labels(*labels).observe(now - track.start)
        queue_time = meta.get("queue_time")
        if queue_time is not None:
            self.queue_time.labels(*labels).observe(max(float(queue_time), 0.0))

    # ---- engine gauges -------------------------------------------------------------------------------
    def set_engine_stats(self, stats: dict[str, Any], info: dict[str, Any] | None = None) -> None:
        m = self.model_name
        self.engine_up.labels(m).set(1)
        self.num_running_reqs.labels(m).set(stats.get("num_running_reqs", 0))
        self.num_queue_reqs.labels(m).set(stats.get("num_queue_reqs", 0))
        self.num_used_tokens.labels(m).set(stats.get("num_used_tokens", 0))
        self.token_usage.labels(m).set(stats.get("token_usage", 0.0))
        self.cache_hit_rate.labels(m).set(stats.get("cache_hit_rate", 0.0))
        self.cached_tokens.labels(m).set(stats.get("cached_tokens", 0))
        self.num_preemptions.labels(m).set(stats.get("num_preemptions", 0))
        info = info or {}
        total = stats.get("max_total_tokens", info.get("max_total_tokens"))
        if total is not None:
            self.max_total_num_tokens.labels(m).set(total)
        if info.get("max_running_requests") is not None:
            self.max_running_requests.labels(m).set(info["max_running_requests"])
        self.max_queued_requests.labels(m).set(info.get("max_queued_requests") or 0)

    def set_engine_down(self) -> None:
        """The engine is gone: nothing runs, nothing waits, no page is in use (no stale values while it is
        down; the next scrape after a restart reads the new engine's)."""
        m = self.model_name
        self.engine_up.labels(m).set(0)
        for gauge in (self.num_running_reqs, self.num_queue_reqs, self.num_used_tokens, self.token_usage,
                      self.cached_tokens):
            gauge.labels(m).set(0)

    # ---- exposition ----------------------------------------------------------------------------------
    def render(self) -> bytes:
        if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            from prometheus_client import multiprocess

            merged = CollectorRegistry()
            multiprocess.MultiProcessCollector(merged)
            return generate_latest(merged)
        return generate_latest(self.registry)
