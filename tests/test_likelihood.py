"""Likelihoods (engine/text/likelihood.py, docs/likelihood.md) against an independent naive implementation: full
recompute, the block-causal mask, MASK excluded, in float64 on a tiny random checkpoint."""

from __future__ import annotations

import itertools
import math
import statistics

import pytest
import torch

from naive_llada2 import block_causal_mask
from test_engine_exactness import Tiny, TinyCache, tinies  # noqa: F401 - fixture

from redraft.engine.text.likelihood import elbo_plan, timesteps, uniform

B = 32


def naive_logprob(t: Tiny, seq: list[int], pos: int, masked: set[int]) -> float:
    """log p(seq[pos]) with `masked` positions replaced by MASK, everything after pos's block cut off and the
    block filled up with MASK past the text's end, under the block-causal mask; MASK's logit dropped, as the
    engine never proposes it."""
    end = (pos // B + 1) * B
    x = torch.tensor([t.mask_id if i in masked or i >= len(seq) else seq[i] for i in range(end)])
    logits = t.naive.forward_logits(x, block_causal_mask(end))[pos].clone()
    logits[t.mask_id] = float("-inf")
    return float(torch.log_softmax(logits, -1)[seq[pos]])


def naive_staircase(t: Tiny, seq: list[int], pos: int) -> float:
    return naive_logprob(t, seq, pos, set(range(pos, (pos // B + 1) * B)))


def test_the_mask_hash_is_the_samplers() -> None:
    from redraft.engine.decoding.decoding import uniform_noise

    seeds = torch.tensor([0, 7, 2**40 + 3, -5])
    positions = torch.tensor([[0, 1, 31, 1000]] * 4)
    steps = torch.tensor([0, 3, 11, 2])
    got = uniform_noise(seeds, positions, steps)
    for r in range(4):
        for c in range(4):
            assert got[r, c].item() == uniform(int(seeds[r]), int(positions[r, c]), int(steps[r]))


def test_echo_values_are_the_naive_staircase(tinies: TinyCache) -> None:
    t = tinies[0]
    seq = t.prompt(75, salt=2000)  # three blocks, the last partial
    got = t.engine.prompt_logprobs(seq, start=1, top_k=3)
    assert got[0] is None
    for i in range(1, len(seq)):
        lp, top = got[i]
        assert lp == pytest.approx(naive_staircase(t, seq, i), abs=1e-9), i
        assert len(top) == 3 and top[0][1] >= lp - 1e-12  # alternatives from the same row, best first
    # unchanged by what follows and by what it is batched with
    longer = t.engine.prompt_logprobs(seq + t.prompt(40, salt=2001), start=1)
    assert [g[0] for g in got[1:]] == pytest.approx([g[0] for g in longer[1 : len(seq)]], abs=1e-12)
    late = t.engine.prompt_logprobs(seq, start=50)
    assert late[:50] == [None] * 50 and [g[0] for g in late[50:]] == pytest.approx([g[0] for g in got[50:]], abs=1e-12)


def test_one_token_continuation_all_estimators_agree(tinies: TinyCache) -> None:
    t = tinies[1]
    prompt, response = t.prompt(40, salt=2100), t.prompt(1, salt=2101)
    seq = prompt + response
    want = naive_logprob(t, seq, len(prompt), {len(prompt)})
    count = t.engine.score([(prompt, response)], estimator="elbo", num_timesteps=1, masking="count")[0]
    stair = t.engine.score([(prompt, response)], estimator="staircase")[0]
    assert count["estimate"] == pytest.approx(want, abs=1e-9)
    assert stair["estimate"] == pytest.approx(want, abs=1e-9)
    assert count["terms"][0]["masked"] == 1 and count["terms"][0]["scale"] == 1.0


@pytest.mark.parametrize("length", [2, 3])
def test_exact_elbo_is_the_average_over_orders_of_the_staircase(tinies: TinyCache, length: int) -> None:
    t = tinies[2]
    prompt, response = t.prompt(20, salt=2200 + length), t.prompt(length, salt=2210 + length)
    seq, p0 = prompt + response, len(prompt)
    resp = list(range(p0, p0 + length))
    # the exact ELBO, enumerating every mask: E_l~U{1..L} E_|m|=l [ (L/l) sum_{i in m} log p(x_i | x_not m) ]
    exact = 0.0
    for l in range(1, length + 1):
        masks = list(itertools.combinations(resp, l))
        for m in masks:
            exact += (1 / length) * (1 / len(masks)) * (length / l) * sum(naive_logprob(t, seq, i, set(m)) for i in m)
    # the average over token orders of the order-wise staircase: reveal in order, each read with the rest masked
    orders = list(itertools.permutations(resp))
    by_order = 0.0
    for order in orders:
        for k, i in enumerate(order):
            by_order += naive_logprob(t, seq, i, set(order[k:])) / len(orders)
    assert exact == pytest.approx(by_order, abs=1e-9)
    got = t.engine.score([(prompt, response)], estimator="exact")[0]
    assert got["estimate"] == pytest.approx(exact, abs=1e-9)


def test_monte_carlo_spread_shrinks_like_one_over_root_n(tinies: TinyCache) -> None:
    t = tinies[0]
    prompt, response = t.prompt(30, salt=2300), t.prompt(45, salt=2301)
    exact_stair = t.engine.score([(prompt, response)], estimator="staircase")[0]["estimate"]
    spreads = {}
    for n in (2, 8, 32):
        ests = [t.engine.score([(prompt, response)], estimator="elbo", num_timesteps=n, masking="count",
                               seed=s)[0]["estimate"] for s in range(24)]
        spreads[n] = statistics.pstdev(ests)
    ratio_1, ratio_2 = spreads[2] / spreads[8], spreads[8] / spreads[32]
    assert 1.4 < ratio_1 < 3.2 and 1.4 < ratio_2 < 3.2, spreads  # 2x expected for 4x the timesteps
    assert math.isfinite(exact_stair)


def test_masks_are_reproducible_from_seed_timestep_and_position() -> None:
    plan = elbo_plan([(10, 80)], estimator="elbo", num_timesteps=4, masking="bernoulli", seed=9)
    for term in plan.terms[0]:
        v = plan.variants[term.variant]
        lo, hi = term.block * B, min((term.block + 1) * B, 80)
        want = tuple(p for p in range(max(lo, 10), hi) if uniform(9, p, term.timestep) < term.t)
        assert v.masked == want
    ts = timesteps(5, "gauss_legendre", 0)
    assert sum(w for _, w in ts) == pytest.approx(1.0) and all(0 < x < 1 for x, _ in ts)
    assert sum(x**3 * w for x, w in ts) == pytest.approx(0.25)  # exact for polynomials up to degree 9


def test_scores_are_batch_invariant(tinies: TinyCache) -> None:
    t = tinies[0]
    items = [(t.prompt(n, salt=2400 + n), t.prompt(m, salt=2500 + m)) for n, m in [(5, 30), (40, 7), (64, 64)]]
    together = t.engine.score(items, estimator="elbo", num_timesteps=3, masking="complementary", seed=4)
    for item, got in zip(items, together):
        alone = t.engine.score([item], estimator="elbo", num_timesteps=3, masking="complementary", seed=4)[0]
        assert got["estimate"] == pytest.approx(alone["estimate"], abs=1e-12)
        assert [r["masked"] for r in got["terms"]] == [r["masked"] for r in alone["terms"]]
