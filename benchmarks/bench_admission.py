"""One /generate carrying N prompts against the same N prompts sent as N concurrent requests.

    python benchmarks/bench_admission.py --launch                 # the bundled demo model, 32 prompts, 5 rounds
    python benchmarks/bench_admission.py --base-url http://127.0.0.1:30000 --prompts 64

RL and evaluation frameworks send a batch of prompts in one request. All of them should start decoding in the
same engine iteration, as concurrent requests do (the engine admits one HTTP request's engine requests in one
message). Rounds alternate the two shapes; the table gives the median wall time of each, their ratio, and the
spread of `first_forward` (the engine forward each prompt began at) within the batched request.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from bench_serving import LaunchedServer

WORDS = "the river sees a cat and the dog runs to the old house near the water".split()


def prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i + j) % len(WORDS)] for j in range(6 + i % 5)) for i in range(n)]


async def batched(client: httpx.AsyncClient, url: str, texts: list[str], new_tokens: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = await client.post(url, json={"text": texts, "sampling_params": {"max_new_tokens": new_tokens,
                                                                        "ignore_eos": True}})
    r.raise_for_status()
    starts = [out["meta_info"].get("first_forward") for out in r.json()]
    spread = max(starts) - min(starts) if None not in starts else -1
    return time.perf_counter() - t0, spread


async def concurrent(client: httpx.AsyncClient, url: str, texts: list[str], new_tokens: int) -> float:
    async def one(text: str) -> None:
        r = await client.post(url, json={"text": text, "sampling_params": {"max_new_tokens": new_tokens,
                                                                           "ignore_eos": True}})
        r.raise_for_status()

    t0 = time.perf_counter()
    await asyncio.gather(*(one(t) for t in texts))
    return time.perf_counter() - t0


async def run(base_url: str, n: int, new_tokens: int, rounds: int) -> None:
    url = f"{base_url}/generate"
    texts = prompts(n)
    one_req: list[float] = []
    many: list[float] = []
    spreads: list[int] = []
    limits = httpx.Limits(max_connections=n + 4)
    async with httpx.AsyncClient(timeout=600, trust_env=False, limits=limits) as client:
        await batched(client, url, texts[:2], new_tokens)  # warm-up
        for _ in range(rounds):
            seconds, spread = await batched(client, url, texts, new_tokens)
            one_req.append(seconds)
            spreads.append(spread)
            many.append(await concurrent(client, url, texts, new_tokens))
    a, b = statistics.median(one_req), statistics.median(many)
    print(f"{n} prompts x {new_tokens} new tokens, {rounds} rounds (alternating), medians [min-max]:\n")
    print("| shape | wall s | first_forward spread |")
    print("|---|---:|---:|")
    print(f"| one /generate with {n} prompts | {a:.3f} [{min(one_req):.3f}-{max(one_req):.3f}] | "
          f"{max(spreads)} |")
    print(f"| {n} concurrent /generate | {b:.3f} [{min(many):.3f}-{max(many):.3f}] | - |")
    print(f"\nbatched / concurrent: {a / b:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url")
    where.add_argument("--launch", action="store_true", help="serve the bundled demo model on a free port")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--server-args", default="--cpu-threads 1")
    args = ap.parse_args()
    if args.base_url:
        asyncio.run(run(args.base_url, args.prompts, args.new_tokens, args.rounds))
        return
    launch = argparse.Namespace(model=None, load_format=None, max_running_requests=max(64, args.prompts),
                                server_args=args.server_args, server_log=None, tiny=False, small=False)
    with tempfile.TemporaryDirectory() as tmp:
        server = LaunchedServer(launch, Path(tmp))
        try:
            server.wait_healthy(300)
            asyncio.run(run(server.base_url, args.prompts, args.new_tokens, args.rounds))
        finally:
            server.stop()


if __name__ == "__main__":
    main()
