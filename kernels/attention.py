"""Block-causal paged attention: the one visibility rule, its metadata, and the plain-torch implementation.

The rule: key k is visible to query q iff `block(k) <= horizon(q)`, with `block(i) = i // block_size` over
absolute positions, and `horizon(q)` the request's active block (the last block of its window) when q lies in
its open multi-block-editing window (positions >= `window_start`), else `block(q)`. Without a window it is
LLaDA2's block-causal mask, `block(k) <= block(q)`: one-pass prompt prefill, the denoising step (the active
block sees all its prefix and itself). With one, the open window is bidirectional inside itself and sees every
committed block (docs/mbe.md), while committed blocks recomputed in the same forward stay block-causal.

KV cache layout: one page per block. `k_cache[layer]`: [num_pages, block_size, Hkv, D]; a request's page
table lists its pages block by block, so the key at position p lives in page `page_table[p // block_size]`,
row `p % block_size`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int, window_start: torch.Tensor | int | None = None,
            last_block: torch.Tensor | int | None = None) -> torch.Tensor:
    """THE attention rule (module docstring). Broadcasts. `window_start`: first position of the open window
    (None: no window); `last_block`: the active block, the horizon of every query in the window."""
    q_blk = torch.div(q_pos, block_size, rounding_mode="floor")
    horizon = q_blk if window_start is None else torch.where(q_pos >= window_start, last_block, q_blk)
    return torch.div(k_pos, block_size, rounding_mode="floor") <= horizon


def block_causal_visible(q_pos: torch.Tensor, k_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """The rule without a window: `k_pos // B <= q_pos // B` (training's dual-copy mask builds on it)."""
    return visible(q_pos, k_pos, block_size)


@dataclass
class AttentionMetadata:
    """Everything a layer needs to attend for one ragged batch; built once per forward, shared by all layers.

    The batch is a flat list of T query tokens: request r contributes the tokens of its window
    (whole blocks, positions `q_start[r] .. q_start[r] + q_len[r] - 1`); its keys are positions
    `0 .. kv_len[r] - 1` with kv_len = q_start + q_len (the window's K/V are written before attending).
    Queries at positions >= window_starts[r] form the open multi-block-editing window (see `visible`);
    window_starts[r] = kv_len[r] means none.
    """

    block_size: int
    positions: torch.Tensor  # [T] absolute position of each query token
    slot_mapping: torch.Tensor  # [T] flat cache row (page * block_size + offset) where each token's K/V goes
    page_tables: torch.Tensor  # [N, max_pages] int64, padded with page 0
    kv_lens: torch.Tensor  # [N]
    q_starts: torch.Tensor  # [N] first query position of each request
    q_lens: torch.Tensor  # [N]
    window_starts: torch.Tensor  # [N] first position of the open window (kv_len: no window)
    cu_q: torch.Tensor  # [N + 1] offsets of each request's tokens in the flat batch
    max_q: int
    max_kv: int
    # torch-backend gather plan (derived once per forward)
    q_index: torch.Tensor | None = None  # [N, max_q] flat token index (padded with 0)
    q_valid: torch.Tensor | None = None  # [N, max_q]
    kv_slots: torch.Tensor | None = None  # [N, max_kv] flat cache row of each key (padded with 0)
    mask: torch.Tensor | None = None  # [N, 1, max_q, max_kv] bool

    @classmethod
    def build(
        cls,
        q_starts: list[int],
        q_lens: list[int],
        page_tables: list[list[int]],
        block_size: int,
        device: torch.device | str,
        with_torch_plan: bool = True,
        window_starts: list[int] | None = None,
    ) -> "AttentionMetadata":
        n = len(q_starts)
        kv_lens = [s + l for s, l in zip(q_starts, q_lens)]
        if window_starts is None:
            window_starts = kv_lens
        max_pages = max(len(p) for p in page_tables)
        for r in range(n):
            if len(page_tables[r]) * block_size < kv_lens[r]:
                raise ValueError(f"request {r}: {len(page_tables[r])} pages cannot hold {kv_lens[r]} tokens")
        pt = torch.zeros(n, max_pages, dtype=torch.long)
        for r, pages in enumerate(page_tables):
            pt[r, : len(pages)] = torch.tensor(pages, dtype=torch.long)
        cu = [0]
        for l in q_lens:
            cu.append(cu[-1] + l)
        positions = torch.cat([torch.arange(s, s + l) for s, l in zip(q_starts, q_lens)])
        owner = torch.repeat_interleave(torch.arange(n), torch.tensor(q_lens))
        slot_mapping = pt[owner, positions // block_size] * block_size + positions % block_size
        meta = cls(
            block_size=block_size,
            positions=positions.to(device),
            slot_mapping=slot_mapping.to(device),
            page_tables=pt.to(device),
            kv_lens=torch.tensor(kv_lens, device=device),
            q_starts=torch.tensor(q_starts, device=device),
            q_lens=torch.tensor(q_lens, device=device),
            window_starts=torch.tensor(window_starts, device=device),
            cu_q=torch.tensor(cu, device=device),
            max_q=max(q_lens),
            max_kv=max(kv_lens),
        )
        if with_torch_plan:
            meta._build_torch_plan(pt, torch.tensor(q_starts), torch.tensor(q_lens), torch.tensor(cu[:-1]), device)
        return meta

    def _build_torch_plan(self, pt, q_starts, q_lens, q_offsets, device) -> None:
        b = self.block_size
        ar_q = torch.arange(self.max_q)
        q_valid = ar_q[None, :] < q_lens[:, None]  # [N, max_q]
        q_index = torch.where(q_valid, q_offsets[:, None] + ar_q[None, :], 0)
        # Padded query rows take position 0 so that they see key 0 and never produce NaN rows.
        q_pos = torch.where(q_valid, q_starts[:, None] + ar_q[None, :], 0)
        k_pos = torch.arange(self.max_kv)  # keys are positions 0..kv_len-1 in page-table order
        kv_lens = self.kv_lens.cpu()
        kv_valid = k_pos[None, :] < kv_lens[:, None]  # [N, max_kv]
        page_of_key = pt[:, torch.clamp(k_pos // b, max=pt.shape[1] - 1)]  # [N, max_kv]
        kv_slots = torch.where(kv_valid, page_of_key * b + k_pos % b, 0)
        last_block = torch.div(kv_lens - 1, b, rounding_mode="floor")[:, None, None]  # [N, 1, 1]
        seen = visible(q_pos[:, :, None], k_pos[None, None, :], b, self.window_starts.cpu()[:, None, None],
                       last_block) & kv_valid[:, None, :]
        self.q_index = q_index.to(device)
        self.q_valid = q_valid.to(device)
        self.kv_slots = kv_slots.to(device)
        self.mask = seen[:, None].to(device)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter the new keys/values ([T, Hkv, D]) into their cache rows (caches: [P, B, Hkv, D])."""
    k_cache.view(-1, *k_cache.shape[2:])[slots] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slots] = v.to(v_cache.dtype)


def paged_attention_torch(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor,  # [T, Hkv, D] new keys of the window
    v: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [P, B, Hkv, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:  # [T, Hq, D]
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    hkv, d = k.shape[1], k.shape[2]
    k_rows = k_cache.view(-1, hkv, d)[meta.kv_slots]  # [N, max_kv, Hkv, D]
    v_rows = v_cache.view(-1, hkv, d)[meta.kv_slots]
    q_pad = q[meta.q_index]  # [N, max_q, Hq, D]
    out = F.scaled_dot_product_attention(
        q_pad.transpose(1, 2),
        k_rows.transpose(1, 2).to(q.dtype),
        v_rows.transpose(1, 2).to(q.dtype),
        attn_mask=meta.mask,
        scale=1.0 / d**0.5,
        enable_gqa=True,
    )  # [N, Hq, max_q, D]
    out = out.transpose(1, 2)  # [N, max_q, Hq, D]
    flat = torch.empty_like(q)
    flat[meta.q_index[meta.q_valid]] = out[meta.q_valid]
    return flat
