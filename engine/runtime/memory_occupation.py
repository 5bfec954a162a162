"""Releasing and re-taking one rank's device memory (SGLang's /release_memory_occupation and
/resume_memory_occupation, docs/rl.md): between rollouts an RL trainer colocated on the same GPUs takes the memory
back, then hands it over again. SGLang does it with torch_memory_saver; here it is done by hand, on any device:

    kv_cache    the K/V tensors' storage is freed (resized to 0 bytes) and re-allocated, zeroed, on resume; the
                engine flushes the radix cache first (engine/runtime/weight_update.py): its pages are gone
    weights     every parameter and buffer storage is copied to a host backup (pinned on CUDA), then freed; on
                resume re-allocated and copied back, bitwise
    cuda_graph  the captured denoising graphs and their static buffers are dropped (engine/runtime/cuda_graphs.py),
                and captured again on resume

The tensors stay the same Python objects (only their storage is resized), so every reference to them (the model,
the runner, the scoring path) stays valid; their device addresses change, so CUDA graphs, which captured the old
addresses, are dropped whenever the weights or the KV cache are released, whatever the tags, and captured again
once all three are resident. Under tensor parallelism every rank holds one of these (engine/runtime/
tensor_parallel.py).
"""

from __future__ import annotations

import gc
import logging
from typing import Iterable

import torch

log = logging.getLogger("redraft.memory")

MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def parse_tags(tags: Iterable[str] | None) -> list[str]:
    """SGLang's rule: no tags (None or empty) means every tag. ValueError naming an unknown one."""
    out = list(tags) if tags else list(MEMORY_TAGS)
    bad = [t for t in out if t not in MEMORY_TAGS]
    if bad:
        raise ValueError(f"unknown tag {bad[0]!r}; tags are {', '.join(MEMORY_TAGS)}")
    return [t for t in MEMORY_TAGS if t in out]  # each once, in release order


def _unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """The distinct non-empty storages under `tensors` (tied weights and views share one)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for t in tensors:
        s = t.untyped_storage()
        if s.nbytes() > 0:
            seen.setdefault(s.data_ptr(), s)
    return list(seen.values())


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage: [nbytes]."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class RankMemory:
    """One rank's releasable memory: its model's weights, its runner's KV cache and CUDA graphs."""

    def __init__(self, model: torch.nn.Module, runner: object) -> None:
        self.model, self.runner = model, runner
        self.device = torch.device(runner.device)  # type: ignore[attr-defined]
        self.released: set[str] = set()
        # (storage, its bytes on the host: [nbytes] uint8) for each weight storage, while the weights are released
        self._backup: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._kv: list[tuple[torch.UntypedStorage, int]] = []  # storage, its size, while the KV cache is released
        self._graph_spec: tuple[int, bool, bool] | None = None  # dropped graphs' (max_bs, capture, decide)

    # ---- what is resident --------------------------------------------------------------------------
    def resident_bytes(self) -> dict[str, int]:
        """Bytes each tag holds on this rank's device now (cuda_graph: the graphs' static buffers; the graphs'
        private memory pool is not counted)."""
        r = self.runner
        graphs = getattr(r, "graphs", None)
        weights = _unique_storages([*self.model.parameters(), *self.model.buffers()])
        return {"weights": sum(s.nbytes() for s in weights),
                "kv_cache": sum(s.nbytes() for s in _unique_storages([r.k_cache, r.v_cache])),  # type: ignore
                "cuda_graph": graphs.static_bytes() if graphs is not None else 0}

    def serving(self) -> bool:
        """Whether a forward can run now (without CUDA graphs it runs eagerly)."""
        return not (self.released & {"weights", "kv_cache"})

    # ---- release / resume --------------------------------------------------------------------------
    def apply(self, op: str, tags: list[str]) -> dict[str, int | str]:
        """`release_memory` or `resume_memory` of `tags`: this rank's resident bytes per tag after it, or
        {"error": why} (under tensor parallelism every rank answers, so that none waits for a rank that
        raised)."""
        try:
            if op == "release_memory":
                self.release(tags)
            else:
                self.resume(tags)
        except Exception as exc:  # noqa: BLE001 - reported by rank 0's answer
            log.error("%s %s failed: %s: %s", op, tags, type(exc).__name__, exc)
            return {"error": f"{type(exc).__name__}: {exc}"}
        return dict(self.resident_bytes())

    @torch.inference_mode()
    def release(self, tags: list[str]) -> None:
        """Free what `tags` name (already released ones: nothing to do). The caller made sure nothing runs. A tag
        counts as released as soon as its memory may be gone, so that a failure part way never lets a forward
        read freed memory (a resume of it then finishes the job)."""
        new = [t for t in tags if t not in self.released]
        if new:
            self._drop_graphs()  # they captured the addresses of everything released below
        if "cuda_graph" in new:
            self.released.add("cuda_graph")
        if "kv_cache" in new:
            self._kv = [(s, s.nbytes()) for s in _unique_storages([self.runner.k_cache, self.runner.v_cache])]
            self.released.add("kv_cache")
            for s, _ in self._kv:
                s.resize_(0)
        if "weights" in new:
            self._release_weights()
        self._empty_cache()

    @torch.inference_mode()
    def resume(self, tags: list[str]) -> None:
        """Re-allocate what `tags` name (resident ones: nothing to do); CUDA graphs are captured again once the
        weights, the KV cache and the graphs are all resumed."""
        if "weights" in tags and "weights" in self.released:
            self._resume_weights()
            self.released.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.released:
            for s, nbytes in self._kv:
                s.resize_(nbytes)
                _bytes_of(s).zero_()  # as allocated at start-up (the scratch page's padding reads it)
            self._kv = []
            self.released.discard("kv_cache")
        if "cuda_graph" in tags:
            self.released.discard("cuda_graph")
        if not self.released and self._graph_spec is not None:
            spec, self._graph_spec = self._graph_spec, None
            self.runner.build_graphs(*spec)  # type: ignore[attr-defined]
        self._empty_cache()

    def _release_weights(self) -> None:
        pin = self.device.type == "cuda"
        self._backup = []
        for s in _unique_storages([*self.model.parameters(), *self.model.buffers()]):
            host = torch.empty(s.nbytes(), dtype=torch.uint8, pin_memory=pin)  # [nbytes]
            host.copy_(_bytes_of(s), non_blocking=pin)
            self._backup.append((s, host))
        if pin:
            torch.cuda.synchronize(self.device)  # the copies landed before the storage goes
        self.released.add("weights")
        for s, _ in self._backup:
            s.resize_(0)

    def _resume_weights(self) -> None:
        for s, host in self._backup:
            s.resize_(host.numel())
            _bytes_of(s).copy_(host, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # before the pinned backup is dropped
        self._backup = []

    def _drop_graphs(self) -> None:
        graphs = getattr(self.runner, "graphs", None)
        if graphs is None:
            return
        self._graph_spec = (graphs.max_bs, graphs.capture_graphs, bool(graphs.rules))
        if graphs.capture_graphs:
            torch.cuda.synchronize(self.device)
        graphs.reset()
        self.runner.graphs = None  # type: ignore[attr-defined]

    def _empty_cache(self) -> None:
        gc.collect()  # (a dropped graph's pool goes with its last reference)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
