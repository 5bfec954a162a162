"""What every decoding rule shares: the proposal of each position from a forward's logits, and the step's result.

One forward proposes a token v and its probability p for every position of each request's open window (its
active block; with multi-block editing, docs/mbe.md, also the open blocks before it): `propose` on full logits
(greedy or sampled), or the chunked argmax of kernels/vocab_top1.py for rows that need nothing else. A decoder
(engine/decoding/decoder.py: threshold.py, levenshtein.py) then decides from v and p which positions change.
Everything here is tensor ops over [N, L] (N requests, L window positions, padded to the longest window; no
per-request Python loop). The logits may have been adjusted first by the request's logit controls (engine/decoding/logit_controls.py: penalties,
logit_bias, min_tokens), so the thresholds see the adjusted probabilities.
The MASK id is never a proposal: its logit is dropped first (`exclude_mask_`). (A trained LLaDA2 never puts
mass there; a model that did would leave its position masked and could stall a block forever.)
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

_MASK32 = 0xFFFFFFFF


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (lowbias32-style) on int64 lanes; constants < 2^31 keep products < 2^63."""
    x = x & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x46C8A68B) & _MASK32
    return x ^ (x >> 16)


def uniform_noise(seeds: torch.Tensor, positions: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """U[0, 1) drawn from (seed, absolute position, step) alone: a request's samples never depend on its
    batch neighbours. seeds, steps: [N] int64; positions: [N, L] int64 -> [N, L] float64."""
    s = seeds[:, None]
    x = _mix32(_mix32(_mix32(s ^ 0x1B873593) ^ (s >> 32)) ^ positions)
    x = _mix32(x ^ (steps[:, None] * 0x2545F491))
    hi = _mix32(x ^ 0x68E31DA4)
    lo = _mix32(x ^ 0x1B56C4E9)
    return ((hi >> 5).double() * 67108864.0 + (lo >> 6).double()) / 9007199254740992.0  # 53 random bits


@dataclass
class SamplingBatch:
    """Per-request sampling inputs for the rows of a step (`propose`'s `sampling`: None when every row is
    greedy)."""

    temperature: torch.Tensor  # [N] float (0 = greedy row)
    top_k: torch.Tensor  # [N] int64 (<= 0: off)
    top_p: torch.Tensor  # [N] float
    seeds: torch.Tensor  # [N] int64
    steps: torch.Tensor  # [N] int64, the request's denoising-step counter
    positions: torch.Tensor  # [N, L] absolute positions of the window


def propose(logits: torch.Tensor, sampling: SamplingBatch | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Proposal v and its probability p for every position. logits: [N, L, V] (>= fp32).

    Greedy rows: v = argmax, p = softmax(logits)[v]. Sampled rows: logits / temperature, keep the top_k,
    then the top_p nucleus (the first token always kept), sample by inverse CDF with `uniform_noise`;
    p is the sampled token's probability under that filtered distribution.
    """
    v = logits.argmax(-1)  # [N, L]
    p = torch.exp(logits.max(-1).values - torch.logsumexp(logits, -1))  # [N, L]
    if sampling is None:
        return v, p
    rows = (sampling.temperature > 0).nonzero().flatten()
    if rows.numel() == 0:
        return v, p
    sub = logits[rows] / sampling.temperature[rows, None, None].to(logits.dtype)  # [n, L, V]
    probs, order = torch.softmax(sub, -1).sort(-1, descending=True)  # [n, L, V]
    rank = torch.arange(probs.shape[-1], device=probs.device)
    top_k = sampling.top_k[rows]
    keep = (rank[None, None, :] < torch.where(top_k > 0, top_k, probs.shape[-1])[:, None, None])
    probs = probs * keep
    probs = probs / probs.sum(-1, keepdim=True)
    mass_before = probs.cumsum(-1) - probs
    keep = mass_before < sampling.top_p[rows, None, None].to(probs.dtype)
    keep[..., 0] = True
    probs = probs * keep
    cdf = probs.cumsum(-1)  # [n, L, V]
    total = cdf[..., -1:]
    u = uniform_noise(sampling.seeds[rows], sampling.positions[rows], sampling.steps[rows]).to(cdf.dtype)
    pick = torch.searchsorted(cdf, (u[..., None] * total).contiguous(), right=True).clamp_(max=cdf.shape[-1] - 1)
    pick = torch.where(probs.gather(-1, pick) > 0, pick, 0)  # guard the rounding edge: never a filtered token
    v = v.clone()
    p = p.clone()
    v[rows] = order.gather(-1, pick).squeeze(-1)
    p[rows] = (probs.gather(-1, pick) / total).squeeze(-1).to(p.dtype)
    return v, p


@dataclass
class StepResult:
    tokens: torch.Tensor  # [N, L] the window after this step
    proposal: torch.Tensor  # [N, L] the model's token at every position (v)
    confidence: torch.Tensor  # [N, L] p of v
    m2t: torch.Tensor  # [N, L] bool: masks filled
    t2t: torch.Tensor  # [N, L] bool: tokens edited
    had_mask: torch.Tensor  # [N] bool: the window held a mask before the step
    # what a decoder reports beyond the above (Decoder.reports: name -> [N] long), e.g. the Levenshtein step's
    # `ended`, `deletions`, `insertions`; rows of other decoders hold each report's `fill`
    reports: dict[str, torch.Tensor] = field(default_factory=dict)


def exclude_mask_(logits: torch.Tensor, mask_id: int) -> torch.Tensor:
    """MASK's logit to -inf, in place (for the owner of a scratch logits tensor: the model runner, whose
    logprobs then describe the same distribution the step decides on)."""
    logits[..., mask_id] = float("-inf")
    return logits
