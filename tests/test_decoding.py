"""The batched joint-threshold step on hand-built logits, and the seeded sampler."""

from __future__ import annotations

import math

import pytest
import torch

from redraft.engine.decoding.decoding import SamplingBatch, propose, uniform_noise
from tests.threshold_rows import joint_threshold_step
from redraft.protocol.sampling_params import Defaults, SamplingParams, SamplingParamsError, resolve

MASK = 9
V = 10


def logits_for(rows: list[list[tuple[int, float]]]) -> torch.Tensor:
    """Logits [N, B, V] whose softmax puts probability `p` on token `v` at each position, the rest uniform
    over the other non-MASK tokens (the step never proposes MASK, so it must carry no mass here)."""
    out = torch.zeros(len(rows), len(rows[0]), V, dtype=torch.float64)
    for n, row in enumerate(rows):
        for b, (v, p) in enumerate(row):
            rest = (1 - p) / (V - 2)
            out[n, b] = math.log(rest)
            out[n, b, v] = math.log(p)
            out[n, b, MASK] = float("-inf")
    return out


def test_mask_is_never_proposed():
    logits = logits_for([[(1, 0.4), (2, 0.4)]])
    logits[0, 0, MASK] = 10.0  # the model prefers MASK at position 0
    r = joint_threshold_step(logits, torch.tensor([[MASK, MASK]]), torch.ones(1, 2, dtype=torch.bool),
                             torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64), MASK)
    assert MASK not in r.proposal.tolist()[0]
    assert r.tokens.tolist()[0].count(MASK) == 1  # one position filled (fallback), with a real token


def step(rows, block, editable=None, threshold=0.5, edit_threshold=0.0):
    n = len(rows)
    block_t = torch.tensor(block)
    editable_t = torch.ones_like(block_t, dtype=torch.bool) if editable is None else torch.tensor(editable)
    return joint_threshold_step(
        logits_for(rows), block_t, editable_t, torch.full((n,), threshold, dtype=torch.float64),
        torch.full((n,), edit_threshold, dtype=torch.float64), MASK,
    )


def test_m2t_fills_only_masks_strictly_above_threshold():
    r = step([[(1, 0.9), (2, 0.49), (3, 0.51), (4, 0.2)]], [[MASK, MASK, MASK, MASK]], threshold=0.5)
    assert r.tokens.tolist() == [[1, MASK, 3, MASK]]
    assert r.m2t.tolist() == [[True, False, True, False]]
    assert r.had_mask.tolist() == [True]


def test_threshold_is_strict():
    logits = torch.full((1, 2, V), float("-inf"), dtype=torch.float64)
    logits[0, :, 1] = logits[0, :, 2] = 0.0  # p = exactly 0.5 for token 1 (first of the tie)
    logits[0, 1, 3] = -30.0  # p just below 0.5 at position 1
    r = joint_threshold_step(logits, torch.tensor([[MASK, 1]]), torch.ones(1, 2, dtype=torch.bool),
                             torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.4999], dtype=torch.float64), MASK)
    assert r.confidence[0, 0].item() == 0.5
    assert r.m2t.tolist() == [[True, False]]  # only via the fallback: 0.5 is not > 0.5
    r2 = joint_threshold_step(logits, torch.tensor([[MASK, MASK]]), torch.ones(1, 2, dtype=torch.bool),
                              torch.tensor([0.5], dtype=torch.float64), torch.tensor([0.0], dtype=torch.float64), MASK)
    assert r2.m2t.tolist() == [[True, False]]  # nothing passes 0.5: fallback picks position 0


def test_fallback_fills_the_single_most_confident_mask():
    r = step([[(1, 0.3), (2, 0.45), (3, 0.44), (4, 0.99)]], [[MASK, MASK, MASK, 7]], threshold=0.7,
             edit_threshold=1.0)
    assert r.tokens.tolist() == [[MASK, 2, MASK, 7]]  # position 3 is not a mask: its 0.99 does not count
    assert r.m2t.sum().item() == 1


def test_t2t_edits_placed_tokens_in_the_same_forward_and_never_prompt_tokens():
    rows = [[(5, 0.8), (6, 0.8), (1, 0.9), (2, 0.4)]]
    r = step(rows, [[1, 2, MASK, 3]], editable=[[False, True, True, True]], threshold=0.5, edit_threshold=0.5)
    # pos 0 is prompt (kept), pos 1 edited (0.8 > 0.5), pos 2 filled, pos 3 kept (0.4 is not > 0.5)
    assert r.tokens.tolist() == [[1, 6, 1, 3]]
    assert r.t2t.tolist() == [[False, True, False, False]]


def test_t2t_needs_a_different_token():
    r = step([[(4, 0.99), (5, 0.99)]], [[4, 6]], threshold=0.5, edit_threshold=0.0)
    assert r.t2t.tolist() == [[False, True]]
    assert r.had_mask.tolist() == [False]


def test_rows_are_independent_with_their_own_thresholds():
    rows = [[(1, 0.6), (2, 0.6)], [(1, 0.6), (2, 0.6)]]
    block = torch.tensor([[MASK, MASK], [MASK, MASK]])
    r = joint_threshold_step(logits_for(rows), block, torch.ones(2, 2, dtype=torch.bool),
                             torch.tensor([0.5, 0.7], dtype=torch.float64),
                             torch.tensor([0.0, 0.0], dtype=torch.float64), MASK)
    assert r.tokens.tolist() == [[1, 2], [1, MASK]]  # row 2: nothing above 0.7 -> fallback picks the first max


def _sampling(n, temperature, top_k=-1, top_p=1.0, seed=0, step=0):
    return SamplingBatch(
        temperature=torch.full((n,), temperature, dtype=torch.float64),
        top_k=torch.full((n,), top_k, dtype=torch.long),
        top_p=torch.full((n,), top_p, dtype=torch.float64),
        seeds=torch.full((n,), seed, dtype=torch.long),
        steps=torch.full((n,), step, dtype=torch.long),
        positions=torch.arange(n * 4).view(n, 4),
    )


def test_uniform_noise_is_a_function_of_seed_position_step_only():
    seeds = torch.tensor([1, 2, 1])
    pos = torch.tensor([[0, 1, 2], [0, 1, 2], [0, 1, 2]])
    u = uniform_noise(seeds, pos, torch.tensor([0, 0, 0]))
    assert torch.equal(u[0], u[2]) and not torch.equal(u[0], u[1])
    assert not torch.equal(u[0], uniform_noise(seeds[:1], pos[:1], torch.tensor([1]))[0])
    big = uniform_noise(torch.arange(4000), torch.arange(4000)[:, None], torch.zeros(4000, dtype=torch.long))
    assert 0.0 <= big.min() and big.max() < 1.0
    assert abs(big.mean().item() - 0.5) < 0.02


def test_sampling_respects_top_k_and_matches_the_distribution():
    torch.manual_seed(0)
    logits = torch.randn(1, 1, V, dtype=torch.float64).repeat(2000, 4, 1)  # [2000, 4, V] same distribution
    s = _sampling(2000, 1.0, top_k=3)
    s.seeds = torch.arange(2000)
    v, p = propose(logits, s)
    top3 = logits[0, 0].topk(3).indices.tolist()
    assert set(v.flatten().tolist()) <= set(top3)
    probs = torch.softmax(logits[0, 0][top3], -1)
    freq = torch.tensor([(v == t).double().mean().item() for t in top3], dtype=torch.float64)
    assert torch.allclose(freq, probs, atol=0.03)
    # p is the sampled token's probability under the filtered (renormalised) distribution
    for t, q in zip(top3, probs):
        assert torch.allclose(p[v == t], q)


def test_top_p_keeps_the_first_token_always():
    logits = logits_for([[(3, 0.97)] * 4])
    v, p = propose(logits, _sampling(1, 1.0, top_p=0.01))
    assert v.tolist() == [[3, 3, 3, 3]] and torch.allclose(p, torch.ones_like(p, dtype=p.dtype))


def test_greedy_rows_unaffected_by_sampled_neighbours():
    torch.manual_seed(1)
    logits = torch.randn(3, 4, V, dtype=torch.float64)
    s = _sampling(3, 0.0)
    s.temperature[1] = 1.5
    v, p = propose(logits, s)
    v0, p0 = propose(logits, None)
    assert torch.equal(v[[0, 2]], v0[[0, 2]]) and torch.equal(p[[0, 2]], p0[[0, 2]])


def test_presets_and_overrides():
    assert resolve(SamplingParams(mode="S")).threshold == 0.5
    r = resolve(SamplingParams(mode="Q"))
    assert (r.threshold, r.edit_threshold, r.max_post_steps) == (0.7, 0.5, 16)
    r = resolve(SamplingParams(mode="S", edit_threshold=0.9, max_post_steps=0))
    assert (r.threshold, r.edit_threshold, r.max_post_steps) == (0.5, 0.9, 0)
    assert resolve(SamplingParams(mode="auto", domain="code")).mode == "S"
    assert resolve(SamplingParams(mode="auto", domain="chat")).mode == "Q"
    assert resolve(SamplingParams(), [Defaults(mode="S")]).mode == "S"


@pytest.mark.parametrize("bad", [
    {"max_new_tokens": 0}, {"max_new_tokens": 1.5}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2},
    {"mode": "fast"}, {"threshold": 1.5}, {"edit_threshold": "x"}, {"max_post_steps": -1}, {"stop": [""]},
    {"mbe_window": 0}, {"unknown_knob": 1}, {"seed": "abc"}, {"stop_token_ids": [-1]},
])
def test_invalid_params_name_the_field(bad):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams.from_dict(bad)
    assert err.value.param == next(iter(bad))
