"""Weight versions and weight updates (docs/rl.md): the radix cache never matches K/V across weight versions; on a
live server, an update from disk and a trainer's gloo broadcast each give exactly the tokens of a fresh engine on the
new checkpoint (a prompt cached before the update included), a mismatched checkpoint is refused with nothing
changed, and an engine that dies after an update never serves the launch weights again."""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer, assert_error_shape
from rl_support import PROMPTS, SP, Trainer, fresh_ids, tensor_specs
from redraft.scheduler.page_pool import PagePool
from redraft.scheduler.radix_cache import RadixCache


# ---- the radix cache's versions (no process) -------------------------------------------------------------------
def _blocks(*firsts: int) -> list[int]:
    return [t for f in firsts for t in range(f, f + 4)]


def test_a_new_version_never_matches_old_blocks_and_flush_frees_them() -> None:
    pool = PagePool(16)
    cache = RadixCache(pool, block_size=4)
    tokens = _blocks(10, 20, 30)
    cache.insert(tokens, pool.alloc(3))
    assert cache.match_prefix(tokens).num_tokens == 12
    assert cache.new_version(flush=True) == 1
    assert cache.match_prefix(tokens).num_tokens == 0  # computed under the old weights: never again
    assert cache.cached_pages == 0 and pool.num_free == 16
    cache.check_invariants()


def test_without_flush_old_blocks_stay_unmatched_and_are_evicted_first() -> None:
    pool = PagePool(8)
    cache = RadixCache(pool, block_size=4)
    old = _blocks(10, 20)
    cache.insert(old, pool.alloc(2))
    held = cache.match_prefix(old)
    cache.inc_lock(held.last_node)  # a request paused in place still reads them
    cache.new_version(flush=False)
    assert cache.match_prefix(old).num_tokens == 0
    new = _blocks(10, 20)  # the same tokens, now under the new weights: cached apart
    cache.insert(new, pool.alloc(2))
    assert cache.match_prefix(new).pages != held.pages
    assert cache.evict(8) == 2 and cache.cached_pages == 2  # only the new, unlocked ones could go
    cache.check_invariants()
    cache.dec_lock(held.last_node)
    assert cache.evict(8) == 2 and cache.cached_pages == 0
    cache.check_invariants()
    assert cache.reset() and pool.num_free == 8


def test_a_request_admitted_under_old_weights_caches_nothing_after_an_update() -> None:
    from redraft.protocol.sampling_params import SamplingParams, resolve
    from redraft.scheduler.request import Request
    from redraft.scheduler.scheduler import Scheduler, SchedulerConfig

    sched = Scheduler(SchedulerConfig(num_pages=16, block_size=32, max_running_requests=4, max_prefill_tokens=256))
    prompt = list(range(1, 65))
    req = Request("r", prompt, resolve(SamplingParams(max_new_tokens=32), (), prompt_len=64, max_model_len=4096),
                  mask_id=999, eos_id=2)
    sched.add_request(req)
    sched.schedule()
    assert req.book.kv_version == 0
    sched.cache.new_version(flush=True)
    req.book.exact_blocks = 2  # its prompt's K/V, computed under version 0
    sched.abort("r")
    assert sched.cache.cached_pages == 0 and sched.pool.num_used == 0
    assert sched.cache.match_prefix(prompt).num_tokens == 0


def test_fp8_serving_requantises_received_tensors_as_a_load_would(tiny_checkpoint) -> None:
    """Full-precision tensors from a trainer, copied into an FP8 model, are quantised exactly as loading that
    checkpoint quantises them (same e4m3 weights, same block scales)."""
    import torch
    from safetensors.torch import load_file

    from redraft.engine.model import weight_sync
    from redraft.engine.model.config import ModelConfig
    from redraft.engine.model.loader import load_model

    a, c = tiny_checkpoint(seed=0), tiny_checkpoint(seed=2)
    cfg = ModelConfig.from_pretrained(a)
    served = load_model(a, cfg, dtype="float32", progress=False, quantization="fp8")
    fresh = load_model(c, cfg, dtype="float32", progress=False, quantization="fp8")
    received = list(load_file(str(c / "model.safetensors")).items())
    assert weight_sync.apply(served, received, cfg, None) == len(received)
    got = dict(served.named_parameters()) | dict(served.named_buffers())
    want = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
    assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
    for name, t in want.items():
        assert torch.equal(got[name].float(), t.float()), name


# ---- a live server ------------------------------------------------------------------------------------------
def _post(c: httpx.Client, path: str, body: dict | None = None) -> httpx.Response:
    return c.post(path, json=body) if body is not None else c.post(path)


def _ids(c: httpx.Client, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[dict]]:
    r = c.post("/generate", json={"input_ids": prompts, "sampling_params": SP})
    assert r.status_code == 200, r.text
    return [x["output_ids"] for x in r.json()], [x["meta_info"] for x in r.json()]


def _distributed(c: httpx.Client, trainer: Trainer, names: list[str], dtypes: list[str], shapes: list[list[int]],
                 **extra) -> httpx.Response:
    r = c.post("/update_weights_from_distributed", json={"names": names, "dtypes": dtypes, "shapes": shapes,
                                                          "group_name": trainer.group, **extra})
    trainer.next_round()
    return r


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint) -> dict[str, Path]:
    return {"A": tiny_checkpoint(seed=0), "B": tiny_checkpoint(seed=1), "C": tiny_checkpoint(seed=2)}


@pytest.fixture(scope="module")
def expected(checkpoints) -> dict[str, list[list[int]]]:
    out = {k: fresh_ids(p) for k, p in checkpoints.items()}
    assert out["A"] != out["B"] != out["C"] != out["A"], "the tiny checkpoints must answer differently"
    return out


def _updates_from_disk(c: httpx.Client, checkpoints: dict[str, Path], expected: dict, tmp_path: Path) -> None:
    """A checkpoint of another shape refused, then B from disk, then A with flush_cache false (a server on A)."""
    # a checkpoint of another shape is refused before anything is touched
    other = tmp_path / "other"
    shutil.copytree(checkpoints["B"], other)
    cfg = json.loads((other / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (other / "config.json").write_text(json.dumps(cfg))
    r = c.post("/update_weights_from_disk", json={"model_path": str(other), "weight_version": "bad"})
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "num_hidden_layers" in r.json()["message"]
    assert _ids(c)[0] == expected["A"] and c.get("/get_weight_version").json() == {"weight_version": "default"}

    # from disk: B, the cached prompt included
    r = c.post("/update_weights_from_disk", json={"model_path": str(checkpoints["B"]), "weight_version": "v1"})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert r.json()["num_paused_requests"] == 0
    ids, meta = _ids(c)
    assert ids == expected["B"] and meta[0]["cached_tokens"] == 0
    assert {m["weight_version"] for m in meta} == {"v1"}
    assert c.get("/model_info").json()["weight_version"] == "v1"

    # flush_cache false: the old blocks stay, but are never matched under the new weights
    _ids(c, PROMPTS[:1])
    r = c.post("/update_weights_from_disk", json={"model_path": str(checkpoints["A"]), "flush_cache": False,
                                                   "weight_version": "v2"})
    assert r.status_code == 200, r.text
    ids, meta = _ids(c, PROMPTS[:1])
    assert ids == expected["A"][:1] and meta[0]["cached_tokens"] == 0


def _updates_by_broadcast(c: httpx.Client, checkpoints: dict[str, Path], expected: dict, tmp_path: Path) -> None:
    """C broadcast tensor by tensor over gloo, a broadcast of the wrong shapes refused, then B as one flattened
    bucket."""
    # a trainer's broadcast of C, tensor by tensor, over gloo
    names, dtypes, shapes = tensor_specs(checkpoints["C"])
    trainer = Trainer(checkpoints["C"], names, tmp_path, rounds=2)
    r = c.post("/init_weights_update_group", json=trainer.init_payload())
    assert r.status_code == 200 and r.json() == {"success": True, "message": r.json()["message"]}, r.text
    r = _distributed(c, trainer, names, dtypes, shapes, weight_version="v3")
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    ids, meta = _ids(c)
    assert ids == expected["C"] and {m["weight_version"] for m in meta} == {"v3"}

    # a broadcast the model cannot take is refused (its tensors drained), the weights unchanged
    bad = list(shapes)
    bad[0] = [bad[0][0], bad[0][1] + 1]
    r = _distributed(c, trainer, names, dtypes, bad, weight_version="v4")
    assert r.status_code == 400 and r.json()["success"] is False and "shapes" in r.json()["message"], r.text
    trainer.finish()
    assert _ids(c)[0] == expected["C"] and c.get("/get_weight_version").json()["weight_version"] == "v3"
    r = c.post("/destroy_weights_update_group", json={"group_name": trainer.group})
    assert r.status_code == 200 and r.json()["success"] is True, r.text
    r = c.post("/update_weights_from_distributed", json={"names": names, "dtypes": dtypes, "shapes": shapes})
    assert r.status_code == 400 and r.json()["success"] is False  # no group any more

    # the same, as one flattened bucket (a subset: B's layers only; the rest stays C's)
    trainer = Trainer(checkpoints["B"], names, tmp_path, group="bucketed", flattened=True)
    assert c.post("/init_weights_update_group", json=trainer.init_payload()).status_code == 200
    r = _distributed(c, trainer, names, dtypes, shapes, load_format="flattened_bucket", weight_version="v5")
    assert r.status_code == 200, r.text
    trainer.finish()
    assert _ids(c)[0] == expected["B"]


@pytest.mark.slow
def test_disk_and_broadcast_updates_give_a_fresh_engines_tokens(checkpoints, expected, tmp_path) -> None:
    srv = RedraftServer(checkpoints["A"], tmp_path, []).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=120, trust_env=False)
        ids, meta = _ids(c)
        assert ids == expected["A"] and {m["weight_version"] for m in meta} == {"default"}
        assert _ids(c, PROMPTS[:1])[1][0]["cached_tokens"] == 32  # the first prompt is cached now

        _updates_from_disk(c, checkpoints, expected, tmp_path)
        _updates_by_broadcast(c, checkpoints, expected, tmp_path)

        # the weights came from a broadcast and were not kept (no --weight-spool-dir): the engine dies, and the
        # server refuses to serve rather than fall back to A
        os.kill(srv.engine_pid(), signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            r = c.post("/generate", json={"input_ids": PROMPTS[0], "sampling_params": SP})
            if r.status_code == 503 and r.json()["error"]["code"] == "weights_lost":
                break
            time.sleep(0.5)
        err = assert_error_shape(r, 503)
        assert err["code"] == "weights_lost" and "weight-spool-dir" in err["message"]
        assert "restarting the engine" not in srv.log_tail(20000)
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_restarted_engine_serves_the_updated_weights(checkpoints, expected, tmp_path) -> None:
    spool = tmp_path / "spool"
    srv = RedraftServer(checkpoints["A"], tmp_path, ["--weight-spool-dir", str(spool)]).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=120, trust_env=False)
        assert c.post("/update_weights_from_disk", json={"model_path": str(checkpoints["B"]),
                                                         "weight_version": "b"}).status_code == 200
        _kill_and_wait(srv, c)
        ids, meta = _ids(c)
        assert ids == expected["B"] and {m["weight_version"] for m in meta} == {"b"}

        names, dtypes, shapes = tensor_specs(checkpoints["C"])
        trainer = Trainer(checkpoints["C"], names, tmp_path)
        assert c.post("/init_weights_update_group", json=trainer.init_payload()).status_code == 200
        assert _distributed(c, trainer, names, dtypes, shapes, weight_version="c").status_code == 200
        trainer.finish()
        _kill_and_wait(srv, c)
        ids, meta = _ids(c)
        assert ids == expected["C"] and {m["weight_version"] for m in meta} == {"c"}
        assert len(list(spool.iterdir())) == 1  # only the weights served now are kept
    finally:
        srv.stop()


def _kill_and_wait(srv: RedraftServer, c: httpx.Client) -> None:
    pid = srv.engine_pid()
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            if srv.engine_pid() != pid and c.get("/health").status_code == 200:
                return
        except AssertionError:
            pass  # between the two engine processes
        time.sleep(0.5)
    pytest.fail(f"the engine did not come back; log:\n{srv.log_tail()}")


@pytest.mark.slow
@pytest.mark.parametrize("ep", [1, 2])
def test_under_tensor_parallelism_every_rank_loads_or_receives_its_shard(checkpoints, tmp_path, ep) -> None:
    """--tp-size 2: a disk update and a gloo broadcast (the trainer's world: itself and the two ranks, as
    rank_offset + tp_rank) each give a fresh single-process engine's tokens (float64, where ranks are exact)."""
    want = {k: fresh_ids(checkpoints[k], dtype="float64") for k in ("B", "C")}
    srv = RedraftServer(checkpoints["A"], tmp_path, ["--tp-size", "2", "--ep-size", str(ep), "--dtype",
                                                     "float64"]).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=300, trust_env=False)
        assert c.get("/server_info").json()["tp_size"] == 2
        assert c.post("/update_weights_from_disk", json={"model_path": str(checkpoints["B"])}).status_code == 200
        assert _ids(c)[0] == want["B"]
        names, dtypes, shapes = tensor_specs(checkpoints["C"])
        trainer = Trainer(checkpoints["C"], names, tmp_path, world_size=3)
        r = c.post("/init_weights_update_group", json=trainer.init_payload())
        assert r.status_code == 200 and r.json()["success"], r.text
        r = _distributed(c, trainer, names, dtypes, shapes, weight_version="tp")
        assert r.status_code == 200 and r.json()["success"], r.text
        trainer.finish()
        ids, meta = _ids(c)
        assert ids == want["C"] and {m["weight_version"] for m in meta} == {"tp"}
        assert c.post("/destroy_weights_update_group", json={}).json()["success"] is True
    finally:
        srv.stop()


@pytest.mark.slow
def test_a_slow_trainer_is_no_engine_hang(checkpoints, expected, tmp_path) -> None:
    """The engine loop blocks while it joins a trainer's group and receives its tensors: silent longer than
    --engine-heartbeat-timeout, it must not be taken for hung and killed."""
    srv = RedraftServer(checkpoints["A"], tmp_path, ["--engine-heartbeat-timeout", "2"]).start()
    try:
        c = httpx.Client(base_url=srv.url, timeout=120, trust_env=False)
        pid = srv.engine_pid()
        names, dtypes, shapes = tensor_specs(checkpoints["C"])
        trainer = Trainer(checkpoints["C"], names, tmp_path, delay=5.0)
        r = c.post("/init_weights_update_group", json=trainer.init_payload())
        assert r.status_code == 200 and r.json()["success"], r.text
        assert _distributed(c, trainer, names, dtypes, shapes).status_code == 200
        trainer.finish()
        assert srv.engine_pid() == pid and _ids(c)[0] == expected["C"]
    finally:
        srv.stop()
