"""The host side of the decision inside the CUDA graph (engine/runtime/cuda_graphs.py): what the static rows hold,
the one staging upload when rows change and the one packed read per step.

The in-graph step writes the next step's query (each window after the step) into the static `input_ids` itself,
so the host keeps a record of every static row: its slot, first query position, page table and query tokens (the
tokens the last packed read brought back). A step whose rows match the record copies nothing to the device. Rows
that differ (a request joined, finished, was preempted, began a block, or the bucket grew) are written into one
pinned staging buffer as records [row, slot, q_start, query tokens (B), page table (P)], with the SlotState
rows of requests whose block (re)began (`SlotState.record`, in place of `SlotState.sync`'s own copy), copied in
one host -> device transfer and scattered on the device. Rows past the batch are padding: the scratch slot,
position 0, every page the scratch page, a MASK query.

Every transfer of this path goes through two methods, so that a test can count them: `upload` (host -> device,
only when rows changed) and `read` (device -> host, once per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from redraft.engine.runtime.cuda_graphs import DecodeGraphs
    from redraft.scheduler.request import Request
    from redraft.scheduler.scheduler import WorkItem

RowKey = tuple[int, int, list[int]]  # (slot, q_start, page table through the active block)


def packed_width(block_size: int) -> int:
    """Columns of the packed step (output.pack_rows): B tokens, had_mask, M2T, T2T, B confidence bits."""
    return 2 * block_size + 3


class GraphInputs:
    """The static rows' record, the staging buffer and the packed read of one DecodeGraphs (module docstring)."""

    def __init__(self, graphs: DecodeGraphs, scratch_slot: int):
        self.g, self.scratch_slot = graphs, scratch_slot
        b, dev = graphs.b, graphs.input_ids.device
        pinned = dev.type == "cuda"  # (page-locked memory needs CUDA; on CPU the buffers are plain tensors)
        cap = graphs.max_bs * (3 + b + graphs.max_pages + 1 + graphs.runner.slots.record_width)
        self.staging = torch.empty(cap, dtype=torch.long, pin_memory=pinned)  # [max_bs * record] flat, host
        self.staged = torch.empty(cap, dtype=torch.long, device=dev)  # its device twin
        self.packed = torch.zeros(graphs.max_bs, packed_width(b), dtype=torch.int32, device=dev)  # [max_bs, 2B+3]
        self.host_packed = torch.zeros(graphs.max_bs, packed_width(b), dtype=torch.int32,
                                       pin_memory=pinned)  # [max_bs, 2B + 3] on the host: where the one read lands
        self.ar = torch.arange(b, device=dev)  # [B]
        self.keys: list[RowKey | None] = [None] * graphs.max_bs  # what each static row holds (None: unknown)
        self.ids: list[list[int] | None] = [None] * graphs.max_bs
        self.uploads = 0  # host -> device transfers made (tests count them)
        self.reads = 0  # device -> host transfers made

    def forget(self, rows: int) -> None:
        """Static rows [0, rows) were written by someone else (the full-logits variant, capture, a failure)."""
        self.keys[:rows] = [None] * rows
        self.ids[:rows] = [None] * rows

    def stage(self, items: list[WorkItem], bs: int) -> list[Request]:
        """Make static rows [0, bs) hold `items` (then padding), and load the slot rows of items whose block
        (re)began (`SlotState.stale`): what differs, in one upload and a scatter on the device; nothing when
        nothing differs. Returns the requests whose slot rows it loaded."""
        b, g = self.g.b, self.g
        static: list[list[int]] = []
        for i in range(bs):
            if i < len(items):
                it = items[i]
                start = it.first * b
                key: RowKey = (it.req.book.slot, start, it.req.book.pages[: it.last + 1])
                ids = it.req.state.tokens[start : start + b]
            else:
                key, ids = (self.scratch_slot, 0, [g.scratch]), [g.runner.mask_id] * b
            if self.keys[i] != key or self.ids[i] != ids:
                static.append([i, key[0], key[1], *ids, *key[2]])
                self.keys[i], self.ids[i] = key, ids
        slots = g.runner.slots
        stale = [it.req for it in items if slots.stale(it.req)]
        if static or stale:
            rec, rows = self.upload(static, [[r.book.slot, *slots.record(r)] for r in stale])
            if rec is not None:
                self._scatter(rec)
            if rows is not None:
                slots.load(rows[:, 0], rows[:, 1:])
            for r in stale:
                slots.loaded(r)
        return stale

    def upload(self, static: list[list[int]], rows: list[list[int]]
               ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The one host -> device copy of a step whose rows changed, through the pinned staging buffer: static
        records (ragged tables padded with the scratch page) -> [k, 3 + B + P] and slot-row records ([slot,
        SlotState.record]) -> [k', 1 + record_width] on the device (None where there are none)."""
        width = max((len(r) for r in static), default=0)  # 3 + B + P, P: the longest table among the records
        padded = [x for r in static for x in (*r, *[self.g.scratch] * (width - len(r)))]
        data = padded + [x for r in rows for x in r]
        flat = self.staging[: len(data)]
        flat.copy_(torch.tensor(data, dtype=torch.long))  # host data into pinned memory
        self.uploads += 1
        # (non_blocking from pinned memory; the step's own read, later on the same stream, waits for it, and
        # the staging buffer is not written again before that read)
        on_device = self.staged[: len(data)].copy_(flat, non_blocking=True)
        rec = on_device[: len(padded)].view(len(static), width) if static else None
        loads = on_device[len(padded) :].view(len(rows), -1) if rows else None
        return rec, loads

    def _scatter(self, rec: torch.Tensor) -> None:
        """rec [k, 3 + B + P] on the device into the static rows it names (device ops only)."""
        g, b = self.g, self.g.b
        rows, start, pages = rec[:, 0], rec[:, 2], rec[:, 3 + b :]  # [k], [k], [k, P]
        g.slot_idx[rows] = rec[:, 1]
        g.q_starts[rows] = start
        g.kv_lens[rows] = start + b
        g.page_tables[rows, : pages.shape[1]] = pages  # (columns past P are never read: kv_len bounds them)
        g.input_ids.view(-1, b)[rows] = rec[:, 3 : 3 + b]
        g.positions.view(-1, b)[rows] = start[:, None] + self.ar[None, :]  # [k, B]
        active = pages.gather(1, (start // b)[:, None])  # [k, 1] the page of the active block
        g.slot_mapping.view(-1, b)[rows] = active * b + self.ar[None, :]

    def read(self, n: int) -> list[list[int]]:
        """The step's one device -> host transfer: packed rows [0, n) into pinned memory, then plain lists; the
        record's query tokens become the tokens the step wrote into `input_ids`."""
        host = self.host_packed[:n]
        host.copy_(self.packed[:n])  # (blocking: returns when the step is done)
        self.reads += 1
        rows: list[list[Any]] = host.tolist()  # [n, 2B + 3] (reads pinned host memory: no transfer)
        b = self.g.b
        for i, row in enumerate(rows):
            self.ids[i] = row[:b]
        return rows
