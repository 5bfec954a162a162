"""Structured output inside the step: each constrained row's window, after its decoder's step, goes through its
grammar's frontier sweep (engine/decoding/constrained.py), in place in the step's result and the slot rows. A
sweep reads only its own row's logits; one that raises ends that request alone."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from redraft.engine.decoding.constrained import Constraint
from redraft.engine.decoding.decoding import StepResult
from redraft.engine.runtime.faults import Failures, guard
from redraft.scheduler.request import Request

if TYPE_CHECKING:
    from redraft.engine.runtime.model_runner import ModelRunner

GRAMMAR_CANDIDATES = 8  # the model's top-k a rejected position may take an allowed token from
_BIT_INDEX = torch.arange(8, dtype=torch.uint8)


def constrain_rows(runner: ModelRunner, logits: torch.Tensor, slots: torch.Tensor, reqs: list[Request],
                   rows: list[int], before: torch.Tensor, result: StepResult, lens: list[int],
                   failed: Failures) -> None:
    """The sweep of rows `rows` of logits [N, L, V] / result / slots [N]; `before`: the windows before the step
    [N, L]. Recounts M2T and T2T of the changed rows (a grammar runs only with a rule that edits in place: M2T
    fills a mask, T2T replaces a token)."""
    t0 = time.perf_counter()
    dev, b, mask = runner.device, runner.block_size, runner.mask_id
    idx = torch.tensor(rows, device=dev)
    before_rows, after_rows = before[idx].tolist(), result.tokens[idx].tolist()
    thresholds = runner.slots.threshold[slots[idx]].tolist()  # the rows the step read (SlotState), not r.params
    for j, i in enumerate(rows):
        r, n = reqs[i], lens[i]
        c: Constraint = r.state.constraint  # type: ignore[assignment]
        fixed: list[list[int]] = []
        guard(runner.faults, failed, r.rid, "sweep", lambda: fixed.append(c.sweep(
            r.state.window_start * b, before_rows[j][:n], after_rows[j][:n], mask,
            lambda pos, row=i: candidates(logits[row, pos]), thresholds[j],
            lambda pos, bitmask, row=i: masked_argmax(logits[row, pos], bitmask))))
        if fixed and fixed[0] != after_rows[j][:n]:
            result.tokens[i, :n] = torch.tensor(fixed[0], device=dev)
    width = before.shape[1]
    masked = before[idx] == mask
    placed = result.tokens[idx] != mask
    result.m2t[idx] = masked & placed
    result.t2t[idx] = ~masked & placed & (result.tokens[idx] != before[idx]) & runner.slots.editable[slots[idx], :width]
    runner.slots.tokens[slots[idx], :width] = result.tokens[idx]
    runner.grammar_seconds += time.perf_counter() - t0


def candidates(row: torch.Tensor) -> list[tuple[int, float]]:
    """The model's top GRAMMAR_CANDIDATES at one position (row: [V] logits), with their probabilities in the
    step's distribution (no temperature), best first. One position at a time: the sweep asks for about one
    per request and forward, and a top-k over the whole window cost more than the grammar itself."""
    probs = torch.softmax(row.float(), -1)  # [V]
    p, ids = probs.topk(min(GRAMMAR_CANDIDATES, probs.shape[-1]))
    return list(zip(ids.tolist(), p.tolist()))


def masked_argmax(row: torch.Tensor, bitmask: bytes) -> int:
    """The highest-logit token among those `bitmask` allows (row: [V] logits of one position)."""
    bits = torch.frombuffer(bytearray(bitmask), dtype=torch.uint8).to(row.device)
    allowed = ((bits[:, None] >> _BIT_INDEX.to(row.device)) & 1).bool().flatten()  # [8 * bytes]
    v = row.shape[-1]
    allowed = allowed[:v] if allowed.numel() >= v else torch.cat([allowed, allowed.new_zeros(v - allowed.numel())])
    best = int(row.masked_fill(~allowed, float("-inf")).argmax())
    if not allowed[best]:  # every allowed token has probability 0 (e.g. EOS under min_tokens): take the first
        best = int(allowed.nonzero()[0])
    return best
