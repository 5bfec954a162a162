"""Multi-block editing (docs/mbe.md) on CPU: what a window of W open blocks costs and what it buys.

    python benchmarks/bench_mbe.py                       # speed: W = 1, 2, 3 at batch 1 and 16 (tiny model)
    python benchmarks/bench_mbe.py --accuracy            # + accuracy / tokens per forward on the demo model

Speed: a tiny random checkpoint, S mode, `--new-tokens` per request with ignore_eos, prompts of 20-60 tokens;
per (W, batch): engine forwards per second, output tokens per second and tokens per forward, each against
W = 1 in the same process. A forward with W open blocks computes W blocks of queries (plus the block that
just left the window, recomputed block-causally), so forwards get slower as W grows.
Accuracy: the bundled demo model (or --model) on its held-out problems through training/evaluate.py, in S
and Q with W = 1, 2, 3, per family: exact match, tokens per forward, edits and edits in earlier blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path


def speed(args: argparse.Namespace) -> list[dict]:
    import torch

    import redraft
    from redraft.engine.model.tiny import make_tiny_checkpoint

    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        engine = redraft.Engine(str(ckpt), progress=False, enable_prefix_cache=False)
        rng = random.Random(0)
        vocab = [i for i in range(engine.model_config.vocab_size) if i not in engine.tokenizer.special_token_ids]
        prompts = [[rng.choice(vocab) for _ in range(rng.randint(20, 60))] for _ in range(max(args.batches))]
        base: dict[int, dict] = {}
        for batch in args.batches:
            for w in args.windows:
                params = {"mode": "S", "max_new_tokens": args.new_tokens, "ignore_eos": True, "mbe_window": w}
                engine.generate(input_ids=prompts[:batch], sampling_params=params)  # warm-up
                f0, t0 = engine.core.num_forwards, time.perf_counter()
                outs = engine.generate(input_ids=prompts[:batch], sampling_params=params)
                dt = time.perf_counter() - t0
                forwards = engine.core.num_forwards - f0
                tokens = sum(o["meta_info"]["completion_tokens"] for o in outs)
                steps = sum(o["meta_info"]["steps"] for o in outs)
                row = {"batch": batch, "window": w, "forwards_per_s": forwards / dt, "tokens_per_s": tokens / dt,
                       "tokens_per_forward": tokens / steps, "mbe_edits": sum(o["meta_info"]["mbe_edits"] for o in outs)}
                base.setdefault(batch, row)
                row["speed_vs_w1"] = row["tokens_per_s"] / base[batch]["tokens_per_s"]
                rows.append(row)
                print(f"  batch {batch} W {w}: {row['tokens_per_s']:.0f} tokens/s", flush=True)
        engine.shutdown()
    return rows


def accuracy(args: argparse.Namespace) -> dict:
    from redraft.training.evaluate import evaluate, model_suite

    model = args.model
    if model is None:
        from redraft.engine.text.model_path import BUNDLED_MODEL_DIR

        model = str(BUNDLED_MODEL_DIR)
    modes = ["S", "S-W2", "S-W3", "Q", "Q-W2", "Q-W3"]
    result = evaluate(model, args.per_family, modes, threads=args.threads)
    result.pop("samples", None)
    result["suite"] = model_suite(model)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_mbe.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--windows", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--accuracy", action="store_true", help="also the demo model's accuracy with W = 1, 2, 3")
    p.add_argument("--model", default=None, help="checkpoint for --accuracy (default: the bundled demo model)")
    p.add_argument("--per-family", type=int, default=100)
    p.add_argument("--skip-speed", action="store_true", help="only the accuracy part")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    out: dict = {}
    if not args.skip_speed:
        rows = out["speed"] = speed(args)
        print(f"\ntiny random model, S mode, {args.new_tokens} new tokens per request, {args.threads} thread(s)\n")
        print("| batch | W | forwards/s | output tokens/s | tokens/forward | multi-block edits | tokens/s vs W=1 |")
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch']} | {r['window']} | {r['forwards_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
                  f"{r['tokens_per_forward']:.2f} | {r['mbe_edits']} | {r['speed_vs_w1']:.2f}x |")
    if args.accuracy:
        acc = accuracy(args)
        out["accuracy"] = acc
        settings = [m for m in ("S", "S-W2", "S-W3", "Q", "Q-W2", "Q-W3") if m in acc]
        families = list(acc[settings[0]]["tpf_by_family"])
        print(f"\n{args.per_family} held-out problems per family, suite {acc['suite']}\n")
        print("| setting | " + " | ".join(families) + " | all | tokens/forward | edits/req | earlier-block edits/req |")
        print("|---|" + "---|" * (len(families) + 4))
        for m in settings:
            r = acc[m]
            print(f"| {m} | " + " | ".join(f"{100 * r[f]:.1f}%" for f in families) +
                  f" | {100 * r['all']:.1f}% | {r['tpf']:.2f} | {r['edits_per_req']:.2f} | "
                  f"{r['mbe_edits_per_req']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
