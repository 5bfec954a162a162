"""Structured output (docs/structured-output.md) on CPU: what a grammar costs draft-and-edit decoding.

    python benchmarks/bench_structured.py                 # demo model + tiny random model
    python benchmarks/bench_structured.py --per-family 100 --batch 16 --json out.json

Demo model (the bundled one, or --model): held-out math problems asked for JSON (`... Answer in JSON.`) and
with the tools add / subtract (training/tasks.py, suite v3), decoded free and constrained (a `{"answer":
integer}` schema; a forced call of one of the tools), in S and Q. Per setting: outputs that end by EOS, those
that also are valid (parse and validate), right answers, tokens per forward, time per forward, and the grammar's host
time per forward (the frontier sweep, engine/decoding/constrained.py) with its share of the step.
Tiny random model: every request runs to --new-tokens (ignore_eos) free, under an open-ended JSON array
grammar, and under a regex, at batch 1 and --batch: the same figures against free decoding in one process.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ANSWER_SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
                 "additionalProperties": False}
TINY_GRAMMARS = {
    "free": {},
    "json array": {"json_schema": json.dumps({"type": "array", "items": {"type": "integer"}})},
    "regex": {"regex": r"[a-z]+( [a-z]+)*"},
}


def _run(engine: Any, prompts: list[list[int]], params: list[dict], batch: int) -> dict:
    """Decode `prompts` `batch` at a time; totals of forwards, tokens, wall and grammar time."""
    outs: list[dict] = []
    f0, g0, t0 = engine.core.num_forwards, engine.core.runner.grammar_seconds, time.perf_counter()
    for i in range(0, len(prompts), batch):
        outs += engine.generate(input_ids=prompts[i : i + batch], sampling_params=params[i : i + batch])
    wall = time.perf_counter() - t0
    forwards = engine.core.num_forwards - f0
    tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
    steps = sum(o["meta_info"]["steps"] for o in outs)
    grammar = engine.core.runner.grammar_seconds - g0
    return {"outs": outs, "tokens_per_forward": tokens / max(steps, 1), "ms_per_forward": 1e3 * wall / max(forwards, 1),
            "grammar_ms_per_forward": 1e3 * grammar / max(forwards, 1), "grammar_share": grammar / wall,
            "tokens_per_s": tokens / wall}


def _valid_json(text: str) -> bool:
    import jsonschema

    try:
        jsonschema.validate(json.loads(text), ANSWER_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _valid_call(text: str) -> bool:
    import jsonschema

    from redraft.training.tasks import MATH_TOOLS

    if not (text.startswith("<tool_call>") and text.endswith("</tool_call>")):
        return False
    try:
        call = json.loads(text[len("<tool_call>") : -len("</tool_call>")])
        schema = next(t["function"]["parameters"] for t in MATH_TOOLS if t["function"]["name"] == call["name"])
        jsonschema.validate(call["arguments"], schema)
    except (ValueError, KeyError, TypeError, StopIteration, jsonschema.ValidationError):
        return False
    return True


def demo(args: argparse.Namespace) -> list[dict]:
    import torch

    import redraft
    from redraft.engine.text.grammar import tool_call_lark
    from redraft.training.tasks import MATH_TOOLS, eval_set, is_correct, render_prompt

    torch.set_num_threads(args.threads)
    engine = redraft.Engine(args.model, progress=False)
    tok = engine.tokenizer
    rows = []
    tool_grammar = tool_call_lark(list(MATH_TOOLS), tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"),
                                  parallel=False)
    for family, constraint, valid in [("json", {"json_schema": json.dumps(ANSWER_SCHEMA)}, _valid_json),
                                      ("tool", {"lark": tool_grammar}, _valid_call)]:
        examples = eval_set(args.seed, args.per_family, families=(family,), suite="v3")
        prompts = [tok.encode(render_prompt(ex, tok)) for ex in examples]
        for mode in ("S", "Q"):
            base = None
            for name, extra in (("free", {}), ("constrained", constraint)):
                params = [dict(mode=mode, max_new_tokens=args.max_new_tokens, skip_special_tokens=False, **extra)
                          for _ in prompts]
                r = _run(engine, prompts, params, args.batch)
                outs = r.pop("outs")
                texts = [tok.decode([t for t in o["output_ids"] if t != tok.eos_token_id], skip_special_tokens=False)
                         for o in outs]
                stopped = [o["meta_info"]["finish_reason"]["type"] == "stop" for o in outs]
                row = dict(model="demo", task=family, mode=mode, decoding=name, **r,
                           ended=sum(stopped) / len(outs),
                           valid=sum(s and valid(t) for s, t in zip(stopped, texts)) / len(outs),
                           right=sum(is_correct(ex, t) for ex, t in zip(examples, texts)) / len(outs))
                base = base or row
                row["tpf_vs_free"] = row["tokens_per_forward"] / base["tokens_per_forward"]
                rows.append(row)
                print(f"  demo {family} {mode} {name}: valid {row['valid']:.0%} right {row['right']:.0%}", flush=True)
    engine.shutdown()
    return rows


def tiny(args: argparse.Namespace) -> list[dict]:
    import torch

    import redraft
    from redraft.engine.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        engine = redraft.Engine(str(make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)), progress=False,
                                enable_prefix_cache=False)
        rng = random.Random(0)
        vocab = [i for i in range(engine.model_config.vocab_size) if i not in engine.tokenizer.special_token_ids]
        prompts = [[rng.choice(vocab) for _ in range(rng.randint(20, 60))] for _ in range(args.batch)]
        for batch in sorted({1, args.batch}):
            base = None
            for name, extra in TINY_GRAMMARS.items():
                params = [dict(mode="S", max_new_tokens=args.new_tokens, ignore_eos=True, **extra)] * batch
                _run(engine, prompts[:batch], params, batch)  # warm-up
                r = _run(engine, prompts[:batch], params, batch)
                r.pop("outs")
                row = dict(model="tiny", task=f"batch {batch}", mode="S", decoding=name, **r)
                base = base or row
                row["tpf_vs_free"] = row["tokens_per_forward"] / base["tokens_per_forward"]
                row["step_vs_free"] = row["ms_per_forward"] / base["ms_per_forward"]
                rows.append(row)
                print(f"  tiny batch {batch} {name}: {row['ms_per_forward']:.1f} ms/forward", flush=True)
        engine.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_structured.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="demo checkpoint (default: the bundled demo model)")
    p.add_argument("--per-family", type=int, default=50, help="held-out problems per task on the demo model")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64, help="demo model")
    p.add_argument("--new-tokens", type=int, default=128, help="tiny model (every request runs to it)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-demo", action="store_true")
    p.add_argument("--skip-tiny", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    rows = ([] if args.skip_demo else demo(args)) + ([] if args.skip_tiny else tiny(args))
    print(f"\nbatch {args.batch}, {args.threads} thread(s); valid: ends by EOS and parses/validates; grammar: host "
          "time of the frontier sweep\n")
    print("| model | task | mode | decoding | ended by EOS | valid | right | tokens/forward | vs free | ms/forward | "
          "grammar ms/forward | grammar share |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        ended, valid, right = (f"{r[k]:.0%}" if k in r else "-" for k in ("ended", "valid", "right"))
        print(f"| {r['model']} | {r['task']} | {r['mode']} | {r['decoding']} | {ended} | {valid} | {right} | "
              f"{r['tokens_per_forward']:.2f} | {r['tpf_vs_free']:.2f}x | {r['ms_per_forward']:.1f} | "
              f"{r['grammar_ms_per_forward']:.2f} | {r['grammar_share']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
