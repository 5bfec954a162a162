"""Prometheus metrics, named as SGLang names them so its dashboards work unchanged.

Gauges mirror the engine's scheduler (refreshed from the engine on every scrape); counters are advanced
by the HTTP process when a request finishes.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from redraft.scheduler.messages import RequestOutput

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "Requests being decoded.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "Requests waiting for admission.")
        self.num_used_tokens = gauge("sglang:num_used_tokens", "KV cache tokens in use (requests and prefix cache).")
        self.token_usage = gauge("sglang:token_usage", "Fraction of the KV cache in use.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "Prefix cache hit rate (matched / looked-up prompt tokens).")
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens of finished requests.")
        self.num_requests = counter("sglang:num_requests", "Finished requests.")
        self.forwards = counter("redraft:forwards", "Denoising forwards spent on finished requests.")
        self.edits = counter("redraft:edits", "Token-to-token edits in finished requests.")

    def set_engine_stats(self, stats: dict[str, Any]) -> None:
        m = self.model_name
        self.num_running_reqs.labels(m).set(stats.get("num_running_reqs", 0))
        self.num_queue_reqs.labels(m).set(stats.get("num_queue_reqs", 0))
        self.num_used_tokens.labels(m).set(stats.get("num_used_tokens", 0))
        self.token_usage.labels(m).set(stats.get("token_usage", 0.0))
        self.cache_hit_rate.labels(m).set(stats.get("cache_hit_rate", 0.0))

    def on_finished(self, out: RequestOutput) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(out.meta.get("prompt_tokens", 0))
        self.generation_tokens.labels(m).inc(out.meta.get("completion_tokens", 0))
        self.forwards.labels(m).inc(out.meta.get("steps", 0))
        self.edits.labels(m).inc(out.meta.get("edits", 0))
        self.num_requests.labels(m).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
