"""The RL control plane on a GPU (docs/rl.md): a CUDA server (Triton kernels, CUDA graphs) on tiny checkpoint A
gets checkpoint C by broadcast from a trainer process (NCCL with two GPUs, the trainer on the second; gloo with
one: NCCL cannot put two ranks on one GPU), and must then answer exactly as a fresh CUDA engine on C, with its
CUDA graphs still in use; then a /release_memory_occupation -> /resume_memory_occupation round trip, with the
engine process's GPU memory before, between and after (nvidia-smi), and the answers again. Prints a table.

    python scripts/gpu_rl_check.py            # needs a CUDA device; run from the repository root
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
PROMPTS = [list(range(5, 45)), list(range(60, 75))]
SP = {"max_new_tokens": 64, "temperature": 0.0}
FLAGS = ["--device", "cuda", "--kernel-backend", "triton", "--dtype", "float32", "--max-total-tokens", "16384"]


def fresh(path: Path) -> list[list[int]]:
    import redraft

    with redraft.Engine(str(path), device="cuda", kernel_backend="triton", dtype="float32", progress=False,
                        max_total_tokens=16384) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=[SP] * len(PROMPTS))]


def gpu_mib(pid: int) -> int | None:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout
    for line in out.splitlines():
        p, mib = (x.strip() for x in line.split(","))
        if int(p) == pid:
            return int(mib)
    return None


def _wait_healthy(http: httpx.Client) -> None:
    for _ in range(600):
        try:
            if http.get("/health").status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)


def _broadcast(http: httpx.Client, c: Path, tmp: Path, backend: str, trainer_device: str,
               rows: list[tuple[str, str]]) -> None:
    """A trainer process broadcasts checkpoint c to the engine (init_weights_update_group, then
    update_weights_from_distributed), timed into `rows`."""
    from live_server import free_port
    from rl_support import tensor_specs

    names, dtypes, shapes = tensor_specs(c)
    (tmp / "names.json").write_text(json.dumps(names))
    master_port = free_port()
    trainer = subprocess.Popen([sys.executable, str(ROOT / "tests" / "rl_trainer.py"), "--port",
                                str(master_port), "--world-size", "2", "--group", "g",
                                "--checkpoint", str(c), "--names", str(tmp / "names.json"), "--backend",
                                backend, "--device", trainer_device], stdin=subprocess.PIPE)
    t0 = time.perf_counter()
    r = http.post("/init_weights_update_group", json={"master_address": "127.0.0.1", "master_port":
                                                      master_port, "rank_offset": 1, "world_size": 2,
                                                      "group_name": "g", "backend": backend})
    rows.append(("init_weights_update_group", f"{r.status_code} {r.json()} in {time.perf_counter() - t0:.2f}s"))
    t0 = time.perf_counter()
    r = http.post("/update_weights_from_distributed", json={"names": names, "dtypes": dtypes, "shapes": shapes,
                                                            "group_name": "g", "weight_version": "c"})
    rows.append(("update_weights_from_distributed", f"{r.status_code} in {time.perf_counter() - t0:.2f}s"))
    trainer.stdin.write(b"\n")
    trainer.stdin.flush()
    trainer.wait(60)


def _memory_round_trip(http: httpx.Client, engine_pid: int, rows: list[tuple[str, str]]) -> None:
    """release_memory_occupation then resume_memory_occupation, with the engine's GPU memory at each stage."""
    mem = [gpu_mib(engine_pid)]
    rows.append(("release_memory_occupation", str(http.post("/release_memory_occupation", json={}).status_code)))
    mem.append(gpu_mib(engine_pid))
    rows.append(("resume_memory_occupation", str(http.post("/resume_memory_occupation", json={}).status_code)))
    mem.append(gpu_mib(engine_pid))
    rows.append(("engine GPU MiB before/released/resumed", " / ".join(map(str, mem))))


def main() -> int:
    import torch

    from live_server import free_port
    from redraft.engine.model.tiny import make_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="gpu-rl-"))
    a, c = make_tiny_checkpoint(tmp / "A", 0), make_tiny_checkpoint(tmp / "C", 2)
    want_c = fresh(c)
    two = torch.cuda.device_count() >= 2
    backend, trainer_device = ("nccl", "cuda:1") if two else ("gloo", "cpu")
    port = free_port()
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0"} if two else dict(os.environ)
    server = subprocess.Popen([sys.executable, "-m", "redraft", "serve", "--model", str(a), "--port", str(port),
                               "--log-level", "info", *FLAGS], env=env, stdout=open(tmp / "server.log", "wb"),
                              stderr=subprocess.STDOUT, cwd=ROOT)
    rows: list[tuple[str, str]] = [("device", torch.cuda.get_device_name(0)), ("group backend", backend)]
    try:
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600, trust_env=False)
        _wait_healthy(http)
        info = http.get("/server_info").json()
        engine_pid = int(subprocess.run(["pgrep", "-P", str(server.pid), "-f", "spawn_main"], capture_output=True,
                                        text=True).stdout.split()[0])
        gen = lambda: [o["output_ids"] for o in http.post("/generate", json={"input_ids": PROMPTS,  # noqa: E731
                                                                              "sampling_params": SP}).json()]
        before = gen()
        _broadcast(http, c, tmp, backend, trainer_device, rows)
        after = gen()
        rows.append(("answers before == fresh C", str(before == want_c)))
        rows.append(("answers after == fresh C", str(after == want_c)))
        rows.append(("CUDA graphs (server_info)", str({k: v for k, v in info.items() if "graph" in k})))
        _memory_round_trip(http, engine_pid, rows)
        rows.append(("answers after the round trip == fresh C", str(gen() == want_c)))
    finally:
        server.terminate()
        server.wait(60)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"(server log: {tmp / 'server.log'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
