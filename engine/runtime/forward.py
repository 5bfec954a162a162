"""The forward: one model pass over a planned batch (eager, or a replayed CUDA graph), and the lm_head's work on
the decoding rows: each position's argmax and its probability for the rows that decide from vocabulary chunks
(kernels/vocab_top1.py: no [L, V] logits), full logits for the others.

It writes the query's K/V, reads nothing but the `ForwardPlan`, the weights and the KV cache, and changes no
decoding state, so the overlap scheduler (engine/runtime/overlap.py) may run it while the host updates requests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from redraft.engine.decoding.decoder import LogitsAt
from redraft.engine.decoding.decoding import exclude_mask_
from redraft.engine.runtime.batch import ForwardPlan
from redraft.kernels.attention import AttentionMetadata
from redraft.kernels.vocab_top1 import Top1, lm_head_top1_torch

if TYPE_CHECKING:
    from redraft.engine.runtime.model_runner import ModelRunner


@dataclass
class Forward:
    """What a forward hands the decision: per row of `ForwardPlan.decoding`, the argmax and its probability of the
    quick rows, full logits of the others."""

    top: Top1 | None = None  # [n_quick * L] flat, row-major
    logits: torch.Tensor | None = None  # [n_full, L, V]
    width: int = 0  # L: the longest window
    quick_hidden: torch.Tensor | None = None  # [n_quick * L, H]: the quick rows' states, for the few vocabulary
    #   rows a decoder reads (`ForwardPlan.keep_hidden`)


def run_forward(runner: ModelRunner, plan: ForwardPlan) -> Forward:
    """The forward of `plan` (module docstring); not of an `in_graph` plan, whose forward is its decision too."""
    if plan.in_graph:
        raise ValueError("an in-graph plan runs its forward and decision as one step (ModelRunner.run)")
    if plan.graphs:
        logits = runner.graphs.run(plan.batch)  # [N, B, V]: every item decodes its one active block
        return Forward(logits=logits, width=logits.shape[1])
    hidden, rows = eager_forward(runner, plan)
    if rows is None:
        return Forward()
    n, width = rows.shape
    quick_set = set(plan.quick)
    full = [j for j in range(n) if j not in quick_set]
    top = quick_top1(runner, hidden, rows, plan) if plan.quick else None
    logits = runner.model.logits(hidden, rows[full]) if full else None  # [n_full, L, V]
    quick_hidden = hidden[rows[plan.quick].reshape(-1)] if plan.keep_hidden else None  # [n_quick * L, H]
    return Forward(top, logits, width, quick_hidden=quick_hidden)


def eager_forward(runner: ModelRunner, plan: ForwardPlan) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Any batch: the hidden states [T, H] and the rows [N, L] of the decoding items' open windows in them (L:
    the longest; shorter windows repeat their last row in the padding, which the step never reads; None when
    no item decodes)."""
    batch, dev, model = plan.batch, runner.device, runner.model
    meta = AttentionMetadata.build(batch.q_starts, batch.q_lens, batch.page_tables, runner.block_size, dev,
                                   with_torch_plan=model.kernel_backend == "torch", window_starts=batch.window_starts)
    hidden = model(batch.input_ids.to(dev), meta, runner.k_cache, runner.v_cache)  # [T, H]
    if not plan.decoding:
        return hidden, None
    lens = torch.tensor(plan.lens, device=dev)  # [N]
    ends = meta.cu_q[1:][plan.decoding]  # [N] flat end of each decoding query = end of its active block
    width = int(lens.max())
    rows = (ends - lens)[:, None] + torch.arange(width, device=dev)[None, :]  # [N, L]
    return hidden, torch.minimum(rows, ends[:, None] - 1)


def quick_top1(runner: ModelRunner, hidden: torch.Tensor, rows: torch.Tensor, plan: ForwardPlan) -> Top1:
    """The quick rows' top-1 [n_quick * L]: MASK left out, and each row's `plan.excluded` ids too (one reduction
    per distinct set, in row order)."""
    sets = sorted(set(plan.excluded))
    if len(sets) <= 1:
        return top1(runner, hidden[rows[plan.quick].reshape(-1)], sets[0] if sets else ())
    width = rows.shape[1]
    ids = torch.empty(len(plan.quick), width, dtype=torch.long, device=runner.device)  # [n_quick, L]
    prob = None
    for also in sets:
        qs = [q for q, ex in enumerate(plan.excluded) if ex == also]
        top = top1(runner, hidden[rows[[plan.quick[q] for q in qs]].reshape(-1)], also)
        if prob is None:
            prob = torch.empty(len(plan.quick), width, dtype=top.prob.dtype, device=runner.device)
        ids[qs], prob[qs] = top.ids.view(len(qs), width), top.prob.view(len(qs), width)
    return Top1(ids=ids.reshape(-1), prob=prob.reshape(-1))


def top1(runner: ModelRunner, hidden: torch.Tensor, also: tuple[int, ...] = ()) -> Top1:
    """Each row's best token (MASK and `also` excluded, lowest id on ties) and its probability, from [R, H]
    hidden states. Compiled Triton on CUDA (one fused lm_head + reduction); the chunked torch path elsewhere,
    whose ids are the full logits' (the Triton kernel accumulates in another order: see
    kernels/vocab_top1_triton.py)."""
    weight = runner.model.lm_head.weight  # [V, H]
    if runner.device.type == "cuda" and runner.model.kernel_backend == "triton" and hidden.dtype != torch.float64:
        from redraft.kernels.vocab_top1_triton import lm_head_top1_triton  # imports triton lazily

        return lm_head_top1_triton(hidden, weight, (runner.mask_id, *also)).combine()
    return lm_head_top1_torch(hidden, weight, (runner.mask_id, *also)).combine()


def logits_from(runner: ModelRunner, hidden: torch.Tensor | None, width: int) -> LogitsAt | None:
    """The LogitsAt of rows that have no full logits: position (row, col) is hidden[row * width + col] through
    the lm_head, in the full logits' dtype, MASK at -inf."""
    if hidden is None:
        return None

    def at(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        logits = runner.model.logits(hidden, rows * width + cols)  # [n, V]
        exclude_mask_(logits, runner.mask_id)
        return logits

    return at
