"""`Decoder`: the interface every decoding rule implements, and `merge_results`, which puts the rows of several
decoders back in batch order.

A request names its rule by `decoder` (protocol/sampling_params.py); engine/decoding/registry.py maps each name to
its class. The model runner holds one instance per rule the checkpoint can run and never asks which rule a row
runs: it groups the rows by their decoder and hands each group its proposals. What a decoder declares:

- `excluded`: token ids its rows never propose besides MASK (the forward leaves them out of the argmax and the
  logits: the threshold step on a LLaDA2.2 checkpoint leaves out DELETE and SPLIT);
- `reads_vocab_rows`: its step reads whole vocabulary rows at a few positions (`LogitsAt`), so the forward keeps
  the hidden states of rows that decided from vocabulary chunks;
- `keeps_block_state`: it keeps per-slot state the request does not hold, so a row reloaded mid-block (after a
  failed batch) restarts its block;
- `in_graph`: its step reads nothing but v, p and the slot rows (not the requests, no vocabulary rows), reports
  nothing and never waits on the host, so a CUDA graph of the denoising step may end in it (the decision inside
  the graph: engine/runtime/cuda_graphs.py), for rows that need no more than each position's argmax;
- `reports`: per-row figures beyond tokens, had_mask, M2T and T2T (`Report`), which ride in the step's one
  device -> host read and land in the `StepOutput` field of the same name;
- `admit`: refuses (RequestError) a request it cannot serve on this checkpoint, at admission;
- `load`: its own state of a row whose block (re)began, after `SlotState.sync` loaded the shared row;
- `step`: the batched device step from proposals v and probabilities p ([N, L]), advancing the slot rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch

from redraft.engine.decoding.decoding import StepResult
from redraft.engine.decoding.slots import SlotState
from redraft.engine.model.config import ModelConfig
from redraft.protocol.sampling_params import ResolvedParams
from redraft.scheduler.request import Request

# Whole vocabulary rows at some positions of the step's rows: (rows [n], cols [n]) -> [n, V] logits with MASK at
# -inf, the caller's to change. Built from full logits, or computed on demand from kept hidden states.
LogitsAt = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def logits_at_of(logits: torch.Tensor) -> LogitsAt:
    """The LogitsAt of full logits [N, L, V] (MASK at -inf): their rows, copied."""
    return lambda rows, cols: logits[rows, cols]  # (advanced indexing copies)


@dataclass(frozen=True)
class Report:
    """A per-row figure a decoder reports: the StepOutput field `name`, `fill` on other decoders' rows, and
    `flag`: read back as a bool, None where negative (another decoder's row), instead of an int."""

    name: str
    fill: int
    flag: bool = False


class Decoder:
    """One decoding rule (module docstring). Subclasses set `name` and implement `step`."""

    name: ClassVar[str]
    reads_vocab_rows: ClassVar[bool] = False
    keeps_block_state: ClassVar[bool] = False
    in_graph: ClassVar[bool] = False
    reports: ClassVar[tuple[Report, ...]] = ()

    def __init__(self, slots: SlotState, cfg: ModelConfig, mask_id: int):
        self.slots, self.cfg, self.mask_id = slots, cfg, mask_id
        self.excluded: tuple[int, ...] = ()

    @classmethod
    def runs_on(cls, cfg: ModelConfig) -> bool:
        """Whether this checkpoint can run the rule at all (else no instance is made for it)."""
        return True

    @classmethod
    def implied_by(cls, cfg: ModelConfig) -> bool:
        """Whether the checkpoint makes this rule the default of requests that name none."""
        return False

    @classmethod
    def admit(cls, params: ResolvedParams, cfg: ModelConfig) -> None:
        """Raise RequestError (naming the field) when a request with these settings cannot run this rule here."""

    def load(self, r: Request) -> None:
        """r's block (re)began and SlotState.sync just loaded its row: load this rule's own state of it."""

    def step(self, v: torch.Tensor, p: torch.Tensor, slots: torch.Tensor, reqs: list[Request],
             logits_at: LogitsAt | None) -> StepResult:
        """The step of rows `slots` [N] (requests `reqs`) from their proposals v and probabilities p [N, L]; the
        slot rows then hold the windows after it. logits_at: their vocabulary rows, where `reads_vocab_rows`."""
        raise NotImplementedError


def merge_results(parts: list[tuple[list[int], StepResult]], n: int, reports: tuple[Report, ...]) -> StepResult:
    """StepResults of disjoint row subsets (each with its row indices) as one of n rows, in batch order; every
    report of `reports` is filled with its `fill` on the rows that did not give it."""
    if len(parts) == 1 and parts[0][0] == list(range(n)):
        result = parts[0][1]
        for r in reports:
            if r.name not in result.reports:
                result.reports[r.name] = torch.full((n,), r.fill, dtype=torch.long, device=result.tokens.device)
        return result
    first = parts[0][1]
    dev, width = first.tokens.device, first.tokens.shape[1]
    dtype = torch.promote_types(*(part.confidence.dtype for _, part in parts)) if len(parts) > 1 \
        else first.confidence.dtype

    def empty(like: torch.Tensor, dt: torch.dtype | None = None) -> torch.Tensor:
        return torch.empty((n, *like.shape[1:]), dtype=dt or like.dtype, device=dev)

    out = StepResult(tokens=empty(first.tokens), proposal=empty(first.proposal), confidence=empty(first.confidence, dtype),
                     m2t=empty(first.m2t), t2t=empty(first.t2t), had_mask=empty(first.had_mask),
                     reports={r.name: torch.full((n,), r.fill, dtype=torch.long, device=dev) for r in reports})
    for rows, part in parts:
        idx = torch.tensor(rows, device=dev)
        assert part.tokens.shape[1] == width
        for name in ("tokens", "proposal", "confidence", "m2t", "t2t", "had_mask"):
            getattr(out, name)[idx] = getattr(part, name).to(getattr(out, name).dtype)
        for name, values in part.reports.items():
            out.reports[name][idx] = values.long()
    return out
