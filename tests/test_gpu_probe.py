"""scripts/gpu_probe.sh, the next GPU session's one call, as far as a CPU can check it: it parses, its phases fit
eight minutes, and the commands it runs take the arguments it gives them (their CPU dry runs)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from bench_scripts import bench_module

REPO = Path(__file__).resolve().parents[1]
PROBE = REPO / "scripts" / "gpu_probe.sh"
PHASES = ["setup", "info", "kernels", "step-uniform", "step-model", "moe-sweep", "attention", "fp8"]


def test_probe_parses_and_fits_eight_minutes(tmp_path):
    assert subprocess.run(["bash", "-n", str(PROBE)]).returncode == 0
    out = subprocess.run(["bash", str(PROBE), "--dry-run"], capture_output=True, text=True, cwd=REPO,
                         env={"OUT": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=30).stdout
    lines = [line.split() for line in out.splitlines() if line and not line.startswith((" ", "p =", "d =", "total"))]
    assert [w[0] for w in lines if w[0] in PHASES] == PHASES
    total = int(out.split("total limit ")[1].split("s")[0])
    assert total <= 480, total
    assert not list(tmp_path.glob("*.json"))  # a dry run runs nothing


def test_probe_arguments_parse():
    step = bench_module("bench_gpu_step").parse_args
    a = step(["--skip-prefill", "--profile", "--iters", "20", "--warmup", "3", "--routing", "model", "--block", "mask",
              "--batches", "1", "--skip-attention"])
    assert (a.routing, a.block, a.batches, a.profile, a.skip_attention) == ("model", "mask", [1], True, True)
    a = step(["--skip-steps", "--attn-contexts", "1024,8192", "--batches", "1,8,64"])
    assert a.skip_steps and a.attn_contexts == [1024, 8192]
    moe = bench_module("bench_moe").parse_args(["--tokens", "32", "--methods", "auto"])
    assert moe.routing == "uniform" and moe.block == "random"


@pytest.mark.kernels
def test_moe_config_sweep_dry_run(tmp_path):
    """The sweep's flow on CPU (tiny shape, one candidate per token count): a table keyed by token count."""
    import json

    sweep = bench_module("moe_config_sweep")
    out = tmp_path / "sweep.json"
    assert sweep.main(["--dry-run", "--formats", "bf16", "--out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["table"]["bf16"]) == {"32", "64"}
    assert all(r["ok"] for r in res["results"])


@pytest.mark.kernels
def test_sweep_short_list_starts_at_the_seeds():
    """Each cell of the probe's short sweep times the seed configuration first, so the table it writes is never worse
    than the seeds on that device; the 16-row cells include an unswapped tile (swap-AB's A/B)."""
    sweep = bench_module("moe_config_sweep")
    from redraft.kernels import moe_triton as mt

    for fmt in ("bf16", "fp8"):
        for t in (32, 64, 128, 512, 2048):
            seeds = mt.SEED_CONFIGS[fmt]
            seed = seeds[max(k for k in seeds if k <= t)]
            cands = sweep.candidates(fmt, t)
            assert cands[0] == seed, (fmt, t)
            assert len(cands) <= 4
        assert any(c.get("SWAP") is False and c["BLOCK_M"] == 16 for c in sweep.candidates(fmt, 32))
