"""The demo task suite: one-turn problems with exact answers, in two versions.

Suite v1 (the first bundled model): five families whose answers fit one 32-token block. Suite v2 (its
successor) keeps them, makes the code family copy any name it is given, and adds two families whose answers
span several blocks, so that drafting in parallel, editing and multi-block editing have room to show:

Every example is one user turn and one assistant turn in the LLaDA2 chat format; the assistant's answer is
exactly `Example.answer` (for chat, any of `Example.answers` is right).

- math:    `What is A + B?` / `What is A - B?`, A, B in 0..99          -> `42`, `-7`
- reverse: `Reverse the word: W`, W of 3..6 random lowercase letters    -> W reversed
- sort:    `Sort these numbers: 7 93 15`, 3..6 integers in 0..99      -> `7 15 93`
- code:    `Write a Python function named F that returns the OP of a and b.`
           -> `def F(a, b):\n    return E`
- chat:    `Tell me about the X.` -> one of three sentences about X
v2 only:
- code:    as above, the name any snake_case name of one or two parts of 3..8 random letters (30% list words)
- count:   `Count from A to B.`, A in 0..899, B - A in 10..40 -> `A A+1 ... B` (2-4 blocks)
- repeat:  `Repeat the word W N times.`, W of 3..7 random letters, N in 4..12 -> W N times, space-separated
v3 (structured output; every v2 family plus):
- json:    a math problem + ` Answer in JSON.` -> `{"answer":42}` (compact)
- tool:    a math problem in a chat with the tools `add` and `subtract` (rendered into the prompt by the chat
           template) -> `<tool_call>{"name": "add", "arguments": {"a": 12, "b": 7}}</tool_call>`, exactly what
           the template's render_tool_call writes for that call (`<tool_call>`, `</tool_call>` are special tokens)

Train and eval are disjoint by construction: a problem's canonical key (the problem up to trivial rewrites:
`A + B` and `B + A` share one key, so do the permutations of a list to sort, and the three answers of a chat
prompt) is hashed, and the hash alone decides its split. A generator for one split rejects the other's
problems, so no eval problem ever appears in training, whatever the seed. json and tool problems have the
math problem's key (and its eval share), so a held-out math problem is held out in all three. In v2 the code key is the function
name alone and the repeat key the word alone: a held-out name or word never appears in training at all.

A curriculum `level` in [0, 1] shrinks the problems (small operands, short words and lists, one-word
function names); level 1 is exactly the distribution above.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from redraft.training.open_tasks import (CATEGORIES, COUNT_WORDS, OPEN_FAMILIES, SENTENCE_ANIMALS, all_lists,
                                         all_sentences, check_list, check_sentence, draw_list, draw_sentence,
                                         list_prompt, sentence_prompt)

FAMILIES: tuple[str, ...] = ("math", "reverse", "sort", "code", "chat")
FAMILIES_V2: tuple[str, ...] = (*FAMILIES, "count", "repeat")
FAMILIES_V3: tuple[str, ...] = (*FAMILIES_V2, "json", "tool")
FAMILIES_V4: tuple[str, ...] = (*FAMILIES_V3, *OPEN_FAMILIES)
SUITES: dict[str, tuple[str, ...]] = {"v1": FAMILIES, "v2": FAMILIES_V2, "v3": FAMILIES_V3, "v4": FAMILIES_V4}
MULTI_BLOCK_FAMILIES: tuple[str, ...] = ("count", "repeat")
SPLITS: tuple[str, ...] = ("train", "eval")

# Fraction of each family's problems that belong to eval. Chat has only as many problems as animals, so it
# keeps a larger share back (a held-out animal is a name the model must copy without having seen it asked).
EVAL_FRACTION: dict[str, float] = {"math": 0.1, "reverse": 0.1, "sort": 0.1, "code": 0.1, "chat": 0.2,
                                   "count": 0.1, "repeat": 0.1, "json": 0.1, "tool": 0.1,
                                   "list": 0.25, "sentence": 0.2}
_SPLIT_SALT = "redraft-demo-tasks-v1"

# 120 words for function names (lowercase, no underscore: names join one or two of them with "_").
CODE_WORDS: tuple[str, ...] = (
    "add", "apply", "area", "average", "balance", "base", "best", "bonus", "budget", "build",
    "calc", "cart", "check", "chunk", "clamp", "clean", "combine", "compare", "compute", "count",
    "cost", "credit", "data", "delta", "depth", "diff", "distance", "edge", "energy", "error",
    "eval", "extra", "factor", "fee", "final", "find", "first", "force", "gain", "get",
    "grade", "height", "item", "join", "key", "last", "level", "limit", "line", "load",
    "loss", "make", "mass", "match", "merge", "metric", "mix", "mode", "net", "node",
    "offset", "order", "pair", "part", "peak", "pick", "point", "power", "price", "profit",
    "range", "rank", "rate", "ratio", "raw", "result", "round", "row", "rule", "scale",
    "score", "shift", "size", "slot", "speed", "split", "start", "step", "stock", "sum",
    "swap", "tax", "temp", "test", "tick", "time", "token", "total", "track", "trade",
    "unit", "update", "usage", "value", "volume", "wage", "weight", "width", "yield", "zone",
    "alpha", "beta", "gamma", "left", "right", "high", "low", "min", "max", "mid",
)

CODE_OPS: dict[str, str] = {
    "sum": "a + b",
    "difference": "a - b",
    "product": "a * b",
    "maximum": "max(a, b)",
    "minimum": "min(a, b)",
}

# 100 animals, one lowercase word each.
ANIMALS: tuple[str, ...] = (
    "ant", "ape", "badger", "bat", "bear", "beaver", "bee", "beetle", "bison", "boar",
    "buffalo", "camel", "cat", "cheetah", "chicken", "cobra", "cow", "crab", "crane", "crow",
    "deer", "dingo", "dog", "dolphin", "donkey", "dove", "duck", "eagle", "eel", "elephant",
    "elk", "emu", "falcon", "ferret", "finch", "fox", "frog", "gazelle", "gecko", "giraffe",
    "goat", "goose", "gorilla", "hamster", "hare", "hawk", "hedgehog", "heron", "hippo", "horse",
    "hyena", "ibis", "iguana", "jackal", "jaguar", "kangaroo", "koala", "lemur", "leopard", "lion",
    "lizard", "llama", "lobster", "lynx", "macaw", "mole", "monkey", "moose", "mouse", "mule",
    "newt", "octopus", "otter", "owl", "ox", "panda", "panther", "parrot", "pelican", "penguin",
    "pig", "pigeon", "puma", "rabbit", "raccoon", "rat", "raven", "rhino", "salmon", "seal",
    "shark", "sheep", "skunk", "sloth", "snail", "snake", "spider", "squid", "swan", "tiger",
    "toad", "trout", "turkey", "turtle", "viper", "walrus", "wasp", "weasel", "whale", "wolf",
    "wombat", "yak", "zebra",
)

CHAT_TEMPLATES: tuple[str, ...] = (
    "The {x} is an animal.",
    "I like the {x} a lot.",
    "A {x} can be found in many places.",
)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"

# The tools of the v3 tool family (OpenAI / Hugging Face function format).
ADD_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "add", "description": "Add two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
SUB_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": "subtract", "description": "Subtract b from a.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
MATH_TOOLS: tuple[dict[str, Any], ...] = (ADD_TOOL, SUB_TOOL)
TOOL_NAMES: dict[str, str] = {"+": "add", "-": "subtract"}
JSON_SUFFIX = " Answer in JSON."


@dataclass(frozen=True)
class Example:
    family: str
    user: str  # the user turn
    answer: str  # the assistant turn used as the training target
    answers: tuple[str, ...]  # every correct answer (answer is one of them)
    key: str  # canonical problem: decides the split
    tools: tuple[dict[str, Any], ...] = ()  # tools offered in the chat (the prompt renders them), if any

    def messages(self, with_answer: bool = False) -> list[dict[str, str]]:
        msgs = [{"role": "user", "content": self.user}]
        if with_answer:
            msgs.append({"role": "assistant", "content": self.answer})
        return msgs

    def tool_list(self) -> list[dict[str, Any]] | None:
        """The `tools` argument of the chat template: None without tools."""
        return [dict(t) for t in self.tools] or None


def split_of(key: str, family: str) -> str:
    """'train' or 'eval', from a hash of the canonical problem key alone."""
    digest = hashlib.sha256(f"{_SPLIT_SALT}|{key}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2.0**64
    return "eval" if u < EVAL_FRACTION[family] else "train"


def is_correct(example: Example, output_text: str) -> bool:
    """Exact match against any correct answer (surrounding whitespace ignored); json and tool by parsing.

    json: the output parses (json.loads) to exactly {"answer": N}, N an int. tool: the output is one call,
    `<tool_call>{...}</tool_call>` or, as the engine returns it by default (special tokens skipped), the JSON
    object alone, parsing to exactly {"name": the tool, "arguments": {"a": A, "b": B}} with the problem's
    operands (for add, either order)."""
    if example.family == "list":
        return check_list(example.user, output_text).valid
    if example.family == "sentence":
        return check_sentence(example.user, output_text).valid
    if example.family == "json":
        return _json_value(output_text) == {"answer": _int_answer(example)}
    if example.family == "tool":
        text = output_text.strip()
        if text.startswith("<tool_call>") and text.endswith("</tool_call>"):
            text = text[len("<tool_call>"):-len("</tool_call>")]
        got = _json_value(text)
        a, op, b = parse_math(example.user)
        ok = [{"name": TOOL_NAMES[op], "arguments": {"a": a, "b": b}}]
        if op == "+":
            ok.append({"name": "add", "arguments": {"a": b, "b": a}})
        return got in ok
    return output_text.strip() in example.answers


def _int_answer(example: Example) -> int:
    a, op, b = parse_math(example.user.removesuffix(JSON_SUFFIX))
    return a + b if op == "+" else a - b


def _json_value(text: str) -> Any:
    """json.loads(text), with non-int numbers and bools made unequal to ints (5.0 == 5 and True == 1 in Python)."""
    import json

    def strict(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strict(v) for k, v in value.items()}
        if isinstance(value, list):
            return [strict(v) for v in value]
        if isinstance(value, (bool, float)):
            return repr(value)  # never equal to an int
        return value

    try:
        return strict(json.loads(text))
    except ValueError:
        return None


# ----- one problem per family ------------------------------------------------------------------------
def make_math(a: int, op: str, b: int) -> Example:
    if op not in "+-":
        raise ValueError(f"math op must be + or -, not {op!r}")
    result = a + b if op == "+" else a - b
    key = f"math|+|{min(a, b)}|{max(a, b)}" if op == "+" else f"math|-|{a}|{b}"
    return Example("math", f"What is {a} {op} {b}?", str(result), (str(result),), key)


def make_reverse(word: str) -> Example:
    return Example("reverse", f"Reverse the word: {word}", word[::-1], (word[::-1],), f"reverse|{word}")


def make_sort(numbers: Sequence[int]) -> Example:
    shown = " ".join(str(n) for n in numbers)
    answer = " ".join(str(n) for n in sorted(numbers))
    return Example("sort", f"Sort these numbers: {shown}", answer, (answer,), f"sort|{answer}")


def make_code(name: str, op: str) -> Example:
    user = f"Write a Python function named {name} that returns the {op} of a and b."
    answer = f"def {name}(a, b):\n    return {CODE_OPS[op]}"
    return Example("code", user, answer, (answer,), f"code|{name}|{op}")


def make_code_v2(name: str, op: str) -> Example:
    """v2: the same problem, split by the name alone (a held-out name is never trained on, with any op)."""
    ex = make_code(name, op)
    return Example("code", ex.user, ex.answer, ex.answers, f"code-name|{name}")


def make_count(a: int, b: int) -> Example:
    answer = " ".join(str(n) for n in range(a, b + 1))
    return Example("count", f"Count from {a} to {b}.", answer, (answer,), f"count|{a}|{b}")


def make_repeat(word: str, n: int) -> Example:
    answer = " ".join([word] * n)
    return Example("repeat", f"Repeat the word {word} {n} times.", answer, (answer,), f"repeat-word|{word}")


def make_json(a: int, op: str, b: int) -> Example:
    """v3: the math problem, answered as compact JSON; the math problem's key, so the same split."""
    m = make_math(a, op, b)
    answer = '{"answer":' + m.answer + "}"
    return Example("json", m.user + JSON_SUFFIX, answer, (answer,), m.key)


def tool_call_text(name: str, arguments: dict[str, Any]) -> str:
    """What engine/text/templates/llada2_chat.jinja's render_tool_call writes for one call (tests check it is)."""
    import json

    return '<tool_call>{"name": ' + json.dumps(name) + ', "arguments": ' + json.dumps(arguments) + "}</tool_call>"


def make_tool(a: int, op: str, b: int) -> Example:
    """v3: the math problem with the add and subtract tools offered; the answer calls the right one."""
    m = make_math(a, op, b)
    answer = tool_call_text(TOOL_NAMES[op], {"a": a, "b": b})
    return Example("tool", m.user, answer, (answer,), m.key, tools=MATH_TOOLS)


def make_chat(animal: str, template: int) -> Example:
    answers = tuple(t.format(x=animal) for t in CHAT_TEMPLATES)
    return Example("chat", f"Tell me about the {animal}.", answers[template], answers, f"chat|{animal}")


def make_list(category: str, n: int, excluded: str, items: Sequence[str]) -> Example:
    """v4: `items` (one drawn answer) for the list problem; every valid answer in `answers`."""
    user = list_prompt(category, n, excluded)
    return Example("list", user, ", ".join(items), all_lists(category, n, excluded), f"list|{category}|{n}|{excluded}")


def make_sentence(animal: str, answer: str) -> Example:
    """v4: one drawn sentence about `animal`; every sentence of the grammar in `answers`."""
    return Example("sentence", sentence_prompt(animal), answer, all_sentences(animal), f"sentence|{animal}")


# ----- sampling --------------------------------------------------------------------------------------
def _letters(rng: random.Random, lo: int, hi: int) -> str:
    return "".join(rng.choice(_LETTERS) for _ in range(rng.randint(lo, hi)))


def _draw(family: str, rng: random.Random, level: float, suite: str = "v1") -> Example:
    """One problem of `family` at curriculum `level` (1.0 = the full distribution), either split."""
    if family == "list":
        category = rng.choice(sorted(CATEGORIES))
        n, excluded = rng.choice(sorted(COUNT_WORDS)), rng.choice(CATEGORIES[category])
        return make_list(category, n, excluded, draw_list(rng, category, n, excluded))
    if family == "sentence":
        animal = rng.choice(SENTENCE_ANIMALS)
        return make_sentence(animal, draw_sentence(rng, animal))
    if family in ("json", "tool"):
        m = _draw("math", rng, level)
        a, op, b = parse_math(m.user)
        return (make_json if family == "json" else make_tool)(a, op, b)
    if suite in ("v2", "v3", "v4"):
        if family == "code":
            parts = 1 + (rng.random() < 0.5 * level)
            longest = 3 + round(5 * level)
            name = "_".join(rng.choice(CODE_WORDS) if rng.random() < 0.3 else _letters(rng, 3, longest)
                            for _ in range(parts))
            return make_code_v2(name, rng.choice(sorted(CODE_OPS)))
        if family == "count":
            a = rng.randint(0, 899)
            return make_count(a, a + rng.randint(10, 10 + round(30 * level)))
        if family == "repeat":
            return make_repeat(_letters(rng, 3, 3 + round(4 * level)), rng.randint(4, 4 + round(8 * level)))
    if family == "math":
        top = 9 + round(90 * level)
        return make_math(rng.randint(0, top), rng.choice("+-"), rng.randint(0, top))
    if family == "reverse":
        n = rng.randint(3, 3 + round(3 * level))
        return make_reverse("".join(rng.choice(_LETTERS) for _ in range(n)))
    if family == "sort":
        n = rng.randint(3, 3 + round(3 * level))
        top = 9 + round(90 * level)
        return make_sort([rng.randint(0, top) for _ in range(n)])
    if family == "code":
        two_words = rng.random() < 0.5 * level
        name = "_".join(rng.sample(CODE_WORDS, 2)) if two_words else rng.choice(CODE_WORDS)
        return make_code(name, rng.choice(sorted(CODE_OPS)))
    if family == "chat":
        return make_chat(rng.choice(ANIMALS), rng.randrange(len(CHAT_TEMPLATES)))
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def sample(family: str, split: str, rng: random.Random, level: float = 1.0, suite: str = "v1") -> Example:
    """A problem of `family` from `split` (rejection: problems of the other split are redrawn)."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
    if not 0.0 <= level <= 1.0:
        raise ValueError(f"level must be in [0, 1], not {level}")
    if family not in SUITES.get(suite, ()):
        raise ValueError(f"unknown family {family!r} for suite {suite!r}; choose from {SUITES.get(suite)}")
    for _ in range(10_000):
        ex = _draw(family, rng, level, suite)
        if split_of(ex.key, family) == split:
            return ex
    raise RuntimeError(f"no {split} problem of {family!r} found at level {level}")


class TaskGenerator:
    """A seeded stream of problems: `next(gen)` or `gen.batch(n)`; family weights and a curriculum level.

    `invented_animals`: the share of chat problems asked about an invented name (3..8 random letters) instead
    of a listed animal. Training uses it as copying practice (the held-out animals are names the model has
    never been asked about); invented names are never eval problems, and eval never uses them.
    `long_counts`: the share of count problems (train only) with B - A in 3..64 instead of the suite's 10..40,
    so that the model stops where the prompt says rather than after a length it has learnt. `low_count_starts`:
    the share of those starting at A in 0..20, where the numbers cross from one digit to two (A is uniform in
    0..899 otherwise, so a long count from a single digit is rare: the v3 model stopped `Count from 5 to 60.`
    at 41).
    """

    def __init__(self, seed: int, split: str = "train", weights: dict[str, float] | None = None,
                 invented_animals: float = 0.0, suite: str = "v1", long_counts: float = 0.0,
                 low_count_starts: float = 0.0):
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, not {split!r}")
        if suite not in SUITES:
            raise ValueError(f"suite must be one of {sorted(SUITES)}, not {suite!r}")
        self.rng = random.Random(seed)
        self.split = split
        self.suite = suite
        w = weights or {f: 1.0 for f in SUITES[suite]}
        self.families = [f for f in SUITES[suite] if w.get(f, 0.0) > 0]
        self.weights = [w[f] for f in self.families]
        self.invented_animals = invented_animals if split == "train" else 0.0
        self.long_counts = long_counts if split == "train" else 0.0
        self.low_count_starts = low_count_starts
        self.level = 1.0

    def __iter__(self) -> Iterator[Example]:
        return self

    def __next__(self) -> Example:
        family = self.rng.choices(self.families, self.weights)[0]
        # Curriculum: most problems at the current level, the rest easier (uniform below it).
        level = self.level if self.rng.random() < 0.7 else self.rng.uniform(0.0, self.level)
        if family == "chat" and self.rng.random() < self.invented_animals:
            while True:
                name = "".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(3, 8)))
                if name not in ANIMALS and split_of(f"chat|{name}", "chat") == self.split:
                    return make_chat(name, self.rng.randrange(len(CHAT_TEMPLATES)))
        if family == "sentence" and self.rng.random() < self.invented_animals:
            while True:  # copying practice, as for chat: a sentence about an invented name
                name = "".join(self.rng.choice(_LETTERS) for _ in range(self.rng.randint(3, 7)))
                if name not in SENTENCE_ANIMALS and split_of(f"sentence|{name}", "sentence") == self.split:
                    return make_sentence(name, draw_sentence(self.rng, name))
        if family == "count" and self.rng.random() < self.long_counts:
            while True:  # a count shorter or longer than the suite's (B - A in 3..64): where to stop is read, not learnt
                a = self.rng.randint(0, 20) if self.rng.random() < self.low_count_starts else self.rng.randint(0, 899)
                ex = make_count(a, a + self.rng.randint(3, 64))
                if split_of(ex.key, "count") == self.split:
                    return ex
        return sample(family, self.split, self.rng, level, self.suite)

    def batch(self, n: int) -> list[Example]:
        return [next(self) for _ in range(n)]

    def state(self) -> Any:
        return self.rng.getstate()

    def set_state(self, state: Any) -> None:
        self.rng.setstate(state)


def eval_set(seed: int, per_family: int, families: Sequence[str] = FAMILIES, suite: str = "v1") -> list[Example]:
    """Held-out problems, `per_family` of each family, deterministic for a seed.

    Distinct problems where the family has enough of them; chat has one problem per held-out animal, so
    its list cycles through those animals (with the answer template drawn at random, which does not matter:
    any of the three answers is correct).
    """
    rng = random.Random(seed)
    out: list[Example] = []
    for family in families:
        seen: set[str] = set()
        picked: list[Example] = []
        for _ in range(200 * per_family):
            if len(picked) == per_family:
                break
            ex = sample(family, "eval", rng, suite=suite)
            if ex.key not in seen:
                seen.add(ex.key)
                picked.append(ex)
        while len(picked) < per_family:  # a family with fewer distinct eval problems (chat) repeats them
            picked.append(picked[len(picked) % len(seen)])
        out.extend(picked)
    return out


def eval_animals() -> list[str]:
    return [a for a in ANIMALS if split_of(f"chat|{a}", "chat") == "eval"]


# ----- rendering ---------------------------------------------------------------------------------------
def render_prompt(example: Example, tokenizer: Any | None = None) -> str:
    """The prompt text: the user turn (and the example's tools, if any) through the LLaDA2 chat template, with
    the assistant turn opened.

    With a `redraft.engine.text.tokenizer.Tokenizer`, its own (checkpoint) template renders it; without one, the
    LLaDA2 template redraft ships (the one the demo checkpoint carries).
    """
    if tokenizer is not None:
        return tokenizer.apply_chat_template(example.messages(), tools=example.tool_list(), add_generation_prompt=True)
    from redraft.engine.text.tokenizer import EOS_TOKEN, MASK_TOKEN, render_chat_template

    return render_chat_template(_default_template(), example.messages(), tools=example.tool_list(),
                                add_generation_prompt=True,
                                bos_token="", eos_token=EOS_TOKEN, pad_token=EOS_TOKEN, mask_token=MASK_TOKEN)


@lru_cache(maxsize=1)
def _default_template() -> Any:
    from redraft.engine.text.tokenizer import compile_chat_template, load_default_chat_template

    return compile_chat_template(load_default_chat_template())  # compiling is slow: once per process


_MATH_RE = re.compile(r"What is (\d+) ([+-]) (\d+)\?")


def parse_math(user: str) -> tuple[int, str, int]:
    m = _MATH_RE.fullmatch(user)
    if not m:
        raise ValueError(f"not a math problem: {user!r}")
    return int(m.group(1)), m.group(2), int(m.group(3))
