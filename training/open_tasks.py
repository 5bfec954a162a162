"""Open-ended demo families (suite v4): many right answers, graded by a checker instead of one reference.

A deterministic task teaches a model to be either sure or far off, so its confidences never sit between S's
threshold (0.5) and Q's (0.7) and S decodes no faster than Q. These families have genuinely open answers drawn
from skewed distributions (a popular choice about 60% of the time, as people and real LMs answer), so at a
branch point the model's confidence is middling: S commits it, Q waits for a forward that settles it. Their
answers mix words of different token lengths, so drafting several branch points in one forward can join
pieces of different answers (a duplicated item, `a` before a vowel, a plural subject with a singular verb):
the conflicts T2T editing exists to repair.

- list:     `Name three fruits other than pear.` -> `apple, plum, lemon`: N (2..4) distinct items of the
            category, none the excluded one, any order; category x N x excluded item is the problem.
- sentence: `Write a sentence about a cat.` -> `The old cats run today.`: a small probabilistic grammar,
            determiner (A/An by the next word's first letter; Two only with a plural), an optional
            adjective, the animal, singular or plural, a verb that agrees, an optional ending.

`check(example, text)` says whether an output is valid, and why not (`Verdict`): the families' `is_correct`.
"""

from __future__ import annotations

import itertools
import random
import re
from dataclasses import dataclass
from functools import lru_cache

OPEN_FAMILIES: tuple[str, ...] = ("list", "sentence")

# Items in order of popularity. A list answer takes, slot by slot, the next popular item with probability
# P_POPULAR (else any other unused item): each slot's favourite then has a middling probability, not a certain one.
CATEGORIES: dict[str, tuple[str, ...]] = {
    "fruits": ("apple", "banana", "orange", "pear", "plum", "lemon", "mango", "peach"),
    "colors": ("red", "blue", "green", "yellow", "black", "white", "pink", "brown"),
    "drinks": ("water", "tea", "milk", "coffee", "juice", "soda", "cocoa", "lemonade"),
    "shapes": ("circle", "square", "triangle", "star", "heart", "oval", "diamond", "cube"),
    "tools": ("hammer", "saw", "drill", "knife", "rope", "brush", "shovel", "ladder"),
    "sports": ("soccer", "tennis", "golf", "rugby", "hockey", "boxing", "rowing", "skiing"),
}
P_POPULAR = 0.62
COUNT_WORDS: dict[int, str] = {2: "two", 3: "three", 4: "four"}

# Sentence grammar. Animals whose plural is the name + "s".
SENTENCE_ANIMALS: tuple[str, ...] = (
    "cat", "dog", "bird", "cow", "pig", "duck", "owl", "ant", "eagle", "ape", "eel", "elk", "emu", "frog",
    "goat", "hen", "horse", "lion", "tiger", "bear", "rat", "bat", "crow", "deer", "seal", "swan", "wolf",
    "yak", "otter", "iguana", "ibis", "hawk", "mole", "toad", "crab", "shark", "snake", "koala", "zebra", "llama",
)
ADJECTIVES: tuple[tuple[str, float], ...] = (("old", 0.62), ("big", 0.18), ("small", 0.12), ("happy", 0.08))
VERBS: tuple[tuple[str, float], ...] = (("run", 0.62), ("sleep", 0.18), ("eat", 0.12), ("jump", 0.08))
P_PLURAL = 0.38
P_ADJECTIVE = 0.38
P_ENDING = 0.38
ENDING = " today"
# Determiners by number: singular A/An (which one is decided by the next word) or The; plural The or Two.
SINGULAR_DETS: tuple[tuple[str, float], ...] = (("A", 0.62), ("The", 0.38))
PLURAL_DETS: tuple[tuple[str, float], ...] = (("The", 0.62), ("Two", 0.38))

_LIST_RE = re.compile(r"Name (two|three|four) (\w+) other than (\w+)\.")
_SENTENCE_RE = re.compile(r"Write a sentence about an? (\w+)\.")


@dataclass(frozen=True)
class Verdict:
    valid: bool
    reason: str  # "" when valid, else what is wrong (unknown item, duplicate, a/an, agreement, form)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


# ----- list ------------------------------------------------------------------------------------------------
def list_prompt(category: str, n: int, excluded: str) -> str:
    return f"Name {COUNT_WORDS[n]} {category} other than {excluded}."


def draw_list(rng: random.Random, category: str, n: int, excluded: str) -> list[str]:
    """n distinct items, none `excluded`: slot i is the i-th most popular item with probability P_POPULAR (if
    still unused), else a uniform pick among the other unused items."""
    popular = [w for w in CATEGORIES[category] if w != excluded]
    out: list[str] = []
    for i in range(n):
        unused = [w for w in popular if w not in out]
        if popular[i] in unused and rng.random() < P_POPULAR:
            out.append(popular[i])
        else:
            out.append(rng.choice([w for w in unused if w != popular[i]]))
    return out


@lru_cache(maxsize=512)
def all_lists(category: str, n: int, excluded: str) -> tuple[str, ...]:
    items = [w for w in CATEGORIES[category] if w != excluded]
    return tuple(", ".join(p) for p in itertools.permutations(items, n))


def check_list(user: str, text: str) -> Verdict:
    m = _LIST_RE.fullmatch(user)
    if not m:
        raise ValueError(f"not a list problem: {user!r}")
    n = {v: k for k, v in COUNT_WORDS.items()}[m.group(1)]
    category, excluded = m.group(2), m.group(3)
    items = text.strip().split(", ")
    if len(items) != n:
        return Verdict(False, f"{len(items)} items, not {n}")
    for it in items:
        if it not in CATEGORIES[category]:
            return Verdict(False, f"not one of the {category}: {it!r}")
        if it == excluded:
            return Verdict(False, f"the excluded {it!r}")
    if len(set(items)) != n:
        return Verdict(False, "a duplicate item")
    return Verdict(True, "")


# ----- sentence --------------------------------------------------------------------------------------------
def sentence_prompt(animal: str) -> str:
    return f"Write a sentence about {article(animal)} {animal}."


def render_sentence(det: str, adjective: str | None, animal: str, plural: bool, verb: str, ending: bool) -> str:
    first = adjective or animal
    if det == "A" and first[0] in "aeiou":
        det = "An"
    noun = animal + "s" if plural else animal
    words = [det, *([adjective] if adjective else []), noun, verb if plural else verb + "s"]
    return " ".join(words) + (ENDING if ending else "") + "."


def draw_sentence(rng: random.Random, animal: str) -> str:
    def pick(options: tuple[tuple[str, float], ...]) -> str:
        return rng.choices([o for o, _ in options], [w for _, w in options])[0]

    plural = rng.random() < P_PLURAL
    det = pick(PLURAL_DETS if plural else SINGULAR_DETS)
    adjective = pick(ADJECTIVES) if rng.random() < P_ADJECTIVE else None
    return render_sentence(det, adjective, animal, plural, pick(VERBS), rng.random() < P_ENDING)


@lru_cache(maxsize=256)
def all_sentences(animal: str) -> tuple[str, ...]:
    out = []
    for plural in (False, True):
        for det, _ in PLURAL_DETS if plural else SINGULAR_DETS:
            for adjective in (None, *(a for a, _ in ADJECTIVES)):
                for verb, _ in VERBS:
                    for ending in (False, True):
                        out.append(render_sentence(det, adjective, animal, plural, verb, ending))
    return tuple(dict.fromkeys(out))


def check_sentence(user: str, text: str) -> Verdict:
    """Valid: `Det [Adj] Animal[s] Verb[s][ today].` with a/an by the next word, Two only with a plural, the
    verb agreeing with the noun, the prompt's animal, the grammar's words."""
    m = _SENTENCE_RE.fullmatch(user)
    if not m:
        raise ValueError(f"not a sentence problem: {user!r}")
    animal = m.group(1)
    words = text.strip().removesuffix(".").split(" ")
    if not text.strip().endswith(".") or len(words) < 3:
        return Verdict(False, "not a sentence of the grammar")
    if words[-1] == ENDING.strip():
        words = words[:-1]
    det, *middle, verb = words
    adjectives = [a for a, _ in ADJECTIVES]
    if len(middle) == 2 and middle[0] in adjectives:
        first, noun = middle
    elif len(middle) == 1:
        first = noun = middle[0]
    else:
        return Verdict(False, "not a sentence of the grammar")
    if noun not in (animal, animal + "s"):
        return Verdict(False, f"not the {animal}: {noun!r}")
    plural = noun == animal + "s"
    if det in ("A", "An"):
        if plural:
            return Verdict(False, "a/an before a plural")
        if det != article(first).capitalize():
            return Verdict(False, f"{det!r} before {first!r}")
    elif det == "Two":
        if not plural:
            return Verdict(False, "two before a singular")
    elif det != "The":
        return Verdict(False, f"not a determiner: {det!r}")
    verbs = [v for v, _ in VERBS]
    if verb not in (verbs if plural else [v + "s" for v in verbs]):
        return Verdict(False, f"the verb {verb!r} does not agree with {noun!r}")
    return Verdict(True, "")


def draw_answer(user: str, rng: random.Random) -> str:
    """A fresh answer to an open-ended prompt, from the training distribution (for estimating it)."""
    if m := _LIST_RE.fullmatch(user):
        n = {v: k for k, v in COUNT_WORDS.items()}[m.group(1)]
        return ", ".join(draw_list(rng, m.group(2), n, m.group(3)))
    if m := _SENTENCE_RE.fullmatch(user):
        return draw_sentence(rng, m.group(1))
    raise ValueError(f"not an open-ended prompt: {user!r}")


def check(user: str, text: str) -> Verdict:
    """The checker of whichever open-ended family `user` belongs to."""
    return check_list(user, text) if _LIST_RE.fullmatch(user) else check_sentence(user, text)
