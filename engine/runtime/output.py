"""Output packing: a step's result as the scheduler's plain lists (`StepOutput`), read from the device in one
transfer, and the logprobs of the rows that asked for them. `pack_rows` / `unpack_rows` are the same for the
decision inside the CUDA graph (engine/runtime/cuda_graphs.py), whose packed tensor has a fixed shape."""

from __future__ import annotations

import struct

import torch

from redraft.engine.decoding.decoder import Report
from redraft.engine.decoding.decoding import StepResult
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import StepOutput

LOGPROB_FLOOR = -9999.0  # OpenAI's value for "impossible": JSON has no -inf


def finite_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim, floored at LOGPROB_FLOOR (a token with probability 0, MASK included, would
    be -inf, which no JSON reply can carry)."""
    return torch.log_softmax(logits, -1).nan_to_num(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)


def confidence_bits(result: StepResult) -> torch.Tensor:
    """[N, L] int32: each position's proposal probability as float32 bits (-1.0 where the step's token is not the
    proposal), to ride in the step's one integer device -> host read."""
    p = result.confidence.float()  # [N, L] float32
    return torch.where(result.tokens == result.proposal, p, torch.full_like(p, -1.0)).view(torch.int32)


def denoise_columns(result: StepResult) -> torch.Tensor:
    """confidence_bits as [N, L] int64 (pack_step's columns)."""
    return confidence_bits(result).long()


def pack_rows(result: StepResult) -> torch.Tensor:
    """A one-block step's result in one int32 tensor [N, 2L + 3]: the window's tokens, had_mask, the M2T and T2T
    counts, the confidence bits (unpack_rows reads it back; multi-block edits cannot occur in one block)."""
    cols = [result.tokens, result.had_mask[:, None], result.m2t.sum(-1, keepdim=True),
            result.t2t.sum(-1, keepdim=True)]
    return torch.cat([*(c.int() for c in cols), confidence_bits(result)], dim=1)


def unpack_rows(rows: list[list[int]], reqs: list[Request], width: int) -> StepOutput:
    """pack_rows' rows (read back as lists) as the StepOutput of requests `reqs`, windows of `width` tokens."""
    out = StepOutput(tokens=[row[:width] for row in rows], had_mask=[bool(row[width]) for row in rows],
                     m2t=[row[width + 1] for row in rows], t2t=[row[width + 2] for row in rows],
                     mbe_edits=[0] * len(rows))
    if any(r.params.stream_denoise for r in reqs):
        out.confidence = [unpack_floats(row[width + 3 :]) if r.params.stream_denoise else None
                          for row, r in zip(rows, reqs)]
    return out


def unpack_floats(bits: list[int]) -> list[float]:
    """The floats of denoise_columns' float32 bits."""
    return list(struct.unpack(f"{len(bits)}f", struct.pack(f"{len(bits)}i", *bits)))


def pack_step(result: StepResult, lens: list[int], reqs: list[Request], block_size: int,
              reports: tuple[Report, ...]) -> StepOutput:
    """The step's result as plain lists, read from the device in one transfer: per row the window's tokens,
    then had_mask, the M2T and T2T counts and the multi-block edits ([N, L + 4] int64), one column per decoder
    report; when a request of the batch streams its forwards (stream_denoise), L more columns: the confidences
    (denoise_columns)."""
    width, dev = result.tokens.shape[1], result.tokens.device
    # T2T edits in blocks before the active one (the last block of each window): multi-block edits
    before_active = torch.arange(width, device=dev)[None, :] < torch.tensor(lens, device=dev)[:, None] - block_size
    cols = [result.tokens, result.had_mask[:, None], result.m2t.sum(-1, keepdim=True),
            result.t2t.sum(-1, keepdim=True), (result.t2t & before_active).sum(-1, keepdim=True)]
    cols += [result.reports[r.name][:, None] for r in reports]
    streams = [r.params.stream_denoise for r in reqs]
    if any(streams):
        cols.append(denoise_columns(result))
    packed = torch.cat([c.long() for c in cols], dim=1).tolist()  # [N, L + 4 (+ reports) (+ L)]: the one read
    out = StepOutput(tokens=[row[:n] for row, n in zip(packed, lens)],
                     had_mask=[bool(row[width]) for row in packed], m2t=[row[width + 1] for row in packed],
                     t2t=[row[width + 2] for row in packed], mbe_edits=[row[width + 3] for row in packed])
    col = width + 4
    for r in reports:
        values = [row[col] for row in packed]
        setattr(out, r.name, [None if x < 0 else bool(x) for x in values] if r.flag else values)
        col += 1
    if any(streams):
        out.confidence = [unpack_floats(row[col : col + n]) if s else None
                          for row, n, s in zip(packed, lens, streams)]
    return out


def add_logprobs(out: StepOutput, logits: torch.Tensor, tokens: torch.Tensor, reqs: list[Request],
                 rows: list[int], lens: list[int]) -> None:
    """Log-probabilities of the window's tokens after the step, under this forward's distribution after the
    request's logit controls (no temperature or filtering; MASK excluded), and the top alternatives where asked.
    logits [n, L, V] and tokens [n, L] are those of batch rows `rows` (the requests that asked)."""
    lp = finite_logprobs(logits)  # [n, L, V]
    chosen = lp.gather(-1, tokens.clamp(min=0)[..., None]).squeeze(-1).tolist()  # [n, L] (PAD: any row)
    k = max(reqs[i].params.top_logprobs for i in rows)
    top_v, top_i = lp.topk(k, -1) if k else (None, None)
    out.logprobs = [None] * len(reqs)
    out.top_logprobs = [None] * len(reqs)
    for j, i in enumerate(rows):
        n = lens[i]
        out.logprobs[i] = chosen[j][:n]
        ki = reqs[i].params.top_logprobs
        if ki and top_v is not None:
            ids, vals = top_i[j, :n, :ki].tolist(), top_v[j, :n, :ki].tolist()
            out.top_logprobs[i] = [list(zip(a, b)) for a, b in zip(ids, vals)]
        else:
            out.top_logprobs[i] = [[] for _ in range(n)]
