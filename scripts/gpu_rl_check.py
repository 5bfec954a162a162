"""The RL control plane on a GPU (docs/rl.md): a CUDA server (Triton kernels, CUDA graphs) on tiny checkpoint A
gets checkpoint C by broadcast from a trainer process (NCCL with two GPUs, the trainer on the second; gloo with
one: NCCL cannot put two ranks on one GPU), and must then answer exactly as a fresh CUDA engine on C, with its
CUDA graphs still in use; then memory: a /release_memory_occupation -> /resume_memory_occupation round trip, and
SGLang's RL order (release all -> resume weights -> update_weights_from_disk -> resume kv_cache -> resume
cuda_graph), each with the engine's device memory at every stage (its allocator's own figures from /server_info,
the device's free memory, nvidia-smi's per-process figure) and the answers again, from recaptured CUDA graphs
(their replay count). Prints a table; exits 1 when an answer or a graph check fails.

    python scripts/gpu_rl_check.py            # needs a CUDA device; run from the repository root
"""
from __future__ import annotations

import json
import os
import shutil
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
# a KV cache of 256k tokens (~hundreds of MiB at the tiny shape), so that what a release frees is plain to see
FLAGS = ["--device", "cuda", "--kernel-backend", "triton", "--dtype", "float32", "--max-total-tokens", "262144"]
MIB = 2**20


def fresh(path: Path) -> list[list[int]]:
    import redraft

    with redraft.Engine(str(path), device="cuda", kernel_backend="triton", dtype="float32", progress=False,
                        max_total_tokens=16384) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=[SP] * len(PROMPTS))]


def gpu_mib(pid: int) -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
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


def _snapshot(http: httpx.Client, engine_pid: int) -> dict:
    """The engine's device memory now: its allocator (allocated, reserved), the device's free memory, nvidia-smi's
    figure for the engine process, the resident bytes per tag it reports, its captured graphs."""
    import torch

    info = http.get("/server_info").json()
    return {"allocated": info.get("cuda_memory_allocated_bytes", 0) / MIB,
            "reserved": info.get("cuda_memory_reserved_bytes", 0) / MIB,
            "free": torch.cuda.mem_get_info(0)[0] / MIB if torch.cuda.is_available() else 0.0,
            "smi": gpu_mib(engine_pid),
            "resident": {k: round(v / MIB, 1) for k, v in info["memory_resident_bytes"].items()},
            "graphs": info["cuda_graph_batch_sizes"], "replays": info["cuda_graph_replays"]}


def _memory(http: httpx.Client, op: str, tags: list[str] | None = None) -> str:
    r = http.post(f"/{op}_memory_occupation", json={"tags": tags} if tags else {})
    return f"{r.status_code} {r.json().get('message', r.text)[:160]}"


def _memory_checks(http: httpx.Client, engine_pid: int, model: Path, want: list[list[int]], gen,
                   rows: list[tuple[str, str]]) -> bool:
    """A round trip, then SGLang's RL order with a disk update of the same weights; memory at every stage, the
    answers (and graph replays) after each. True when every answer matched and the graphs ran again."""
    fmt = lambda m: (f"allocated {m['allocated']:.0f} MiB, reserved {m['reserved']:.0f} MiB, device free "  # noqa: E731
                     f"{m['free']:.0f} MiB, nvidia-smi {m['smi']} MiB; resident {m['resident']}; graphs {m['graphs']}")
    ok = True
    rows.append(("memory before", fmt(_snapshot(http, engine_pid))))
    rows.append(("release (all)", _memory(http, "release")))
    rows.append(("memory released", fmt(_snapshot(http, engine_pid))))
    rows.append(("resume (all)", _memory(http, "resume")))
    rows.append(("memory resumed", fmt(_snapshot(http, engine_pid))))
    same, replays = gen() == want, _snapshot(http, engine_pid)["replays"]
    rows.append(("round trip: answers == fresh C, graph replays since resume", f"{same}, {replays}"))
    ok &= same and replays > 0
    rows.append(("RL order: release (all)", _memory(http, "release")))
    rows.append(("resume weights", _memory(http, "resume", ["weights"])))
    r = http.post("/update_weights_from_disk", json={"model_path": str(model), "weight_version": "c-disk"})
    rows.append(("update_weights_from_disk (KV still released)", f"{r.status_code} {r.json().get('message')}"))
    rows.append(("resume kv_cache", _memory(http, "resume", ["kv_cache"])))
    rows.append(("memory (graphs still released)", fmt(_snapshot(http, engine_pid))))
    rows.append(("resume cuda_graph", _memory(http, "resume", ["cuda_graph"])))
    same, replays = gen() == want, _snapshot(http, engine_pid)["replays"]
    rows.append(("RL order: answers == fresh C, graph replays since resume", f"{same}, {replays}"))
    return ok and same and replays > 0 and r.status_code == 200


def main() -> int:
    import torch

    from live_server import free_port
    from redraft.engine.model.tiny import make_tiny_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="gpu-rl-"))
    a, c = make_tiny_checkpoint(tmp / "A", 0), make_tiny_checkpoint(tmp / "C", 2)
    want_c = fresh(c)
    torch.cuda.empty_cache()  # (this process's cached blocks would blur the device's free memory)
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
        engine_pid = int(subprocess.run(["pgrep", "-P", str(server.pid), "-f", "spawn_main"], capture_output=True,
                                        text=True).stdout.split()[0])
        gen = lambda: [o["output_ids"] for o in http.post("/generate", json={"input_ids": PROMPTS,  # noqa: E731
                                                                              "sampling_params": SP}).json()]
        before = gen()
        _broadcast(http, c, tmp, backend, trainer_device, rows)
        after = gen()
        info = http.get("/server_info").json()
        rows.append(("answers before (on A) differ from fresh C", str(before != want_c)))
        rows.append(("answers after == fresh C", str(after == want_c)))
        rows.append(("CUDA graphs (server_info)", str({k: v for k, v in info.items() if "graph" in k})))
        ok = before != want_c and after == want_c and info["cuda_graph_replays"] > 0
        ok &= _memory_checks(http, engine_pid, c, want_c, gen, rows)
    finally:
        server.terminate()
        server.wait(60)
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    print(f"(server log: {tmp / 'server.log'})")
    print("ALL CHECKS PASSED" if ok else "A CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
