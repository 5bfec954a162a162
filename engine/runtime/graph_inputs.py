"""The host side of the decision inside the CUDA graph (engine/runtime/cuda_graphs.py): what the static rows hold,
the one staging upload when rows change and the one packed read per step.

The in-graph step writes the next step's query (each window after the step) into the static `input_ids` itself,
so the host keeps a record of every static row: its slot, first query position, page table and query tokens (the
tokens the last packed read brought back). A step whose rows match the record copies nothing to the device. Rows
that differ (a request joined, finished, was preempted, began a block, or the bucket grew) are written into one
pinned staging buffer as records [row, slot, q_start, page table (P), query tokens (B)], copied in one host ->
device transfer and scattered into the static buffers on the device. Rows past the batch are padding: the
scratch slot, position 0, every page the scratch page, a MASK query.

Every transfer of this path goes through two methods, so that a test can count them: `upload` (host -> device,
only when rows changed) and `read` (device -> host, once per step).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from redraft.engine.runtime.cuda_graphs import DecodeGraphs
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
        self.record_width = 3 + graphs.max_pages + b
        cap = graphs.max_bs * self.record_width
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

    def stage(self, items: list[WorkItem], bs: int) -> None:
        """Make static rows [0, bs) hold `items` (then padding): the rows that differ from the record, in one
        upload and a scatter on the device; nothing when none differs."""
        b, g = self.g.b, self.g
        records: list[list[int]] = []
        for i in range(bs):
            if i < len(items):
                it = items[i]
                start = it.first * b
                key: RowKey = (it.req.book.slot, start, it.req.book.pages[: it.last + 1])
                ids = it.req.state.tokens[start : start + b]
            else:
                key, ids = (self.scratch_slot, 0, [g.scratch]), [g.runner.mask_id] * b
            if self.keys[i] != key or self.ids[i] != ids:
                records.append([i, key[0], key[1], *key[2], *ids])
                self.keys[i], self.ids[i] = key, ids
        if records:
            self._scatter(self.upload(records))

    def upload(self, records: list[list[int]]) -> torch.Tensor:
        """The one host -> device copy of a step whose rows changed: records (ragged tables) padded to one width
        in the pinned staging buffer -> [k, 3 + P + B] on the device."""
        b = self.g.b
        width = max(len(r) for r in records)  # 3 + P + B, P: the longest table among the records
        rows = [r[: len(r) - b] + [self.g.scratch] * (width - len(r)) + r[len(r) - b :] for r in records]
        flat = self.staging[: len(rows) * width]
        flat.copy_(torch.tensor(rows, dtype=torch.long).view(-1))  # [k * width] host data into pinned memory
        self.uploads += 1
        # (non_blocking from pinned memory; the step's own read, later on the same stream, waits for it, and
        # the staging buffer is not written again before that read)
        return self.staged[: flat.numel()].copy_(flat, non_blocking=True).view(len(rows), width)

    def _scatter(self, rec: torch.Tensor) -> None:
        """rec [k, 3 + P + B] on the device into the static rows it names (device ops only)."""
        g, b = self.g, self.g.b
        pages = rec.shape[1] - 3 - b
        rows, start = rec[:, 0], rec[:, 2]  # [k]
        g.slot_idx[rows] = rec[:, 1]
        g.q_starts[rows] = start
        g.kv_lens[rows] = start + b
        g.page_tables[rows, :pages] = rec[:, 3 : 3 + pages]  # (columns past P are never read: kv_len bounds them)
        g.input_ids.view(-1, b)[rows] = rec[:, 3 + pages :]
        g.positions.view(-1, b)[rows] = start[:, None] + self.ar[None, :]  # [k, B]
        active = rec[:, 3 : 3 + pages].gather(1, (start // b)[:, None])  # [k, 1] the page of the active block
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
