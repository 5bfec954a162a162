"""How sure is a demo model at the branch points of the open-ended families? `python -m
redraft.training.branch_confidence --model DIR`.

S (threshold 0.5) commits a masked position that Q (0.7) leaves for a later forward only when the model's
confidence there lies between the two. For held-out list and sentence prompts this takes one answer drawn from
the training distribution, reads the model's confidence at each answer position given the answer before it (the
engine's staircase: `Engine.prompt_logprobs`, the rest of the block masked), and compares it with the true
conditional probability of the most likely next token, estimated from fresh draws of the same distribution.
A branch point is a position whose true top probability is below 0.95. Prints histograms of both.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import Counter, defaultdict

from redraft.training.open_tasks import OPEN_FAMILIES, draw_answer
from redraft.training.tasks import eval_set, render_prompt

BINS = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0001)
BRANCH = 0.95  # a position whose true top probability is below this is a branch point


def true_top(user: str, tok, draws: int, seed: int) -> dict[tuple[int, ...], float]:
    """prefix (token ids) -> probability of the most likely next token, from `draws` fresh answers + EOS."""
    rng = random.Random(seed)
    nexts: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for _ in range(draws):
        ids = tok.encode(draw_answer(user, rng)) + [tok.eos_token_id]
        for i, t in enumerate(ids):
            nexts[tuple(ids[:i])][t] += 1
    return {k: max(c.values()) / sum(c.values()) for k, c in nexts.items()}


def histogram(values: list[float]) -> list[int]:
    return [sum(lo <= v < hi for v in values) for lo, hi in zip(BINS, BINS[1:])]


def measure(model: str, per_family: int, seed: int, draws: int, threads: int) -> dict[str, dict[str, list]]:
    import torch

    from redraft.engine.runtime.engine import Engine

    torch.set_num_threads(threads)
    exs = [ex for ex in eval_set(seed, per_family, OPEN_FAMILIES, suite="v4")]
    out: dict[str, dict[str, list]] = {f: {"model": [], "true": [], "model_elsewhere": []} for f in OPEN_FAMILIES}
    with Engine(model, device="cpu", dtype="float32", progress=False) as eng:
        tok = eng.tokenizer
        for ex in exs:
            prompt = tok.encode(render_prompt(ex, tok))
            answer = tok.encode(ex.answer) + [tok.eos_token_id]
            rows = eng.prompt_logprobs(prompt + answer, start=len(prompt), top_k=1)[len(prompt):]
            tops = true_top(ex.user, tok, draws, seed)
            for i, row in enumerate(rows):
                model_top = math.exp(row[1][0][1])
                truth = tops.get(tuple(answer[:i]))
                if truth is not None and truth < BRANCH:
                    out[ex.family]["model"].append(model_top)
                    out[ex.family]["true"].append(truth)
                else:
                    out[ex.family]["model_elsewhere"].append(model_top)
    return out


def format_report(res: dict[str, dict[str, list]]) -> str:
    labels = [f"[{lo:.1f}, {min(hi, 1.0):.1f}{']' if hi > 1 else ')'}" for lo, hi in zip(BINS, BINS[1:])]
    lines = ["| family | confidence of | positions | " + " | ".join(labels) + " | mean |",
             "|---|---|---|" + "---|" * len(labels) + "---|"]
    names = {"true": "the data (branch points)", "model": "the model (branch points)",
             "model_elsewhere": "the model (elsewhere)"}
    for fam, r in res.items():
        for key in ("true", "model", "model_elsewhere"):
            v = r[key]
            mean = sum(v) / len(v) if v else float("nan")
            lines.append(f"| {fam} | {names[key]} | {len(v)} | " + " | ".join(map(str, histogram(v)))
                         + f" | {mean:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.training.branch_confidence", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="exported demo checkpoint (suite v4)")
    p.add_argument("--per-family", type=int, default=30)
    p.add_argument("--seed", type=int, default=1000)
    p.add_argument("--draws", type=int, default=3000, help="fresh answers per prompt to estimate the truth")
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    print(format_report(measure(args.model, args.per_family, args.seed, args.draws, args.threads)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
