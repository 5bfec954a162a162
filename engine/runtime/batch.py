"""Batch building and planning: what one forward computes, fixed before it starts.

`build_forward_batch` turns the scheduler's work items into the forward's inputs; `plan_forward` adds what the
forward must hand the decision: which items decode, their windows, which rows decide from vocabulary chunks (a
request that needs nothing but each position's argmax and its probability), what those rows' argmax leaves out,
whether a CUDA graph runs the batch, and whether that graph also decides (`ForwardPlan.in_graph`). The forward (engine/runtime/forward.py) reads the plan and nothing else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import torch

from redraft.engine.decoding.decoder import Decoder
from redraft.scheduler.request import Request
from redraft.scheduler.scheduler import WorkItem


@dataclass
class ForwardBatch:
    """The inputs of one forward, on the host: what both the eager path and the CUDA-graph path consume."""

    ids: list[int]  # [T] flat query tokens
    q_starts: list[int]  # [N] first query position of each item
    q_lens: list[int]  # [N]
    page_tables: list[list[int]]  # [N][pages through the item's last block]
    window_starts: list[int]  # [N] first position of the open MBE window (q_start + q_len: none)

    @cached_property
    def input_ids(self) -> torch.Tensor:  # [T] int64, made on first use (the in-graph decision never asks)
        return torch.tensor(self.ids, dtype=torch.long)


def build_forward_batch(items: list[WorkItem], block_size: int) -> ForwardBatch:
    """Every item's query: blocks [first, last] of its tokens, with its page table through `last`; a decoding
    item's open window [req.state.window_start, last] is bidirectional (prefill items are block-causal
    throughout)."""
    q_starts, q_lens, tables, windows, ids = [], [], [], [], []
    for it in items:
        start, end = it.first * block_size, (it.last + 1) * block_size
        q_starts.append(start)
        q_lens.append(end - start)
        tables.append(it.req.book.pages[: it.last + 1])
        windows.append(it.req.state.window_start * block_size if it.decodes else end)
        ids.extend(it.req.state.tokens[start:end])
    return ForwardBatch(ids, q_starts, q_lens, tables, windows)


@dataclass
class ForwardPlan:
    """One forward, fixed before it starts: `ModelRunner.forward` reads this and nothing else (it may run on the
    overlap worker, engine/runtime/overlap.py, while the host changes the requests)."""

    batch: ForwardBatch
    decoding: list[int]  # which items decode
    lens: list[int]  # [n] window positions of each decoding item
    quick: list[int]  # of the decoding rows, those decided from vocabulary chunks (`needs_distribution` false)
    graphs: bool  # replayed from a CUDA graph (every row then gets full logits, unless `in_graph`)
    excluded: list[tuple[int, ...]] = field(default_factory=list)  # per quick row: ids its argmax leaves out
    #   besides MASK (its decoder's `excluded`)
    keep_hidden: bool = False  # keep the quick rows' hidden states: a decoder reads vocabulary rows of them
    in_graph: bool = False  # the CUDA graph decides too (every row quick, one `Decoder.in_graph` rule): the forward
    #   and the decision are one step (cuda_graphs.DecodeGraphs.decide), no logits leave the graph


def needs_distribution(r: Request) -> bool:
    """Whether a request's step reads more of the distribution than each position's argmax and its probability:
    sampling, logprobs, a grammar's candidates, logit controls (penalties, logit_bias, min_tokens)."""
    p = r.params
    return p.temperature > 0 or p.wants_logprobs or p.has_logit_controls or r.state.constraint is not None


def plan_forward(items: list[WorkItem], batch: ForwardBatch, decoders: Mapping[str, Decoder], graphs: bool,
                 chunked: bool, block_size: int, graph_decides: bool = False) -> ForwardPlan:
    """The plan of `items` (module docstring); `chunked`: greedy rows may decide from vocabulary chunks;
    `graph_decides`: the graphs can end in an `in_graph` decoder's step (cuda_graphs.DecodeGraphs)."""
    decoding = [i for i, it in enumerate(items) if it.decodes]
    reqs = [items[i].req for i in decoding]
    argmax_only = [chunked and not needs_distribution(r) for r in reqs]
    in_graph = (graphs and graph_decides and len(decoding) == len(items) and all(argmax_only)
                and len({r.params.decoder for r in reqs}) == 1 and decoders[reqs[0].params.decoder].in_graph)
    quick = [j for j, ok in enumerate(argmax_only) if ok and (in_graph or not graphs)]
    rules = [decoders[reqs[j].params.decoder] for j in quick]
    return ForwardPlan(batch, decoding, [r.window_size * block_size for r in reqs], quick, graphs,
                       [d.excluded for d in rules], any(d.reads_vocab_rows for d in rules), in_graph)
