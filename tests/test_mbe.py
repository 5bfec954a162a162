"""Multi-Block Editing (docs/mbe.md) against the independent naive implementation (tests/naive_llada2.py
`naive_mbe_generate`: full recompute under the window mask, no cache), in float64 on tiny random checkpoints:
the same output_ids AND the same number of denoising forwards. Also: W = 1 is the official loop, mixed
windows in one batch, preemption, prefix-cache hits, the attention rule against the naive mask, the Triton
backend, and the per-request meta."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from naive_llada2 import mbe_mask, naive_mbe_generate
from test_engine_exactness import OVERLAP, OVERLAP_ARGS, PARAMS, Tiny, TinyCache, check_meta, resolve, tinies  # noqa: F401 - fixture

import redraft
from redraft.kernels.attention import visible

B = 32


def mbe_reference(t: Tiny, ids: list[int], params: dict[str, Any], model=None) -> tuple[list[int], int]:
    threshold, edit_threshold, max_post_steps = resolve(params)
    key = ("mbe", tuple(ids), params["max_new_tokens"], threshold, edit_threshold, max_post_steps,
           params.get("mbe_window", 1), id(model))
    return t.memo(key, lambda: naive_mbe_generate(
        model or t.naive, ids, max_new_tokens=params["max_new_tokens"], threshold=threshold,
        edit_threshold=edit_threshold, max_post_steps=max_post_steps, window=params.get("mbe_window", 1),
        mask_id=t.mask_id, eos_id=t.eos_id))


# ---- the rule ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("length,start,active", [(160, 2, 4), (96, 0, 2), (128, 3, 3), (64, 1, 1)])
def test_attention_rule_is_the_naive_window_mask(length: int, start: int, active: int) -> None:
    pos = torch.arange(length)
    engine_rule = visible(pos[:, None], pos[None, :], B, start * B, active)
    assert torch.equal(engine_rule, mbe_mask(length, start, active, B))
    if start == active:  # W = 1: the plain block-causal mask
        assert torch.equal(engine_rule, visible(pos[:, None], pos[None, :], B))


def test_naive_window_one_is_the_official_loop(tinies: TinyCache) -> None:
    t = tinies[0]
    for length, new, name in [(20, 70, "S"), (33, 40, "Q-post1"), (64, 7, "S-post0")]:
        ids = t.prompt(length, salt=700)
        params = dict(PARAMS[name], max_new_tokens=new)
        assert mbe_reference(t, ids, dict(params, mbe_window=1)) == t.reference(ids, new, *resolve(params))


# ---- exactness -------------------------------------------------------------------------------------------------
# (prompt length, max_new_tokens, params name, W): prompts ending mid-block and on a boundary, outputs inside one
# block and across many, S / Q / custom thresholds / max_post_steps 0 and 1.
CASES = [
    (20, 100, "S", 2),
    (20, 100, "Q", 3),
    (32, 96, "S", 3),
    (1, 70, "S-post0", 2),
    (45, 20, "S", 4),  # inside one block: the window never grows past it
    (64, 120, "th0.9-ed0.3", 4),
    (31, 70, "th0.3-ed0.9", 2),
    (100, 64, "Q-post1", 3),
    (10, 90, "S-post1", 4),
    (40, 60, "fallback-only", 2),
]


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("seed", [0, 1, 2], ids=lambda s: f"ckpt{s}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"prompt{c[0]}-new{c[1]}-{c[2]}-W{c[3]}")
def test_engine_matches_naive_mbe(tinies: TinyCache, seed: int, case: tuple[int, int, str, int], overlap: str) -> None:
    t = tinies[seed]
    prompt_len, max_new, name, window = case
    ids = t.prompt(prompt_len, salt=800)
    params = dict(PARAMS[name], max_new_tokens=max_new, temperature=0.0, mbe_window=window)
    out = t.engine_for(overlap).generate(input_ids=ids, sampling_params=params)
    want = mbe_reference(t, ids, params)
    assert (out["output_ids"], out["meta_info"]["steps"]) == want, f"seed={seed} params={params}"
    check_meta(out, ids, max_new, t.eos_id)
    assert out["meta_info"]["mbe_window"] == window


def test_windows_make_a_difference(tinies: TinyCache) -> None:
    """Over the cases above, windows > 1 change some outputs and edit earlier blocks (else the tests above
    could not tell MBE from the single-block loop)."""
    t = tinies[0]
    changed, mbe_edits = 0, 0
    for prompt_len, max_new, name, window in CASES:
        ids = t.prompt(prompt_len, salt=800)
        params = dict(PARAMS[name], max_new_tokens=max_new, temperature=0.0)
        one = t.engine.generate(input_ids=ids, sampling_params=dict(params, mbe_window=1))
        many = t.engine.generate(input_ids=ids, sampling_params=dict(params, mbe_window=window))
        changed += one["output_ids"] != many["output_ids"]
        mbe_edits += many["meta_info"]["mbe_edits"]
        assert one["meta_info"]["mbe_edits"] == 0
    assert changed >= 2 and mbe_edits > 0, (changed, mbe_edits)


def _mixed(t: Tiny) -> tuple[list[list[int]], list[dict[str, Any]]]:
    shapes = [(20, 70, "S", 2), (5, 40, "Q", 1), (33, 90, "S-post0", 3), (64, 33, "th0.9-ed0.3", 4),
              (100, 20, "Q-post1", 1), (47, 64, "S", 8), (130, 45, "S-post1", 2)]
    prompts, params = [], []
    for k, (p, n, name, w) in enumerate(shapes):
        prompts.append(t.prompt(p, salt=900 + k))
        params.append(dict(PARAMS[name], max_new_tokens=n, temperature=0.0, mbe_window=w))
    return prompts, params


def test_mixed_windows_in_one_batch_equal_each_alone(tinies: TinyCache) -> None:
    t = tinies[1]
    prompts, params = _mixed(t)
    together = t.engine.generate(input_ids=prompts, sampling_params=params)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        want = mbe_reference(t, ids, sp)
        assert (together[k]["output_ids"], together[k]["meta_info"]["steps"]) == want, f"request {k}: {sp}"


def test_sampled_windows_are_batch_invariant(tinies: TinyCache) -> None:
    t = tinies[1]
    prompts, params = _mixed(t)
    params = [dict(p, temperature=0.8, seed=50 + k) for k, p in enumerate(params)]
    together = t.engine.generate(input_ids=prompts, sampling_params=params)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        alone = t.engine.generate(input_ids=ids, sampling_params=sp)
        assert together[k]["output_ids"] == alone["output_ids"], f"request {k}: {sp}"


@pytest.mark.parametrize("overlap", OVERLAP)
def test_exact_under_forced_preemption(tinies: TinyCache, overlap: str) -> None:
    """A KV cache far too small for the batch: requests are preempted mid-window and resume exactly (with the
    overlap scheduler on: a speculative forward's batch differs whenever someone is preempted)."""
    t = tinies[2]
    prompts, params = _mixed(t)
    params = [dict(p, ignore_eos=True) for p in params]  # every request grows to its last block
    small = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False,
                           max_total_tokens=8 * B, **OVERLAP_ARGS[overlap])
    try:
        got = small.generate(input_ids=prompts, sampling_params=params)
        assert small.core.scheduler.num_preemptions > 0, "the cache was large enough: nothing was preempted"
    finally:
        small.shutdown()
    # the same as the engine with room for everything (itself equal to the naive reference above; the naive
    # loop knows no ignore_eos)
    want = t.memo("preemption-roomy", lambda: t.engine.generate(input_ids=prompts, sampling_params=params))
    for k in range(len(prompts)):
        assert (got[k]["output_ids"], got[k]["meta_info"]["steps"]) == \
            (want[k]["output_ids"], want[k]["meta_info"]["steps"]), f"request {k}"


def test_exact_with_prefix_cache_hits(tinies: TinyCache) -> None:
    """A second turn whose prompt is the first turn's prompt + answer reads committed blocks from the radix tree
    (only committed, block-causally recomputed K/V ever enter it) and decodes exactly as without the cache."""
    t = tinies[0]
    ids = t.prompt(40, salt=1000)
    params = {"mode": "S", "max_new_tokens": 100, "temperature": 0.0, "mbe_window": 3, "ignore_eos": True}
    first = t.engine.generate(input_ids=ids, sampling_params=params)
    follow = ids + first["output_ids"] + t.prompt(9, salt=1001)
    second = t.engine.generate(input_ids=follow, sampling_params=dict(params, max_new_tokens=70))
    # blocks 0 (prompt) and 1 (prompt + answer) were committed and recomputed; 2..4 were still open at the end
    assert second["meta_info"]["cached_tokens"] == 2 * B, second["meta_info"]
    uncached = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False,
                              enable_prefix_cache=False)
    try:
        want = uncached.generate(input_ids=follow, sampling_params=dict(params, max_new_tokens=70))
    finally:
        uncached.shutdown()
    assert (second["output_ids"], second["meta_info"]["steps"]) == (want["output_ids"], want["meta_info"]["steps"])
    again = t.engine.generate(input_ids=ids, sampling_params=params)
    assert again["output_ids"] == first["output_ids"] and again["meta_info"]["cached_tokens"] == B


def test_window_one_is_the_official_loop_in_the_engine(tinies: TinyCache) -> None:
    t = tinies[2]
    ids = t.prompt(20, salt=1100)
    params = {"mode": "S", "max_new_tokens": 90, "temperature": 0.0, "mbe_window": 1}
    out = t.engine.generate(input_ids=ids, sampling_params=params)
    assert (out["output_ids"], out["meta_info"]["steps"]) == t.reference(ids, 90, *resolve(params))


def test_logprobs_cover_the_output_with_windows(tinies: TinyCache) -> None:
    t = tinies[0]
    ids = t.prompt(20, salt=1200)
    params = {"mode": "S", "max_new_tokens": 80, "temperature": 0.0, "mbe_window": 3, "logprobs": True,
              "top_logprobs": 2, "ignore_eos": True}
    out = t.engine.generate(input_ids=ids, sampling_params=params)
    meta = out["meta_info"]
    assert [t_ for _, t_, _ in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(lp <= 0 for lp, _, _ in meta["output_token_logprobs"])
    assert all(len(alts) == 2 for alts in meta["output_top_logprobs"])
    plain = t.engine.generate(input_ids=ids, sampling_params={k: v for k, v in params.items()
                                                              if k not in ("logprobs", "top_logprobs")})
    assert plain["output_ids"] == out["output_ids"]


def test_window_out_of_range_is_refused(tinies: TinyCache) -> None:
    t = tinies[0]
    for bad in (0, 9, 2.5):
        with pytest.raises(ValueError, match="mbe_window"):
            t.engine.generate(input_ids=[20, 21], sampling_params={"mbe_window": bad})


def test_server_flag_sets_the_default_window(tinies: TinyCache) -> None:
    t = tinies[0]
    eng = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False, mbe_window=3)
    try:
        ids = t.prompt(20, salt=800)
        params = {"mode": "S", "max_new_tokens": 100, "temperature": 0.0}
        out = eng.generate(input_ids=ids, sampling_params=params)
        assert out["meta_info"]["mbe_window"] == 3
        assert (out["output_ids"], out["meta_info"]["steps"]) == mbe_reference(t, ids, dict(params, mbe_window=3))
        explicit = eng.generate(input_ids=ids, sampling_params=dict(params, mbe_window=1))
        assert explicit["meta_info"]["mbe_window"] == 1  # the request wins over the flag
    finally:
        eng.shutdown()


# ---- serving ---------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_streaming_with_a_window_sends_each_committed_block_once(tinies: TinyCache, tmp_path) -> None:
    """Only committed blocks are streamed: with W = 3 every chunk adds whole blocks to what was sent, nothing
    sent is ever revised, and the streamed text equals the non-streamed text (and the offline engine's)."""
    import json as _json

    import httpx

    from live_server import RedraftServer

    t = tinies[1]
    ids = t.prompt(20, salt=1300)
    params = {"mode": "S", "max_new_tokens": 150, "temperature": 0.0, "mbe_window": 3, "ignore_eos": True}
    want = t.engine.generate(input_ids=ids, sampling_params=params)
    srv = RedraftServer(t.dir, tmp_path, ["--dtype", "float64"]).start()
    try:
        with httpx.Client(base_url=srv.url, timeout=120, trust_env=False) as http:
            plain = http.post("/generate", json={"input_ids": ids, "sampling_params": params}).json()
            chunks = []
            with http.stream("POST", "/generate", json={"input_ids": ids, "sampling_params": params,
                                                          "stream": True}) as r:
                assert r.status_code == 200
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(_json.loads(line[6:]))
            bad = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 8, "mbe_window": 9})
    finally:
        srv.stop()
    assert plain["output_ids"] == want["output_ids"]
    sent: list[int] = []
    for k, c in enumerate(chunks):
        assert c["output_ids"][: len(sent)] == sent, "a streamed token was revised"
        new = len(c["output_ids"]) - len(sent)
        assert new > 0
        if k == 0:  # the first block is shared with the prompt
            assert new == B - len(ids) % B, new
        elif k < len(chunks) - 1:
            assert new == B, new  # one block each time the window slides
        sent = c["output_ids"]
    assert sent == want["output_ids"] and chunks[-1]["text"] == plain["text"] == want["text"]
    # 6 blocks: blocks 0..2 commit one by one as the window slides, 3..5 together at the end
    assert want["meta_info"]["blocks"] == 6 and len(chunks) == 4
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "mbe_window"
