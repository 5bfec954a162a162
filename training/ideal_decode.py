"""What would S and Q do with a perfect model? `python -m redraft.training.ideal_decode`.

Decodes the open-ended families' held-out prompts with the Bayes-optimal denoiser of their training distribution
instead of a network: the answer distribution is estimated from fresh draws, and the proposal at every position is
the most likely token under the posterior over answers given the window (a visible token is taken to be wrong
with a small probability `eps`, as the editing noise of training makes it). The threshold step is LLaDA2.1's
(engine/decoding/decoding.py: M2T strictly above the threshold, else the top-1 fallback; T2T strictly above
the edit threshold; a block ends after a mask-free forward that edits nothing). Simplification: the answer and
its EOS padding sit in one window of `--length` positions (the engine shares the first block with the prompt).

It separates the design from the training: the tokens per forward S gains over Q here is what the families allow,
and an answer made invalid here comes from the distribution itself, not from an imperfect model.
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import Counter, defaultdict

from redraft.training.open_tasks import OPEN_FAMILIES, check, draw_answer
from redraft.training.tasks import sample

MODES: dict[str, tuple[float, float]] = {"Q": (0.7, 0.5), "S": (0.5, 0.0), "S-noedit": (0.5, 1.0),
                                         "Q-noedit": (0.7, 1.0)}


def answer_distribution(user: str, tok, length: int, draws: int, seed: int) -> list[tuple[list[int], float]]:
    """(answer ids + EOS padding to `length`, probability) for every answer seen in `draws` fresh draws."""
    rng = random.Random(seed)
    counts = Counter(draw_answer(user, rng) for _ in range(draws))
    eos = tok.eos_token_id
    return [((tok.encode(a) + [eos] * length)[:length], c / draws) for a, c in counts.items()]


def proposals(answers: list[tuple[list[int], float]], window: list[int], mask_id: int, eps: float
              ) -> list[tuple[int, float]]:
    """(most likely token, its posterior probability) at every position of the window."""
    logw = [math.log(p) + math.log(eps) * sum(1 for a, x in zip(ids, window) if x != mask_id and x != a)
            for ids, p in answers]
    top = max(logw)
    weights = [math.exp(w - top) for w in logw]
    total = sum(weights)
    out = []
    for i in range(len(window)):
        mass: dict[int, float] = defaultdict(float)
        for (ids, _), w in zip(answers, weights):
            mass[ids[i]] += w / total
        best = max(mass, key=mass.__getitem__)
        out.append((best, mass[best]))
    return out


def decode(answers: list[tuple[list[int], float]], length: int, threshold: float, edit_threshold: float,
           mask_id: int, eps: float = 1e-3, max_post_steps: int = 16) -> tuple[list[int], int, int]:
    """(final window, forwards, edits) of the threshold loop on one window."""
    window = [mask_id] * length
    forwards = edits = post = 0
    while True:
        had_mask = mask_id in window
        if not had_mask:
            post += 1
            if post > max_post_steps:
                return window, forwards, edits
        prop = proposals(answers, window, mask_id, eps)
        forwards += 1
        masked = [i for i, x in enumerate(window) if x == mask_id]
        fill = [i for i in masked if prop[i][1] > threshold]
        if masked and not fill:
            fill = [max(masked, key=lambda i: prop[i][1])]
        edit = [i for i, x in enumerate(window) if x != mask_id and prop[i][0] != x and prop[i][1] > edit_threshold]
        for i in fill + edit:
            window[i] = prop[i][0]
        edits += len(edit)
        if not had_mask and not edit:
            return window, forwards, edits


def run(tok, per_family: int, seed: int, length: int, draws: int) -> dict[str, dict[str, dict[str, float]]]:
    rng = random.Random(seed)
    res: dict[str, dict[str, dict[str, float]]] = {}
    for family in OPEN_FAMILIES:
        agg = {m: {"valid": 0, "forwards": 0, "tokens": 0, "edits": 0} for m in MODES}
        for _ in range(per_family):
            ex = sample(family, "eval", rng, suite="v4")
            answers = answer_distribution(ex.user, tok, length, draws, seed)
            for mode, (th, eth) in MODES.items():
                window, forwards, edits = decode(answers, length, th, eth, tok.mask_token_id)
                n = window.index(tok.eos_token_id) + 1 if tok.eos_token_id in window else length
                a = agg[mode]
                a["valid"] += check(ex.user, tok.decode(window[:n], skip_special_tokens=True)).valid
                a["forwards"], a["tokens"], a["edits"] = a["forwards"] + forwards, a["tokens"] + n, a["edits"] + edits
        res[family] = {m: {"valid": a["valid"] / per_family, "tpf": a["tokens"] / a["forwards"],
                           "forwards_per_req": a["forwards"] / per_family, "edits_per_req": a["edits"] / per_family}
                       for m, a in agg.items()}
    return res


def main(argv: list[str] | None = None) -> int:
    from redraft.engine.text.model_path import BUNDLED_MODEL_DIR
    from redraft.engine.text.tokenizer import Tokenizer

    p = argparse.ArgumentParser(prog="python -m redraft.training.ideal_decode", description=__doc__.split("\n")[0])
    p.add_argument("--tokenizer", default=str(BUNDLED_MODEL_DIR), help="a demo checkpoint (its tokenizer)")
    p.add_argument("--per-family", type=int, default=12)
    p.add_argument("--seed", type=int, default=5)
    p.add_argument("--length", type=int, default=24, help="window positions (answer + EOS padding)")
    p.add_argument("--draws", type=int, default=4000, help="fresh answers per prompt to estimate the distribution")
    args = p.parse_args(argv)
    res = run(Tokenizer.from_pretrained(args.tokenizer), args.per_family, args.seed, args.length, args.draws)
    print("| family | setting | valid | tok/fwd | fwd/req | edits/req |\n|---|---|---|---|---|---|")
    for family, modes in res.items():
        for mode, r in modes.items():
            print(f"| {family} | {mode} | {100 * r['valid']:.1f}% | {r['tpf']:.2f} | {r['forwards_per_req']:.2f} | "
                  f"{r['edits_per_req']:.2f} |")
        print(f"| {family} | S / Q | | {modes['S']['tpf'] / modes['Q']['tpf']:.2f}x | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
