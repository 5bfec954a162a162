"""A multiple-choice task for lm-evaluation-harness made from the demo task suite's held-out problems: the chat
prompt, the right answer and near misses (the sum off by one or ten, two letters swapped, a neighbouring pair
out of order, another operator, another animal), each choice ending with EOS so that a choice that stops too
early or runs on is scored as such. Written as JSONL for the task in evals/lm_eval/redraft_demo_mc.

    python -m redraft.training.lm_eval_task --out evals/lm_eval/redraft_demo_mc/demo_mc.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from redraft.training.tasks import ANIMALS, CHAT_TEMPLATES, CODE_OPS, FAMILIES, Example, eval_set, parse_math, \
    render_prompt

EOS = "<|endoftext|>"


def near_misses(ex: Example, rng: random.Random) -> list[str]:
    """Three wrong answers close to the right one."""
    right = ex.answer
    wrong: list[str] = []
    if ex.family == "math":
        a, op, b = parse_math(ex.user)
        value = a + b if op == "+" else a - b
        wrong = [str(value + d) for d in (1, -1, 10, -10, 2)]
    elif ex.family == "reverse":
        letters = list(right)
        for i in range(len(letters) - 1):
            w = letters[:]
            w[i], w[i + 1] = w[i + 1], w[i]
            wrong.append("".join(w))
        wrong += [right[::-1], right[:-1], right + right[-1]]
    elif ex.family == "sort":
        nums = right.split(" ")
        for i in range(len(nums) - 1):
            w = nums[:]
            w[i], w[i + 1] = w[i + 1], w[i]
            wrong.append(" ".join(w))
        wrong.append(" ".join(nums[::-1]))
    elif ex.family == "code":
        name = ex.user.split("named ")[1].split(" ")[0]
        wrong = [f"def {name}(a, b):\n    return {expr}" for expr in CODE_OPS.values()]
    elif ex.family == "chat":
        animal = ex.user[len("Tell me about the "):-1]
        others = [a for a in ANIMALS if a != animal]
        wrong = [CHAT_TEMPLATES[0].format(x=o) for o in rng.sample(others, 3)]
        wrong.append(CHAT_TEMPLATES[0].format(x=animal[:-1]))
    candidates = [w for w in dict.fromkeys(wrong) if w != right and w not in ex.answers]
    rng.shuffle(candidates)
    return candidates[:3]


def make_docs(per_family: int = 40, seed: int = 2026) -> list[dict]:
    rng = random.Random(seed)
    by_family: dict[str, list[dict]] = {}
    for ex in eval_set(seed, per_family, FAMILIES):
        choices = [ex.answer] + near_misses(ex, rng)
        rng.shuffle(choices)
        by_family.setdefault(ex.family, []).append({"family": ex.family, "prompt": render_prompt(ex),
                                                    "choices": [c + EOS for c in choices],
                                                    "answer": choices.index(ex.answer)})
    # families interleaved, so that any prefix (lm_eval --limit N) covers all of them
    return [doc for row in zip(*by_family.values()) for doc in row]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.training.lm_eval_task", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--per-family", type=int, default=40)
    p.add_argument("--seed", type=int, default=2026)
    args = p.parse_args(argv)
    docs = make_docs(args.per_family, args.seed)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(d) + "\n" for d in docs))
    print(f"wrote {len(docs)} problems to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
