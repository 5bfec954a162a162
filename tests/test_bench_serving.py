"""The serving benchmark end to end: it launches a tiny server, drives it at two concurrencies, stops it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("httpx")

from bench_scripts import bench_module, bench_script  # noqa: E402

from redraft.clients.loadgen import percentile  # noqa: E402

bench_serving = bench_module("bench_serving")
make_prompts = bench_serving.make_prompts

ROW_FIELDS = {
    "concurrency", "requests", "completed", "failed", "duration_s", "req_per_s", "output_tokens", "output_tok_per_s",
    "speedup_vs_base", "ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p50", "e2e_ms_p99", "tokens_per_forward",
    "all_full_length", "errors", "mode", "max_new_tokens",
}


def test_percentile_and_prompts():
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    a, b = make_prompts(5, (4, 9), seed=7), make_prompts(5, (4, 9), seed=7)
    assert a == b and len(set(a)) == 5
    assert all(4 <= len(p.split()) <= 9 for p in a)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_launch_tiny_two_levels(tmp_path):
    out = tmp_path / "rows.json"
    cmd = [sys.executable, bench_script("bench_serving"), "--launch", "--tiny", "--concurrency", "1", "4",
           "--num-requests", "8", "--max-new-tokens", "32", "--max-seconds", "120", "--json", str(out)]
    # One torch thread in the server: on a small shared CPU, spinning intra-op threads make the tiny model crawl.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert "| concurrency |" in res.stdout
    rows = json.loads(out.read_text())
    assert [r["concurrency"] for r in rows] == [1, 4]
    for r in rows:
        assert ROW_FIELDS <= r.keys()
        assert r["requests"] == r["completed"] == 8 and r["failed"] == 0 and r["errors"] == {}
        assert r["output_tokens"] == r["completed"] * 32 and r["all_full_length"]
        assert r["output_tok_per_s"] > 0 and r["tokens_per_forward"] > 0
        assert 0 < r["ttft_ms_p50"] <= r["e2e_ms_p50"] and r["ttft_ms_p50"] <= r["ttft_ms_p99"]
    assert rows[0]["speedup_vs_base"] == pytest.approx(1.0)
