"""The training control plane in the engine process (docs/rl.md): weight versions, weight updates from disk or
from a trainer's broadcast, pausing and continuing generation, memory release. The HTTP routes are
server/rl_api.py; what one rank does with the weights is engine/model/weight_sync.py.

Semantics (SGLang's):
- A request runs on one weight version. An update waits until no request is running; requests that arrive
  meanwhile queue behind it and run on the new weights. With `abort_all_requests` the running and waiting
  requests end at once (finish_reason abort, with what they committed) and the update runs now.
- Generation paused (`pause`): mode abort ends every request and holds new ones; retract sends the running ones
  back to the queue (their K/V freed, recomputed after `continue`); in_place freezes them where they are (after
  an update they go on with the new weights, their committed K/V kept: `meta_info.weight_versions` lists every
  version such a request ran on). An update while paused runs at once.
- Every update bumps the radix cache's version (scheduler/radix_cache.py): K/V computed under older weights is
  never matched again; flush_cache (default) frees it at once.
- Memory release (SGLang's /release_memory_occupation): only when idle; while the weights or the KV cache are
  released, new requests and likelihood jobs wait in the queue and weight updates are refused; what one rank frees
  is engine/runtime/memory_occupation.py's.
- Under tensor parallelism every rank takes part: rank 0 announces the command to the other ranks
  (engine/model/tensor_parallel.py), then all of them load, or join the group and receive, each its shard.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

from redraft.engine.model import weight_sync
from redraft.engine.model.loader import CheckpointError, load_weights
from redraft.engine.model.sharding import RankLayout
from redraft.engine.runtime.memory_occupation import MEMORY_TAGS, RankMemory, parse_tags
from redraft.protocol.messages import ControlResult, GenerationControlReq, WeightGroupReq, WeightUpdateReq
from redraft.scheduler.request import FinishReason

log = logging.getLogger("redraft.weight_update")

PAUSE_MODES = ("abort", "retract", "in_place")
ABORT_BEFORE_PREFILL = "Abort before prefill"  # SGLang's message: AReaL resends such a request as it was


class WeightsLost(BaseException):
    """An update failed part way and the weights served before cannot be read again: the engine process ends
    (not an Exception: the loop must not answer it and go on), and a restart refuses to serve (docs/rl.md)."""


class WeightControl:
    """Owns the engine's weight version and the control messages; `handle` answers a message (or queues an
    update), `poll` runs a queued update once it may run. Both are called from the engine loop only."""

    def __init__(self, core: Any) -> None:
        self.core = core
        args = core.args
        self.version = args.weight_version  # the free-string name SGLang reports
        self.layout = RankLayout(0, args.tp_size, args.ep_size) if args.tp_size > 1 else None
        self.serving_path = Path(core.model_path)  # where the weights being served can be read again
        self.recoverable = args.load_format != "dummy"
        self.header = weight_sync.checkpoint_header(self.serving_path) if self.recoverable else None
        self.pending: deque[WeightUpdateReq] = deque()
        self.paused: str | None = None
        self.memory = RankMemory(core.model, core.runner)  # this rank's weights, KV cache, CUDA graphs
        self.resident = self.memory.resident_bytes()  # per tag, all ranks, as of the last release or resume
        self.resident_per_rank: list[dict] = [self.resident]  # (rank 0's only until the first release)
        self.groups: dict[str, Any] = {}
        self.versions_seen: dict[str, list[str]] = {}  # rid -> versions, for requests that ran on more than one
        self.ran_on: dict[str, str] = {}  # rid -> version, for requests ended before an update they report after
        self.spool_dir = Path(args.weight_spool_dir) if args.weight_spool_dir else None

    # ---- messages ----------------------------------------------------------------------------------
    def handle(self, msg: Any) -> list[ControlResult]:
        if isinstance(msg, WeightUpdateReq):
            return self._queue_update(msg)
        if isinstance(msg, WeightGroupReq):
            return [self._group(msg)]
        if isinstance(msg, GenerationControlReq):
            return [self._generation(msg)]
        raise TypeError(f"not a control message: {type(msg).__name__}")

    def busy(self) -> bool:
        return bool(self.pending)

    def poll(self) -> list[ControlResult]:
        """Run the queued updates if no request runs now (or generation is paused)."""
        out = []
        while self.pending and self._may_update():
            out.append(self._run(self.pending.popleft()))
        if not self.pending:
            self.core.scheduler.hold_admission = self._holding()
        return out

    def _holding(self) -> bool:
        """Whether new requests wait: an update is queued, generation is paused, or memory is released."""
        return bool(self.pending) or self.paused is not None or not self.memory.serving()

    def request_meta(self, rid: str) -> dict[str, Any]:
        """What a finished request's meta_info says about the weights it ran on."""
        meta: dict[str, Any] = {"weight_version": self.ran_on.pop(rid, self.version)}
        seen = self.versions_seen.pop(rid, None)
        if seen is not None:
            meta["weight_versions"] = seen
        return meta

    def info(self) -> dict[str, Any]:
        """What /server_info adds for RL clients: the weights, and the SGLang server arguments slime compares when
        it attaches to an external engine (one node, the memory saver as --enable-memory-saver says, no
        disaggregation)."""
        a = self.core.args
        return {"weight_version": self.version, "weight_epoch": self.core.scheduler.cache.version,
                "paused": self.paused, "serving_path": str(self.serving_path), "weights_recoverable":
                self.recoverable, "host": a.host, "port": a.port, "nnodes": 1, "node_rank": 0, "gpu_id_step": 1,
                "base_gpu_id": 0, "enable_memory_saver": a.enable_memory_saver, "disaggregation_mode": "null"}

    # ---- updates -----------------------------------------------------------------------------------
    def _queue_update(self, msg: WeightUpdateReq) -> list[ControlResult]:
        refusal = self._check(msg)
        if refusal is not None:
            log.warning("weight update refused (%s): %s", msg.source, refusal)
            if msg.source == "distributed" and msg.group_name in self.groups:
                self._drain(msg)  # the trainer broadcasts anyway: take its tensors, keep none
            return [ControlResult(msg.token, False, refusal, {"num_paused_requests": 0})]
        if msg.abort_all_requests:
            self._abort_all()
        self.pending.append(msg)
        self.core.scheduler.hold_admission = True  # new requests queue behind the update
        return self.poll()

    def _check(self, msg: WeightUpdateReq) -> str | None:
        """Why this update cannot run (nothing is touched then), or None."""
        core = self.core
        if msg.source != "version" and "weights" in self.memory.released:
            return ("the weights are released (/release_memory_occupation): resume them first "
                    "(/resume_memory_occupation with tags [\"weights\"]). The weights are unchanged.")
        if msg.source == "disk":
            if msg.load_format not in (None, "auto", "safetensors"):
                return f"load_format {msg.load_format!r} is not supported from disk: use auto or safetensors"
            try:
                weight_sync.check_checkpoint(msg.model_path, core.model_config, self.header)
            except (CheckpointError, OSError) as exc:
                return f"Failed to update weights: {exc}. The running weights are unchanged."
        elif msg.source == "distributed":
            if msg.group_name not in self.groups:
                return (f"Group {msg.group_name} not in {sorted(self.groups)}. Please call "
                        "`init_weights_update_group` first.")
            if not len(msg.names) == len(msg.dtypes) == len(msg.shapes):
                return "names, dtypes and shapes must have the same length"
            if msg.load_format not in (None, "auto", weight_sync.FLATTENED_BUCKET):
                return f"load_format {msg.load_format!r} is not supported: use flattened_bucket or none"
            try:
                for d in msg.dtypes:
                    weight_sync.parse_dtype(d)
            except ValueError as exc:
                return f"dtypes: {exc}"
            return weight_sync.check_specs(self._specs(msg), core.model_config)
        return None

    def _may_update(self) -> bool:
        sched = self.core.scheduler
        return (not sched.running or self.paused == "in_place") and not self.core.scoring.jobs

    def _run(self, msg: WeightUpdateReq) -> ControlResult:
        t0 = time.perf_counter()
        paused = len(self.core.scheduler.running) + len(self.core.scheduler.waiting)
        try:
            received = self._load(msg)
        except Exception as exc:  # noqa: BLE001 - answered; the weights may be partly new: reload the old ones
            log.error("weight update from %s failed: %s", msg.source, exc)
            return ControlResult(msg.token, False, self._recover(exc), {"num_paused_requests": paused})
        old = self.version
        self._new_epoch(msg)
        self._remember(msg, received)
        text = {"disk": "Succeeded to update model weights.", "distributed": "Succeeded to update parameter online.",
                "version": f"Weight version updated to {self.version}"}[msg.source]
        log.info("weights updated from %s in %.2fs: version %r -> %r (cache epoch %d)", msg.source,
                 time.perf_counter() - t0, old, self.version, self.core.scheduler.cache.version)
        return ControlResult(msg.token, True, text, {"num_paused_requests": paused, "weight_version": self.version,
                                                     "serving_path": str(self.serving_path),
                                                     "weights_recoverable": self.recoverable})

    def _load(self, msg: WeightUpdateReq) -> list[tuple[str, torch.Tensor]]:
        core = self.core
        if msg.source == "disk":
            self._tell_ranks(("disk", msg.model_path))
            load_weights(core.model, msg.model_path, progress=False, cfg=core.model_config, layout=self.layout)
            return []
        if msg.source == "distributed":
            specs = self._specs(msg)
            self._tell_ranks(("receive", msg.group_name, specs, msg.load_format))
            named = weight_sync.receive(self.groups[msg.group_name], specs, core.args.device, msg.load_format)
            weight_sync.apply(core.model, named, core.model_config, self.layout)
            return named
        return []

    def _new_epoch(self, msg: WeightUpdateReq) -> None:
        """The weights changed (or their name did): the cache's version moves on, requests that keep running
        across it (paused in place, or retracted with committed output) record both versions."""
        sched = self.core.scheduler
        if msg.weight_version is not None:
            new = msg.weight_version
        else:
            new = self.version
        if msg.source != "version":
            sched.cache.new_version(flush=msg.flush_cache)
        for req in [*sched.running, *sched.waiting]:
            if req.book.admitted:
                seen = self.versions_seen.setdefault(req.rid, [self.version])
                if seen[-1] != new:
                    seen.append(new)
        self.version = new

    def _remember(self, msg: WeightUpdateReq, received: list[tuple[str, torch.Tensor]]) -> None:
        """Where the weights now served can be read again after a crash (docs/rl.md, crash safety)."""
        if msg.source == "disk":
            self.serving_path = Path(msg.model_path)
            self.header = weight_sync.checkpoint_header(self.serving_path)
            self.recoverable = True
        elif msg.source == "distributed":
            for name, t in received:
                if self.header is not None:
                    self.header[name] = (tuple(t.shape), weight_sync.dtype_name(t.dtype))
            self.recoverable = self._spool(received)

    def _spool(self, received: list[tuple[str, torch.Tensor]]) -> bool:
        """Write the weights now served to --weight-spool-dir (the previous ones with the received tensors in
        place); False without a spool folder or a readable previous checkpoint."""
        if self.spool_dir is None or not self.recoverable:
            return False
        from safetensors.torch import load_file

        merged: dict[str, torch.Tensor] = {}
        for path in sorted(self.serving_path.glob("*.safetensors")):
            merged.update(load_file(str(path)))
        merged.update({n: t for n, t in received})
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        out = self.spool_dir / f"epoch-{self.core.scheduler.cache.version}-{int(time.time())}"
        weight_sync.save_checkpoint(merged, self.serving_path, out)
        previous, self.serving_path = self.serving_path, out
        if previous.parent == self.spool_dir:
            shutil.rmtree(previous, ignore_errors=True)
        return True

    def _recover(self, exc: Exception) -> str:
        """A load that failed part way: the served checkpoint is loaded again, so the old weights keep serving."""
        text = f"Failed to update weights: {exc}."
        if not self.recoverable:
            raise WeightsLost(f"{text} The previous weights cannot be read again: the engine stops") from exc
        self._tell_ranks(("disk", str(self.serving_path)))
        load_weights(self.core.model, self.serving_path, progress=False, cfg=self.core.model_config,
                     layout=self.layout)
        return f"{text} The previous weights were loaded again and keep serving."

    def _drain(self, msg: WeightUpdateReq) -> None:
        """Receive a refused broadcast's tensors and drop them, so that the trainer does not hang."""
        try:
            specs = self._specs(msg)
            self._tell_ranks(("drain", msg.group_name, specs, msg.load_format))
            weight_sync.receive(self.groups[msg.group_name], specs, self.core.args.device, msg.load_format)
        except Exception as exc:  # noqa: BLE001 - nothing more can be done for that trainer
            log.warning("could not drain the refused broadcast: %s", exc)

    @staticmethod
    def _specs(msg: WeightUpdateReq) -> list[weight_sync.TensorSpec]:
        return [weight_sync.TensorSpec(n, d, tuple(int(x) for x in s))
                for n, d, s in zip(msg.names, msg.dtypes, msg.shapes)]

    # ---- groups ------------------------------------------------------------------------------------
    def _group(self, msg: WeightGroupReq) -> ControlResult:
        if msg.op == "destroy":
            group = self.groups.pop(msg.group_name, None)
            if group is None:
                return ControlResult(msg.token, False, f"Group {msg.group_name} not in {sorted(self.groups)}.")
            self._tell_ranks(("destroy", msg.group_name))
            weight_sync.destroy_group(group)
            return ControlResult(msg.token, True, "Succeeded to destroy custom process group.")
        if msg.group_name in self.groups:
            return ControlResult(msg.token, False, f"Group {msg.group_name} already exists.")
        try:
            self._tell_ranks(("join", msg))
            self.groups[msg.group_name] = weight_sync.join_group(
                msg.master_address, msg.master_port, msg.rank_offset, msg.world_size, msg.group_name, msg.backend)
        except Exception as exc:  # noqa: BLE001 - answered as SGLang answers
            log.error("joining group %s failed: %s", msg.group_name, exc)
            return ControlResult(msg.token, False, f"Failed to initialize custom process group: {exc}.")
        log.info("joined weight update group %s as rank %d of %d (%s)", msg.group_name, msg.rank_offset,
                 msg.world_size, msg.backend)
        return ControlResult(msg.token, True, "Succeeded to initialize custom process group.")

    def _tell_ranks(self, command: tuple) -> None:
        workers = self.core._tp_workers
        if workers is not None:
            workers.weights(command)

    # ---- generation --------------------------------------------------------------------------------
    def _generation(self, msg: GenerationControlReq) -> ControlResult:
        sched = self.core.scheduler
        if msg.op == "pause":
            if msg.mode not in PAUSE_MODES:
                return ControlResult(msg.token, False, f"Invalid mode: {msg.mode!r}. Expected one of {list(PAUSE_MODES)}.")
            self.paused = msg.mode
            sched.hold_admission = True
            if msg.mode == "abort":
                self._abort_all()
            elif msg.mode == "retract":
                sched.retract_all()
            else:
                sched.frozen = True
            return ControlResult(msg.token, True, "Generation paused successfully.")
        if msg.op == "continue":
            self.paused = None
            sched.frozen = False
            sched.hold_admission = self._holding()
            return ControlResult(msg.token, True, "Generation continued successfully.")
        if msg.op == "abort_all":
            return ControlResult(msg.token, True, "", {"aborted": self._abort_all()})
        if msg.op in ("release_memory", "resume_memory"):
            return self._memory(msg)
        return ControlResult(msg.token, False, f"unknown operation {msg.op!r}")

    def _abort_all(self) -> int:
        """End every request now; each still reports the version it ran on (its answer is built after an update
        that may follow in the same iteration)."""
        ended = self.core.scheduler.abort_all(FinishReason("abort"),
                                              FinishReason("abort", message=ABORT_BEFORE_PREFILL))
        for req in ended:
            self.ran_on[req.rid] = self.version
        return len(ended)

    # ---- memory ------------------------------------------------------------------------------------
    def serving(self) -> bool:
        """Whether forwards may run (not while the weights or the KV cache are released)."""
        return self.memory.serving()

    def _memory(self, msg: GenerationControlReq) -> ControlResult:
        """Release or resume device memory on every rank (engine/runtime/memory_occupation.py); a release only
        when idle (SGLang asserts it), the radix cache flushed with the KV cache it points into."""
        try:
            tags = parse_tags(msg.tags)
        except ValueError as exc:
            return ControlResult(msg.token, False, str(exc), {"param": "tags"})
        release = msg.op == "release_memory"
        if release:
            busy = self._memory_busy("kv_cache" in tags)
            if busy is not None:
                return ControlResult(msg.token, False, busy)
        t0 = time.perf_counter()
        self.core.overlap.settle()  # no forward in flight (a resume of cuda_graph alone may meet running requests)
        answers = self._apply_memory(msg.op, tags)
        self.core.scheduler.hold_admission = self._holding()
        errors = [f"rank {i}: {a['error']}" for i, a in enumerate(answers) if "error" in a]
        self.resident = {tag: sum(a.get(tag, 0) for a in answers) for tag in MEMORY_TAGS}
        self.resident_per_rank = answers
        released = sorted(self.memory.released)
        if errors:
            return ControlResult(msg.token, False, f"{msg.op} {', '.join(tags)} failed: {'; '.join(errors)}",
                                 {"status": 500})
        mib = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.resident.items())
        text = (f"{'Released' if release else 'Resumed'} {', '.join(tags)} in {time.perf_counter() - t0:.2f}s; "
                f"resident now: {mib}; released: {', '.join(released) or 'nothing'}.")
        log.info("memory: %s", text)
        return ControlResult(msg.token, True, text, {"released": released, "resident_bytes": dict(self.resident)})

    def _memory_busy(self, flush: bool) -> str | None:
        """Why memory cannot be released now (requests running or about to, likelihood jobs), or None; with
        `flush` the radix cache is flushed here (its pages are about to be freed)."""
        core, sched = self.core, self.core.scheduler
        if sched.running or core.scoring.jobs or self.pending or (sched.waiting and not sched.hold_admission):
            return ("release_memory_occupation should be called only when the server is idle: requests are "
                    "running or waiting (pause generation, or wait for them to finish)")
        if flush and not sched.flush_cache():
            return "the radix cache could not be flushed (pages still in use): try again once idle"
        return None

    def memory_stats(self) -> dict[str, Any]:
        """What /server_info shows: the released tags and each tag's resident bytes, over all ranks and (tensor
        parallel) per rank."""
        out: dict[str, Any] = {"memory_released": sorted(self.memory.released),
                               "memory_resident_bytes": dict(self.resident)}
        if len(self.resident_per_rank) > 1:
            out["memory_resident_bytes_per_rank"] = self.resident_per_rank
        graphs = self.core.runner.graphs
        captured = graphs is not None and graphs.capture_graphs
        out["cuda_graph_batch_sizes"] = graphs.buckets if captured else []  # (empty: the step runs eagerly)
        out["cuda_graph_replays"] = graphs.replays if captured else 0  # since the last capture
        device = torch.device(self.core.args.device)
        if device.type == "cuda":  # this process's view of the device (rank 0's)
            out["cuda_memory_allocated_bytes"] = torch.cuda.memory_allocated(device)
            out["cuda_memory_reserved_bytes"] = torch.cuda.memory_reserved(device)
        return out

    def _apply_memory(self, op: str, tags: list[str]) -> list[dict]:
        """Every rank's answer (RankMemory.apply), rank 0's first."""
        workers = self.core._tp_workers
        if workers is None:
            return [self.memory.apply(op, tags)]
        return workers.memory(op, tags, self.memory.apply)
