"""The decision inside the CUDA graph (engine/runtime/cuda_graphs.py, graph_inputs.py) on CPU, with the graphs'
static-buffer mode (capture=False: the same buffers, padding rows, scratch page and scratch slot, run eagerly).

Exactness: greedy threshold rows decided inside the graph give the naive reference's tokens and forward counts
(float64), and every message equals the eager engine's and the full-logits graph variant's (the old decision)
while the batch changes: requests joining and finishing mid-run, an abort, sampled and logprobs rows that send
a batch back to the full-logits variant, preemption in a tiny KV pool, padding rows, prompts ending inside the
first block, the overlap scheduler on.

Counting: a steady-state step (the same rows as the step before) copies nothing to the device and reads the
device once. Every aten op of such a step is recorded (TorchDispatchMode): no tensor made from host data
(aten.lift_fresh: torch.tensor, as_tensor, list indices, scalar stores), no scalar read (item, bool), and the
only tensor turned into Python lists (tolist: resolve_conj) is the pinned packed buffer, read once. The quick test
runs the torch backend and leaves the model's own forward out of the record (its torch attention plan and MoE
read the host; on a GPU that forward is inside the graph, and test_engine_triton's meta-device check holds it
free of host syncs); the slow one records the whole step on the Triton backend (interpreted). The same counter
applied to the full-logits variant sees its copies and reads: the counting can fail.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from test_engine_exactness import PRESETS, read_special_ids  # noqa: E402
from test_overlap import _long, _prompt, drive  # noqa: E402

from naive_llada2 import NaiveLLaDA2, naive_generate  # noqa: E402

import redraft  # noqa: E402
from redraft.engine.runtime.cuda_graphs import DecodeGraphs  # noqa: E402
from redraft.protocol.sampling_params import SamplingParams  # noqa: E402

PROMPT_LENGTHS = (1, 31, 32, 33, 100)  # inside, on and past the first block's end; several blocks
MAX_BS = 6  # buckets 1, 2, 4, 6: five requests run with one padding row


def engine(path: Path, static: str | None, dtype: str = "float64", backend: str = "torch", **kw: Any) -> Any:
    """A CPU engine; static: None (eager), "old" (the full-logits graph variant) or "new" (the decision inside
    the graph), both in capture=False mode."""
    eng = redraft.Engine(str(path), device="cpu", dtype=dtype, kernel_backend=backend, progress=False,
                         disable_cuda_graph=True, **{"max_total_tokens": 4096, **kw})
    if static is not None:
        eng.core.runner.graphs = DecodeGraphs(eng.core.runner, MAX_BS, capture=False, decide=static == "new")
    return eng


@pytest.fixture(scope="module")
def path(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=1, dtype="float64")


@pytest.fixture(scope="module")
def trio(path: Path) -> Iterator[dict[str, Any]]:
    engines = {name: engine(path, static) for name, static in (("eager", None), ("old", "old"), ("new", "new"))}
    yield engines
    for e in engines.values():
        e.shutdown()


def prompts() -> list[list[int]]:
    return [[(17 * n + 5 * i) % 250 + 3 for i in range(n)] for n in PROMPT_LENGTHS]


@pytest.mark.parametrize("mode", ["S", "Q"])
def test_in_graph_decision_equals_the_naive_reference(trio, path: Path, mode: str) -> None:
    """Five prompts in one batch (a padding row in the 6-bucket; prompt tokens inside the first block): the naive
    reference's tokens and forwards, and the eager and old-decision engines' too."""
    mask_id, eos_id = read_special_ids(path)
    naive = NaiveLLaDA2(path, dtype=torch.float64)
    ids = prompts()
    for i in ids:
        assert mask_id not in i and eos_id not in i
    threshold, edit_threshold, post = PRESETS[mode]
    params = {"max_new_tokens": 40, "temperature": 0.0, "mode": mode}
    inputs = trio["new"].core.runner.graphs.inputs
    reads = inputs.reads
    got = {name: eng.generate(input_ids=ids, sampling_params=params) for name, eng in trio.items()}
    assert inputs.reads - reads > 10, "the decision inside the graph never ran"
    for k, prompt in enumerate(ids):
        want = naive_generate(naive, prompt, max_new_tokens=40, threshold=threshold, edit_threshold=edit_threshold,
                              max_post_steps=post, mask_id=mask_id, eos_id=eos_id)
        for name, outs in got.items():
            assert (outs[k]["output_ids"], outs[k]["meta_info"]["steps"]) == want, (name, len(prompt), mode)


def _changing_batch() -> tuple[list[tuple[str, list[int], dict]], dict]:
    """Requests that finish at different steps, and a script: joins mid-run (greedy ones, a sampled one and a
    logprobs one, which send their batches to the full-logits variant while they run) and an abort."""
    reqs = [(f"r{k}", _prompt(k, 3 + 13 * k), {"max_new_tokens": 20 + 30 * k, "mode": "SQ"[k % 2], "threshold": 0.95})
            for k in range(3)]

    def join(rid: str, n: int, params: dict) -> Any:
        return lambda core: core.add_requests([(rid, _prompt(len(rid) + n, n), SamplingParams.from_dict(params))])

    script = {
        3: join("late", 40, {"max_new_tokens": 70, "ignore_eos": True}),
        12: join("sampled", 20, {"max_new_tokens": 12, "temperature": 0.8, "seed": 7}),
        30: join("lp", 9, {"max_new_tokens": 10, "logprobs": True, "top_logprobs": 2}),
        40: lambda core: core.abort("r1"),
        50: join("later", 64, {"max_new_tokens": 50, "mode": "S", "threshold": 0.95}),
    }
    return reqs, script


@pytest.mark.parametrize("overlap", ["off", "on"])
def test_batches_that_change_mid_run(path: Path, trio, overlap: str) -> None:
    """Every message (tokens, finishes, logprobs, steps) equals the eager engine's while requests join, finish and
    leave, and rows needing the distribution come and go; with the overlap scheduler on the in-graph engine too
    (it speculates no in-graph step). Steps with rows that did not change copied nothing to the device."""
    reqs, script = _changing_batch()
    want = drive(trio["eager"].core, reqs, script)
    if overlap == "on":
        with engine(path, "new", enable_overlap=True) as eng:
            got = drive(eng.core, reqs, script)
            inputs = eng.core.runner.graphs.inputs
            uploads, reads = inputs.uploads, inputs.reads
    else:
        inputs = trio["new"].core.runner.graphs.inputs
        uploads, reads = inputs.uploads, inputs.reads
        got = drive(trio["new"].core, reqs, script)
        uploads, reads = inputs.uploads - uploads, inputs.reads - reads
    assert got == want
    assert reads > 20 and uploads < reads / 2, (uploads, reads)
    assert drive(trio["old"].core, reqs, script) == want


def test_preemption_in_a_tiny_kv_pool(path: Path) -> None:
    """Requests preempted and resumed (their rows restaged, their slots and pages new) as on the eager path."""
    reqs = _long(4, new=120)
    logs = {}
    for static in (None, "new"):
        with engine(path, static, max_total_tokens=9 * 32) as eng:
            logs[static] = drive(eng.core, reqs)
            assert eng.core.scheduler.num_preemptions > 0
            if static:
                assert eng.core.runner.graphs.inputs.reads > 20
    assert logs["new"] == logs[None]


# ---- counting ------------------------------------------------------------------------------------------------
class Transfers(TorchDispatchMode):
    """Every aten op while active, sorted into what moves data between the host and tensors: `made` (tensors
    made from host data), `scalar_reads` (item, bool), `list_reads` (tolist/numpy: which tensor's storage)."""

    HOST_DATA = {"aten.lift_fresh.default", "aten.lift_fresh_copy.default"}
    SCALAR_READS = {"aten.item.default", "aten._local_scalar_dense.default", "aten.is_nonzero.default"}

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.list_reads: list[int] = []  # data_ptr of the storage of every tensor read as a Python list
        self.paused = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            name = str(func)
            self.ops[name] += 1
            if name == "aten.resolve_conj.default":  # (what tolist and numpy dispatch first)
                self.list_reads.append(args[0].untyped_storage().data_ptr())
        return func(*args, **(kwargs or {}))

    def made(self) -> int:
        return sum(self.ops[k] for k in self.HOST_DATA)

    def scalar_reads(self) -> int:
        return sum(self.ops[k] for k in self.SCALAR_READS)


def count_steps(eng: Any, reqs: list[tuple[str, list[int], dict]], max_steps: int, skip_model: bool
                ) -> list[dict[str, Any]]:
    """Drive `eng` over `reqs` (at most max_steps core steps), recording each step's transfers; per step: whether
    its batch was the last step's (same requests, blocks, slots and page tables, all decoding: from the outside,
    not from the code under test) and what the recorder and the graph inputs' counters saw. skip_model: leave
    the model's forward out of the record (DecodeGraphs._hidden, with its attention metadata; eager: the model)."""
    core, runner = eng.core, eng.core.runner
    graphs = runner.graphs
    core.add_requests([(rid, ids, SamplingParams.from_dict(p)) for rid, ids, p in reqs])
    signatures: list[Any] = []
    owner, attr = (graphs, "_hidden") if graphs is not None else (runner.model, "forward")
    real_run, real_hidden = runner.run, getattr(owner, attr)

    def run(items):
        signatures.append(tuple((it.req.rid, it.first, it.last, it.decodes, it.req.book.slot,
                                 tuple(it.req.book.pages)) for it in items))
        return real_run(items)

    def hidden(*args):
        rec.paused += 1
        try:
            return real_hidden(*args)
        finally:
            rec.paused -= 1

    runner.run = run
    core.overlap = core.overlap  # (the setter binds the loop to runner.run again: the wrapper)
    if skip_model:
        setattr(owner, attr, hidden)
    steps = []
    try:
        for _ in range(max_steps):
            if not core.has_work():
                break
            up, n = getattr(graphs, "inputs", None), len(signatures)
            before = (up.uploads, up.reads) if up else (0, 0)
            with Transfers() as rec:
                core.step()
            if len(signatures) == n:
                continue
            sig = signatures[-1]
            steady = len(signatures) > 1 and sig == signatures[-2] and all(s[3] for s in sig)
            rd = (up.uploads - before[0], up.reads - before[1]) if up else (None, None)
            packed = up.host_packed.untyped_storage().data_ptr() if up else None
            steps.append({"steady": steady, "made": rec.made(), "scalar_reads": rec.scalar_reads(),
                          "list_reads": rec.list_reads, "packed": packed, "uploads": rd[0], "reads": rd[1]})
    finally:
        del runner.run
        core.overlap = core.overlap
        if skip_model:
            delattr(owner, attr)  # (the instance attribute set above: the class's method again)
        for rid, _, _ in reqs:
            core.abort(rid)
        while core.has_work():
            core.step()
    return steps


def check_steady_steps(steps: list[dict[str, Any]], at_least: int) -> None:
    steady = [s for s in steps if s["steady"]]
    assert len(steady) >= at_least, f"{len(steady)} steady-state steps of {len(steps)}: nothing was counted"
    for s in steady:
        assert s["made"] == 0, f"a tensor was made from host data: {s}"
        assert s["scalar_reads"] == 0, f"a scalar was read from a tensor: {s}"
        assert s["list_reads"] == [s["packed"]], f"the step read something besides the packed buffer: {s}"
        assert (s["uploads"], s["reads"]) == (0, 1), s


COUNTED = [(f"c{k}", _prompt(k, 5 + 20 * k), {"max_new_tokens": 64, "ignore_eos": True, "mode": "Q",
                                              "threshold": 0.99}) for k in range(3)]  # (slow blocks: many steps)


def test_a_steady_step_copies_nothing_to_the_device_and_reads_once(path: Path) -> None:
    with engine(path, "new") as eng:
        steps = count_steps(eng, COUNTED, max_steps=40, skip_model=True)
    check_steady_steps(steps, at_least=10)
    # the other in-graph steps (a block began, a request joined or left): one upload, made from host data once,
    # which carries the slot rows of the blocks that began too (no SlotState.sync copies of their own)
    changed = [s for s in steps if not s["steady"] and s["reads"]]
    assert changed and all((s["uploads"], s["made"], s["reads"]) == (1, 1, 1) for s in changed), changed


def test_the_counter_sees_the_old_decisions_transfers(path: Path) -> None:
    """The same counting on the full-logits variant (and the eager path) fails: it builds tensors from host lists
    each step and reads more than the packed buffer."""
    for static in ("old", None):
        with engine(path, static) as eng:
            steps = count_steps(eng, COUNTED, max_steps=12, skip_model=True)
        steady = [s for s in steps if s["steady"]]
        assert steady and all(s["made"] > 0 for s in steady), static
        with pytest.raises(AssertionError):
            check_steady_steps(steps, at_least=1)


@pytest.mark.slow
@pytest.mark.kernels
def test_the_whole_steady_step_on_the_triton_backend(tiny_checkpoint) -> None:
    """The whole step recorded, the model's forward included (the Triton kernels, interpreted on CPU)."""
    triton_attn = pytest.importorskip("redraft.kernels.attention_triton")
    if not torch.cuda.is_available() and not triton_attn.interpreting():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 before this module")
    reqs = [(f"t{k}", _prompt(k, 40), {"max_new_tokens": 32, "ignore_eos": True, "mode": "Q", "threshold": 0.99})
            for k in range(2)]
    with engine(tiny_checkpoint(seed=0), "new", dtype="float32", backend="triton") as eng:
        steps = count_steps(eng, reqs, max_steps=6, skip_model=False)
    check_steady_steps(steps, at_least=2)


def _messages(core: Any, reqs: list[tuple[str, list[int], dict]], script: dict | None = None) -> list[tuple]:
    """drive()'s messages with each message's denoise events (stream_denoise: per forward, the confidences)."""
    core.add_requests([(rid, ids, SamplingParams.from_dict(p)) for rid, ids, p in reqs])
    log, k, script = [], 0, script or {}
    while core.has_work() or k in script:
        if k in script:
            script[k](core)
        log += [(k, o.rid, list(o.new_ids), o.finished, o.meta.get("steps"), o.denoise) for o in core.step()]
        k += 1
        assert k < 3000
    return log


def test_streamed_forwards_carry_the_same_confidences(trio) -> None:
    """stream_denoise rows decided inside the graph: every forward's event (tokens, confidences from the packed
    bits) equals the eager engine's."""
    reqs = [(f"s{k}", _prompt(k, 7 + 11 * k), {"max_new_tokens": 40, "stream_denoise": k != 1, "mode": "S"})
            for k in range(3)]
    inputs = trio["new"].core.runner.graphs.inputs
    reads = inputs.reads
    got = _messages(trio["new"].core, reqs)
    assert inputs.reads - reads > 5
    assert got == _messages(trio["eager"].core, reqs)
    assert any(m[5] for m in got), "no denoise event came back"


def test_llada22_threshold_rows_in_the_graph_beside_levenshtein_rows(tiny_checkpoint) -> None:
    """On a LLaDA2.2 checkpoint the threshold rows (DELETE and SPLIT left out of their top-1) decide inside the
    graph while they run alone; Levenshtein rows joining send the batch to the full-logits variant; every message
    equals the eager engine's."""
    path = tiny_checkpoint(seed=0, llada22=True)
    reqs = [(f"t{k}", _prompt(k, 9 + 17 * k), {"max_new_tokens": 48, "decoder": "threshold", "mode": "S",
                                                "ignore_eos": True}) for k in range(3)]
    script = {6: lambda core: core.add_requests([(f"l{k}", _prompt(9 + k, 20), SamplingParams.from_dict(
        {"max_new_tokens": 16, "decoder": "levenshtein"})) for k in range(2)])}
    logs, counts = {}, {}
    for static in (None, "new"):
        with engine(path, static, dtype="float32") as eng:
            if static:
                graphs, used = eng.core.runner.graphs, []
                run = graphs.run
                graphs.run = lambda batch, run=run: used.append(len(batch.q_starts)) or run(batch)
            logs[static] = _messages(eng.core, reqs, script)
            if static:
                counts = {"in_graph": graphs.inputs.reads, "full_logits": len(used)}
    assert logs["new"] == logs[None]
    assert counts["in_graph"] > 5 and counts["full_logits"] > 0, counts
