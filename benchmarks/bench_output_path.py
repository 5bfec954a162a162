"""The output path of one long generation, block by block, without the model: what a committed block costs
between the engine's scheduler and the client's SSE chunk, early and late in the output.

    python benchmarks/bench_output_path.py                 # 4096 and 32768 tokens, logprobs 5, a stop string

Per block, "incremental" runs redraft's path: the engine's RequestOutput with only the block's ids and
logprobs (pickled and unpickled, as over ZMQ), then the HTTP side's OutputStream (StreamingDetokenizer: the
block decoded, stop strings matched) and the OpenAI completions logprobs of the block, JSON-encoded.
"cumulative" is the path as it was before (commit 58d6833), run in the same process on the same data: the
engine re-sent the whole output so far (ids and [logprob, id] pairs), and the HTTP side decoded the whole
text again, looked for stop strings in all of it, and cut the block's logprobs out of the whole list.
Printed: the median microseconds per block over the first and the last 16 blocks, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

BLOCK = 32
STOP = "\u2603never\u2603"


def incremental(tok, ids: list[int], lps: list[float], tops: list, stop: list[str]) -> list[float]:
    from redraft.engine.text.output_stream import OutputStream
    from redraft.protocol.messages import RequestOutput

    stream = OutputStream("r", tok, stop)
    times = []
    for start in range(0, len(ids), BLOCK):
        t0 = time.perf_counter()
        msg = RequestOutput("r", ids[start : start + BLOCK], False, None, lps[start : start + BLOCK],
                            tops[start : start + BLOCK], {"steps": 1, "blocks": start // BLOCK + 1})
        msg = pickle.loads(pickle.dumps([msg]))[0]
        text = stream.add(msg)
        rows = zip(stream.ids[start:], stream.logprobs[start:], stream.top_logprobs[start:])
        payload = {"text": text, "logprobs": [[t, v, [[a, b] for a, b in alts]] for t, v, alts in rows]}
        json.dumps(payload)
        times.append(time.perf_counter() - t0)
    return times


def cumulative(tok, ids: list[int], lps: list[float], tops: list, stop: list[str]) -> list[float]:
    """The path before: every message holds everything so far; the HTTP side starts from scratch each time."""
    times = []
    sent_chars = sent_tokens = 0
    for end in range(BLOCK, len(ids) + BLOCK, BLOCK):
        t0 = time.perf_counter()
        meta = {"output_token_logprobs": [[v, t] for v, t in zip(lps[:end], ids[:end])],
                "output_top_logprobs": [[[v, t] for t, v in alts] for alts in tops[:end]]}
        msg = pickle.loads(pickle.dumps([("r", ids[:end], False, None, meta)]))[0]
        text = tok.decode(msg[1])
        cut = min((text.find(s) for s in stop if s in text), default=-1)
        if cut >= 0:
            text = text[:cut]
        while text.endswith("\ufffd"):
            text = text[:-1]
        delta = text[sent_chars:]
        sent_chars = len(text)
        pairs = msg[4]["output_token_logprobs"][sent_tokens:end]
        alts = msg[4]["output_top_logprobs"][sent_tokens:end]
        sent_tokens = end
        json.dumps({"text": delta, "logprobs": [[t, v, a] for (v, t), a in zip(pairs, alts)]})
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/bench_output_path.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[4096, 32768])
    p.add_argument("--window", type=int, default=16)
    args = p.parse_args(argv)
    from redraft.engine.model.tiny import make_tiny_checkpoint
    from redraft.engine.text.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        tok = Tokenizer.from_pretrained(make_tiny_checkpoint(Path(tmp) / "tiny", seed=0))
    rng = random.Random(0)
    vocab = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    print("| tokens | path | early us/block | late us/block | late / early |")
    print("|---|---|---|---|---|")
    for n in args.tokens:
        ids = [rng.choice(vocab) for _ in range(n)]
        lps = [-rng.random() for _ in range(n)]
        tops = [[(rng.choice(vocab), -rng.random()) for _ in range(5)] for _ in range(n)]
        for name, fn in (("cumulative (before)", cumulative), ("incremental (after)", incremental)):
            t = fn(tok, ids, lps, tops, [STOP])
            w = min(args.window, len(t) // 2)
            early, late = statistics.median(t[1 : 1 + w]) * 1e6, statistics.median(t[-w:]) * 1e6
            print(f"| {n} | {name} | {early:.0f} | {late:.0f} | {late / early:.1f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
