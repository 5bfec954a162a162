"""logprob_mode "placement" (docs/rl.md): the step maps carry, for every token, its log-probability in the forward
that placed it (and for every edit, in the forward that made it), held to a naive full recompute of that forward's
canvas, rebuilt from the step maps alone."""

from __future__ import annotations

import math

import pytest
import torch

import redraft
from naive_llada2 import NaiveLLaDA2

BLOCK = 32
pytestmark = pytest.mark.slow  # (a naive float64 forward per placement: about 20 s on a busy 2-core machine)


@pytest.fixture(scope="module")
def run(ckpt):
    prompt = list(range(5, 45))
    with redraft.Engine(str(ckpt), dtype="float64", progress=False) as engine:
        # (the output fills its blocks: the step maps then hold every position the forwards read)
        sp = {"max_new_tokens": 56, "temperature": 0.0, "ignore_eos": True}
        out = engine.generate(input_ids=prompt, sampling_params={**sp, "logprob_mode": "placement", "logprobs": True})
        plain = engine.generate(input_ids=prompt, sampling_params=sp)
    return prompt, out, plain


def test_placement_logprobs_are_those_of_the_forward_that_placed_each_token(ckpt, run) -> None:
    prompt, out, plain = run
    assert out["output_ids"] == plain["output_ids"]  # asking for them changes no token
    maps = out["meta_info"]["step_maps"]
    mask_id = maps["mask_id"]
    naive = NaiveLLaDA2(ckpt, dtype=torch.float64)
    ids = out["output_ids"]
    checked = 0
    events = [(p[0], pos, None, p[1], p[2]) for pos, p in enumerate(maps["placed"]) if p is not None]
    events += [(f, pos, old, new, lp) for pos, f, old, new, lp in maps["edits"]]
    for forward, pos, _, token, lp in events:
        canvas = _canvas_before(prompt, ids, maps, forward, pos, mask_id)
        logits = naive.forward_logits(torch.tensor(canvas))[len(prompt) + pos].clone()
        logits[mask_id] = -math.inf
        want = torch.log_softmax(logits, -1)[token].item()
        assert lp == pytest.approx(want, abs=1e-9), (forward, pos)
        checked += 1
    assert checked >= len(ids)


def _canvas_before(prompt: list[int], ids: list[int], maps: dict, forward: int, pos: int, mask_id: int) -> list[int]:
    """The sequence the engine's forward `forward` read, through the end of the block of output position `pos`:
    the prompt, the committed blocks before, and that block as the earlier forwards left it."""
    p = len(prompt)
    end = ((p + pos) // BLOCK + 1) * BLOCK
    block_start = (p + pos) // BLOCK * BLOCK
    canvas = list(prompt) + list(ids) + [mask_id] * (end - p - len(ids))
    canvas = canvas[:end]
    for i in range(max(block_start, p), end):
        canvas[i] = mask_id
    for out_pos, placed in enumerate(maps["placed"]):
        if placed is not None and placed[0] < forward and block_start <= p + out_pos < end:
            canvas[p + out_pos] = placed[1]
    for out_pos, f, _, new, _ in sorted(maps["edits"], key=lambda e: e[1]):
        if f < forward and block_start <= p + out_pos < end:
            canvas[p + out_pos] = new
    return canvas


def test_an_unknown_logprob_mode_is_refused() -> None:
    from redraft.protocol.sampling_params import SamplingParams, SamplingParamsError

    with pytest.raises(SamplingParamsError, match="logprob_mode"):
        SamplingParams(logprob_mode="final-ish")
