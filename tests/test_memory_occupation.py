"""Releasing and resuming device memory (engine/runtime/memory_occupation.py, docs/rl.md), on engine objects in
this process: after a release the storages are really gone (0 bytes), after a resume they are back, the weights
bitwise, and the engine answers exactly as before, a prompt cached before the release recomputed."""

from __future__ import annotations

import pytest
import torch

import redraft
from redraft.engine.runtime.memory_occupation import MEMORY_TAGS, RankMemory, parse_tags
from redraft.protocol.messages import GenerationControlReq, WeightUpdateReq
from redraft.protocol.sampling_params import SamplingParams

SP = {"max_new_tokens": 40, "temperature": 0.0}
PROMPTS = [list(range(5, 45)), list(range(60, 75))]


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float32", progress=False)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def want(engine) -> list[list[int]]:
    """The engine's answers before any release (its radix cache then holds the first prompt's block)."""
    return _ids(engine)[0]


def _ids(engine: redraft.Engine, prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], list[int]]:
    outs = engine.generate(input_ids=prompts, sampling_params=[SP] * len(prompts))
    return [o["output_ids"] for o in outs], [o["meta_info"]["cached_tokens"] for o in outs]


def _weights(engine: redraft.Engine) -> dict[str, torch.Tensor]:
    model = engine.core.model
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _sizes(engine: redraft.Engine) -> dict[str, int]:
    r = engine.core.runner
    return {**{n: t.untyped_storage().nbytes() for n, t in _weights(engine).items()},
            "k_cache": r.k_cache.untyped_storage().nbytes(), "v_cache": r.v_cache.untyped_storage().nbytes()}


def test_tags_are_sglangs() -> None:
    assert parse_tags(None) == parse_tags([]) == list(MEMORY_TAGS)
    assert parse_tags(["kv_cache", "weights", "kv_cache"]) == ["weights", "kv_cache"]
    with pytest.raises(ValueError, match="unknown tag 'gpu'"):
        parse_tags(["gpu"])


def test_release_frees_every_storage_and_resume_restores_them_bitwise(engine, want) -> None:
    assert engine.core.scheduler.cache.cached_pages > 0  # the first prompt's block is cached now
    sizes = _sizes(engine)
    before = {n: t.detach().clone() for n, t in _weights(engine).items()}
    assert all(v > 0 for v in sizes.values())

    r = engine.release_memory_occupation()
    assert r["success"] and r["released"] == sorted(MEMORY_TAGS), r
    assert r["resident_bytes"] == {"weights": 0, "kv_cache": 0, "cuda_graph": 0}
    assert set(_sizes(engine).values()) == {0}  # the storages themselves are gone
    assert engine.core.scheduler.cache.cached_pages == 0  # the radix cache pointed into the freed pages
    with pytest.raises(RuntimeError, match="released"):
        _ids(engine)
    with pytest.raises(RuntimeError, match="released"):
        engine.prompt_logprobs(PROMPTS[0])
    assert engine.release_memory_occupation(["weights"])["success"]  # already released: harmless

    r = engine.resume_memory_occupation()
    assert r["success"] and r["released"] == [] and r["resident_bytes"]["weights"] > 0, r
    assert _sizes(engine) == sizes
    for name, t in _weights(engine).items():
        assert torch.equal(t.view(torch.uint8) if t.dim() else t, before[name].view(torch.uint8)
                           if t.dim() else before[name]), name
    assert engine.resume_memory_occupation(["kv_cache"])["success"]  # resident already: harmless
    ids, cached = _ids(engine)
    assert ids == want and cached == [0, 0]  # the cached prompt was recomputed, not read from freed pages


def test_release_is_refused_while_a_request_runs_and_updates_while_the_weights_are_out(engine, ckpt) -> None:
    core = engine.core
    core.add_request("running", PROMPTS[0], SamplingParams(max_new_tokens=64, temperature=0.0))
    core.step()
    assert core.scheduler.running
    r = engine.release_memory_occupation(["kv_cache"])
    assert not r["success"] and "idle" in r["message"]
    assert core.runner.k_cache.untyped_storage().nbytes() > 0
    core.abort("running")
    core.step()

    assert engine.release_memory_occupation(["weights"])["success"]
    [refused] = core.weights.handle(WeightUpdateReq("u", "disk", model_path=str(ckpt)))
    assert not refused.success and "resume them first" in refused.message
    assert engine.resume_memory_occupation(["weights"])["success"]
    [done] = core.weights.handle(WeightUpdateReq("u2", "disk", model_path=str(ckpt), weight_version="again"))
    assert done.success, done.message
    [bad] = core.weights.handle(GenerationControlReq("t", "release_memory", tags=["gpu"]))
    assert not bad.success and bad.data["param"] == "tags"


def test_graphs_are_dropped_with_what_they_captured_and_rebuilt_once_all_is_back(engine, want) -> None:
    """The CUDA-graph path (capture=False on CPU: the same static buffers and in-graph decision, run eagerly) goes
    with any release of the KV cache or the weights, and comes back as it was once everything is resumed; while
    it is out the step runs eagerly. (That a recaptured CUDA graph gives the same tokens is
    scripts/gpu_rl_check.py's, on a GPU.)"""
    runner = engine.core.runner
    runner.build_graphs(2, capture=False)
    try:
        static, decides = runner.graphs.static_bytes(), runner.graphs.decides
        on_graphs = _ids(engine)[0]  # the static path's answers
        r = engine.release_memory_occupation(["kv_cache"])
        assert runner.graphs is None and r["resident_bytes"]["cuda_graph"] == 0
        r = engine.resume_memory_occupation(["kv_cache"])
        assert runner.graphs is not None and r["resident_bytes"]["cuda_graph"] == static > 0
        engine.release_memory_occupation(["cuda_graph"])
        assert runner.graphs is None and _ids(engine)[0] == want  # served eagerly meanwhile
        engine.release_memory_occupation(["weights"])
        engine.resume_memory_occupation(["cuda_graph"])
        assert runner.graphs is None  # not while the weights are out
        engine.resume_memory_occupation(["weights"])
        assert runner.graphs is not None and runner.graphs.static_bytes() == static
        assert runner.graphs.decides == decides and _ids(engine)[0] == on_graphs
    finally:
        runner.graphs = None


def test_a_release_that_fails_part_way_never_lets_a_forward_read_freed_memory(engine, want, monkeypatch) -> None:
    """The KV cache freed, then the weights' host copy fails (no host memory, say): the answer is a failure naming
    it, the KV cache counts as released (nothing runs on it), and a resume brings the engine back."""
    def no_host_memory(self) -> None:
        raise RuntimeError("injected: no host memory for the weights' copy")

    monkeypatch.setattr(RankMemory, "_release_weights", no_host_memory)
    r = engine.release_memory_occupation()
    assert not r["success"] and "injected" in r["message"], r
    assert engine.core.weights.memory.released == {"cuda_graph", "kv_cache"}
    assert engine.core.runner.k_cache.untyped_storage().nbytes() == 0 and not engine.core.weights.serving()
    monkeypatch.undo()
    assert engine.resume_memory_occupation()["success"]
    assert _ids(engine)[0] == want
