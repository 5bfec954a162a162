"""Tensor and expert parallelism over torch.distributed (gloo on CPU, NCCL on GPUs): docs/scaling.md.

What each rank holds is engine/model/sharding.py (each rank loads only that: its rows and columns of the sharded
weights, its own experts, its slice of the vocabulary, and the replicated rest). Here: the processes and the
collectives. An all-reduce after the (vocabulary-parallel) embedding, after attention and after the MLP of every
layer turns the ranks' partial sums into the full hidden state everywhere; for logits each rank multiplies the
same rows by its lm_head slice and the slices are all-gathered. Rank 0 alone makes the decisions.

Rank 0 is the engine: it schedules, and before each forward broadcasts the forward's inputs (token ids and
attention metadata) to the other ranks, which run the same forward on their shards and their own KV caches
(`worker_main`); before each logits call, the rows it wants. Every rank therefore schedules identically by
construction: only rank 0 schedules at all.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import resource
import socket
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from redraft.protocol.processes import group_signals_blocked, shield_from_group_signals
from redraft.engine.model.config import ModelConfig
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.model.sharding import RankLayout, is_vocab_parallel

log = logging.getLogger("redraft.tp")
STOP = "stop"


def set_threads(args: Any) -> None:
    """Torch's intra-op threads for this rank: --cpu-threads if given; on CPU with tp ranks, the cores shared out
    among them (more threads than cores leave a rank descheduled at every collective: 7x slower measured with 4
    ranks on 2 cores)."""
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    elif args.tp_size > 1 and torch.device(args.device).type == "cpu":
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cores // args.tp_size))


def install_all_reduces(model: LLaDA2Model) -> None:
    """Sum the ranks' partial attention and MLP outputs after every layer's two blocks (and their embedding
    rows); gather their lm_head slices."""
    for layer in model.layers:
        layer.attn.register_forward_hook(_all_reduce_output)
        layer.mlp.register_forward_hook(_all_reduce_output)
    if is_vocab_parallel(model):
        model.embed.register_forward_hook(_all_reduce_output)
        model.lm_head.register_forward_hook(_all_gather_vocab)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a rank holds."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def peak_memory_bytes(device: str | torch.device) -> int:
    """The process's peak: device memory allocated on a GPU, resident set size on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # (Linux reports KiB)


def log_rank_memory(rank: int, model: torch.nn.Module, k_cache: torch.Tensor) -> None:
    kv = 2 * k_cache.numel() * k_cache.element_size()
    log.info("rank %d holds %.1f MB of weights and %.1f MB of KV cache (%d KV heads); peak process memory %.1f MB",
             rank, weight_bytes(model) / 1e6, kv / 1e6, k_cache.shape[3], peak_memory_bytes(k_cache.device) / 1e6)


def _all_reduce_output(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out)
    return out


def _all_gather_vocab(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    """[..., V / tp] logits of this rank's token rows -> [..., V], the ranks' slices in rank order."""
    parts = [torch.empty_like(out) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, out.contiguous())
    return torch.cat(parts, dim=-1)


# ---- processes ---------------------------------------------------------------------------------------------
def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(rank: int, tp: int, device: str, init_method: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=tp)


def init_leader(tp: int, device: str, init_method: str, workers: list[Any], poll_s: float = 0.2) -> None:
    """Rank 0's rendezvous, watching the workers meanwhile: one that exits first (bad arguments, no device,
    an import error) is an error naming it, not a wait without end. (The rendezvous runs on a daemon thread:
    a C++ wait cannot be interrupted; if a worker died, the thread is left to the process's exit.)"""
    done = threading.Event()
    failure: list[BaseException] = []

    def rendezvous() -> None:
        try:
            init(0, tp, device, init_method)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
            failure.append(exc)
        finally:
            done.set()

    threading.Thread(target=rendezvous, name="redraft-tp-init", daemon=True).start()
    while not done.wait(poll_s):
        dead = [w for w in workers if not w.is_alive()]
        if dead:
            raise RuntimeError(f"tensor-parallel worker {dead[0].name} exited during start-up (exit code "
                               f"{dead[0].exitcode}); its log above says why")
    if failure:
        raise failure[0]


def install_leader(model: LLaDA2Model) -> None:
    """Rank 0: every forward first sends its inputs to the other ranks, which run it too; with a vocabulary-
    parallel lm_head, every logits call sends its rows, and the ranks give their slices of them."""
    def send(module: torch.nn.Module, args: tuple) -> None:
        ids, meta = args[0], args[1]
        dist.broadcast_object_list([("forward", ids.cpu(), _tensors_to(meta, "cpu"))], src=0)

    model.register_forward_pre_hook(send)
    if is_vocab_parallel(model):
        own_logits = model.logits

        def logits(hidden: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
            dist.broadcast_object_list([("logits", None if rows is None else rows.cpu(), None)], src=0)
            return own_logits(hidden, rows)

        model.logits = logits  # type: ignore[method-assign]


def _tensors_to(obj: Any, device: str | torch.device) -> Any:
    """A dataclass (attention metadata) with its tensor fields on `device`: each rank reads its own copy."""
    changes = {f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
               if isinstance(getattr(obj, f.name), torch.Tensor)}
    return dataclasses.replace(obj, **changes)


class Workers:
    """Ranks 1..tp-1, each in its own process. Started before rank 0 loads, so that every rank reads its shard at
    the same time; `join` then meets them (rendezvous, the KV cache size, the collectives) once rank 0 is ready."""

    def __init__(self, args: Any) -> None:
        self.args = args
        self.init_method = free_init_method()
        ctx = torch.multiprocessing.get_context("spawn")
        # The kernel's parent-death signal follows the starting thread: only a main thread lives as long as we do.
        main = threading.current_thread() is threading.main_thread()
        self.procs = [ctx.Process(target=worker_main, name=f"redraft-tp{rank}", daemon=True,
                                  args=(rank, args.tp_size, args.ep_size, args, self.init_method, main))
                      for rank in range(1, args.tp_size)]
        with group_signals_blocked():  # a signal to the group during their start-up must not kill them
            for p in self.procs:
                p.start()
        # They ignore SIGTERM, which multiprocessing's own exit hook sends before it joins them: an interpreter
        # that exits without shutdown() (Ctrl-C in a script) kills them first instead of waiting forever.
        atexit.register(self.kill)

    def join(self, model: LLaDA2Model, num_pages: int, num_slots: int) -> None:
        """Rank 0 (this process, `model` loaded): meet the workers, tell them the KV cache's size (rank 0's
        choice: every rank must hold the same pages), and make every forward a collective one."""
        try:
            init_leader(self.args.tp_size, self.args.device, self.init_method, self.procs)
            dist.broadcast_object_list([(num_pages, num_slots)], src=0)
        except BaseException:
            self.kill()
            raise
        install_all_reduces(model)
        install_leader(model)

    def weights(self, command: tuple) -> None:
        """Announce a weight command to the other ranks (engine/model/weight_sync.py `rank_command`); rank 0 then
        does its own share."""
        dist.broadcast_object_list([("weights", command, None)], src=0)

    def memory(self, op: str, tags: list[str], apply: Any) -> list[dict]:
        """A memory release or resume (engine/runtime/memory_occupation.py) on every rank: announced, rank 0's
        own (`apply(op, tags)`), then every rank's answer (resident bytes per tag, or an error), in rank order."""
        dist.broadcast_object_list([("memory", op, tags)], src=0)
        answers: list[Any] = [None] * self.args.tp_size
        dist.gather_object(apply(op, tags), answers, dst=0)
        return answers

    def kill(self) -> None:
        """None may outlive a failed start, or the interpreter."""
        for p in self.procs:
            p.kill()
            p.join(5)
        self.procs = []

    def stop(self) -> None:
        if dist.is_initialized():
            dist.broadcast_object_list([(STOP, None, None)], src=0)
            dist.destroy_process_group()
        for p in self.procs:
            p.join(timeout=30)
        self.kill()  # any rank that did not stop in time


def worker_main(rank: int, tp: int, ep: int, args: Any, init_method: str, die_with_parent: bool = True) -> None:
    """A rank > 0: load its shard, meet rank 0, build its KV cache, then run every forward rank 0 announces.
    Signals to the process group are ignored (the engine stops the ranks: STOP, or a kill; started by the engine
    process they inherit its "ignored" already, this says so for any other parent), and a rank dies with the
    engine process (when it started us from its main thread)."""
    shield_from_group_signals(die_with_parent)
    from redraft.engine.model.loader import load_model
    from redraft.engine.text.model_path import resolve_model_path
    from redraft.engine.runtime.memory_occupation import RankMemory
    from redraft.engine.runtime.model_runner import ModelRunner

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_threads(args)
    device = f"cuda:{rank}" if torch.device(args.device).type == "cuda" else args.device
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    path = resolve_model_path(args.model_path, args.revision)
    cfg, layout = ModelConfig.from_pretrained(path), RankLayout(rank, tp, ep)
    model = load_model(path, cfg, dtype=args.resolved_dtype, device=device,
                       load_format=args.load_format, seed=args.seed, progress=False,
                       quantization=args.quantization, layout=layout)
    model.set_kernel_backend(args.kernel_backend)
    install_all_reduces(model)
    init(rank, tp, args.device, init_method)
    box: list[Any] = [None]
    dist.broadcast_object_list(box, src=0)
    num_pages, num_slots = box[0]
    runner = ModelRunner(model, num_pages, num_slots, 0, 0, device)
    memory = RankMemory(model, runner)  # /release_memory_occupation's share of this rank
    log_rank_memory(rank, model, runner.k_cache)
    hidden = torch.empty(0)
    groups: dict[str, Any] = {}  # the trainers' process groups this rank joined (docs/rl.md)
    with torch.inference_mode():
        while True:
            dist.broadcast_object_list(box, src=0)
            kind, first, second = box[0]
            if kind == STOP:
                break
            if kind == "weights":  # a weight update: every rank loads, or receives, its shard
                from redraft.engine.model.weight_sync import rank_command

                rank_command(first, model, cfg, layout, device, groups)
            elif kind == "memory":  # release or resume: every rank answers rank 0
                dist.gather_object(memory.apply(first, second), None, dst=0)
            elif kind == "logits":  # rows of the last forward's hidden states; the gather is lm_head's hook
                model.logits(hidden, None if first is None else first.to(device))
            else:
                hidden = model(first.to(device), _tensors_to(second, device), runner.k_cache, runner.v_cache)
    dist.destroy_process_group()
    os._exit(0)
