"""Quick held-out evaluation of an exported demo checkpoint through `redraft.Engine` (the serving path).

    python -m redraft.training.evaluate --model runs/demo/eval_model --per-family 40 --modes Q S

Prints one JSON object: per mode, exact-match accuracy per family and overall, tokens per forward, forwards
and edits per request; plus a few sample answers. The trainer runs it in a subprocess, so an evaluation
always imports the engine code as it is now (others edit it while a long training run goes on) and never
disturbs the training process.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from redraft.training.tasks import FAMILIES, eval_set, is_correct, render_prompt

MODE_PARAMS: dict[str, dict[str, Any]] = {
    "Q": {"mode": "Q"},
    "S": {"mode": "S"},
    "S-noedit": {"mode": "S", "edit_threshold": 1.0},
    "Q-noedit": {"mode": "Q", "edit_threshold": 1.0},
}


def evaluate(model_dir: str, per_family: int, modes: list[str], seed: int = 1000,
             max_new_tokens: int = 64) -> dict[str, Any]:
    import torch

    from redraft.engine.engine import Engine

    torch.set_num_threads(1)
    exs = eval_set(seed, per_family)
    engine = Engine(model_dir, device="cpu", dtype="float32", max_total_tokens=32 * 1024, progress=False)
    try:
        prompts = [engine.tokenizer.encode(render_prompt(ex, engine.tokenizer)) for ex in exs]
        result: dict[str, Any] = {}
        for mode in modes:
            params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **MODE_PARAMS[mode]}
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            right = {f: 0 for f in FAMILIES}
            count = {f: 0 for f in FAMILIES}
            tokens = forwards = edits = 0
            for ex, o in zip(exs, outs):
                count[ex.family] += 1
                right[ex.family] += is_correct(ex, o["text"])
                m = o["meta_info"]
                tokens += m["completion_tokens"]
                forwards += m["steps"]
                edits += m.get("edits", 0)
            r: dict[str, Any] = {f: right[f] / count[f] for f in FAMILIES if count[f]}
            r["all"] = sum(right.values()) / len(exs)
            r["tpf"] = tokens / max(1, forwards)
            r["forwards_per_req"] = forwards / len(exs)
            r["edits_per_req"] = edits / len(exs)
            result[mode] = r
            if mode == modes[0]:
                result["samples"] = [[ex.user, o["text"]] for ex, o in list(zip(exs, outs))[::per_family]]
        return result
    finally:
        engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m redraft.training.evaluate")
    p.add_argument("--model", required=True, help="an exported checkpoint directory")
    p.add_argument("--per-family", type=int, default=40)
    p.add_argument("--modes", nargs="+", default=["Q", "S"], choices=sorted(MODE_PARAMS))
    p.add_argument("--seed", type=int, default=1000)
    args = p.parse_args(argv)
    print(json.dumps(evaluate(args.model, args.per_family, args.modes, args.seed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
