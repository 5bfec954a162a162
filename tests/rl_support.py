"""Shared parts of the reinforcement-learning tests (docs/rl.md): a fresh engine's tokens for a checkpoint (the
reference every update is held to), a stand-in trainer process (tests/rl_trainer.py) and the tensor lists it sends."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import httpx
from safetensors import safe_open

from live_server import free_port

TRAINER = Path(__file__).with_name("rl_trainer.py")
SP = {"max_new_tokens": 40, "temperature": 0.0}
# prompts of whole blocks and a tail: the first is generated (and so cached) before an update in the tests
PROMPTS = [list(range(5, 45)), list(range(60, 75)), [7, 8, 9] * 12]
PROMPT = list(range(5, 45))
LONG = {"max_new_tokens": 256, "temperature": 0.0, "ignore_eos": True}  # seconds of work on a CPU


def fresh_ids(path: Path, prompts: list[list[int]] = PROMPTS, sp: dict = SP, dtype: str = "float32"
              ) -> list[list[int]]:
    """The output ids a freshly started engine on `path` gives (the server's settings: float32 on CPU)."""
    import redraft

    engine = redraft.Engine(model_path=str(path), device="cpu", dtype=dtype, progress=False)
    try:
        return [out["output_ids"] for out in engine.generate(input_ids=prompts, sampling_params=[sp] * len(prompts))]
    finally:
        engine.shutdown()


def tensor_specs(path: Path) -> tuple[list[str], list[str], list[list[int]]]:
    """Names (file order), dtypes (as slime spells them) and shapes of a one-file checkpoint's tensors."""
    names, dtypes, shapes = [], [], []
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            names.append(name)
            dtypes.append(str(t.dtype).replace("torch.", ""))
            shapes.append(list(t.shape))
    return names, dtypes, shapes


class Trainer:
    """tests/rl_trainer.py in its own process: hosts the group's store on a free port, joins as rank 0, then
    broadcasts `names` of `checkpoint` `rounds` times; `next_round()` after the engine answered each round."""

    def __init__(self, checkpoint: Path, names: list[str], tmp: Path, *, world_size: int = 2,
                 group: str = "weight_update_group", flattened: bool = False, rounds: int = 1, delay: float = 0.0):
        self.port, self.group, self.world_size = free_port(), group, world_size
        names_file = tmp / f"names-{self.port}.json"
        names_file.write_text(json.dumps(names))
        cmd = [sys.executable, str(TRAINER), "--port", str(self.port), "--world-size", str(world_size), "--group",
               group, "--checkpoint", str(checkpoint), "--names", str(names_file), "--rounds", str(rounds)]
        self.log = tmp / f"trainer-{self.port}.log"
        cmd += ["--delay", str(delay)] + (["--flattened"] if flattened else [])
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE,
                                     stdout=open(self.log, "wb"), stderr=subprocess.STDOUT)

    def init_payload(self, backend: str = "gloo") -> dict:
        return {"master_address": "127.0.0.1", "master_port": self.port, "rank_offset": 1,
                "world_size": self.world_size, "group_name": self.group, "backend": backend}

    def next_round(self) -> None:
        self.proc.stdin.write(b"\n")
        self.proc.stdin.flush()

    def finish(self, timeout: float = 60.0) -> None:
        try:
            assert self.proc.wait(timeout) == 0, self.log.read_text()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()


class Streamed:
    """One streamed /generate in a thread: `started` once its first block arrived; `last` is its final chunk."""

    def __init__(self, url: str, sp: dict = LONG, prompt: list[int] = PROMPT):
        self.started, self.done = threading.Event(), threading.Event()
        self.last: dict | None = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, args=(url, sp, prompt), daemon=True).start()
        assert self.started.wait(60), "the request never committed a block"

    def _run(self, url: str, sp: dict, prompt: list[int]) -> None:
        try:
            with httpx.stream("POST", url + "/generate", json={"input_ids": prompt, "sampling_params": sp,
                                                               "stream": True}, timeout=300, trust_env=False) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        self.last = json.loads(line[6:])
                        self.started.set()
        except BaseException as exc:  # noqa: BLE001 - reported by result()
            self.error = exc
        finally:
            self.started.set()
            self.done.set()

    def result(self, timeout: float = 120) -> dict:
        assert self.done.wait(timeout), "the request did not finish"
        assert self.error is None and self.last is not None, self.error
        return self.last
