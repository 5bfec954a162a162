"""Demo suite v4: the open-ended families (list, sentence) and their checker, the skewed answer distributions that
put branch-point confidences between S's and Q's thresholds, and the checker-based evaluation."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from redraft.training import open_tasks, tasks
from redraft.training.evaluate import failure_kind, summarise
from redraft.training.open_tasks import check_list, check_sentence
from redraft.training.tasks import FAMILIES_V3, FAMILIES_V4, TaskGenerator, eval_set, is_correct, sample, split_of


@pytest.mark.parametrize("text", ["apple, pear, plum", "plum, apple, banana", " mango, peach, lemon "])
def test_list_checker_accepts_any_three_distinct_fruits_in_any_order(text: str) -> None:
    assert check_list("Name three fruits other than orange.", text).valid


@pytest.mark.parametrize("text,why", [
    ("apple, apple, plum", "a duplicate item"),
    ("apple, orange, plum", "the excluded 'orange'"),
    ("apple, plum", "2 items, not 3"),
    ("apple, pear, plum, mango", "4 items, not 3"),
    ("apple, red, plum", "not one of the fruits: 'red'"),
    ("apple, pear plum", "2 items, not 3"),
])
def test_list_checker_rejects_with_the_reason(text: str, why: str) -> None:
    verdict = check_list("Name three fruits other than orange.", text)
    assert not verdict.valid and verdict.reason == why


@pytest.mark.parametrize("text", ["A cat runs.", "The cat runs.", "The cats run.", "Two cats sleep today.",
                                  "An old cat eats.", "A big cat jumps today.", "The happy cats run."])
def test_sentence_checker_accepts_agreeing_sentences(text: str) -> None:
    assert check_sentence("Write a sentence about a cat.", text).valid


@pytest.mark.parametrize("user,text,kind", [
    ("Write a sentence about an owl.", "A owl runs.", "a/an"),
    ("Write a sentence about a cat.", "An cat runs.", "a/an"),
    ("Write a sentence about a cat.", "A old cat runs.", "a/an"),
    ("Write a sentence about a cat.", "A cats run.", "a/an"),
    ("Write a sentence about a cat.", "Two cat runs.", "a/an"),
    ("Write a sentence about a cat.", "The cats runs.", "agreement"),
    ("Write a sentence about a cat.", "The cat run.", "agreement"),
    ("Write a sentence about a cat.", "The dog runs.", "wrong noun"),
    ("Write a sentence about a cat.", "The cat cat runs.", "form"),
    ("Write a sentence about a cat.", "The cat runs", "form"),
])
def test_sentence_checker_rejects_broken_agreement(user: str, text: str, kind: str) -> None:
    verdict = check_sentence(user, text)
    assert not verdict.valid and failure_kind(verdict.reason) == kind, verdict


@pytest.mark.parametrize("split", ["train", "eval"])
def test_every_drawn_answer_is_valid_and_listed(split: str) -> None:
    rng = random.Random(3)
    for family in ("list", "sentence"):
        for _ in range(300):
            ex = sample(family, split, rng, suite="v4")
            assert is_correct(ex, ex.answer) and ex.answer in ex.answers
            assert all(is_correct(ex, a) for a in ex.answers[:50])
            assert split_of(ex.key, family) == split


def test_branch_points_sit_between_the_thresholds() -> None:
    """The popular choice is taken about 62% of the time: in (0.5, 0.7), where S commits and Q waits."""
    rng = random.Random(0)
    first = Counter(open_tasks.draw_list(rng, "colors", 3, "pink")[0] for _ in range(4000))
    assert 0.58 < first["red"] / 4000 < 0.66
    second = Counter(open_tasks.draw_list(rng, "colors", 3, "red")[1] for _ in range(4000))
    assert 0.55 < second["green"] / 4000 < 0.66  # "blue" is the first popular one once red is excluded
    sentences = [open_tasks.draw_sentence(rng, "cat") for _ in range(4000)]
    assert 0.58 < sum(s.endswith("runs.") or s.endswith("run.") or " run" in s for s in sentences) / 4000 < 0.66
    assert 0.58 < sum(not s.endswith("today.") for s in sentences) / 4000 < 0.66


def test_v4_keeps_the_v3_problems_and_holds_out_whole_prompts() -> None:
    v3 = eval_set(1000, 10, FAMILIES_V3, suite="v3")
    v4 = eval_set(1000, 10, FAMILIES_V4, suite="v4")
    assert v4[: len(v3)] == v3
    held = {ex.key for ex in v4 if ex.family in ("list", "sentence")}
    assert {ex.family for ex in v4[len(v3):]} == {"list", "sentence"}
    gen = TaskGenerator(2, "train", {"list": 1.0, "sentence": 1.0}, invented_animals=0.3, suite="v4")
    seen = Counter()
    for ex in gen.batch(3000):
        assert ex.key not in held
        seen[ex.family] += 1
    assert min(seen.values()) > 1000


def test_checker_based_summary_counts_what_broke() -> None:
    exs = [tasks.make_list("fruits", 2, "pear", ["apple", "plum"]),
           tasks.make_list("fruits", 2, "pear", ["apple", "plum"]),
           tasks.make_sentence("owl", "An owl runs.")]
    texts = ["apple, apple", "plum, apple", "A owl runs."]
    outs = [{"text": t, "output_ids": [5, 6, 1], "meta_info": {"completion_tokens": 3, "steps": 2, "edits": 0}}
            for t in texts]
    refs = [[[5, 6, 1]]] * 3
    res = summarise(exs, outs, refs)
    assert res["list"] == 0.5 and res["sentence"] == 0.0
    assert res["open"]["valid"] == pytest.approx(1 / 3)
    assert res["open"]["invalid"] == {"list": {"duplicate": 1}, "sentence": {"a/an": 1}}
    assert res["forwards_per_req_by_family"] == {"list": 2.0, "sentence": 2.0}


def test_ideal_decode_s_commits_middling_branch_points_in_one_forward_where_q_waits() -> None:
    """Two independent branch points (token 10 or 11, then 20 or 21, the first of each at 0.6) and an EOS (1):
    S (0.5) fills all three in its first forward and confirms in a second; Q (0.7) fills EOS, then one branch point
    per forward by the top-1 fallback, then confirms: four forwards. Neither ever edits (the answers agree)."""
    from redraft.training.ideal_decode import decode

    mask = 99
    answers = [([10, 20, 1], 0.36), ([10, 21, 1], 0.24), ([11, 20, 1], 0.24), ([11, 21, 1], 0.16)]
    assert decode(answers, 3, 0.5, 0.0, mask) == ([10, 20, 1], 2, 0)
    assert decode(answers, 3, 0.7, 0.5, mask) == ([10, 20, 1], 4, 0)


def test_ideal_decode_edits_a_token_the_rest_of_the_window_contradicts() -> None:
    from redraft.training.ideal_decode import proposals

    mask = 99
    answers = [([10, 20, 30], 0.5), ([11, 21, 31], 0.5)]
    prop = proposals(answers, [10, 21, 31], mask, eps=1e-3)  # two tokens vote for the second answer
    assert prop[0][0] == 11 and prop[0][1] > 0.99
