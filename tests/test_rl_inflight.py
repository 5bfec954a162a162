"""Requests in flight across a weight update (docs/rl.md), on a live server: an update waits for the running
requests (they finish on the old weights, new ones queue and run on the new), abort_all_requests ends them with
what they committed, pause_generation's three modes, flush_cache's refusal while requests run, abort_all, and
versions in answers that change only at updates, monotonic under concurrent bounded load."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from live_server import RedraftServer
from rl_support import LONG, PROMPT, Streamed, fresh_ids

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def ckpts(tiny_checkpoint) -> dict[str, Path]:
    return {"A": tiny_checkpoint(seed=0), "B": tiny_checkpoint(seed=1)}


@pytest.fixture(scope="module")
def long_refs(ckpts) -> dict[str, list[int]]:
    return {k: fresh_ids(p, [PROMPT], LONG)[0] for k, p in ckpts.items()}


@pytest.fixture(scope="module")
def server(ckpts, tmp_path_factory):
    srv = RedraftServer(ckpts["A"], tmp_path_factory.mktemp("rl-inflight"), []).start()
    yield srv
    srv.stop()


def _background(fn, *args, **kwargs):
    pool = ThreadPoolExecutor(1)
    future = pool.submit(fn, *args, **kwargs)
    pool.shutdown(wait=False)
    return future


def test_an_update_waits_for_running_requests_and_new_ones_queue_behind_it(server, ckpts, long_refs) -> None:
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    running = Streamed(server.url)
    update = _background(c.post, "/update_weights_from_disk", json={"model_path": str(ckpts["B"]),
                                                                   "weight_version": "v1"})
    time.sleep(0.5)
    behind = _background(c.post, "/generate", json={"input_ids": PROMPT, "sampling_params": LONG})  # queues
    first = running.result()
    assert first["output_ids"] == long_refs["A"] and first["meta_info"]["weight_version"] == "default"
    assert first["meta_info"]["finish_reason"]["type"] == "length"
    assert update.result(120).json()["success"] is True
    late = behind.result(120).json()
    assert late["output_ids"] == long_refs["B"] and late["meta_info"]["weight_version"] == "v1"


def test_abort_all_requests_ends_them_with_what_they_committed(server, ckpts, long_refs) -> None:
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    version = c.get("/get_weight_version").json()["weight_version"]
    weights = "B" if version == "v1" else "A"
    running = Streamed(server.url)
    r = c.post("/update_weights_from_disk", json={"model_path": str(ckpts["A"]), "weight_version": "v2",
                                                   "abort_all_requests": True})
    assert r.status_code == 200 and r.json()["success"], r.text
    out = running.result()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["weight_version"] == version
    n = len(out["output_ids"])
    assert 0 < n < LONG["max_new_tokens"] and out["output_ids"] == long_refs[weights][:n]


def test_pause_abort_holds_new_requests_until_continue(server, long_refs) -> None:
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    running = Streamed(server.url)
    assert c.post("/pause_generation").json() == {"message": "Generation paused successfully.", "status": "ok"}
    out = running.result()
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["output_ids"] == long_refs["A"][:len(out["output_ids"])]
    held = _background(c.post, "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8}})
    time.sleep(2.0)
    assert not held.done(), "a request sent while paused must wait for continue_generation"
    assert c.get("/flush_cache").status_code == 200  # nothing runs: the cache can be flushed
    assert c.post("/continue_generation", json={}).json()["status"] == "ok"
    assert held.result(60).status_code == 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_paused_request_goes_on_with_the_new_weights_and_says_so(server, ckpts, mode) -> None:
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    before = c.get("/get_weight_version").json()["weight_version"]
    running = Streamed(server.url)
    assert c.post("/pause_generation", json={"mode": mode}).status_code == 200
    flush = c.post("/flush_cache")
    assert flush.status_code == (400 if mode == "in_place" else 200), flush.text  # (SGLang's rule)
    r = c.post("/update_weights_from_disk", json={"model_path": str(ckpts["B"]), "weight_version": f"{mode}-v"})
    assert r.status_code == 200 and r.json()["num_paused_requests"] == 1, r.text
    assert not running.done.is_set()
    c.post("/continue_generation")
    out = running.result()
    meta = out["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(out["output_ids"]) == LONG["max_new_tokens"]
    assert meta["weight_version"] == f"{mode}-v" and meta["weight_versions"] == [before, f"{mode}-v"]


def test_abort_all_and_flush_refused_while_running(server) -> None:
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    running = Streamed(server.url)
    r = c.post("/flush_cache")
    assert r.status_code == 400, r.text
    r = c.post("/abort_request", json={"abort_all": True})
    assert r.status_code == 200 and r.json()["aborted"] == 1, r.text
    assert running.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert c.post("/abort_request", json={}).status_code == 400  # neither a rid nor abort_all


def test_versions_change_only_at_updates_and_never_go_back(server, ckpts) -> None:
    """Bounded concurrent load (4 clients, 6 requests each) while the version is renamed 3 times and the weights
    swapped once: every answer carries a version no older than the one current when it was sent, and no newer
    than the one current when it came back."""
    c = httpx.Client(base_url=server.url, timeout=300, trust_env=False)
    order = [c.get("/get_weight_version").json()["weight_version"]]
    rank = lambda v: order.index(v)  # noqa: E731
    seen: list[tuple[int, str, int]] = []
    lock = threading.Lock()

    def client() -> None:
        for _ in range(6):
            with lock:
                low = len(order) - 1
            r = httpx.post(server.url + "/generate", json={"input_ids": PROMPT, "sampling_params":
                           {"max_new_tokens": 32, "temperature": 0.0}}, timeout=300, trust_env=False)
            assert r.status_code == 200, r.text
            with lock:
                seen.append((low, r.json()["meta_info"]["weight_version"], len(order) - 1))

    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client) for _ in range(4)]
        for i in range(3):
            time.sleep(0.7)
            name = f"load-{i}"
            with lock:
                order.append(name)  # (before the call: an answer may carry it as soon as the engine switches)
            body = {"new_version": name, "abort_all_requests": False}
            assert c.post("/update_weight_version", json=body).json()["new_version"] == name
        with lock:
            order.append("load-disk")
        assert c.post("/update_weights_from_disk", json={"model_path": str(ckpts["A"]),
                                                         "weight_version": "load-disk"}).status_code == 200
        for f in futures:
            f.result()
    assert len(seen) == 24
    assert all(low <= rank(v) <= high for low, v, high in seen), seen
    assert c.get("/get_weight_version").json()["weight_version"] == "load-disk"
