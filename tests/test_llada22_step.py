"""The engine's Levenshtein step (LLaDA2.2) against the naive reference (tests/naive_llada22.py) on tiny 2.2
checkpoints, in float64: the same output ids AND the same forward count (meta_info.steps, stability forwards
included) and the same DELETE/SPLIT counts, for several checkpoints and settings (S- and Q-like thresholds,
steps 8 and 32, max_post_steps 0/3/16, a small max_steps_per_block), alone, batched with 2.1-step requests of the
same checkpoint, under preemption and with prefix-cache hits; and the admission refusals."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from naive_llada2 import NaiveLLaDA2, naive_generate
from naive_llada22 import Settings, naive_generate_llada22

import redraft

B = 32
SEEDS = (0, 1, 2)


class Tiny22:
    """One tiny 2.2 checkpoint (float64) with its engine and naive model; ids read from its files."""

    def __init__(self, model_dir: Path, seed: int) -> None:
        self.dir, self.seed = model_dir, seed
        cfg = json.loads((model_dir / "config.json").read_text())
        self.del_id, self.spl_id, self.vocab = cfg["delete_token_id"], cfg["split_token_id"], cfg["vocab_size"]
        self.gen = json.loads((model_dir / "generation_config.json").read_text())
        added = {t["content"]: t["id"] for t in json.loads((model_dir / "tokenizer.json").read_text())["added_tokens"]}
        self.mask_id, self.eos_id = added["<|mask|>"], added["<|endoftext|>"]
        self.specials = set(added.values())
        self.engine = redraft.Engine(model_path=str(model_dir), device="cpu", dtype="float64", progress=False)
        self.naive = NaiveLLaDA2(model_dir, dtype=torch.float64)

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        rng = random.Random(f"22/{self.seed}/{length}/{salt}")
        ordinary = [i for i in range(self.vocab) if i not in self.specials]
        return [rng.choice(ordinary) for _ in range(length)]

    def settings(self, sp: dict[str, Any]) -> Settings:
        """The settings a sampling_params dict asks for, from the definition: mode S/Q's thresholds, else
        generation_config.json's values, else the spec's."""
        preset = {"S": (0.5, 0.0), "Q": (0.7, 0.5)}.get(sp.get("mode", ""), (self.gen.get("threshold", 0.5),
                                                                        self.gen.get("edit_threshold", 0.0)))
        return Settings(threshold=sp.get("threshold", preset[0]), edit_threshold=sp.get("edit_threshold", preset[1]),
                        steps=sp.get("steps", self.gen.get("steps", 32)),
                        max_post_steps=sp.get("max_post_steps", self.gen.get("max_post_steps", 16)),
                        max_steps_per_block=sp.get("max_steps_per_block", self.gen.get("max_steps_per_block", 1000)))

    def reference(self, ids: list[int], sp: dict[str, Any]) -> tuple[list[int], int, int, int]:
        """(output ids, forwards, deletions, insertions) of the definition."""
        stops = set() if sp.get("ignore_eos") else {self.eos_id}
        out, c = naive_generate_llada22(self.naive, ids, max_new_tokens=sp["max_new_tokens"],
                                        settings=self.settings(sp), mask_id=self.mask_id, del_id=self.del_id,
                                        spl_id=self.spl_id, stop_ids=stops)
        return out, c.forwards, c.deletions, c.insertions

    def reference_threshold(self, ids: list[int], sp: dict[str, Any]) -> tuple[list[int], int]:
        """The 2.1 step on this checkpoint: the naive 2.1 loop with DELETE and SPLIT never proposed."""
        def suppress(logits: torch.Tensor, *_: Any) -> torch.Tensor:
            logits = logits.clone()
            logits[:, [self.del_id, self.spl_id]] = float("-inf")
            return logits

        th, et = {"S": (0.5, 0.0), "Q": (0.7, 0.5)}[sp.get("mode", "Q")]
        return naive_generate(self.naive, ids, max_new_tokens=sp["max_new_tokens"], threshold=th, edit_threshold=et,
                              max_post_steps=sp.get("max_post_steps", 16), mask_id=self.mask_id, eos_id=self.eos_id,
                              controls=suppress)

    def check(self, out: dict, want: tuple) -> None:
        meta = out["meta_info"]
        got = (out["output_ids"], meta["steps"], meta["deletions"], meta["insertions"])
        assert got == want
        assert not {self.mask_id, self.del_id, self.spl_id} & set(out["output_ids"])
        assert meta["decoder"] == "levenshtein"


class Cache(dict):
    def __init__(self, tiny_checkpoint: Callable[..., Path]) -> None:
        super().__init__()
        self.tiny_checkpoint = tiny_checkpoint

    def __missing__(self, seed: int) -> Tiny22:
        t = self[seed] = Tiny22(self.tiny_checkpoint(seed=seed, dtype="float64", llada22=True), seed)
        return t


@pytest.fixture(scope="module")
def t22(tiny_checkpoint: Callable[..., Path]) -> Iterator[Cache]:
    cache = Cache(tiny_checkpoint)
    yield cache
    for t in cache.values():
        t.engine.shutdown()


PARAMS: dict[str, dict[str, Any]] = {
    "default": {},
    "S": {"mode": "S"},
    "Q-steps8": {"mode": "Q", "steps": 8},
    "S-post0": {"mode": "S", "max_post_steps": 0},
    "Q-post3-steps8": {"mode": "Q", "max_post_steps": 3, "steps": 8},
    "cap4": {"threshold": 0.95, "max_steps_per_block": 4},
    "th0.3-ed0.9-post3": {"threshold": 0.3, "edit_threshold": 0.9, "max_post_steps": 3},
}
# (checkpoint seed, prompt length, max_new_tokens, params name): prompts ending mid-block, on a block boundary,
# of one token; outputs inside one block and across several
QUICK = [(0, 20, 40, "default"), (1, 1, 33, "Q-steps8"), (2, 31, 40, "S-post0"), (0, 32, 20, "cap4"),
         (1, 45, 30, "Q-post3-steps8")]
SLOW = [(0, 5, 70, "S"), (1, 64, 50, "th0.3-ed0.9-post3"), (2, 10, 70, "Q-steps8"), (2, 40, 64, "default"),
        (0, 100, 40, "S-post0"), (1, 20, 70, "cap4"), (2, 33, 64, "Q-post3-steps8")]


def _run(t: Tiny22, p: int, n: int, name: str, salt: int = 0) -> None:
    ids = t.prompt(p, salt)
    sp = dict(PARAMS[name], max_new_tokens=n)
    t.check(t.engine.generate(input_ids=ids, sampling_params=sp), t.reference(ids, sp))


@pytest.mark.parametrize("case", QUICK, ids=lambda c: f"ckpt{c[0]}-prompt{c[1]}-new{c[2]}-{c[3]}")
def test_engine_matches_the_definition(t22: Cache, case: tuple[int, int, int, str]) -> None:
    _run(t22[case[0]], *case[1:])


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW, ids=lambda c: f"ckpt{c[0]}-prompt{c[1]}-new{c[2]}-{c[3]}")
def test_engine_matches_the_definition_more(t22: Cache, case: tuple[int, int, int, str]) -> None:
    _run(t22[case[0]], *case[1:], salt=1)


def test_every_path_runs_on_the_tiny_checkpoints(t22: Cache) -> None:
    """The tiny 2.2 weights make the step delete and insert, end blocks both ways (a forward that found no mask
    and changed nothing; a final round then the stability forward), and the engine follows: else the tests
    above would prove little."""
    sp = {"mode": "Q", "max_new_tokens": 64, "ignore_eos": True}
    paths = {"deletions": 0, "insertions": 0, "converged": 0, "final_rounds": 0}
    for seed, salt in ((0, 1), (2, 1)):
        t = t22[seed]
        ids = t.prompt(20, salt=salt)
        out, c = naive_generate_llada22(t.naive, ids, max_new_tokens=64, settings=t.settings(sp), mask_id=t.mask_id,
                                        del_id=t.del_id, spl_id=t.spl_id, stop_ids=set())
        paths = {k: v + getattr(c, k) for k, v in paths.items()}
        t.check(t.engine.generate(input_ids=ids, sampling_params=sp), (out, c.forwards, c.deletions, c.insertions))
    assert all(paths.values()), paths


def test_levenshtein_rows_decide_without_full_logits(t22: Cache, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Levenshtein request that needs nothing but the top-1 decides from vocabulary chunks (no [N, L, V]
    logits in its forwards), and the step computes whole vocabulary rows only at the positions it reads them
    (a structural proposal in a final round, an anti-loop escape), still equal to the definition; a 2.1-step
    request of the same checkpoint as well (its argmax without DELETE and SPLIT)."""
    t = t22[0]
    runner = t.engine.core.runner
    forward, logits_from = runner.forward, runner.logits_at
    full_logits, positions, rows_read = [], [0], [0]

    def spy_forward(plan):
        fwd = forward(plan)
        full_logits.append(fwd.logits is not None)
        return fwd

    def spy_logits_from(hidden, width):
        at = logits_from(hidden, width)

        def counted(r, c):
            rows_read[0] += len(r)
            return at(r, c)

        return counted

    monkeypatch.setattr(runner, "forward", spy_forward)
    monkeypatch.setattr(runner, "logits_at", spy_logits_from)
    sp = {"mode": "Q", "max_new_tokens": 64, "ignore_eos": True}
    for salt in (1, 2, 3):
        ids = t.prompt(20, salt=salt)
        out = t.engine.generate(input_ids=ids, sampling_params=sp)
        t.check(out, t.reference(ids, sp))
        positions[0] += out["meta_info"]["steps"] * B
    assert 0 < rows_read[0] < positions[0] / 10, (rows_read, positions)
    # the 2.1 step's rows of this checkpoint too: their chunked argmax leaves DELETE and SPLIT out
    for salt, mode in ((1, "S"), (2, "Q")):
        ids, sp = t.prompt(33, salt=salt), {"decoder": "threshold", "mode": mode, "max_new_tokens": 40}
        assert _got(t, t.engine.generate(input_ids=ids, sampling_params=sp), sp) == _want(t, ids, sp)
    assert full_logits and not any(full_logits)  # every forward: top-1 only


def _mixed(t: Tiny22) -> tuple[list[list[int]], list[dict[str, Any]]]:
    prompts = [t.prompt(n, salt=7) for n in (3, 20, 33, 50, 64)]
    params = [{"max_new_tokens": 40}, {"decoder": "threshold", "mode": "S", "max_new_tokens": 50},
              {"mode": "Q", "steps": 8, "max_new_tokens": 40},
              {"decoder": "threshold", "mode": "Q", "max_new_tokens": 30},
              {"max_post_steps": 0, "max_new_tokens": 40, "ignore_eos": True}]
    return prompts, params


def _want(t: Tiny22, ids: list[int], sp: dict[str, Any]) -> tuple:
    if sp.get("decoder") == "threshold":
        return t.reference_threshold(ids, sp)
    return t.reference(ids, sp)


def _got(t: Tiny22, out: dict, sp: dict[str, Any]) -> tuple:
    meta = out["meta_info"]
    assert not {t.mask_id, t.del_id, t.spl_id} & set(out["output_ids"])
    if sp.get("decoder") == "threshold":
        assert meta["deletions"] == meta["insertions"] == 0
        return out["output_ids"], meta["steps"]
    return out["output_ids"], meta["steps"], meta["deletions"], meta["insertions"]


def test_batched_with_threshold_requests(t22: Cache) -> None:
    """Levenshtein rows and 2.1-step rows of the same checkpoint in one batch, each its own definition's."""
    t = t22[1]
    prompts, params = _mixed(t)
    together = t.engine.generate(input_ids=prompts, sampling_params=params)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        assert _got(t, together[k], sp) == _want(t, ids, sp), f"request {k}: {sp}"


def test_exact_under_forced_preemption(t22: Cache) -> None:
    """A KV cache far too small for the batch: blocks are preempted mid-way and restart from their entry."""
    t = t22[2]
    prompts, params = _mixed(t)
    params = [dict(p, ignore_eos=True) for p in params]
    small = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False,
                           max_total_tokens=6 * B)
    try:
        got = small.generate(input_ids=prompts, sampling_params=params)
        assert small.core.scheduler.num_preemptions > 0, "nothing was preempted"
    finally:
        small.shutdown()
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        if sp.get("decoder") != "threshold":  # (the naive 2.1 loop knows no ignore_eos)
            assert _got(t, got[k], sp) == _want(t, ids, sp), f"request {k}: {sp}"


def test_exact_with_prefix_cache_hits(t22: Cache) -> None:
    """A second turn whose prompt extends the first turn's answer reads its committed blocks from the radix tree."""
    t = t22[0]
    ids = t.prompt(40, salt=3)
    sp = {"max_new_tokens": 60, "ignore_eos": True}
    first = t.engine.generate(input_ids=ids, sampling_params=sp)
    follow = ids + first["output_ids"] + t.prompt(9, salt=4)
    second = t.engine.generate(input_ids=follow, sampling_params=dict(sp, max_new_tokens=40))
    assert second["meta_info"]["cached_tokens"] >= 2 * B, second["meta_info"]
    t.check(second, t.reference(follow, dict(sp, max_new_tokens=40)))


def test_refusals(t22: Cache, ckpt: Path) -> None:
    t = t22[0]
    ids = t.prompt(10)
    with pytest.raises(ValueError, match="mbe_window 2 is not supported with decoder 'levenshtein'"):
        t.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "mbe_window": 2})
    with pytest.raises(ValueError, match="structured output .* not supported with decoder 'levenshtein'"):
        t.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "regex": "[a-z]+"})
    # both are fine with the 2.1 step on the same checkpoint
    out = t.engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "mbe_window": 2,
                                                            "decoder": "threshold"})
    assert out["meta_info"]["decoder"] == "threshold"
    old = redraft.Engine(model_path=str(ckpt), device="cpu", progress=False)
    try:
        with pytest.raises(ValueError, match="needs a LLaDA2.2 checkpoint"):
            old.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "decoder": "levenshtein"})
        assert old.generate(input_ids=ids, sampling_params={"max_new_tokens": 8})["meta_info"]["decoder"] == "threshold"
    finally:
        old.shutdown()


@pytest.mark.slow
def test_tensor_parallel_two_ranks(t22: Cache) -> None:
    """--tp-size 2 (gloo, float64): the Levenshtein rows and the 2.1 rows give their definitions' tokens."""
    t = t22[1]
    prompts, params = _mixed(t)
    with redraft.Engine(str(t.dir), dtype="float64", progress=False, tp_size=2) as two:
        got = two.generate(input_ids=prompts[:3], sampling_params=params[:3])
    for k in range(3):
        assert _got(t, got[k], params[k]) == _want(t, prompts[k], params[k]), f"request {k}"


def _sse_chunks(resp: "httpx.Response") -> list[dict]:
    lines = [ln for ln in resp.text.splitlines() if ln.startswith("data: {")]
    return [json.loads(ln[len("data: "):]) for ln in lines]


@pytest.mark.slow
def test_redraft_serve(t22: Cache, tmp_path: Path) -> None:
    """A live `redraft serve` on a 2.2 checkpoint: /generate gives the definition's ids and counts, its stream
    one cumulative chunk per committed block, the OpenAI route takes `decoder` in its body, the 400s name the
    field, and /metrics counts the structural edits."""
    import httpx

    from live_server import RedraftServer

    t = t22[0]
    server = RedraftServer(t.dir, tmp_path, ["--dtype", "float64"]).start()
    try:
        with httpx.Client(base_url=server.url, timeout=120.0) as c:
            ids, sp = t.prompt(20, salt=9), {"max_new_tokens": 70}
            want = t.reference(ids, sp)
            out = c.post("/generate", json={"input_ids": ids, "sampling_params": sp}).json()
            t.check(out, want)
            chunks = _sse_chunks(c.post("/generate", json={"input_ids": ids, "sampling_params": sp, "stream": True}))
            assert chunks[-1]["output_ids"] == want[0]
            assert len(chunks) == chunks[-1]["meta_info"]["blocks"]  # one chunk per committed block
            for a, b in zip(chunks, chunks[1:]):
                assert b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
            body = {"model": "tiny", "prompt": ids, "max_tokens": 20, "decoder": "threshold", "mode": "S"}
            r = c.post("/v1/completions", json=body)
            assert r.status_code == 200 and "deletions" not in r.json()["diffusion"], r.text
            r = c.post("/v1/completions", json={**body, "decoder": "levenshtein", "max_tokens": 64})
            assert r.status_code == 200, r.text
            diffusion = r.json()["diffusion"]
            assert diffusion["deletions"] > 0 and diffusion["forwards"] > 0, diffusion
            r = c.post("/v1/completions", json={**body, "decoder": "levenshtein", "mbe_window": 2})
            assert r.status_code == 400 and r.json()["error"]["param"] == "mbe_window", r.text
            metrics = c.get("/metrics").text
        deletes = [ln for ln in metrics.splitlines()
                   if ln.startswith("redraft:structural_edits_total{") and 'op="delete"' in ln]
        assert sum(float(ln.rsplit(" ", 1)[1]) for ln in deletes) == 2 * want[2] + diffusion["deletions"]
    finally:
        server.stop()


def test_a_failed_batch_restarts_levenshtein_blocks_from_their_entry(t22: Cache) -> None:
    """A forward that fails for one request mid-way through another's block: the batch is rerun in halves, the
    Levenshtein row (whose step state lives on the device only) restarts its block from its entry, and its
    tokens and forward count are still the definition's."""
    from redraft.engine.runtime.faults import FaultInjector
    from redraft.protocol.sampling_params import SamplingParams

    t = t22[2]
    core = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False).core
    try:
        core.faults = core.runner.faults = FaultInjector([("forward", "bad")])
        # settings under which the schedule and the hard cap decide (a row reloaded mid-block would differ)
        ids, sp = t.prompt(25, salt=11), {"max_new_tokens": 45, "threshold": 0.95, "steps": 8,
                                          "max_steps_per_block": 9}
        core.add_request("good", ids, SamplingParams.from_dict(sp))
        got, meta, bad = [], {}, None
        for i in range(400):
            if i == 4:
                core.add_request("bad", t.prompt(5), SamplingParams.from_dict({"max_new_tokens": 8}))
            for out in core.step():
                if out.rid == "good":
                    got += out.new_ids
                    meta = out.meta if out.finished else meta
                else:
                    bad = out.finish_reason
            if not core.has_work():
                break
        assert bad is not None and bad["type"] == "error"
        assert (got, meta["steps"], meta["deletions"], meta["insertions"]) == t.reference(ids, sp)
    finally:
        core.shutdown()


def test_logprobs_and_score_never_show_structural_tokens(t22: Cache) -> None:
    t = t22[0]
    ids = t.prompt(12, salt=5)
    sp = {"max_new_tokens": 40, "logprobs": True, "top_logprobs": 5}
    out = t.engine.generate(input_ids=ids, sampling_params=sp)
    assert out["output_ids"] == t.reference(ids, {"max_new_tokens": 40})[0]  # logprobs change nothing
    lps, tops = out["meta_info"]["output_token_logprobs"], out["meta_info"]["output_top_logprobs"]
    assert len(lps) == len(out["output_ids"])
    assert not {t.del_id, t.spl_id, t.mask_id} & {tok for top in tops for _, tok, *_ in top}
    echo = t.engine.prompt_logprobs(ids + out["output_ids"], top_k=5)  # /score's and echo's path
    alternatives = {tok for entry in echo if entry is not None for tok, _ in entry[1]}
    assert len(alternatives) > 5 and not {t.del_id, t.spl_id, t.mask_id} & alternatives


def test_seeded_sampling_is_batch_invariant(t22: Cache) -> None:
    """temperature > 0 (outside the definition, which is greedy): the proposals are sampled as for the 2.1 step,
    the rest of the step as defined; a request's tokens do not depend on its batch neighbours."""
    t = t22[1]
    prompts, params = _mixed(t)
    params = [dict(p, temperature=0.8, seed=40 + k) for k, p in enumerate(params)]
    together = t.engine.generate(input_ids=prompts, sampling_params=params)
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        alone = t.engine.generate(input_ids=ids, sampling_params=sp)
        assert together[k]["output_ids"] == alone["output_ids"], f"request {k}"
        assert not {t.mask_id, t.del_id, t.spl_id} & set(alone["output_ids"])


def test_generate_command(t22: Cache, capsys: pytest.CaptureFixture) -> None:
    from redraft.cli import main

    t = t22[0]
    args = ["generate", "--model", str(t.dir), "--dtype", "float64", "--raw", "Hello there", "--max-new-tokens", "40",
            "--json"]
    assert main([*args, "--steps", "8", "--max-steps-per-block", "6"]) == 0
    out = json.loads(capsys.readouterr().out)
    ids = t.engine.tokenizer.encode("Hello there")
    want = t.reference(ids, {"max_new_tokens": 40, "steps": 8, "max_steps_per_block": 6})
    t.check(out, want)
    assert main([*args, "--decoder", "threshold"]) == 0
    assert json.loads(capsys.readouterr().out)["meta_info"]["decoder"] == "threshold"


@pytest.mark.parametrize("kv_tokens", [None, 6 * B], ids=["roomy", "preempted"])
def test_exact_with_the_overlap_scheduler(t22: Cache, kv_tokens: int | None) -> None:
    """The overlap scheduler (engine/runtime/overlap.py) on Levenshtein and 2.1-step rows of one batch: the definition's
    ids and forwards, with speculative forwards actually used (and, with a tiny KV pool, preemption)."""
    t = t22[1]
    prompts, params = _mixed(t)
    params = [dict(p, ignore_eos=True) for p in params] if kv_tokens else params
    extra = {"max_total_tokens": kv_tokens} if kv_tokens else {}
    eng = redraft.Engine(model_path=str(t.dir), device="cpu", dtype="float64", progress=False,
                         enable_overlap=True, **extra)
    try:
        assert eng.core.info()["overlap"] == "on"
        got = eng.generate(input_ids=prompts, sampling_params=params)
        assert eng.core.num_overlapped_forwards > 0
        if kv_tokens:
            assert eng.core.scheduler.num_preemptions > 0, "nothing was preempted"
    finally:
        eng.shutdown()
    for k, (ids, sp) in enumerate(zip(prompts, params)):
        if not (kv_tokens and sp.get("decoder") == "threshold"):  # (the naive 2.1 loop knows no ignore_eos)
            assert _got(t, got[k], sp) == _want(t, ids, sp), f"request {k}: {sp}"
