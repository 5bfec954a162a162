"""Held-out evaluation of a demo checkpoint through `redraft.Engine` (the serving path): `redraft eval-demo`.

    redraft eval-demo                                   # the bundled model, 200 problems per family, 4 settings
    python -m redraft.training.evaluate --model runs/demo/eval_model --per-family 40 --modes Q S   # JSON

Per setting (Q, S, and each with editing off: edit_threshold 1.0, so T2T never fires): exact-match accuracy
per family and overall, tokens per forward (per family too), forwards and edits per request, and what the
edits did: an edit *repairs* when it turns a token that differs from the reference answer into the reference
token, *breaks* when it does the opposite, and is *neutral* otherwise (wrong to another wrong). The reference
of an output is the correct answer closest to it (chat has three), token by token, EOS-padded.

`python -m redraft.training.evaluate` prints one JSON object (the trainer's periodic evaluation reads it from
a subprocess, so an evaluation always imports the engine code as it is now); `redraft eval-demo` a table,
and `--plot` writes a PNG of accuracy against tokens per forward, one point per setting.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from redraft.protocol.fields import refusal
from redraft.protocol.sampling_params import FIELDS
from redraft.training.open_tasks import OPEN_FAMILIES, check
from redraft.training.tasks import SUITES, Example, eval_set, is_correct, render_prompt

MODE_PARAMS: dict[str, dict[str, Any]] = {
    "Q": {"mode": "Q"},
    "S": {"mode": "S"},
    "S-noedit": {"mode": "S", "edit_threshold": 1.0},
    "Q-noedit": {"mode": "Q", "edit_threshold": 1.0},
    # multi-block editing (docs/mbe.md): W open blocks
    "S-W2": {"mode": "S", "mbe_window": 2},
    "S-W3": {"mode": "S", "mbe_window": 3},
    "Q-W2": {"mode": "Q", "mbe_window": 2},
    "Q-W3": {"mode": "Q", "mbe_window": 3},
    # the stutter penalty (engine/decoding/logit_controls.py)
    "S-stutter1": {"mode": "S", "stutter_penalty": 1.0},
    "S-stutter3": {"mode": "S", "stutter_penalty": 3.0},
}
ALL_MODES = ["Q", "S", "S-noedit", "Q-noedit"]
MBE_MODES = ["S-W2", "S-W3", "Q-W2", "Q-W3"]
# what --set may change in every setting, with its type: the fields declared `sweep` (protocol/sampling_params.py)
SWEEPABLE: dict[str, type] = {name: spec.kind for name, spec in FIELDS.items() if spec.sweep}
MAX_NEW_TOKENS = {"v1": 64, "v2": 128, "v3": 128, "v4": 128}  # v2: count and repeat answers run to ~100 tokens


def model_suite(model_dir: str | Path) -> str:
    """The task suite a demo checkpoint was trained on (config.json's `redraft_task_suite`, else v1)."""
    try:
        return json.loads((Path(model_dir) / "config.json").read_text()).get("redraft_task_suite", "v1")
    except (OSError, ValueError):
        return "v1"


def classify_edits(trace: list[list[int]], output_ids: list[int], references: list[list[int]]
                   ) -> tuple[int, int, int]:
    """(repairs, breaks, neutral) among the edits of one request, against the reference closest to the output."""
    def agreement(ref: list[int]) -> int:
        return sum(a == b for a, b in zip(output_ids, ref))

    ref = max(references, key=agreement)
    repairs = breaks = neutral = 0
    for pos, old, new in trace:
        want = ref[pos] if pos < len(ref) else ref[-1]
        if old != want and new == want:
            repairs += 1
        elif old == want and new != want:
            breaks += 1
        else:
            neutral += 1
    return repairs, breaks, neutral


def evaluate(model_dir: str, per_family: int, modes: list[str], seed: int = 1000,
             max_new_tokens: int | None = None, threads: int = 1, suite: str | None = None,
             families: list[str] | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each setting of `modes` on the held-out problems; `overrides` (sampling params such as threshold) apply
    on top of every setting."""
    import torch

    from redraft.engine.runtime.engine import Engine

    torch.set_num_threads(threads)
    suite = suite or model_suite(model_dir)
    max_new_tokens = max_new_tokens or MAX_NEW_TOKENS[suite]
    exs = eval_set(seed, per_family, SUITES[suite], suite=suite)
    if families:  # a subset: the same problems as the whole suite's draw, for comparison
        unknown = sorted(set(families) - set(SUITES[suite]))
        if unknown:
            raise ValueError(f"families {unknown} are not in suite {suite!r}: {SUITES[suite]}")
        exs = [ex for ex in exs if ex.family in families]
    engine = Engine(model_dir, device="cpu", dtype="float32", max_total_tokens=64 * 1024, progress=False,
                    trace_edits=True)
    try:
        tok = engine.tokenizer
        prompts = [tok.encode(render_prompt(ex, tok)) for ex in exs]
        refs = [[tok.encode(a) + [tok.eos_token_id] * (max_new_tokens + 1) for a in ex.answers] for ex in exs]
        result: dict[str, Any] = {"overrides": dict(overrides or {})}
        for mode in modes:
            params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **MODE_PARAMS[mode], **(overrides or {})}
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            result[mode] = summarise(exs, outs, refs)
            if mode == modes[0]:
                result["samples"] = [[ex.user, o["text"]] for ex, o in list(zip(exs, outs))[::per_family]]
        return result
    finally:
        engine.shutdown()


def summarise(exs: list[Example], outs: list[dict], refs: list[list[list[int]]]) -> dict[str, Any]:
    families = list(dict.fromkeys(ex.family for ex in exs))
    right = {f: 0 for f in families}
    count = {f: 0 for f in families}
    tokens = {f: 0 for f in families}
    forwards = {f: 0 for f in families}
    fam_edits = {f: {"total": 0, "repairs": 0, "breaks": 0} for f in families}
    invalid: dict[str, dict[str, int]] = {f: {} for f in families if f in OPEN_FAMILIES}
    edits = mbe_edits = repairs = breaks = neutral = 0
    pairs = repeats = 0
    for ex, o, ref in zip(exs, outs, refs):
        m = o["meta_info"]
        count[ex.family] += 1
        right[ex.family] += is_correct(ex, o["text"])
        if ex.family in OPEN_FAMILIES and not (verdict := check(ex.user, o["text"])).valid:
            kind = failure_kind(verdict.reason)
            invalid[ex.family][kind] = invalid[ex.family].get(kind, 0) + 1
        tokens[ex.family] += m["completion_tokens"]
        forwards[ex.family] += m["steps"]
        edits += m.get("edits", 0)
        mbe_edits += m.get("mbe_edits", 0)
        ids = [t for t in o["output_ids"]]
        pairs += max(0, len(ids) - 1)
        repeats += sum(a == b for a, b in zip(ids, ids[1:]))
        r, b, n = classify_edits(m.get("edit_trace", []), o["output_ids"], ref)
        repairs, breaks, neutral = repairs + r, breaks + b, neutral + n
        fe = fam_edits[ex.family]
        fe["total"], fe["repairs"], fe["breaks"] = fe["total"] + m.get("edits", 0), fe["repairs"] + r, fe["breaks"] + b
    fams = [f for f in families if count[f]]
    out: dict[str, Any] = {f: right[f] / count[f] for f in fams}
    out["all"] = sum(right.values()) / len(exs)
    out["tpf"] = sum(tokens.values()) / max(1, sum(forwards.values()))
    out["tpf_by_family"] = {f: tokens[f] / max(1, forwards[f]) for f in fams}
    out["requests_by_family"] = {f: count[f] for f in fams}
    out["forwards_per_req_by_family"] = {f: forwards[f] / count[f] for f in fams}
    out["edits_by_family"] = {f: fam_edits[f] for f in fams}
    out["forwards_per_req"] = sum(forwards.values()) / len(exs)
    out["edits_per_req"] = edits / len(exs)
    out["mbe_edits_per_req"] = mbe_edits / len(exs)
    out["adjacent_repeat_rate"] = repeats / max(1, pairs)  # stutter: a token equal to the one before it
    out["edits"] = {"total": edits, "repairs": repairs, "breaks": breaks, "neutral": neutral}
    open_fams = [f for f in fams if f in OPEN_FAMILIES]
    if open_fams:  # the open-ended families together: graded by their checker
        n_open = sum(count[f] for f in open_fams)
        out["open"] = {"valid": sum(right[f] for f in open_fams) / n_open,
                       "tpf": sum(tokens[f] for f in open_fams) / max(1, sum(forwards[f] for f in open_fams)),
                       "forwards_per_req": sum(forwards[f] for f in open_fams) / n_open,
                       "invalid": {f: invalid[f] for f in open_fams}}
    closed = [f for f in fams if f not in OPEN_FAMILIES]
    if open_fams and closed:
        out["closed_all"] = sum(right[f] for f in closed) / sum(count[f] for f in closed)
    return out


def failure_kind(reason: str) -> str:
    """A checker's reason, in a word: what kind of conflict made an open-ended answer invalid."""
    for key, kind in (("duplicate", "duplicate"), ("before", "a/an"), ("agree", "agreement"), ("two before", "a/an"),
                      ("excluded", "excluded"), ("items, not", "count"), ("not the", "wrong noun"),
                      ("not one of", "unknown item")):
        if key in reason:
            return kind
    return "form"


# ----- presentation ------------------------------------------------------------------------------------
def format_table(result: dict[str, Any], per_family: int) -> str:
    modes = [m for m in result if m in MODE_PARAMS]
    families = list(result[modes[0]]["tpf_by_family"]) if modes else []
    head = ["setting", *families, "all", "tok/fwd", "fwd/req", "edits/req", "earlier-block edits/req", "repairs",
            "breaks", "neutral"]
    rows = []
    for m in modes:
        r = result[m]
        e = r["edits"]
        rows.append([m, *(f"{100 * r[f]:.1f}%" for f in families), f"{100 * r['all']:.1f}%", f"{r['tpf']:.2f}",
                     f"{r['forwards_per_req']:.2f}", f"{r['edits_per_req']:.2f}",
                     f"{r.get('mbe_edits_per_req', 0.0):.2f}", str(e["repairs"]), str(e["breaks"]), str(e["neutral"])])
    every = ", ".join(f"{k}={v}" for k, v in result.get("overrides", {}).items())
    lines = [f"exact match on {per_family} held-out problems per family ({per_family * len(families)} in all)"
             + (f"; in every setting {every}" if every else ""),
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    if "S" in result and "Q" in result:
        ratio = " ".join(f"{f} {result['S']['tpf_by_family'][f] / result['Q']['tpf_by_family'][f]:.2f}x"
                         for f in families)
        lines.append(f"\ntokens per forward, S / Q: all {result['S']['tpf'] / result['Q']['tpf']:.2f}x; {ratio}")
    if modes and "open" in result[modes[0]]:
        lines += ["", format_open_table(result, modes)]
    return "\n".join(lines)


def format_open_table(result: dict[str, Any], modes: list[str]) -> str:
    """The open-ended families, graded by their checker: per setting and family, how many answers are valid (and
    what broke the others), tokens per forward, forwards per request, and what the edits did; then the S/Q
    comparison the families exist for."""
    fams = [f for f in result[modes[0]]["open"]["invalid"]]
    head = ["setting", "family", "valid", "invalid because", "tok/fwd", "fwd/req", "edits/req", "repairs", "breaks"]
    lines = ["open-ended families (valid = the checker accepts it: the right items, distinct, agreeing)",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m in modes:
        r = result[m]
        for f in fams:
            bad = r["open"]["invalid"][f]
            why = ", ".join(f"{k} {v}" for k, v in sorted(bad.items(), key=lambda kv: -kv[1])) or "-"
            e = r["edits_by_family"][f]
            lines.append(f"| {m} | {f} | {100 * r[f]:.1f}% | {why} | {r['tpf_by_family'][f]:.2f} | "
                         f"{r['forwards_per_req_by_family'][f]:.2f} | {e['total'] / r['requests_by_family'][f]:.2f} | "
                         f"{e['repairs']} | {e['breaks']} |")
        o = r["open"]
        lines.append(f"| {m} | **both** | **{100 * o['valid']:.1f}%** | | **{o['tpf']:.2f}** | {o['forwards_per_req']:.2f} "
                     "| | | |")
    if "S" in result and "Q" in result:
        s, q = result["S"]["open"], result["Q"]["open"]
        parts = [f"S / Q tokens per forward {s['tpf'] / q['tpf']:.2f}x", f"S valid {100 * s['valid']:.1f}% vs Q "
                 f"{100 * q['valid']:.1f}% ({100 * (s['valid'] - q['valid']):+.1f} points)"]
        if "S-noedit" in result:
            parts.append(f"S with editing off {100 * result['S-noedit']['open']['valid']:.1f}% "
                         f"({100 * (result['S-noedit']['open']['valid'] - s['valid']):+.1f} points)")
        lines.append("\nopen-ended families: " + "; ".join(parts))
    if "Q" in result and "closed_all" in result["Q"]:
        lines.append(f"the other families, Q: {100 * result['Q']['closed_all']:.1f}%")
    return "\n".join(lines)


def plot(result: dict[str, Any], path: Path, title: str) -> bool:
    """Accuracy against tokens per forward, one point per setting; with open-ended families (suite v4) a second
    panel: their validity against their tokens per forward. False (and a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return False
    modes = [m for m in result if m in MODE_PARAMS]
    has_open = bool(modes) and "open" in result[modes[0]]
    panels = [("all", "exact match, all families (%)")]
    if has_open:
        panels = [("closed_all", "exact match, the other families (%)"), ("open", "valid, open-ended families (%)")]
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.2), dpi=120, squeeze=False)
    for ax, (key, label) in zip(axes[0], panels):
        for m in modes:
            r = result[m]
            x, y = (r["open"]["tpf"], r["open"]["valid"]) if key == "open" else (r["tpf"], r[key])
            if key == "closed_all":
                x = _closed_tpf(r)
            ax.scatter(x, 100 * y, s=60, marker="o" if "noedit" not in m else "x")
            ax.annotate(m, (x, 100 * y), textcoords="offset points", xytext=(6, 4))
        ax.set_xlabel("tokens per forward (higher = faster)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0][0].set_title(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return True


def _closed_tpf(r: dict[str, Any]) -> float:
    """Tokens per forward over the families that are not open-ended, from the per-family figures."""
    fams = [f for f in r["tpf_by_family"] if f not in OPEN_FAMILIES]
    reqs, fwd, tpf = r["requests_by_family"], r["forwards_per_req_by_family"], r["tpf_by_family"]
    tokens = sum(tpf[f] * fwd[f] * reqs[f] for f in fams)
    return tokens / max(1e-9, sum(fwd[f] * reqs[f] for f in fams))


def main(argv: list[str] | None = None, default_format: str = "json", prog: str | None = None) -> int:
    """`python -m redraft.training.evaluate` prints JSON (the trainer reads it); `redraft eval-demo` a table."""
    p = argparse.ArgumentParser(prog=prog,
                                description="Held-out exact match, tokens per forward and edits of a demo checkpoint "
                                            "in Q, S and editing-off settings, through redraft.Engine.")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--per-family", type=int, default=200, help="held-out problems per family (default: 200)")
    p.add_argument("--modes", nargs="+", default=None, choices=list(MODE_PARAMS),
                   help="settings to run (default: Q S S-noedit Q-noedit, plus S-W2 S-W3 Q-W2 Q-W3 for suites v2, v3, v4)")
    p.add_argument("--suite", choices=sorted(SUITES), default=None,
                   help="task suite (default: the one the checkpoint was trained on, else v1)")
    p.add_argument("--families", nargs="+", default=None, metavar="FAMILY",
                   help="evaluate only these families of the suite (the problems are those of the whole suite's draw)")
    p.add_argument("--seed", type=int, default=1000, help="seed of the held-out problem draw")
    p.add_argument("--set", action="append", default=[], metavar="PARAM=VALUE", dest="overrides",
                   help="a sampling parameter for every setting, e.g. --set threshold=0.3 (repeatable)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--format", choices=["table", "json"], default=default_format,
                   help=f"a table, or one JSON object on one line (default {default_format})")
    p.add_argument("--out", default=None, help="also write the JSON result to this file")
    p.add_argument("--plot", default=None, metavar="PNG", help="write accuracy vs tokens-per-forward here")
    args = p.parse_args(argv)
    model = args.model
    if model is None:
        from redraft.engine.text.model_path import BUNDLED_MODEL_DIR

        if not (BUNDLED_MODEL_DIR / "config.json").is_file():
            p.error(f"no bundled demo model in this install ({BUNDLED_MODEL_DIR}); pass --model DIR")
        model = str(BUNDLED_MODEL_DIR)
    suite = args.suite or model_suite(model)
    modes = args.modes or (ALL_MODES + (MBE_MODES if suite in ("v2", "v3", "v4") else []))
    if args.families and set(args.families) - set(SUITES[suite]):
        p.error(f"--families must be among suite {suite}'s: {' '.join(SUITES[suite])}")
    overrides = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in SWEEPABLE:
            p.error(f"--set takes PARAM=VALUE with PARAM one of {', '.join(sorted(SWEEPABLE))}, not {item!r}")
        overrides[key] = SWEEPABLE[key](value)
        if (why := refusal(FIELDS[key], overrides[key])) is not None:  # the field's declared range
            p.error(f"--set {why}")
    result = evaluate(model, args.per_family, modes, args.seed, threads=args.threads, suite=suite,
                      families=args.families, overrides=overrides)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    if args.format == "json":
        print(json.dumps(result))
        return 0
    print(format_table(result, args.per_family))
    if args.plot and plot(result, Path(args.plot), f"{Path(model).name}: {args.per_family} problems per family"):
        print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
