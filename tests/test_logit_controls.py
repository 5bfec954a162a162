"""Logit controls (engine/decoding/logit_controls.py) against the naive loops with the controls written from their
definitions (tests/naive_llada2.py NaiveControls), in float64 on tiny random checkpoints: each control alone,
all together, with multi-block windows, and in mixed batches (requests with and without controls)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from naive_llada2 import NaiveControls, naive_generate, naive_mbe_generate
from test_engine_exactness import OVERLAP, PARAMS, Tiny, TinyCache, resolve, tinies  # noqa: F401 - fixture

CONTROLS: dict[str, dict[str, Any]] = {
    "stutter": {"stutter_penalty": 3.0},
    "frequency": {"frequency_penalty": 1.5},
    "presence": {"presence_penalty": -1.0},
    "repetition": {"repetition_penalty": 1.8},
    "logit_bias": {"logit_bias": {"40": 6.0, "41": -100.0, "300": 2.5}},
    "min_tokens": {"min_tokens": 50},
    "all": {"stutter_penalty": 1.0, "frequency_penalty": 0.7, "presence_penalty": 0.4, "repetition_penalty": 1.3,
            "logit_bias": {"40": 3.0}, "min_tokens": 20},
}


def reference(t: Tiny, ids: list[int], params: dict[str, Any]) -> tuple[list[int], int]:
    threshold, edit_threshold, max_post_steps = resolve(params)
    bias = {int(k): v for k, v in params.get("logit_bias", {}).items()}
    controls = NaiveControls(len(ids), t.mask_id, t.eos_id, stutter=params.get("stutter_penalty", 0.0),
                             frequency=params.get("frequency_penalty", 0.0),
                             presence=params.get("presence_penalty", 0.0),
                             repetition=params.get("repetition_penalty", 1.0), logit_bias=bias,
                             min_tokens=params.get("min_tokens", 0))
    common = dict(max_new_tokens=params["max_new_tokens"], threshold=threshold, edit_threshold=edit_threshold,
                  max_post_steps=max_post_steps, mask_id=t.mask_id, eos_id=t.eos_id, controls=controls)
    key = ("controls", tuple(ids), repr(sorted(params.items())))
    if params.get("mbe_window", 1) > 1:
        return t.memo(key, lambda: naive_mbe_generate(t.naive, ids, window=params["mbe_window"], **common))
    return t.memo(key, lambda: naive_generate(t.naive, ids, **common))


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("window", [1, 2], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("control", list(CONTROLS))
def test_each_control_matches_the_naive_definition(tinies: TinyCache, control: str, window: int,
                                                   overlap: str) -> None:
    t = tinies[0]
    length, new, mode = [(20, 70, "S"), (33, 60, "Q")][window - 1]
    ids = t.prompt(length, salt=1399 + window)
    params = dict(PARAMS[mode], max_new_tokens=new, temperature=0.0, mbe_window=window, **CONTROLS[control])
    out = t.engine_for(overlap).generate(input_ids=ids, sampling_params=params)
    assert (out["output_ids"], out["meta_info"]["steps"]) == reference(t, ids, params), f"{control} {params}"


def test_controls_change_the_output(tinies: TinyCache) -> None:
    """Each control changes some output on these prompts (else the comparison above shows nothing)."""
    t = tinies[0]
    for control, extra in CONTROLS.items():
        changed = False
        for k, (length, new, mode) in enumerate([(20, 70, "S"), (33, 60, "Q")]):
            ids = t.prompt(length, salt=1400 + k)
            base = dict(PARAMS[mode], max_new_tokens=new, temperature=0.0)
            plain = t.engine.generate(input_ids=ids, sampling_params=base)["output_ids"]
            changed |= t.engine.generate(input_ids=ids, sampling_params={**base, **extra})["output_ids"] != plain
        assert changed, control


def test_mixed_batch_with_and_without_controls(tinies: TinyCache) -> None:
    t = tinies[1]
    prompts, params = [], []
    for k, control in enumerate([None, "stutter", None, "all", "logit_bias", None, "repetition"]):
        prompts.append(t.prompt(10 + 13 * k, salt=1500 + k))
        params.append(dict(PARAMS["S" if k % 2 else "Q"], max_new_tokens=40 + 10 * k, temperature=0.0,
                           mbe_window=1 + k % 2, **(CONTROLS[control] if control else {})))
    together = t.engine.generate(input_ids=prompts, sampling_params=params)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        assert (together[k]["output_ids"], together[k]["meta_info"]["steps"]) == reference(t, ids, sp), k


def test_logit_bias_bans_a_token_and_min_tokens_lengthens(tinies: TinyCache) -> None:
    t = tinies[0]
    stopped = None
    for salt in range(40):  # a prompt whose answer ends by EOS early
        ids = t.prompt(20, salt=1600 + salt)
        out = t.engine.generate(input_ids=ids, sampling_params={"mode": "S", "max_new_tokens": 90})
        if out["output_ids"][-1] == t.eos_id and len(out["output_ids"]) < 40:
            stopped = (ids, out["output_ids"])
            break
    assert stopped, "no prompt stops early on this checkpoint"
    ids, plain = stopped
    longer = t.engine.generate(input_ids=ids, sampling_params={"mode": "S", "max_new_tokens": 90, "min_tokens": 60})
    assert len(longer["output_ids"]) >= 60 and t.eos_id not in longer["output_ids"][:59]
    common = max(set(plain[:-1]), key=plain.count)
    banned = t.engine.generate(input_ids=ids, sampling_params={"mode": "S", "max_new_tokens": 90,
                                                                "logit_bias": {str(common): -100}})
    assert common not in banned["output_ids"]


def test_logprobs_stay_finite_for_json():
    """A token the distribution rules out (MASK, a logit driven to -inf or NaN) reports the floor, never
    -inf/NaN: json.dumps refuses those, which once turned a reply into a 500."""
    import json

    from redraft.engine.runtime.output import LOGPROB_FLOOR, finite_logprobs

    logits = torch.tensor([[0.0, float("-inf"), 1.0], [float("nan"), 0.0, 0.0]], dtype=torch.float64)
    lp = finite_logprobs(logits)
    assert torch.isfinite(lp).all()
    assert lp[0, 1] == LOGPROB_FLOOR and (lp[1] == LOGPROB_FLOOR).all()  # a NaN row: nothing is known
    assert torch.allclose(lp[0, [0, 2]], torch.log_softmax(torch.tensor([0.0, 1.0], dtype=torch.float64), -1))
    json.dumps(lp.tolist(), allow_nan=False)
