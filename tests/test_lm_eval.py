"""lm-evaluation-harness end to end: `lm_eval --model local-completions` runs the repository's multiple-choice
task (evals/lm_eval/redraft_demo_mc) against a live `redraft serve` on the bundled demo model, over loopback with
the Hugging Face hub switched off, and scores far above chance (4 choices: 25%)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer
from optional_tools import need_module

need_module("lm_eval")

pytestmark = pytest.mark.slow

TASK_DIR = Path(__file__).resolve().parents[1] / "evals" / "lm_eval" / "redraft_demo_mc"
LIMIT = 20  # problems (families interleaved: 4 of each), 4 loglikelihood requests each
CHANCE = 0.25


def _task_copy(dst: Path) -> Path:
    """The task with data_files made absolute (the shipped YAML is relative to the repository root)."""
    shutil.copytree(TASK_DIR, dst)
    yaml = dst / "redraft_demo_mc.yaml"
    text = yaml.read_text()
    assert "test: evals/lm_eval/redraft_demo_mc/demo_mc.jsonl" in text
    yaml.write_text(text.replace("test: evals/lm_eval/redraft_demo_mc/demo_mc.jsonl", f"test: {dst / 'demo_mc.jsonl'}"))
    return dst.parent


def test_lm_eval_multiple_choice_against_a_live_server(tmp_path: Path) -> None:
    srv = RedraftServer(None, tmp_path, [])
    srv.start()
    try:
        include = _task_copy(tmp_path / "tasks" / "redraft_demo_mc")
        env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp_path / "hf"), "NO_PROXY": "127.0.0.1", "TOKENIZERS_PARALLELISM": "false"}
        cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--include_path", str(include),
               "--tasks", "redraft_demo_mc", "--limit", str(LIMIT), "--output_path", str(tmp_path / "out"),
               "--model_args", f"base_url={srv.url}/v1/completions,model=demo_model,tokenizer_backend=remote,"
                               "num_concurrent=1,max_retries=1"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
        assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}\nserver:\n{srv.log_tail()}"
        results = sorted((tmp_path / "out").rglob("results_*.json"))
        assert results, done.stdout[-2000:]
        task = json.loads(results[-1].read_text())["results"]["redraft_demo_mc"]
        acc = task["acc,none"]
        print(f"lm-eval redraft_demo_mc --limit {LIMIT}: acc {acc:.3f} (chance {CHANCE})")
        assert acc >= 0.75, task
        metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
        served = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("sglang:num_requests_total"))
        # the scores came from this server: 4 requests per problem, less the (context, choice) pairs lm-eval finds
        # twice and sends once
        assert served >= 3 * LIMIT, (served, [m for m in metrics.splitlines() if "num_requests" in m])
        assert "Traceback" not in srv.log_tail(), srv.log_tail()
    finally:
        srv.stop()
