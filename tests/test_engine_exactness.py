"""The engine against the naive reference (tests/naive_llada2.py) on tiny random checkpoints.

In float64 the engine must reproduce the official algorithm exactly: the same output_ids AND the same number
of forwards, for prompts that end mid-block, on a block boundary or span several blocks, for 1 to 70 new
tokens, in modes S and Q, with custom thresholds and max_post_steps 0 / 1, and when EOS stops generation.
Batching must not change any request's output (temperature 0, and seeded sampling). A float32 run is
compared with the naive reference in float32 too. The main cases run with the overlap scheduler on
(`enable_overlap`) and off (the default; `disable_overlap` here, engine/runtime/overlap.py): both must equal the
reference (the overlap-on half in the slow suite: the scheduler is opt-in).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from naive_llada2 import NaiveLLaDA2, naive_generate

import redraft
from redraft.engine.text.tokenizer import Tokenizer

SEEDS = (0, 1, 2)
PRESETS = {"S": (0.5, 0.0, 16), "Q": (0.7, 0.5, 16)}  # model card: threshold, edit_threshold, max_post_steps


def read_special_ids(model_dir: Path) -> tuple[int, int]:
    """(mask_id, eos_id) read straight from tokenizer_config.json + tokenizer.json (no redraft code)."""
    cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    added = json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]
    by_content = {t["content"]: t["id"] for t in added}

    def content(entry: Any) -> str:
        return entry["content"] if isinstance(entry, dict) else entry

    return by_content[content(cfg["mask_token"])], by_content[content(cfg["eos_token"])]


class Tiny:
    """One tiny checkpoint with its float64 engine and float64 naive model, built once per module."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.seed = seed
        self.dir = model_dir
        self.mask_id, self.eos_id = read_special_ids(self.dir)
        tok = Tokenizer.from_pretrained(self.dir)
        assert (tok.mask_token_id, tok.eos_token_id) == (self.mask_id, self.eos_id)
        self.vocab = json.loads((self.dir / "config.json").read_text())["vocab_size"]
        self.specials = {t["id"] for t in json.loads((self.dir / "tokenizer.json").read_text())["added_tokens"]}
        self.engine = redraft.Engine(model_path=str(self.dir), device="cpu", dtype="float64", progress=False)
        self._overlapped: Any = None  # the same engine with the overlap scheduler on, built on first use
        self.naive = NaiveLLaDA2(self.dir, dtype=torch.float64)
        self._memo: dict[Any, Any] = {}

    def engine_for(self, overlap: str) -> Any:
        """The float64 engine with the overlap scheduler "on" or "off" (the default)."""
        if overlap == "off":
            assert self.engine.core.info()["overlap"].startswith("off: the default")
            return self.engine
        if self._overlapped is None:
            self._overlapped = redraft.Engine(model_path=str(self.dir), device="cpu", dtype="float64",
                                              progress=False, **OVERLAP_ARGS["on"])
            assert self._overlapped.core.info()["overlap"] == "on"
        return self._overlapped

    def memo(self, key: Any, fn: Callable[[], Any]) -> Any:
        """fn() once per key: a naive reference shared by a test's overlap-on and overlap-off runs."""
        if key not in self._memo:
            self._memo[key] = fn()
        return self._memo[key]

    def shutdown(self) -> None:
        self.engine.shutdown()
        if self._overlapped is not None:
            self._overlapped.shutdown()

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        """A deterministic prompt of ordinary (non-special) tokens: never MASK, never EOS."""
        rng = random.Random(f"{self.seed}/{length}/{salt}")
        ordinary = [i for i in range(self.vocab) if i not in self.specials]
        return [rng.choice(ordinary) for _ in range(length)]

    def reference(self, ids: list[int], max_new_tokens: int, threshold: float, edit_threshold: float,
                  max_post_steps: int, model: NaiveLLaDA2 | None = None) -> tuple[list[int], int]:
        key = ("naive", tuple(ids), max_new_tokens, threshold, edit_threshold, max_post_steps, id(model))
        return self.memo(key, lambda: naive_generate(
            model or self.naive, ids, max_new_tokens=max_new_tokens, threshold=threshold,
            edit_threshold=edit_threshold, max_post_steps=max_post_steps, mask_id=self.mask_id, eos_id=self.eos_id))


class TinyCache(dict):
    """seed -> Tiny, built on first use (a test module run for one case builds one checkpoint only)."""

    def __init__(self, tiny_checkpoint: Callable[..., Path]) -> None:
        super().__init__()
        self.tiny_checkpoint = tiny_checkpoint

    def __missing__(self, seed: int) -> Tiny:
        tiny = self[seed] = Tiny(self.tiny_checkpoint(seed=seed), seed)
        return tiny


@pytest.fixture(scope="module")
def tinies(tiny_checkpoint: Callable[..., Path]) -> Iterator[TinyCache]:
    cache = TinyCache(tiny_checkpoint)
    yield cache
    for tiny in cache.values():
        tiny.shutdown()


def resolve(params: dict[str, Any]) -> tuple[float, float, int]:
    """The (threshold, edit_threshold, max_post_steps) a sampling_params dict asks for."""
    th, et, mps = PRESETS[params.get("mode", "Q")]
    return params.get("threshold", th), params.get("edit_threshold", et), params.get("max_post_steps", mps)


# name -> sampling params (max_new_tokens and temperature are added per case)
PARAMS: dict[str, dict[str, Any]] = {
    "S": {"mode": "S"},
    "Q": {"mode": "Q"},
    "th0.9-ed0.3": {"mode": "S", "threshold": 0.9, "edit_threshold": 0.3},
    "th0.3-ed0.9": {"mode": "Q", "threshold": 0.3, "edit_threshold": 0.9},
    "S-post0": {"mode": "S", "max_post_steps": 0},
    "Q-post1": {"mode": "Q", "max_post_steps": 1},
    "S-post1": {"mode": "S", "max_post_steps": 1},
    "fallback-only": {"mode": "S", "threshold": 1.0, "edit_threshold": 1.0, "max_post_steps": 2},
}

# (prompt length, max_new_tokens, params name): prompts of 1 token, ending mid-block, on a block boundary,
# spanning several blocks; outputs of 1 token, inside one block, exactly filling one, across several.
CASES: list[tuple[int, int, str]] = [
    (1, 1, "S"),
    (1, 7, "Q"),
    (1, 70, "S"),
    (20, 7, "S"),
    (20, 12, "Q"),  # generation ends exactly on the block boundary
    (20, 70, "Q"),
    (31, 33, "S-post0"),
    (32, 1, "Q"),
    (32, 64, "S"),
    (64, 7, "S-post0"),
    (64, 70, "th0.9-ed0.3"),
    (100, 70, "Q-post1"),
    (120, 40, "th0.3-ed0.9"),
    (140, 7, "S"),
    (45, 50, "S-post1"),
    (10, 30, "fallback-only"),
]


def _case_id(case: tuple[int, int, str]) -> str:
    p, n, name = case
    return f"prompt{p}-new{n}-{name}"


def check_meta(out: dict, ids: list[int], max_new_tokens: int, eos_id: int) -> None:
    got = out["output_ids"]
    meta = out["meta_info"]
    assert meta["prompt_tokens"] == len(ids)
    assert meta["completion_tokens"] == len(got)
    assert 1 <= len(got) <= max_new_tokens
    if got[-1] == eos_id:
        assert meta["finish_reason"]["type"] == "stop"
    else:
        assert eos_id not in got
        assert meta["finish_reason"]["type"] == "length"
        assert len(got) == max_new_tokens


# the overlap scheduler is opt-in (--enable-overlap), so its half of these matrices runs in the slow suite
OVERLAP = (pytest.param("on", id="overlap-on", marks=pytest.mark.slow), pytest.param("off", id="overlap-off"))
OVERLAP_ARGS: dict[str, dict[str, bool]] = {"on": {"enable_overlap": True}, "off": {"disable_overlap": True}}


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("seed", SEEDS, ids=[f"ckpt{s}" for s in SEEDS])
@pytest.mark.parametrize("case", CASES, ids=[_case_id(c) for c in CASES])
def test_engine_matches_naive_float64(tinies: TinyCache, seed: int, case: tuple[int, int, str], overlap: str) -> None:
    t = tinies[seed]
    prompt_len, max_new, name = case
    ids = t.prompt(prompt_len)
    params = dict(PARAMS[name], max_new_tokens=max_new, temperature=0.0)
    out = t.engine_for(overlap).generate(input_ids=ids, sampling_params=params)
    want_ids, want_steps = t.reference(ids, max_new, *resolve(params))
    where = f"seed={seed} prompt={ids} params={params}"
    assert out["output_ids"] == want_ids, where
    assert out["meta_info"]["steps"] == want_steps, where
    check_meta(out, ids, max_new, t.eos_id)


def test_eos_stops_generation(tinies: TinyCache) -> None:
    """Some prompt must stop at EOS before max_new_tokens; engine and naive agree on it."""
    stopped = []
    for seed in SEEDS:
        t = tinies[seed]
        for salt in range(4):
            ids = t.prompt(20 + 7 * salt, salt=100 + salt)
            params = {"mode": "S", "max_new_tokens": 96, "temperature": 0.0}
            out = t.engine.generate(input_ids=ids, sampling_params=params)
            want_ids, want_steps = t.reference(ids, 96, *resolve(params))
            assert (out["output_ids"], out["meta_info"]["steps"]) == (want_ids, want_steps), f"seed={seed} {ids}"
            check_meta(out, ids, 96, t.eos_id)
            if want_ids[-1] == t.eos_id:
                assert want_ids.count(t.eos_id) == 1 and len(want_ids) < 96
                assert out["meta_info"]["finish_reason"]["type"] == "stop"
                stopped.append((seed, salt))
        if stopped:
            break
    assert stopped, "no prompt stopped at EOS: the tiny checkpoints no longer reach EOS"


@pytest.mark.parametrize("mode", ["S", "Q"])
def test_eos_inside_the_prompt_does_not_stop(tinies: TinyCache, mode: str) -> None:
    # EOS in an earlier prompt block and at the end of the prompt's shared partial block: prompt tokens are
    # not generated tokens, so neither may stop generation
    t = tinies[0]
    ids = t.prompt(45, salt=500)
    ids[10] = ids[44] = t.eos_id
    params = {"mode": mode, "max_new_tokens": 40, "temperature": 0.0}
    out = t.engine.generate(input_ids=ids, sampling_params=params)
    want = t.reference(ids, 40, *resolve(params))
    assert (out["output_ids"], out["meta_info"]["steps"]) == want
    check_meta(out, ids, 40, t.eos_id)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("mode", ["S", "Q"])
def test_mask_token_inside_the_prompt(tinies: TinyCache, mode: str) -> None:
    # A MASK id in the prompt's shared partial block is a prompt token: never filled, never edited, and it
    # must not keep the block "unfinished" (max_post_steps still caps it). Rejecting such a prompt with a
    # ValueError is an acceptable alternative.
    t = tinies[0]
    ids = t.prompt(20, salt=600)
    ids[5] = t.mask_id
    params = {"mode": mode, "max_new_tokens": 40, "temperature": 0.0}
    try:
        out = t.engine.generate(input_ids=ids, sampling_params=params)
    except ValueError:
        return
    want = t.reference(ids, 40, *resolve(params))
    assert (out["output_ids"], out["meta_info"]["steps"]) == want


@pytest.fixture(scope="module")
def sharded_bf16(tiny_checkpoint: Callable[..., Path]) -> Iterator[tuple[Path, Any, NaiveLLaDA2]]:
    d = tiny_checkpoint(seed=3, dtype="bfloat16", shards=3)
    assert (d / "model.safetensors.index.json").is_file()
    engine = redraft.Engine(model_path=str(d), device="cpu", dtype="float64", progress=False)
    yield d, engine, NaiveLLaDA2(d, dtype=torch.float64)
    engine.shutdown()


@pytest.mark.parametrize("case", [(20, 70, "S"), (33, 40, "Q-post1")], ids=lambda c: _case_id(c))
def test_sharded_bfloat16_checkpoint(sharded_bf16: tuple[Path, Any, NaiveLLaDA2], case: tuple[int, int, str]) -> None:
    # Loading path: weights stored in bf16 across 3 shards (expert_bias stays fp32); both sides upcast the
    # same stored values to float64, so they must still agree exactly.
    d, engine, naive = sharded_bf16
    mask_id, eos_id = read_special_ids(d)
    prompt_len, max_new, name = case
    ids = [12 + (7 * i) % 300 for i in range(prompt_len)]
    params = dict(PARAMS[name], max_new_tokens=max_new, temperature=0.0)
    threshold, edit_threshold, max_post_steps = resolve(params)
    out = engine.generate(input_ids=ids, sampling_params=params)
    want = naive_generate(naive, ids, max_new_tokens=max_new, threshold=threshold, edit_threshold=edit_threshold,
                          max_post_steps=max_post_steps, mask_id=mask_id, eos_id=eos_id)
    assert (out["output_ids"], out["meta_info"]["steps"]) == want


# ----------------------------------------------------------------------------------------------
# batch invariance: the same requests together and one by one
# ----------------------------------------------------------------------------------------------

def _mixed_requests(t: Tiny, sampled: bool) -> tuple[list[list[int]], list[dict[str, Any]]]:
    shapes = [(1, 40, "S"), (20, 7, "Q"), (32, 64, "S-post0"), (64, 33, "th0.9-ed0.3"),
              (100, 20, "Q-post1"), (5, 70, "S"), (47, 1, "Q"), (130, 45, "S-post1")]
    prompts, params = [], []
    for k, (p, n, name) in enumerate(shapes):
        prompts.append(t.prompt(p, salt=200 + k))
        sp: dict[str, Any] = dict(PARAMS[name], max_new_tokens=n, temperature=0.0)
        if sampled:
            sp.update(temperature=0.8, seed=1000 + k)
            if k % 3 == 1:
                sp["top_k"] = 20
            if k % 3 == 2:
                sp["top_p"] = 0.9
            if k == 5:
                sp.update(top_k=50, top_p=0.8)
        params.append(sp)
    return prompts, params


@pytest.mark.parametrize("overlap", OVERLAP)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "temp0.8-seeded"])
def test_batch_invariance(tinies: TinyCache, sampled: bool, overlap: str) -> None:
    """Batched (with the overlap scheduler on or off) against each request alone (on the serial engine)."""
    t = tinies[0]
    prompts, params = _mixed_requests(t, sampled)
    together = t.engine_for(overlap).generate(input_ids=prompts, sampling_params=params)
    assert isinstance(together, list) and len(together) == len(prompts)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        alone = t.memo(("alone", sampled, k), lambda: t.engine_for("off").generate(input_ids=ids, sampling_params=sp))
        assert together[k]["output_ids"] == alone["output_ids"], f"request {k}: {sp}"
        assert together[k]["meta_info"]["steps"] == alone["meta_info"]["steps"], f"request {k}: {sp}"
        check_meta(alone, ids, sp["max_new_tokens"], t.eos_id)
        if not sampled:  # and both equal the official algorithm
            want = t.reference(ids, sp["max_new_tokens"], *resolve(sp))
            assert (alone["output_ids"], alone["meta_info"]["steps"]) == want, f"request {k}: {sp}"


def test_seeded_sampling_is_reproducible_and_seed_dependent(tinies: TinyCache) -> None:
    t = tinies[0]
    ids = t.prompt(20, salt=300)
    sp = {"mode": "Q", "max_new_tokens": 40, "temperature": 0.8, "seed": 7}
    first = t.engine.generate(input_ids=ids, sampling_params=sp)
    again = t.engine.generate(input_ids=ids, sampling_params=sp)
    assert first["output_ids"] == again["output_ids"]
    others = [t.engine.generate(input_ids=ids, sampling_params=dict(sp, seed=s))["output_ids"] for s in (8, 9, 10)]
    assert any(o != first["output_ids"] for o in others)


# ----------------------------------------------------------------------------------------------
# float32: the engine in float32 against the naive reference in float32
# ----------------------------------------------------------------------------------------------

FLOAT32_CASES = [(1, 40, "S"), (20, 70, "Q"), (32, 33, "S-post1"), (100, 40, "th0.9-ed0.3")]


@pytest.fixture(scope="module")
def float32_pair(tinies: TinyCache) -> Iterator[tuple[Tiny, Any, NaiveLLaDA2]]:
    t = tinies[1]
    engine = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float32", progress=False)
    yield t, engine, NaiveLLaDA2(t.dir, dtype=torch.float32)
    engine.shutdown()


@pytest.mark.parametrize("case", FLOAT32_CASES, ids=[_case_id(c) for c in FLOAT32_CASES])
def test_engine_matches_naive_float32(float32_pair: tuple[Tiny, Any, NaiveLLaDA2], case: tuple[int, int, str]) -> None:
    t, engine, naive32 = float32_pair
    prompt_len, max_new, name = case
    ids = t.prompt(prompt_len, salt=400)
    params = dict(PARAMS[name], max_new_tokens=max_new, temperature=0.0)
    out = engine.generate(input_ids=ids, sampling_params=params)
    want_ids, want_steps = t.reference(ids, max_new, *resolve(params), model=naive32)
    assert out["output_ids"] == want_ids, f"prompt={ids} params={params}"
    assert out["meta_info"]["steps"] == want_steps, f"prompt={ids} params={params}"


def test_edit_trace_records_every_edit_and_changes_nothing(tinies: TinyCache) -> None:
    """trace_edits=True (the demo evaluation's edit accounting) gives the same outputs and steps, one trace
    entry per counted edit, and the last entry of a kept position is the token that position ends with."""
    t = tinies[0]
    prompts, params = _mixed_requests(t, sampled=False)
    traced = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False, trace_edits=True)
    try:
        got = traced.generate(input_ids=prompts, sampling_params=params)
    finally:
        traced.shutdown()
    want = t.engine.generate(input_ids=prompts, sampling_params=params)
    total = 0
    for g, w in zip(got, want):
        assert (g["output_ids"], g["meta_info"]["steps"]) == (w["output_ids"], w["meta_info"]["steps"])
        assert "edit_trace" not in w["meta_info"]
        trace = g["meta_info"]["edit_trace"]
        assert len(trace) == g["meta_info"]["edits"]
        last = {pos: new for pos, _, new in trace}
        for pos, new in last.items():
            assert pos >= 0 and old_differs(trace, pos)
            if pos < len(g["output_ids"]):
                assert g["output_ids"][pos] == new
        total += len(trace)
    assert total > 0  # the tiny model edits in these settings: the check above is not vacuous


def old_differs(trace: list[list[int]], pos: int) -> bool:
    return all(old != new for p, old, new in trace if p == pos)
