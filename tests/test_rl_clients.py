"""The calls AReaL and slime make, replayed against a live server (tests/fixtures/rl/*.json: each payload as the
client's code builds it, with this machine's paths, ports and tensors filled in, and gloo for NCCL on a CPU): every
call is answered as SGLang answers it, and the weights a replayed broadcast sends are the weights served."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from live_server import RedraftServer
from rl_support import Trainer, fresh_ids, tensor_specs

pytestmark = pytest.mark.slow
FIXTURES = Path(__file__).parent / "fixtures" / "rl"
GREEDY = {"max_new_tokens": 40, "temperature": 0.0}


def fill(value: Any, values: dict[str, Any]) -> Any:
    """The payload with every "${NAME}" string replaced by values[NAME] (any JSON value)."""
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        return values[value[2:-1]]
    if isinstance(value, dict):
        return {k: fill(v, values) for k, v in value.items()}
    if isinstance(value, list):
        return [fill(v, values) for v in value]
    return value


def _check_generate(body: dict) -> None:
    """What the clients read from a /generate answer (AReaL: output_token_logprobs' [logprob, id] pairs and
    finish_reason's type; slime: the same, and output_ids)."""
    meta = body["meta_info"]
    assert meta["finish_reason"]["type"] in ("stop", "length", "abort")
    lps = meta["output_token_logprobs"]
    assert [x[1] for x in lps] == body["output_ids"] and all(isinstance(x[0], float) and x[0] <= 0 for x in lps)
    assert isinstance(meta["weight_version"], str)


@pytest.mark.parametrize("client", ["areal", "slime"])
def test_a_recorded_client_session_is_answered_as_sglang_answers_it(client, tiny_checkpoint, tmp_path) -> None:
    a, b, c = tiny_checkpoint(seed=0), tiny_checkpoint(seed=1), tiny_checkpoint(seed=2)
    recorded = json.loads((FIXTURES / f"{client}.json").read_text())["calls"]
    names, dtypes, shapes = tensor_specs(c)
    group = next(call["json"]["group_name"] for call in recorded if call["path"] == "/init_weights_update_group")
    srv = RedraftServer(a, tmp_path, []).start()
    trainer = None
    try:
        http = httpx.Client(base_url=srv.url, timeout=300, trust_env=False)
        eos = http.get("/tokenizer_info").json()["eos_token_ids"][0]
        for call in recorded:
            if call.get("trainer"):
                trainer = Trainer(c, names, tmp_path, group=group)
            values = {"PROMPT_IDS": list(range(5, 45)), "STOP_TOKEN_IDS": [eos], "CHECKPOINT_B": str(b),
                      "BACKEND": "gloo", "TENSOR_NAMES": names, "TENSOR_DTYPES": dtypes, "TENSOR_SHAPES": shapes,
                      "MASTER_PORT": trainer.port if trainer else 0, "MASTER_PORT_STR": str(trainer.port if trainer else 0)}
            body = fill(copy.deepcopy(call.get("json")), values) if "json" in call else None
            r = http.request(call["method"], call["path"], json=body) if body is not None else \
                http.request(call["method"], call["path"])
            if call.get("broadcast"):
                trainer.next_round()
            assert r.status_code == 200, (call["path"], r.status_code, r.text)
            if call["path"] == "/generate":
                _check_generate(r.json())
            if call["path"] in ("/update_weights_from_disk", "/update_weights_from_distributed",
                                "/init_weights_update_group", "/destroy_weights_update_group"):
                assert r.json()["success"] is True, r.text
            for key in call.get("expect_keys", []):
                assert key in r.json(), (call["path"], key)
            for key, want in call.get("expect", {}).items():
                assert r.json()[key] == want, (call["path"], r.json())
        trainer.finish()
        trainer = None
        greedy = http.post("/generate", json={"input_ids": list(range(5, 45)), "sampling_params": GREEDY}).json()
        assert greedy["output_ids"] == fresh_ids(c, [list(range(5, 45))], GREEDY)[0]  # the broadcast's weights
    finally:
        if trainer is not None:
            trainer.proc.kill()
        srv.stop()


def test_unknown_fields_are_still_refused_by_name(tiny_checkpoint, tmp_path) -> None:
    """What the clients send is accepted; a field nobody defines is a 400 naming it, on /generate and on the
    control routes."""
    srv = RedraftServer(tiny_checkpoint(seed=0), tmp_path, []).start()
    try:
        http = httpx.Client(base_url=srv.url, timeout=60, trust_env=False)
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4},
                                         "return_routed_expert": False})
        assert r.status_code == 400 and r.json()["error"]["param"] == "return_routed_expert", r.text
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4,
                                                                                     "sampling_sed": 3}})
        assert r.status_code == 400 and "sampling_sed" in r.json()["error"]["param"], r.text
        r = http.post("/generate", json={"input_ids": [5, 6, 7], "image_data": "x.png"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "image_data", r.text
        r = http.post("/update_weights_from_disk", json={"model_path": "/nowhere", "abort_all_request": True})
        assert r.status_code == 400 and r.json()["error"]["param"] == "abort_all_request", r.text
        r = http.post("/pause_generation", json={"mode": "freeze"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "mode", r.text
        r = http.post("/update_weights_from_disk", json={"model_path": "/nowhere"})
        assert r.status_code == 400 and r.json()["success"] is False  # SGLang's shape: not an error object
    finally:
        srv.stop()
