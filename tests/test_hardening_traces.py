"""Hardening III, item 4 (issue 37): denoise traces are bounded. Against a live `redraft serve` on a tiny
LLaDA2.2 checkpoint (it edits, deletes and splits a lot) started with a small --max-trace-changes: step maps stop
at the cap with a `truncated` marker naming it while still placing every output token, and the answer's tokens
are those of the same request without maps (the bystander). LLaDA2.2's per-slot `seen` history shrinks back
after a long block."""

from __future__ import annotations

import httpx
import pytest
import torch

from live_server import RedraftServer
from redraft.engine.decoding.levenshtein import _SEEN_CHUNK, _SHRINK_ABOVE, LevenshteinSlots, StructuralIds
from redraft.scheduler.denoise_trace import DenoiseTrace

CAP = 40


@pytest.fixture(scope="module")
def srv(request, tiny_checkpoint, tmp_path_factory) -> RedraftServer:
    server = RedraftServer(tiny_checkpoint(0, llada22=True), tmp_path_factory.mktemp("hard-traces"),
                           ["--cpu-threads", "1", "--max-trace-changes", str(CAP)])
    request.addfinalizer(server.stop)
    return server.start()


@pytest.mark.slow
def test_step_maps_stop_at_the_cap_with_a_marker_and_tokens_are_unchanged(srv) -> None:
    body = {"input_ids": list(range(40, 75)), "sampling_params": {"max_new_tokens": 96, "mode": "Q"}}
    with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as c:
        plain = c.post("/generate", json=body).json()  # the bystander: no trace at all
        traced = c.post("/generate", json={**body, "return_step_maps": True}).json()
    assert traced["output_ids"] == plain["output_ids"]
    maps = traced["meta_info"]["step_maps"]
    assert maps["truncated"]["max_trace_changes"] == CAP, maps.get("truncated")
    assert maps["truncated"]["edits_left_out"] > 0 and maps["truncated"]["from_forward"] >= 1
    n_out = len(traced["output_ids"])
    recorded = sum(p is not None for p in maps["placed"]) + len(maps["edits"])
    assert len(maps["edits"]) <= CAP and recorded <= CAP + n_out, (len(maps["edits"]), recorded)


def test_a_trace_keeps_first_placements_past_its_cap() -> None:
    trace = DenoiseTrace(prompt_len=0, mask_id=9, output_end=4, block_size=4, max_changes=2)
    trace.record(1, 0, 0, [9, 9, 9, 9], [1, 2, 9, 9], None)  # two placements: the cap is full
    trace.record(2, 0, 0, [1, 2, 9, 9], [3, 2, 4, 9], None)  # an edit (left out), a first placement (kept)
    trace.record(3, 0, 0, [3, 2, 4, 9], [3, 5, 4, 6], None)  # an edit (left out), a first placement (kept)
    maps = trace.step_maps(4, 4)
    assert maps["placed"] == [[1, 1], [1, 2], [2, 4], [3, 6]] and maps["edits"] == []
    assert maps["truncated"] == {"from_forward": 2, "edits_left_out": 2, "max_trace_changes": 2}
    assert "truncated" not in DenoiseTrace(0, 9, 4, 4).step_maps(0, 4)


def test_levenshtein_seen_history_shrinks_after_a_long_block() -> None:
    slots = LevenshteinSlots(4, 8, StructuralIds(0, 1, 2), torch.device("cpu"))
    slots._reserve(4096)  # a block that ran 4096 steps
    assert slots.seen.shape[1] >= 4096
    slots.seen_len[1] = 20  # another slot still holds 20 rows of its block
    slots.load(0, torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), 8, 0, 8)
    assert slots.seen.shape[1] == 2 * _SEEN_CHUNK <= _SHRINK_ABOVE  # back to what slot 1 needs
    slots.seen_len[1] = 0
    slots.load(1, torch.zeros(8, dtype=torch.long), torch.ones(8, dtype=torch.bool), 8, 0, 8)
    assert slots.seen.shape[1] == 2 * _SEEN_CHUNK  # at or under the threshold it is left alone
