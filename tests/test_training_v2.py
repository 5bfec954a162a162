"""Demo model v2 training: the v2 task families (answers right by construction, train and eval disjoint, held-out
names and words never trained on), the multi-block-editing window layout, and one training step with it."""

from __future__ import annotations

import random
import re

import pytest
import torch

from test_training import SMALL_MODEL
from redraft.training import tasks
from redraft.training.data import window_mask
from redraft.training.tasks import FAMILIES, FAMILIES_V2, TaskGenerator, eval_set, sample, split_of


def check_answer(ex: tasks.Example) -> None:
    """Recompute the answer from the question text alone."""
    if ex.family == "count":
        a, b = map(int, re.fullmatch(r"Count from (\d+) to (\d+)\.", ex.user).groups())
        assert 0 <= a <= 899 and 10 <= b - a <= 40
        assert ex.answer.split(" ") == [str(n) for n in range(a, b + 1)]
    elif ex.family == "repeat":
        word, n = re.fullmatch(r"Repeat the word ([a-z]+) (\d+) times\.", ex.user).groups()
        assert 3 <= len(word) <= 7 and 4 <= int(n) <= 12
        assert ex.answer == " ".join([word] * int(n))
    elif ex.family == "code":
        name, op = re.fullmatch(r"Write a Python function named ([a-z_]+) that returns the (\w+) of a and b\.",
                                ex.user).groups()
        parts = name.split("_")
        assert 1 <= len(parts) <= 2 and all(3 <= len(p) <= 8 or p in tasks.CODE_WORDS for p in parts)
        assert ex.answer == f"def {name}(a, b):\n    return {tasks.CODE_OPS[op]}"
    assert ex.answer in ex.answers


@pytest.mark.parametrize("split", ["train", "eval"])
def test_v2_answers_are_right_by_construction(split: str) -> None:
    rng = random.Random(5)
    for family in ("count", "repeat", "code"):
        for _ in range(300):
            ex = sample(family, split, rng, suite="v2")
            check_answer(ex)
            assert split_of(ex.key, family) == split


def test_v2_train_never_draws_a_held_out_problem_name_or_word() -> None:
    held_out = eval_set(11, 150, FAMILIES_V2, suite="v2")
    held_keys = {ex.key for ex in held_out}
    held_names = {re.search(r"named ([a-z_]+)", ex.user).group(1) for ex in held_out if ex.family == "code"}
    held_words = {ex.user.split()[3] for ex in held_out if ex.family == "repeat"}
    assert len(held_names) > 100 and len(held_words) > 100
    gen = TaskGenerator(3, "train", suite="v2", invented_animals=0.3)
    for level in (0.2, 1.0):
        gen.level = level
        for ex in gen.batch(6000):
            assert ex.key not in held_keys, ex
            if ex.family == "code":
                assert re.search(r"named ([a-z_]+)", ex.user).group(1) not in held_names
            if ex.family == "repeat":
                assert ex.user.split()[3] not in held_words
    families = {ex.family for ex in gen.batch(500)}
    assert families == set(FAMILIES_V2)


def test_v1_suite_is_unchanged() -> None:
    """The bundled v1 model is evaluated on v1 problems: the default suite, list names only, no new family."""
    assert eval_set(1000, 20) == eval_set(1000, 20, FAMILIES, suite="v1")
    names = {re.search(r"named ([a-z_]+)", ex.user).group(1) for ex in eval_set(1000, 50) if ex.family == "code"}
    assert all(part in tasks.CODE_WORDS for n in names for part in n.split("_"))
    assert {ex.family for ex in TaskGenerator(0).batch(400)} == set(FAMILIES)
    with pytest.raises(ValueError):
        sample("count", "train", random.Random(0))  # not a v1 family


def brute_force_window(num_blocks: int, start: int, active: int, block: int) -> torch.Tensor:
    """docs/mbe.md in words: a committed query sees blocks up to its own; a window query sees every block up
    to the active one (committed blocks and the whole window)."""
    n = num_blocks * block
    out = torch.zeros(n, n, dtype=torch.bool)
    for q in range(n):
        for k in range(n):
            qb, kb = q // block, k // block
            out[q, k] = kb <= (active if qb >= start else qb)
    return out


@pytest.mark.parametrize("num_blocks,start,active", [(3, 1, 2), (4, 0, 3), (2, 1, 1), (5, 2, 4), (1, 0, 0)])
def test_window_mask_is_the_definition(num_blocks: int, start: int, active: int) -> None:
    assert torch.equal(window_mask(num_blocks, start, active, block_size=4), brute_force_window(num_blocks, start,
                                                                                                active, 4))


@pytest.fixture(scope="module")
def trainer_v2(tmp_path_factory):
    from redraft.training.train import TrainConfig, Trainer

    cfg = TrainConfig(run_dir=str(tmp_path_factory.mktemp("run_v2")), seed=0, steps=20, batch_size=12, lr=3e-3,
                      warmup_steps=1, vocab_size=700, model=dict(SMALL_MODEL), mtf_start=0, eval_every=0,
                      suite="v2", p_mbe=1.0, family_weights={"count": 1.0, "repeat": 1.0})
    return Trainer(cfg)


def test_window_examples_are_noised_as_the_engine_sees_them(trainer_v2) -> None:
    buckets = trainer_v2.make_batch(12)
    dual, windows = trainer_v2.split_windows(buckets)
    assert windows and not dual  # p_mbe = 1 and every count/repeat answer spans two blocks or more
    mask_id = trainer_v2.tok.mask_token_id
    for ex in windows:
        assert len(ex.xt) == (ex.active + 1) * 32 and ex.window_start <= ex.active
        before = slice(0, ex.window_start * 32)
        assert torch.equal(ex.xt[before], ex.x0[before]), "committed blocks must stay clean"
        earlier = slice(ex.window_start * 32, ex.active * 32)
        assert not (ex.xt[earlier] == mask_id).any(), "earlier window blocks hold no mask"
        assert (ex.xt[ex.active * 32 :] == mask_id).any(), "the active block has masks"
        assert ex.scored[ex.window_start * 32 :].sum() == ex.scored.sum()
    assert any(ex.window_start < ex.active for ex in windows)


def test_training_steps_with_windows_decrease_the_loss(trainer_v2) -> None:
    batch = trainer_v2.make_batch(12)
    trainer_v2.torch_gen.manual_seed(7)
    first = trainer_v2.train_step(batch)
    assert "acc_mbe_repair" in first, first  # the windows held wrong earlier-block tokens to repair
    losses = []
    for _ in range(6):
        trainer_v2.torch_gen.manual_seed(7)  # the same split and noise: a fixed batch
        losses.append(trainer_v2.train_step(batch)["loss"])
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < first["loss"] - 0.3, (first["loss"], losses)


def test_long_counts_widen_training_only() -> None:
    """long_counts: train count problems with B - A in 3..64 (stop where the prompt says, not after a learnt
    length); answers still right, the split still respected, and eval problems unchanged (10..40)."""
    gen = TaskGenerator(3, "train", {"count": 1.0}, suite="v2", long_counts=0.5)
    spans = []
    for ex in gen.batch(600):
        a, b = (int(x) for x in re.findall(r"\d+", ex.user))
        assert ex.answer == " ".join(str(n) for n in range(a, b + 1))
        assert split_of(ex.key, "count") == "train"
        spans.append(b - a)
    assert min(spans) < 10 and max(spans) > 40
    held_out = TaskGenerator(3, "eval", {"count": 1.0}, suite="v2", long_counts=0.5).batch(200)
    assert all(10 <= int(re.findall(r"\d+", ex.user)[1]) - int(re.findall(r"\d+", ex.user)[0]) <= 40
               for ex in held_out)


def test_low_count_starts_put_long_counts_at_the_digit_crossing() -> None:
    """low_count_starts: a share of the long counts start at A in 0..20 (one digit to two); still right by
    construction and train-split only; eval problems keep A uniform in 0..899."""
    gen = TaskGenerator(5, "train", {"count": 1.0}, suite="v3", long_counts=1.0, low_count_starts=0.5)
    starts = []
    for ex in gen.batch(400):
        a, b = (int(x) for x in re.findall(r"\d+", ex.user))
        assert ex.answer == " ".join(str(n) for n in range(a, b + 1)) and 3 <= b - a <= 64
        assert split_of(ex.key, "count") == "train"
        starts.append(a)
    low = sum(a <= 20 for a in starts) / len(starts)
    assert 0.4 < low < 0.6, low  # half from 0..20 (plus the 2% of uniform draws that land there)
    held_out = TaskGenerator(5, "eval", {"count": 1.0}, suite="v3", long_counts=1.0, low_count_starts=0.5).batch(300)
    assert sum(int(re.findall(r"\d+", ex.user)[0]) <= 20 for ex in held_out) < 30


# ----- suite v3: structured output (json, tool calls) --------------------------------------------------------
def test_v3_json_and_tool_answers_are_what_the_template_renders_and_held_out_like_math() -> None:
    from redraft.engine.text.tokenizer import Tokenizer
    from redraft.engine.text.model_path import BUNDLED_MODEL_DIR

    tok = Tokenizer.from_pretrained(BUNDLED_MODEL_DIR)
    assert tasks.SUITES["v3"] == (*FAMILIES_V2, "json", "tool")
    rng = random.Random(7)
    for split in ("train", "eval"):
        for family in ("json", "tool"):
            for i in range(40):
                ex = sample(family, split, rng, suite="v3")
                a, op, b = tasks.parse_math(ex.user.removesuffix(" Answer in JSON."))
                assert split_of(ex.key, family) == split == split_of(ex.key, "math")  # math's held-out rule
                assert ex.key == tasks.make_math(a, op, b).key
                value = a + b if op == "+" else a - b
                if family == "json":
                    assert ex.user.endswith(" Answer in JSON.") and ex.answer == f'{{"answer":{value}}}'
                    assert ex.tools == ()
                    continue
                name = {"+": "add", "-": "subtract"}[op]
                assert ex.tool_list() == [tasks.ADD_TOOL, tasks.SUB_TOOL]
                assert tasks.ADD_TOOL["function"]["description"] == "Add two integers."
                assert tasks.SUB_TOOL["function"]["description"] == "Subtract b from a."
                prompt = tasks.render_prompt(ex, tok)
                assert "<tools>" in prompt and prompt == tasks.render_prompt(ex)
                if i < 5:  # the answer is the template's rendering of the assistant's tool call
                    call = {"type": "function", "function": {"name": name, "arguments": {"a": a, "b": b}}}
                    full = tok.apply_chat_template(
                        [*ex.messages(), {"role": "assistant", "content": "", "tool_calls": [call]}],
                        tools=ex.tool_list(), add_generation_prompt=False)
                    assert full == prompt + ex.answer + "<|role_end|>"
                ids = tok.encode(ex.answer)
                assert ids[0] == tok.token_to_id("<tool_call>") == 8 and ids[-1] == tok.token_to_id("</tool_call>") == 9
    held = {ex.key for ex in eval_set(3, 100, ("math",), suite="v3")}
    gen = TaskGenerator(4, "train", suite="v3", weights={"json": 1.0, "tool": 1.0})
    assert not any(ex.key in held for ex in gen.batch(3000))


def test_v3_is_correct_parses_json_and_tool_calls() -> None:
    ex = tasks.make_json(12, "-", 30)
    assert tasks.is_correct(ex, '{"answer":-18}') and tasks.is_correct(ex, ' { "answer": -18 }\n')
    for wrong in ('{"answer":-17}', '{"answer":"-18"}', '{"answer":-18.0}', '{"answer":-18,"x":1}', "-18",
                  '{"answer":-18'):
        assert not tasks.is_correct(ex, wrong), wrong
    ex = tasks.make_tool(31, "-", 4)
    body = '{"name": "subtract", "arguments": {"a": 31, "b": 4}}'
    assert ex.answer == f"<tool_call>{body}</tool_call>"
    assert tasks.is_correct(ex, ex.answer) and tasks.is_correct(ex, body)  # special tokens kept or skipped
    assert tasks.is_correct(ex, '{"name":"subtract","arguments":{"b":4,"a":31}}')
    for wrong in ('{"name": "add", "arguments": {"a": 31, "b": 4}}', '{"name": "subtract", "arguments": {"a": 4, "b": 31}}',
                  '{"name": "subtract", "arguments": {"a": 31, "b": 5}}', '{"name": "subtract", "arguments": {"a": 31}}',
                  '{"name": "subtract", "arguments": {"a": 31, "b": true}}', "27", '<tool_call>{"name": "subtract"'):
        assert not tasks.is_correct(ex, wrong), wrong
    ex = tasks.make_tool(12, "+", 7)
    assert tasks.is_correct(ex, '{"name": "add", "arguments": {"a": 12, "b": 7}}')
    assert tasks.is_correct(ex, '{"name": "add", "arguments": {"a": 7, "b": 12}}')  # add commutes
    assert not tasks.is_correct(ex, '{"name": "add", "arguments": {"a": 12, "b": 8}}')
