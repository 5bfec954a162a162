"""The decision: every decoding row's step from its forward, by the decoder each request names.

Rows that decided from vocabulary chunks have their argmax and its probability already; rows with full logits
first go through their request's logit controls, then `propose` (greedy or sampled). Either way the rows are
grouped by decoder (engine/decoding/decoder.py) and each group runs its decoder's batched step; the groups' results
are put back in batch order (`merge_results`), structured output's sweep runs on the constrained rows, and the
whole batch is read back in one transfer (engine/runtime/output.py). A batch planned to decide inside the CUDA
graph (`ForwardPlan.in_graph`) has done all of that on the device: `decide_in_graph` only unpacks. A per-request stage that raises (grammar,
logit controls) ends that request alone: it lands in `failed`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from redraft.engine.decoding.decoder import Decoder, LogitsAt, Report, logits_at_of, merge_results
from redraft.engine.decoding.decoding import StepResult, exclude_mask_, propose
from redraft.engine.runtime.batch import ForwardPlan
from redraft.engine.runtime.faults import Failures, guard
from redraft.engine.runtime.forward import Forward
from redraft.engine.runtime.grammar_step import constrain_rows
from redraft.engine.runtime.output import add_logprobs, pack_step, unpack_rows
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import StepOutput, WorkItem

if TYPE_CHECKING:
    from redraft.engine.runtime.model_runner import ModelRunner


def decide(runner: ModelRunner, items: list[WorkItem], plan: ForwardPlan, fwd: Forward,
           failed: Failures) -> StepOutput:
    """The step of every decoding item of `plan` from its forward `fwd`; advances the slot rows."""
    reqs = [items[i].req for i in plan.decoding]
    if not reqs:
        return StepOutput(failed=failed)
    quick_set = set(plan.quick)
    full = [j for j in range(len(reqs)) if j not in quick_set]
    parts, ran = [], []
    if plan.quick:
        parts.append((plan.quick, _decide_quick(runner, fwd, [reqs[j] for j in plan.quick], ran)))
    logits = fwd.logits
    if full:
        parts.append((full, _decide_full(runner, logits, [reqs[j] for j in full], failed, ran)))
    reports = tuple(dict.fromkeys(r for d in ran for r in d.reports))
    result = merge_results(parts, len(reqs), reports)
    lens = [r.window_size * runner.block_size for r in reqs]
    out = pack_step(result, lens, reqs, runner.block_size, reports)
    wants = [j for j in full if reqs[j].params.wants_logprobs]
    if wants:
        local = [full.index(j) for j in wants]
        idx = torch.tensor(local, device=logits.device)
        for t in runner.non_text_ids:  # tokens that are edits, not text (DELETE, SPLIT) never reach logprobs
            logits[idx, :, t] = float("-inf")
        add_logprobs(out, logits[local], result.tokens[wants], reqs, wants, lens)
    out.failed = failed
    return out


def decide_in_graph(runner: ModelRunner, items: list[WorkItem], failed: Failures) -> StepOutput:
    """The forward and the step of a batch planned `in_graph`, one CUDA graph (cuda_graphs.DecodeGraphs.decide):
    every item decodes its one block with the same `in_graph` rule; one read brings the packed rows back."""
    reqs = [it.req for it in items]
    rows = runner.graphs.decide(items, runner.decoders[reqs[0].params.decoder])  # [N][2B + 3]
    out = unpack_rows(rows, reqs, runner.block_size)
    out.failed = failed
    return out


def _by_decoder(runner: ModelRunner, reqs: list[Request]) -> dict[Decoder, list[int]]:
    groups: dict[Decoder, list[int]] = {}
    for i, r in enumerate(reqs):
        groups.setdefault(runner.decoders[r.params.decoder], []).append(i)
    return groups


def _step_groups(runner: ModelRunner, v: torch.Tensor, p: torch.Tensor, reqs: list[Request],
                 logits_at: LogitsAt | None, ran: list[Decoder]) -> StepResult:
    """Each decoder's step on its rows of v, p [N, L], as one StepResult in row order."""
    slots = runner.slots.slot_ids(reqs)  # [N]
    groups = _by_decoder(runner, reqs)
    parts = []
    for decoder, rows in groups.items():
        ran.append(decoder)
        if len(groups) == 1:
            parts.append((rows, decoder.step(v, p, slots, reqs, logits_at)))
            continue
        idx = torch.tensor(rows, device=v.device)
        at = None if logits_at is None else (lambda r, c, idx=idx: logits_at(idx[r], c))
        parts.append((rows, decoder.step(v[idx], p[idx], slots[idx], [reqs[i] for i in rows], at)))
    reports: tuple[Report, ...] = tuple(dict.fromkeys(r for d in groups for r in d.reports))
    return merge_results(parts, len(reqs), reports)


def _decide_quick(runner: ModelRunner, fwd: Forward, reqs: list[Request], ran: list[Decoder]) -> StepResult:
    """Rows that decided from vocabulary chunks: their argmax and probability straight to the decoders."""
    n, width = len(reqs), fwd.width
    t0 = time.perf_counter()
    result = _step_groups(runner, fwd.top.ids.view(n, width), fwd.top.prob.view(n, width), reqs,
                          runner.logits_at(fwd.quick_hidden, width), ran)
    runner.step_seconds += time.perf_counter() - t0
    return result


def _decide_full(runner: ModelRunner, logits: torch.Tensor, reqs: list[Request], failed: Failures,
                 ran: list[Decoder]) -> StepResult:
    """Rows with full logits [N, L, V] (>= fp32, a scratch of ours): logit controls, the proposals, the decoders'
    steps, structured output's sweep."""
    exclude_mask_(logits, runner.mask_id)  # the step and the logprobs both read it this way
    for decoder, rows in _by_decoder(runner, reqs).items():
        if decoder.excluded:  # ids this rule never proposes (e.g. DELETE and SPLIT)
            idx = torch.tensor(rows, device=logits.device)
            for t in decoder.excluded:
                logits[idx, :, t] = float("-inf")
    slots = runner.slots.slot_ids(reqs)  # [N]
    width = logits.shape[1]
    if any(r.params.has_logit_controls for r in reqs):
        window = runner.slots.tokens[slots, :width]
        for i, r in enumerate(reqs):  # one request at a time, so that a failure is that request's alone
            if r.params.has_logit_controls and r.rid not in failed:
                guard(runner.faults, failed, r.rid, "controls", runner.controls.apply, logits[i : i + 1], [r],
                      window[i : i + 1], runner.mask_id)
    constrained = [i for i, r in enumerate(reqs) if r.state.constraint is not None and r.rid not in failed]
    before = runner.slots.tokens[slots, :width].clone() if constrained else None  # [N, L]
    t0 = time.perf_counter()
    sampling = runner.slots.sampling(slots, width) if any(r.params.temperature > 0 for r in reqs) else None
    v, p = propose(logits, sampling)
    result = _step_groups(runner, v, p, reqs, logits_at_of(logits), ran)
    runner.step_seconds += time.perf_counter() - t0
    if constrained:
        lens = [r.window_size * runner.block_size for r in reqs]
        constrain_rows(runner, logits, slots, reqs, constrained, before, result, lens, failed)
    return result
