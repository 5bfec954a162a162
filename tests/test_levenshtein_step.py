"""LLaDA2.2's Levenshtein step (engine/decoding/levenshtein.py) against the scalar reference (tests/naive_llada22.py):
the structural scan on hand-made and random blocks, and whole blocks of iterations on synthetic logits, several
rows batched with different settings, ties included, and logits built to loop (the anti-loop escape)."""

from __future__ import annotations

import random

import pytest
import torch

from naive_llada22 import Block, Counts, Settings, structural_scan
from redraft.engine.decoding.levenshtein import LevenshteinSlots, StructuralIds, logits_at_of, structural_scan as batched_scan

M, D, S = 5, 6, 7  # MASK, DELETE, SPLIT in the synthetic vocabulary of 8 ids
IDS = StructuralIds(mask=M, delete=D, split=S)
V = 8


def oracle(x, y, orig, prompt):
    return structural_scan(x, y, orig, prompt, mask_id=M, del_id=D, spl_id=S)


def engine_scan(x, y, orig, prompt):
    z, zo = batched_scan(torch.tensor([x]), torch.tensor([y]), torch.tensor([orig]), torch.tensor([prompt]), IDS)
    return z[0].tolist(), zo[0].tolist()


HAND = [
    # (x, y, orig, prompt) -> (z, zo)
    (([1, 2, 3, 4], [1, D, 3, 4], [True] * 4, [False] * 4), ([1, 3, 4, M], [True, True, True, False])),
    (([1, 2, 3, 4], [1, S, 3, 4], [False, True, False, True], [False] * 4),
     ([1, M, 2, 3], [False, False, True, False])),  # x's token (2) follows the inserted mask; 4 falls off
    (([M, M, 3, 4], [S, D, S, 0], [True, True, False, False], [False] * 4), ([M, M, M, 3], [False, True, False, False])),
    (([9, 2, 3, 4], [D, S, D, D], [False, True, True, True], [True, False, False, False]),  # a literal DEL in the prompt
     ([D, M, 2, M], [False, False, True, False])),
    (([1, 2, 3, 4], [D, D, D, D], [True] * 4, [False] * 4), ([M, M, M, M], [False] * 4)),
    (([1, 2, 3, 4], [S, S, S, S], [True] * 4, [False] * 4), ([M, 1, M, 2], [False, True, False, True])),
]


@pytest.mark.parametrize("case", HAND)
def test_scan_on_hand_made_blocks(case):
    (x, y, orig, prompt), expected = case
    assert oracle(x, y, orig, prompt) == expected
    assert engine_scan(x, y, orig, prompt) == expected


def test_scan_on_random_blocks_batched():
    rng = random.Random(0)
    rows = []
    for _ in range(300):
        b = 32
        n_prompt = rng.choice([0, 0, 3, 17])
        x = [rng.randrange(V) for _ in range(b)]
        y = [rng.choice([D, S, rng.randrange(V)]) if rng.random() < 0.5 else x[i] for i in range(b)]
        orig = [rng.random() < 0.5 for _ in range(b)]
        prompt = [i < n_prompt for i in range(b)]
        orig = [o and not p for o, p in zip(orig, prompt)]
        rows.append((x, y, orig, prompt))
    z, zo = batched_scan(*(torch.tensor([r[k] for r in rows]) for k in range(4)), IDS)
    for j, r in enumerate(rows):
        assert (z[j].tolist(), zo[j].tolist()) == oracle(*r)


# ---- whole blocks on synthetic logits ----------------------------------------------------------------------------
def synthetic_logits(x: list[int], salt: int, kind: str) -> torch.Tensor:
    """[B, V] float64 logits that depend only on the block's tokens (a stand-in for a model): `random` draws them
    from a generator seeded by the block; `cycle` proposes the next token of a short cycle everywhere (T2T then
    revisits earlier blocks, which the anti-loop must break); `ties` rounds random logits to create equal p."""
    gen = torch.Generator().manual_seed(hash((tuple(x), salt)) % (2**31))
    logits = torch.randn(len(x), V, generator=gen, dtype=torch.float64) * 2.0
    logits[:, D] += 0.8
    logits[:, S] += 0.6
    if kind == "cycle":
        for i, t in enumerate(x):
            logits[i, (t + 1) % 3 if t < 3 else i % 3] += 6.0
    if kind == "ties":
        logits = (logits * 2).round() / 2
    logits[:, M] = 3.0  # MASK's logit is dropped by both sides
    return logits


def make_block(rng: random.Random, b: int) -> tuple[list[int], list[bool]]:
    n_prompt = rng.choice([0, 0, 2, 5])
    prompt = [i < n_prompt for i in range(b)]
    return [rng.randrange(5) if p else M for p in prompt], prompt


SETTINGS = [
    Settings(0.5, 0.0, 8, 16, 1000),
    Settings(0.7, 0.5, 32, 3, 1000),
    Settings(0.5, 0.0, 4, 0, 1000),
    Settings(0.9, 0.1, 8, 16, 6),  # the hard cap
    Settings(0.3, 0.0, 2, 1, 1000),
]


@pytest.mark.parametrize("kind", ["random", "cycle", "ties"])
def test_step_matches_the_scalar_reference(kind: str) -> None:
    """Rows of different settings advance together, one synthetic forward per iteration, until every block
    commits; tokens, ends and the counts of DELETE and SPLIT match the reference at every iteration."""
    rng, b, n = random.Random(kind), 8, 10
    slots = LevenshteinSlots(n + 2, b, IDS, torch.device("cpu"))
    blocks, done, counts, totals = [], [False] * n, [Counts() for _ in range(n)], [[0, 0] for _ in range(n)]
    row_slots = list(range(2, n + 2))  # rows live in slots other than their index
    thr, ethr = [], []
    for j in range(n):
        s = SETTINGS[j % len(SETTINGS)]
        x, prompt = make_block(rng, b)
        blocks.append(Block(x, prompt, s, (M, D, S)))
        slots.load(row_slots[j], torch.tensor(x), ~torch.tensor(prompt), s.steps, s.max_post_steps,
                   s.max_steps_per_block)
        thr.append(s.threshold)
        ethr.append(s.edit_threshold)
    tokens = torch.tensor([blk.x for blk in blocks])
    escapes = 0
    for it in range(200):
        live = [j for j in range(n) if not done[j]]
        if not live:
            break
        logits = torch.stack([synthetic_logits(blocks[j].x, j, kind) for j in live])  # [n, B, V]
        logits[..., M] = float("-inf")
        v = logits.argmax(-1)
        p = torch.softmax(logits, -1).gather(-1, v[..., None])[..., 0]
        idx = torch.tensor([row_slots[j] for j in live])
        res = slots.advance(logits_at_of(logits), v, p, idx, tokens[live],
                            torch.tensor([thr[j] for j in live], dtype=torch.float64),
                            torch.tensor([ethr[j] for j in live], dtype=torch.float64))
        for k, j in enumerate(live):
            blk = blocks[j]
            ended = True if blk.finalized else blk.iterate(logits[k], counts[j])
            assert bool(res.ended[k]) == ended, (it, j)
            assert res.tokens[k].tolist() == blk.x, (it, j)
            totals[j][0] += int(res.deletions[k])
            totals[j][1] += int(res.insertions[k])
            tokens[j] = res.tokens[k]
            done[j] = ended
        escapes = sum(c.escapes for c in counts)
    assert all(done)
    assert [[c.deletions, c.insertions] for c in counts] == totals
    assert all(M not in blk.x and D not in blk.x[5:] and S not in blk.x[5:] for blk in blocks)
    if kind == "cycle":
        assert escapes > 0, "the cycling logits never reached the anti-loop"
    assert sum(c.final_rounds for c in counts) > 0


# ---- the request's settings ------------------------------------------------------------------------------------
def test_settings_resolve_through_the_defaults_chain() -> None:
    from redraft.protocol.sampling_params import Defaults, SamplingParams, SamplingParamsError, resolve

    checkpoint = Defaults(decoder="levenshtein")  # what startup adds for a checkpoint with DELETE and SPLIT
    r = resolve(SamplingParams(), [Defaults(), checkpoint])
    assert (r.decoder, r.mode, r.threshold, r.edit_threshold, r.max_post_steps, r.steps, r.max_steps_per_block) == \
        ("levenshtein", "S", 0.5, 0.0, 16, 32, 1000)
    gen = Defaults.from_generation_config({"threshold": 0.6, "steps": 8, "max_steps_per_block": 50})
    r = resolve(SamplingParams(), [gen, checkpoint])
    assert (r.threshold, r.edit_threshold, r.steps, r.max_steps_per_block) == (0.6, 0.0, 8, 50)
    r = resolve(SamplingParams(mode="Q", steps=4, decoder="threshold"), [gen, checkpoint])
    assert (r.decoder, r.threshold, r.edit_threshold, r.steps) == ("threshold", 0.7, 0.5, 4)
    r = resolve(SamplingParams(), [])  # a 2.1 checkpoint: unchanged
    assert (r.decoder, r.mode, r.threshold) == ("threshold", "Q", 0.7)
    for bad in ({"decoder": "beam"}, {"steps": 0}, {"max_steps_per_block": 5000}, {"steps": 2.5}):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams.from_dict(bad)
        assert err.value.param == next(iter(bad))


def test_make_tiny_cli(tmp_path) -> None:
    import json

    from redraft.cli import main

    assert main(["make-tiny", str(tmp_path / "t"), "--llada22", "--seed", "3"]) == 0
    raw = json.loads((tmp_path / "t" / "config.json").read_text())
    assert raw["delete_token_id"] == 448 and raw["split_token_id"] == 449 and raw["expert_capacity"] == 4
