"""Bystanders for the hardening tests: clients that keep asking the same temperature-0 question of a live server
while something hostile happens beside them. Each records every answer and its latency; `check` fails unless
every answer equals the one it got before the hostility began and no request took longer than the bound the
test states."""

from __future__ import annotations

import json
import threading
import time

import httpx

MODEL = "demo_model"


def ask(client: httpx.Client, i: int, max_tokens: int = 16) -> tuple[str, float, float]:
    """(text, total seconds, longest silence between chunks) of one streamed temperature-0 chat completion."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"Count from {i} to 30."}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = last = time.monotonic()
    gap, text = 0.0, []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise AssertionError(f"bystander got {r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text += [c["delta"].get("content") or "" for c in event["choices"]]
    return "".join(text), time.monotonic() - t0, gap


class Bystanders:
    """`n` threads, each asking its own question back to back on its own kept-alive connection (its reference
    answer taken first, alone, before the hostility begins)."""

    def __init__(self, url: str, n: int = 2, max_tokens: int = 16):
        self.url, self.n, self.max_tokens = url, n, max_tokens
        self.stop = threading.Event()
        self.ready = threading.Semaphore(0)
        self.reference: dict[int, str] = {}
        self.answers: dict[int, list[tuple[str, float, float]]] = {i: [] for i in range(n)}
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=120, trust_env=False) as client:
            try:  # the reference, alone, on the connection the bystander keeps using
                self.reference[i] = ask(client, i, self.max_tokens)[0]
            finally:
                self.ready.release()
            while not self.stop.is_set():
                try:
                    self.answers[i].append(ask(client, i, self.max_tokens))
                except Exception as exc:  # noqa: BLE001 - reported by check()
                    self.errors.append(f"bystander {i}: {type(exc).__name__}: {exc}")
                    time.sleep(0.2)

    def __enter__(self) -> "Bystanders":
        for t in self.threads:  # one after another: each reference is taken alone
            t.start()
            assert self.ready.acquire(timeout=120), "a bystander's first answer did not come"
        assert len(self.reference) == self.n, "a bystander's first request failed"
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(130)

    def check(self, max_latency_s: float, max_gap_s: float | None = None, min_answers: int = 1) -> None:
        """Every answer the reference; each request within `max_latency_s`, no silence over `max_gap_s`."""
        assert not self.errors, self.errors[:5]
        for i, got in self.answers.items():
            assert len(got) >= min_answers, (i, got)
            for text, latency, gap in got:
                assert text == self.reference[i], (i, text, self.reference[i])
                assert latency <= max_latency_s, (i, f"a bystander request took {latency:.1f}s", got)
                if max_gap_s is not None:
                    assert gap <= max_gap_s, (i, f"a bystander stream was silent {gap:.1f}s", got)
