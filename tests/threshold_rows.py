"""The engine's threshold step on plain tensors, for tests: the logits lose MASK (`exclude_mask_`, on a copy), the
proposals come from `propose`, and `ThresholdDecoder.step` decides on slot rows loaded with the given windows and
thresholds: the same calls the model runner makes on rows with full logits (engine/runtime/decision.py)."""

from __future__ import annotations

import types

import torch

from redraft.engine.decoding.decoding import SamplingBatch, StepResult, exclude_mask_, propose
from redraft.engine.decoding.slots import SlotState
from redraft.engine.decoding.threshold import ThresholdDecoder


def joint_threshold_step(logits: torch.Tensor, block: torch.Tensor, editable: torch.Tensor, threshold: torch.Tensor,
                         edit_threshold: torch.Tensor, mask_id: int,
                         sampling: SamplingBatch | None = None) -> StepResult:
    """logits [N, L, V] (left unchanged), block / editable [N, L], threshold / edit_threshold [N]."""
    n, width = block.shape
    slots = SlotState(n, width, torch.device("cpu"))  # one block of `width` positions per slot
    slots.tokens[:, :width], slots.editable[:, :width] = block, editable
    slots.threshold[:], slots.edit_threshold[:] = threshold, edit_threshold
    checkpoint = types.SimpleNamespace(edit_token_ids=())  # a LLaDA2.0/2.1 vocabulary: nothing more left out
    decoder = ThresholdDecoder(slots, checkpoint, mask_id)  # type: ignore[arg-type]
    v, p = propose(exclude_mask_(logits.clone(), mask_id), sampling)
    return decoder.step(v, p, torch.arange(n), [], None)
