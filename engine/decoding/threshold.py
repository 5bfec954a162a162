"""`threshold`: the joint-threshold draft-and-edit step (LLaDA2.0/2.1's official decoding), for a whole batch.

Per request, from one forward's proposals v and their probabilities p (engine/decoding/decoding.py):
    M2T: masked positions whose proposal probability p > threshold are filled (strict >); if none passes,
         the single masked position with the highest p is filled (top-1 fallback).
    T2T: already-placed, non-prompt positions whose proposal differs from the current token and has
         p > edit_threshold are replaced (strict >).
Both come from the same forward, over the request's whole open window: multi-block editing (docs/mbe.md,
`mbe_window`) is this same step on a window of several blocks, not a rule of its own.
"""

from __future__ import annotations

import torch

from redraft.engine.decoding.decoder import Decoder, LogitsAt
from redraft.engine.decoding.decoding import StepResult
from redraft.engine.decoding.slots import SlotState
from redraft.engine.model.config import ModelConfig
from redraft.scheduler.request import Request


def threshold_step(
    v: torch.Tensor,  # [N, L] the proposal at every position
    p: torch.Tensor,  # [N, L] its probability
    block: torch.Tensor,  # [N, L] current tokens of each open window (padding: never MASK)
    editable: torch.Tensor,  # [N, L] bool: False on prompt positions and padding (never edited)
    threshold: torch.Tensor,  # [N]
    edit_threshold: torch.Tensor,  # [N]
    mask_id: int,
) -> StepResult:
    """M2T (with the top-1 fallback) and T2T from the proposals alone (module docstring)."""
    masked = (block == mask_id) & editable  # [N, L]
    m2t = masked & (p > threshold[:, None].to(p.dtype))
    # Top-1 fallback: a row with masks but no position above threshold fills its most confident mask.
    need_fallback = masked.any(-1) & ~m2t.any(-1)  # [N]
    best = torch.where(masked, p, torch.full_like(p, -1.0)).argmax(-1)  # [N]
    fallback = torch.zeros_like(m2t).scatter_(1, best[:, None], True) & need_fallback[:, None]
    m2t = m2t | fallback
    t2t = ~masked & editable & (v != block) & (p > edit_threshold[:, None].to(p.dtype))
    tokens = torch.where(m2t | t2t, v, block)
    return StepResult(tokens=tokens, proposal=v, confidence=p, m2t=m2t, t2t=t2t, had_mask=masked.any(-1))


class ThresholdDecoder(Decoder):
    """`decoder: "threshold"`. Its state is SlotState's rows alone. On a LLaDA2.2 checkpoint it never proposes
    DELETE or SPLIT (they are the Levenshtein step's edits, not tokens). Its step is tensor ops on v, p and the slot
    rows alone: it runs inside the denoising step's CUDA graph (`in_graph`)."""

    name = "threshold"
    in_graph = True

    def __init__(self, slots: SlotState, cfg: ModelConfig, mask_id: int):
        super().__init__(slots, cfg, mask_id)
        self.excluded = cfg.edit_token_ids

    def step(self, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor, reqs: list[Request],
             logits_at: LogitsAt | None) -> StepResult:
        s, width = self.slots, v.shape[1]
        result = threshold_step(v, p, s.tokens[slots, :width], s.editable[slots, :width], s.threshold[slots],
                                s.edit_threshold[slots], self.mask_id)
        s.tokens[slots, :width] = result.tokens
        s.steps[slots] += 1
        return result
