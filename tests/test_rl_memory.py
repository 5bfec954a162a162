"""/release_memory_occupation and /resume_memory_occupation on a live server (docs/rl.md): the engine reports the
memory freed, answers exactly as before after a round trip (a prompt cached before the release recomputed),
refuses a release while a request runs, holds requests sent while released until resume, and runs SGLang's RL
flow: release(all) -> resume(weights) -> update_weights_from_disk or _from_distributed -> resume(kv_cache) gives
the new checkpoint's tokens; under tensor parallelism every rank frees and re-takes its share."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer
from rl_support import PROMPTS, SP, Streamed, Trainer, fresh_ids, tensor_specs

pytestmark = pytest.mark.slow
TAGS = ["cuda_graph", "kv_cache", "weights"]


@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint) -> dict[str, Path]:
    return {"A": tiny_checkpoint(seed=0), "B": tiny_checkpoint(seed=1), "C": tiny_checkpoint(seed=2)}


def _ids(c: httpx.Client) -> tuple[list[list[int]], list[dict]]:
    r = c.post("/generate", json={"input_ids": PROMPTS, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [x["output_ids"] for x in r.json()], [x["meta_info"] for x in r.json()]


def _memory(c: httpx.Client, op: str, body: dict | None = None) -> dict:
    r = c.post(f"/{op}_memory_occupation", json=body if body is not None else {})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    return r.json()


def _refusal(r: httpx.Response) -> dict:
    """SGLang's {"success": false, "message"} and, as every refusal here, OpenAI's `error`: a 400."""
    body = r.json()
    assert r.status_code == 400 and body["success"] is False, r.text
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"] == body["message"]
    return body["error"]


def _rss(pid: int) -> int:
    """A process's resident set, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def _round_trip(c: httpx.Client, want: list[list[int]], engine_pid: int) -> None:
    """Release everything (the engine says what it freed, and its process really shrinks), resume everything, the
    same answers."""
    resident = c.get("/server_info").json()["memory_resident_bytes"]
    assert resident["weights"] > 0 and resident["kv_cache"] > 0, resident
    before = _rss(engine_pid)
    out = _memory(c, "release")
    assert out["released"] == TAGS and out["resident_bytes"] == dict.fromkeys(resident, 0), out
    freed = before - _rss(engine_pid)  # (the KV cache, hundreds of MiB, is given back to the OS on CPU too)
    assert freed > 0.9 * resident["kv_cache"], (freed, resident)
    info = c.get("/server_info").json()
    assert info["memory_released"] == TAGS and set(info["memory_resident_bytes"].values()) == {0}
    _memory(c, "release", {"tags": ["kv_cache"]})  # released already: harmless
    out = _memory(c, "resume")
    assert out["released"] == [] and out["resident_bytes"] == resident, out
    ids, meta = _ids(c)
    assert ids == want and meta[0]["cached_tokens"] == 0  # cached before the release: recomputed


def _rl_flow(c: httpx.Client, b: Path, want_b: list[list[int]]) -> None:
    """SGLang's RL order, with a request sent while everything is released: it waits, then runs on B."""
    _memory(c, "release")
    waiting = ThreadPoolExecutor(1).submit(c.post, "/generate", json={"input_ids": PROMPTS[0], "sampling_params": SP})
    r = c.post("/update_weights_from_disk", json={"model_path": str(b), "weight_version": "b"})
    assert r.status_code == 400 and "resume them first" in r.json()["message"], r.text
    _memory(c, "resume", {"tags": ["weights"]})
    time.sleep(1.0)
    assert not waiting.done(), "a request sent while the KV cache is released must wait for resume"
    r = c.post("/update_weights_from_disk", json={"model_path": str(b), "weight_version": "b"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    _memory(c, "resume", {"tags": ["kv_cache"]})  # cuda_graph stays released: the step runs eagerly
    late = waiting.result(120).json()
    assert late["output_ids"] == want_b[0] and late["meta_info"]["weight_version"] == "b"
    assert _ids(c)[0] == want_b


def _rl_flow_broadcast(c: httpx.Client, checkpoint: Path, want_c: list[list[int]], tmp: Path) -> None:
    """The same with a trainer's broadcast: refused (and drained) while the weights are out, applied after
    resume(weights)."""
    names, dtypes, shapes = tensor_specs(checkpoint)
    trainer = Trainer(checkpoint, names, tmp, rounds=2)
    assert c.post("/init_weights_update_group", json=trainer.init_payload()).status_code == 200
    body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": trainer.group, "weight_version": "c"}
    _memory(c, "release")
    r = c.post("/update_weights_from_distributed", json=body)
    trainer.next_round()
    assert r.status_code == 400 and "resume them first" in r.json()["message"], r.text
    _memory(c, "resume", {"tags": ["weights"]})
    r = c.post("/update_weights_from_distributed", json=body)
    trainer.next_round()
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    trainer.finish()
    _memory(c, "resume", {"tags": ["kv_cache", "cuda_graph"]})
    ids, meta = _ids(c)
    assert ids == want_c and {m["weight_version"] for m in meta} == {"c"}


def test_release_and_resume_on_a_live_server(ckpts, tmp_path) -> None:
    want = {k: fresh_ids(p, PROMPTS) for k, p in ckpts.items()}
    srv = RedraftServer(ckpts["A"], tmp_path, []).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=120, trust_env=False)
        assert _ids(c)[0] == want["A"] and _ids(c)[1][0]["cached_tokens"] == 32
        _round_trip(c, want["A"], srv.engine_pid())

        running = Streamed(srv.url)
        r = c.post("/release_memory_occupation", json={"tags": ["kv_cache"]})
        err = _refusal(r)
        assert "idle" in err["message"] and err["code"] == "server_busy"
        assert c.post("/abort_request", json={"abort_all": True}).status_code == 200
        running.result()
        r = c.post("/resume_memory_occupation", json={"tags": ["gpu"]})
        assert _refusal(r)["param"] == "tags"

        _rl_flow(c, ckpts["B"], want["B"])
        _rl_flow_broadcast(c, ckpts["C"], want["C"], tmp_path)
    finally:
        srv.stop()


def test_under_tensor_parallelism_every_rank_releases_and_resumes(ckpts, tmp_path) -> None:
    """--tp-size 2: each rank frees its own shard and KV cache (their resident bytes, per rank, go to 0) and gets
    them back; SGLang's RL order with a disk update then gives a fresh engine's tokens (float64: ranks exact)."""
    want = fresh_ids(ckpts["B"], dtype="float64")
    srv = RedraftServer(ckpts["A"], tmp_path, ["--tp-size", "2", "--dtype", "float64"]).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=300, trust_env=False)
        _ids(c)
        out = _memory(c, "release")
        per_rank = c.get("/server_info").json()["memory_resident_bytes_per_rank"]
        assert len(per_rank) == 2 and all(set(r.values()) == {0} for r in per_rank), per_rank
        _memory(c, "resume", {"tags": ["weights"]})
        r = c.post("/update_weights_from_disk", json={"model_path": str(ckpts["B"])})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
        out = _memory(c, "resume", {"tags": ["kv_cache", "cuda_graph"]})
        per_rank = c.get("/server_info").json()["memory_resident_bytes_per_rank"]
        assert all(r["weights"] > 0 and r["kv_cache"] > 0 for r in per_rank), per_rank
        assert out["resident_bytes"]["weights"] == sum(r["weights"] for r in per_rank)
        assert _ids(c)[0] == want
    finally:
        srv.stop()
