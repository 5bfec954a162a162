"""Writes grafana/dashboards/redraft.json, the redraft dashboard, from the panel list below.

    python deploy/grafana/build_dashboard.py            # rewrite the JSON next to this file
    python deploy/grafana/build_dashboard.py --check    # exit 1 if the JSON is not what this script writes

Edit the panels here, not in the JSON: the JSON is generated (tests/test_deploy_files.py checks that the two
agree), and every PromQL expression in it is evaluated against a real Prometheus by
tests/test_metrics_prometheus.py. Expressions may use the dashboard variables $model_name and $instance and
Grafana's $__rate_interval.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent / "dashboards" / "redraft.json"
SEL = 'model_name=~"$model_name", instance=~"$instance"'
RATE = "[$__rate_interval]"
DS = {"type": "prometheus", "uid": "${datasource}"}


def rate(metric: str, by: str = "") -> str:
    grouping = f"sum by ({by}) " if by else "sum"
    return f"{grouping}(rate({metric}{{{SEL}}}{RATE}))"


def quantile(q: float, histogram: str, by: str = "") -> str:
    labels = f"le, {by}" if by else "le"
    return f"histogram_quantile({q}, sum by ({labels}) (rate({histogram}_bucket{{{SEL}}}{RATE})))"


def ratio(num: str, den: str, by: str) -> str:
    return f"{rate(num, by)} / {rate(den, by)}"


# (title, unit, description, [(expr, legend), ...], kind)
ROWS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]], str]]]] = [
    ("Throughput", [
        ("Output tokens/s per domain", "short",
         "Tokens of committed blocks per second (redraft:tokens_committed_total), by the request's domain.",
         [(rate("redraft:tokens_committed_total", "domain"), "{{domain}}")], "timeseries"),
        ("Output tokens/s per mode", "short",
         "Tokens of committed blocks per second, by decoding mode (S: speed preset, Q: quality preset).",
         [(rate("redraft:tokens_committed_total", "mode"), "{{mode}}")], "timeseries"),
        ("Requests/s per domain", "reqps", "Finished requests per second (sglang:num_requests_total).",
         [(rate("sglang:num_requests_total", "domain"), "{{domain}}"),
          (rate("sglang:num_aborted_requests_total"), "aborted (all domains)")], "timeseries"),
    ]),
    ("Diffusion decoding", [
        ("Tokens per forward per domain and mode", "short",
         "Generated tokens over the denoising forwards the requests took part in. Higher is faster.",
         [(ratio("sglang:generation_tokens_total", "redraft:forwards_total", "domain, mode"),
           "{{domain}} {{mode}}")], "timeseries"),
        ("Edits per block per domain and mode", "short",
         "Token-to-token edits (T2T) per committed block.",
         [(ratio("redraft:edits_total", "redraft:blocks_committed_total", "domain, mode"),
           "{{domain}} {{mode}}")], "timeseries"),
        ("Forwards per block", "short", "Denoising forwards a committed block took (redraft:block_steps).",
         [(quantile(0.5, "redraft:block_steps", "mode"), "p50 {{mode}}"),
          (quantile(0.99, "redraft:block_steps", "mode"), "p99 {{mode}}")], "timeseries"),
        ("Multi-block edits/s and window size", "short",
         "T2T edits landing in an earlier open block (redraft:mbe_edits_total) per mode and domain, and the "
         "median multi-block-editing window of finished requests (1 = the official single-block loop).",
         [(rate("redraft:mbe_edits_total", "domain, mode"), "edits/s {{domain}} {{mode}}"),
          (quantile(0.5, "redraft:mbe_window", "mode"), "window p50 {{mode}}")], "timeseries"),
        ("Structured output: grammar work per constrained request", "short",
         "Per finished constrained request (redraft:constrained_requests_total): tokens the grammar refused, "
         "positions it re-masked, and tokens it placed itself (forced text, closing runs).",
         [(ratio("redraft:grammar_rejected_tokens_total", "redraft:constrained_requests_total", ""), "rejected"),
          (ratio("redraft:grammar_remasked_positions_total", "redraft:constrained_requests_total", ""), "re-masked"),
          (ratio("redraft:grammar_forced_tokens_total", "redraft:constrained_requests_total", ""), "forced")],
         "timeseries"),
    ]),
    ("Latency", [
        ("Time to first token (first committed block)", "s",
         "From submission to the first committed block of a request.",
         [(quantile(0.5, "sglang:time_to_first_token_seconds"), "p50"),
          (quantile(0.99, "sglang:time_to_first_token_seconds"), "p99")], "timeseries"),
        ("End-to-end latency", "s", "From submission to the request's last block.",
         [(quantile(0.5, "sglang:e2e_request_latency_seconds"), "p50"),
          (quantile(0.99, "sglang:e2e_request_latency_seconds"), "p99")], "timeseries"),
        ("Time between committed blocks", "s", "Gap between two consecutive committed blocks of a request.",
         [(quantile(0.5, "redraft:inter_block_latency_seconds"), "p50"),
          (quantile(0.99, "redraft:inter_block_latency_seconds"), "p99")], "timeseries"),
        ("Queue time", "s", "Time requests waited for admission in the engine.",
         [(quantile(0.5, "sglang:queue_time_seconds"), "p50"),
          (quantile(0.99, "sglang:queue_time_seconds"), "p99")], "timeseries"),
    ]),
    ("Saturation", [
        ("Running and queued requests", "short", "Requests being decoded and waiting for admission.",
         [(f"sum(sglang:num_running_reqs{{{SEL}}})", "running"),
          (f"sum(sglang:num_queue_reqs{{{SEL}}})", "queued")], "timeseries"),
        ("KV cache usage", "percentunit",
         "Share of KV pages in use; the prefix cache's pages count too (they are evicted on demand).",
         [(f"avg(sglang:token_usage{{{SEL}}})", "in use (incl. prefix cache)"),
          (f"(sum(sglang:num_used_tokens{{{SEL}}}) - sum(redraft:cached_tokens{{{SEL}}})) "
           f"/ sum(sglang:max_total_num_tokens{{{SEL}}})", "held by requests only")], "timeseries"),
        ("Prefix-cache hit rate", "percentunit",
         "Engine's hit rate since start, and prompt tokens read from the cache over the window.",
         [(f"avg(sglang:cache_hit_rate{{{SEL}}})", "since start"),
          (ratio("sglang:cached_tokens_total", "sglang:prompt_tokens_total", ""), "over the window")],
         "timeseries"),
        ("Engine up", "none", "1 when the engine process answered the last scrape, 0 when not.",
         [(f"min(redraft:engine_up{{{SEL}}})", "engine up")], "stat"),
        ("Rejections, failures and preemptions", "short",
         "Requests refused at admission (by code), requests a failure inside the engine ended, and preemptions.",
         [(rate("redraft:rejected_requests_total", "code"), "rejected: {{code}}"),
          (rate("redraft:failed_requests_total"), "failed in the engine"),
          (f"sum(increase(redraft:num_preemptions{{{SEL}}}{RATE}))", "preemptions")], "timeseries"),
    ]),
]


def _panel(pid: int, title: str, unit: str, desc: str, targets: list[tuple[str, str]], kind: str,
           x: int, y: int, w: int, h: int) -> dict:
    panel: dict = {
        "id": pid,
        "type": kind,
        "title": title,
        "description": desc,
        "datasource": DS,
        "gridPos": {"h": h, "w": w, "x": x, "y": y},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": DS, "expr": expr, "legendFormat": legend,
             "editorMode": "code", "range": True}
            for i, (expr, legend) in enumerate(targets)
        ],
    }
    if kind == "timeseries":
        panel["options"] = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                            "tooltip": {"mode": "multi", "sort": "desc"}}
        panel["fieldConfig"]["defaults"]["custom"] = {"drawStyle": "line", "lineWidth": 1, "fillOpacity": 10,
                                                      "showPoints": "never", "spanNulls": True}
    else:
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "background", "graphMode": "none"}
        panel["fieldConfig"]["defaults"]["thresholds"] = {
            "mode": "absolute", "steps": [{"color": "red", "value": None}, {"color": "green", "value": 1}]}
        panel["fieldConfig"]["defaults"]["mappings"] = [
            {"type": "value", "options": {"0": {"text": "DOWN"}, "1": {"text": "UP"}}}]
    return panel


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2, "includeAll": True, "multi": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "sort": 1,
    }


def build() -> dict:
    panels: list[dict] = []
    pid, y = 1, 0
    for row_title, row in ROWS:
        panels.append({"id": pid, "type": "row", "title": row_title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        per_line = 3 if len(row) % 3 == 0 or len(row) > 4 else 2
        w, h = 24 // per_line, 8
        for i, spec in enumerate(row):
            x = (i % per_line) * w
            if i and i % per_line == 0:
                y += h
            panels.append(_panel(pid, *spec, x=x, y=y, w=w, h=h))
            pid += 1
        y += h
    return {
        "uid": "redraft-overview",
        "title": "redraft",
        "description": "redraft (LLaDA2.x block-diffusion serving): throughput per domain and mode, diffusion "
                       "efficiency, latency and saturation. Generated by deploy/grafana/build_dashboard.py.",
        "tags": ["redraft", "llm", "diffusion"],
        "timezone": "browser",
        "editable": True,
        "graphTooltip": 1,
        "refresh": "10s",
        "schemaVersion": 39,
        "version": 1,
        "time": {"from": "now-1h", "to": "now"},
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": ""},
            _variable("model_name", "model", "label_values(sglang:num_running_reqs, model_name)"),
            _variable("instance", "instance",
                      'label_values(sglang:num_running_reqs{model_name=~"$model_name"}, instance)'),
        ]},
        "panels": panels,
    }


def render() -> str:
    return json.dumps(build(), indent=2) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="only compare with the file on disk")
    args = ap.parse_args(argv)
    text = render()
    if args.check:
        if not OUT.is_file() or OUT.read_text() != text:
            print(f"{OUT} is out of date: run python {Path(__file__).name}", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
