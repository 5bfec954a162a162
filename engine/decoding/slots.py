"""`SlotState`: what every decoder reads of a running request, one device row per slot.

Each running request holds a slot (`Request.book.slot`, given by the scheduler); the tensors here keep, per slot,
the tokens of its open window (the active block alone without multi-block editing), which of them may be edited,
its step counter, thresholds and sampling settings. `sync` mirrors a request's decoding state to its row when its
block (re)began (`Request.row_key` changed) and the decoders update the row in place at each step, so a
steady-state step builds no per-request Python lists. A decoder with state of its own keeps it beside these rows
(engine/decoding/decoder.py).
"""

from __future__ import annotations

import torch

from redraft.engine.decoding.decoding import SamplingBatch
from redraft.protocol.sampling_params import MAX_MBE_WINDOW
from redraft.scheduler.request import Request


class SlotState:
    """Per-slot decoding state on the device, indexed by Request.book.slot: [S, ...] tensors, S = running slots,
    L = the longest window (MAX_MBE_WINDOW blocks). Positions past a request's window hold PAD (never MASK)
    and are not editable, so the step leaves them alone. Each row mirrors one request's decoding state as of its
    block's start (`Request.row_key`); the steps then advance it in place."""

    PAD = -1

    def __init__(self, num_slots: int, block_size: int, device: torch.device):
        s, w = num_slots, MAX_MBE_WINDOW * block_size
        self.block_size = block_size
        self.tokens = torch.full((s, w), self.PAD, dtype=torch.long, device=device)  # [S, L] the open window
        self.editable = torch.zeros(s, w, dtype=torch.bool, device=device)  # [S, L] False on prompt and padding
        self.window_start = torch.zeros(s, dtype=torch.long, device=device)  # [S] absolute position of the window
        self.steps = torch.zeros(s, dtype=torch.long, device=device)  # [S] the request's denoising steps
        self.threshold = torch.zeros(s, dtype=torch.float64, device=device)
        self.edit_threshold = torch.zeros(s, dtype=torch.float64, device=device)
        self.temperature = torch.zeros(s, dtype=torch.float64, device=device)
        self.top_k = torch.zeros(s, dtype=torch.long, device=device)
        self.top_p = torch.ones(s, dtype=torch.float64, device=device)
        self.seed = torch.zeros(s, dtype=torch.long, device=device)
        self._owner: list[tuple[int, int] | None] = [None] * s  # the Request.row_key each row was loaded for

    def stale(self, r: Request) -> bool:
        """Whether r's row does not hold r's current block start (a block began, or the row was forgotten)."""
        return self._owner[r.book.slot] != r.row_key

    def sync(self, r: Request) -> None:
        """THE mirror of a request's decoding state to its device row: the window's tokens, which of them may be
        edited, the step counter, thresholds and sampling settings."""
        i, p, b = r.book.slot, r.params, self.block_size
        start = r.state.window_start * b
        window = r.window_tokens()
        n = len(window)
        self.tokens[i] = self.PAD
        self.tokens[i, :n] = torch.tensor(window, dtype=torch.long)
        self.editable[i] = False
        self.editable[i, :n] = torch.arange(start, start + n) >= r.prompt_len
        self.window_start[i] = start
        self.steps[i] = r.state.stats.steps
        self.threshold[i], self.edit_threshold[i] = p.threshold, p.edit_threshold
        self.temperature[i], self.top_k[i], self.top_p[i] = p.temperature, p.top_k, p.top_p
        self.seed[i] = p.seed or 0
        self._owner[i] = r.row_key

    def slot_ids(self, reqs: list[Request]) -> torch.Tensor:
        return torch.tensor([r.book.slot for r in reqs], dtype=torch.long, device=self.tokens.device)  # [N]

    def forget(self, reqs: list[Request]) -> None:
        """Resync these requests' rows (and their grammars) from the requests before their next step (a step that
        failed half-way may have advanced them)."""
        for r in reqs:
            if r.book.slot >= 0:
                self._owner[r.book.slot] = None

    def sampling(self, slots: torch.Tensor, width: int) -> SamplingBatch:
        ar = torch.arange(width, device=slots.device)
        return SamplingBatch(
            temperature=self.temperature[slots], top_k=self.top_k[slots], top_p=self.top_p[slots],
            seeds=self.seed[slots], steps=self.steps[slots], positions=self.window_start[slots, None] + ar[None, :],
        )
