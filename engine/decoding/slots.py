"""`SlotState`: what every decoder reads of a running request, one device row per slot.

Each running request holds a slot (`Request.book.slot`, given by the scheduler); the tensors here keep, per slot,
the tokens of its open window (the active block alone without multi-block editing), which of them may be edited,
its step counter, thresholds and sampling settings. `sync` mirrors a request's decoding state to its row when its
block (re)began (`Request.row_key` changed: its `record`, in one copy, or within the staging upload of the
decision inside the CUDA graph) and the decoders update the row in place at each step, so a
steady-state step builds no per-request Python lists. A decoder with state of its own keeps it beside these rows
(engine/decoding/decoder.py).
"""

from __future__ import annotations

import torch

import struct

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
        """Load r's row now (one host -> device copy of its `record`)."""
        dev = self.tokens.device
        self.load(torch.tensor([r.book.slot], device=dev), torch.tensor([self.record(r)], device=dev))
        self.loaded(r)

    @property
    def record_width(self) -> int:
        return 2 * self.tokens.shape[1] + 8

    def record(self, r: Request) -> list[int]:
        """THE mirror of a request's decoding state, as the int64s `load` writes to its row: the window's tokens
        (PAD past it), which of them may be edited, its first position, the step counter, thresholds and sampling
        settings (floats as their float64 bits)."""
        p, b, width = r.params, self.block_size, self.tokens.shape[1]
        start = r.state.window_start * b
        window = r.window_tokens()
        n = len(window)
        editable = [int(pos >= r.prompt_len) for pos in range(start, start + n)]
        return [*window, *[self.PAD] * (width - n), *editable, *[0] * (width - n), start, r.state.stats.steps,
                *_bits(p.threshold, p.edit_threshold, p.temperature), p.top_k, *_bits(p.top_p), p.seed or 0]

    def load(self, slots: torch.Tensor, records: torch.Tensor) -> None:
        """Rows `slots` [k] from their `record`s [k, record_width] (int64, on the device: device ops only)."""
        w = self.tokens.shape[1]
        self.tokens[slots] = records[:, :w]
        self.editable[slots] = records[:, w : 2 * w].bool()
        rest = records[:, 2 * w :]  # [k, 8]
        self.window_start[slots], self.steps[slots] = rest[:, 0], rest[:, 1]
        floats = rest.view(torch.float64)  # (the float settings' bits, read back as float64)
        self.threshold[slots], self.edit_threshold[slots] = floats[:, 2], floats[:, 3]
        self.temperature[slots], self.top_k[slots], self.top_p[slots] = floats[:, 4], rest[:, 5], floats[:, 6]
        self.seed[slots] = rest[:, 7]

    def loaded(self, r: Request) -> None:
        """r's row holds r's current block start now (its `record` was loaded)."""
        self._owner[r.book.slot] = r.row_key

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


def _bits(*values: float) -> list[int]:
    """Each float's float64 bits as an int64 (a row record carries floats in its int64 columns)."""
    return list(struct.unpack(f"{len(values)}q", struct.pack(f"{len(values)}d", *values)))
