"""The decoding step's two numbers per position, straight from the hidden states: no full-vocabulary logits.

Most rows of a denoising step (temperature 0, no logprobs, no grammar, no logit control) need, per position,
only the argmax of the logits (lowest id on ties, MASK excluded) and its softmax probability. Materialising
`[N, L, V]` fp32 logits for that costs N * L * V * 4 bytes (1.29 GB at N = 64, L = 32, V = 157,184) and two
passes over them. Here the lm_head runs in vocabulary chunks and each chunk is folded into three running
numbers per row: the best logit so far, its id, and the sum of exp(logit - best) (an online log-sum-exp, as
flash attention does for its softmax). Memory is O(rows * chunk).

Each chunk's logits are computed exactly as `LLaDA2Model.logits` computes the full ones (the lm_head in the
model's dtype, rounded to it, then widened to >= fp32), so the argmax is the full path's argmax whenever the
BLAS gives each output element the same value whatever the slice of weight rows it multiplies (it does for
the CPU builds we test, every dtype). The probability is the same quantity summed in another order: it can
differ from the full path's in the last bits, which matters only for a probability within an ulp of a
threshold (see docs/benchmarks.md).

`Top1Partials` is also how pieces of the vocabulary are merged: the Triton kernel's tiles
(kernels/vocab_top1_triton.py) and tensor-parallel ranks' slices, in vocabulary order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from redraft.kernels.moe import compute_dtype

# Rows x chunk x 4 bytes is the transient cost; 8,192 columns keep 2,048 rows (batch 64 x 32 positions) at 64 MiB.
DEFAULT_CHUNK = 8192


@dataclass
class Top1:
    """Per row: the best token (lowest id on ties) and its softmax probability over the vocabulary."""

    ids: torch.Tensor  # [R] int64
    prob: torch.Tensor  # [R] >= fp32


@dataclass
class Top1Partials:
    """Per row and vocabulary piece: the best logit, its (global) id, sum over the piece of exp(logit - best)."""

    best: torch.Tensor  # [R, P] >= fp32 (-inf for a piece with no candidate)
    ids: torch.Tensor  # [R, P] int64
    sumexp: torch.Tensor  # [R, P] same dtype as best

    def combine(self) -> Top1:
        """Fold the pieces (in vocabulary order: ties go to the earliest piece, hence the lowest id)."""
        best, piece = self.best.max(-1)  # [R]; max returns the first maximal index
        ids = self.ids.gather(-1, piece[:, None]).squeeze(-1)
        scale = torch.exp(self.best - best[:, None]).nan_to_num_(0.0)  # -inf - -inf: an empty piece adds 0
        total = (self.sumexp * scale).sum(-1)
        return Top1(ids=ids, prob=torch.exp(-torch.log(total)))


def excluded_ids(exclude: int | Sequence[int] | None) -> tuple[int, ...]:
    """The token ids a reduction leaves out, as a tuple (None: none; an int: that one)."""
    if exclude is None:
        return ()
    return (int(exclude),) if isinstance(exclude, int) else tuple(int(t) for t in exclude)


def lm_head_top1_torch(hidden: torch.Tensor, weight: torch.Tensor, exclude: int | Sequence[int] | None,
                       chunk: int = DEFAULT_CHUNK, vocab_offset: int = 0) -> Top1Partials:
    """hidden [R, H] (final-normed, model dtype), weight [V, H] (the lm_head, or a rank's slice of it whose first
    row is token `vocab_offset`) -> one piece per call: best logit, its id and sumexp per row. The `exclude` ids
    (MASK; on a LLaDA2.2 checkpoint's 2.1-step rows DELETE and SPLIT too) never win and add nothing to the sum,
    as -inf logits do in the full-logits path."""
    gone = excluded_ids(exclude)
    cdt = compute_dtype(hidden.dtype)
    r, v = hidden.shape[0], weight.shape[0]
    best = torch.full((r,), float("-inf"), dtype=cdt, device=hidden.device)
    ids = torch.zeros(r, dtype=torch.int64, device=hidden.device)
    total = torch.zeros(r, dtype=cdt, device=hidden.device)
    for start in range(0, v, chunk):
        logits = F.linear(hidden, weight[start : start + chunk]).to(cdt)  # [R, C]
        for t in gone:
            if 0 <= t - vocab_offset - start < logits.shape[1]:
                logits[:, t - vocab_offset - start].fill_(float("-inf"))  # (a fill: no tensor from host data)
        chunk_best, chunk_arg = logits.max(-1)  # [R]; the first maximal index on ties
        new_best = torch.maximum(best, chunk_best)
        safe = torch.where(torch.isinf(new_best), torch.zeros_like(new_best), new_best)  # all -inf so far: 0
        total = total * torch.exp(best - safe) + torch.exp(logits - safe[:, None]).sum(-1)
        ids = torch.where(chunk_best > best, chunk_arg + (start + vocab_offset), ids)  # strict: earlier ids win ties
        best = new_best
    return Top1Partials(best=best[:, None], ids=ids[:, None], sumexp=total[:, None])


def full_logits_top1(logits: torch.Tensor) -> Top1:
    """The same two numbers from full logits [R, V] (MASK already at -inf), as `decoding.propose` computes them:
    the reference the chunked paths are tested against."""
    return Top1(ids=logits.argmax(-1), prob=torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1)))
