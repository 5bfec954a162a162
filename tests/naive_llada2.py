"""A deliberately naive, independent reference of LLaDA2-MoE and its official draft-and-edit decoding.

This file is what the engine is tested against. It shares no code with `redraft` (only torch,
safetensors and json) and favours "obviously right" over fast: every forward recomputes the whole
sequence, there is no cache, no batching, no fused op. Spec: the LLaDA2.1 tech report and model cards (the
forward pass and the official generate() loop; engine/decoding/decoding.py's docstring restates the loop); for LLaDA2.2's
block routing (`expert_capacity` in config.json), the LLaDA2.2 page's "Block routing".

Decisions taken where the facts leave room (the lead's choices, keep them in step with the engine):
- blocks run from P // 32 to (P + max_new_tokens - 1) // 32 inclusive;
- the prompt's partial last block is shared with the first generated tokens, and prompt positions are
  never edited (neither by T2T nor counted as masked);
- after each block, stop when the generated positions [P, end of block) hold no MASK and hold an EOS;
- output = x[P : P + max_new_tokens], cut right after the first EOS if there is one;
- the MASK id is never proposed (its logit is dropped before argmax/softmax): a model that proposed it
  would leave its position masked and could stall a block forever.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load_file

BLOCK = 32


# ----------------------------------------------------------------------------------------------
# small pure functions (tested on their own in test_naive_reference.py)
# ----------------------------------------------------------------------------------------------

def block_causal_mask(length: int, block: int = BLOCK) -> torch.Tensor:
    """mask[q, k] is True iff key k is visible to query q, i.e. k // block <= q // block."""
    pos = torch.arange(length)
    blk = pos // block  # [L]
    return blk[None, :] <= blk[:, None]  # [Lq, Lk]


def mbe_mask(length: int, window_start: int, active: int, block: int = BLOCK) -> torch.Tensor:
    """The multi-block-editing mask over positions [0, length) (redraft's definition, docs/mbe.md): blocks
    before `window_start` are committed and block-causal; the open window [window_start, active] is
    bidirectional inside itself and sees every committed block. mask[q, k] True = visible."""
    blk = torch.arange(length) // block  # [L]
    in_window = (blk >= window_start) & (blk <= active)  # [L]
    causal = blk[None, :] <= blk[:, None]  # [Lq, Lk]
    window = in_window[:, None] & (blk[None, :] <= active)  # a window query sees committed + window keys
    return causal | window


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim; the variance is taken in fp32 at least (float64 stays float64)."""
    in_dtype = x.dtype
    work = torch.float64 if in_dtype == torch.float64 else torch.float32
    xf = x.to(work)
    var = xf.pow(2).mean(dim=-1, keepdim=True)
    normed = (xf * torch.rsqrt(var + eps)).to(in_dtype)
    return weight * normed


def rotary_cos_sin(length: int, rotary_dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """NeoX cos/sin tables for absolute positions 0..length-1, computed in fp32 at least."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=work) / rotary_dim))  # [rd/2]
    pos = torch.arange(length, dtype=work)  # [L]
    freqs = pos[:, None] * inv_freq[None, :]  # [L, rd/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [L, rd]: the same angle for both halves (rotate-half)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of every head NeoX style; the rest pass through unchanged.

    x: [L, heads, D]; cos, sin: [L, rd].
    """
    rd = cos.shape[-1]
    x_rot, x_pass = x[..., :rd], x[..., rd:]  # [L, h, rd], [L, h, D - rd]
    half = rd // 2
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated_half = torch.cat([-x2, x1], dim=-1)  # rotate-half within the rotary dims only
    c, s = cos[:, None, :], sin[:, None, :]  # [L, 1, rd], broadcast over heads
    return torch.cat([x_rot * c + rotated_half * s, x_pass], dim=-1)


def route(
    scores: torch.Tensor,
    expert_bias: torch.Tensor | None,
    *,
    n_group: int,
    topk_group: int,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2 router selection for a batch of tokens.

    scores: [T, E] unbiased sigmoid scores s. Returns (idx [T, top_k], weights [T, top_k]).
    The biased b = s + bias only decides WHICH experts; the weights come from the unbiased s.
    """
    t, e = scores.shape
    biased = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)  # [T, E]
    per_group = e // n_group
    grouped = biased.view(t, n_group, per_group)  # [T, G, E/G]
    # group score = sum of the two best biased scores in the group
    group_score = grouped.topk(min(2, per_group), dim=-1).values.sum(dim=-1)  # [T, G]
    kept_groups = group_score.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_ok = torch.zeros(t, n_group, dtype=torch.bool)
    group_ok.scatter_(1, kept_groups, True)
    expert_ok = group_ok[:, :, None].expand(t, n_group, per_group).reshape(t, e)  # [T, E]
    # -inf, not 0: an expert outside the kept groups can never be chosen, whatever its sign
    candidates = biased.masked_fill(~expert_ok, float("-inf"))
    idx = candidates.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, idx)  # [T, k], unbiased
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights * routed_scaling_factor


def block_route(
    scores: torch.Tensor,
    expert_bias: torch.Tensor | None,
    *,
    block_size: int,
    capacity: int,
    top_k: int,
    routed_scaling_factor: float,
    norm_topk_prob: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaDA2.2 block routing of ONE sequence whose tokens sit at positions 0..T-1 (the LLaDA2.2 page, "Block
    routing"): the tokens at positions [k*R, (k+1)*R) form routing block k; the block admits the `capacity` experts
    whose best biased score over its tokens is largest, and each token picks its top_k biased scores among those.
    Ties go to the lower expert id. Plain Python over blocks, tokens and experts, on purpose.

    scores: [T, E] unbiased sigmoid scores s. Returns (idx [T, top_k], weights [T, top_k])."""
    t_len, n_exp = scores.shape
    biased = scores if expert_bias is None else scores + expert_bias.to(scores.dtype)  # [T, E]
    rows = biased.tolist()
    idx = torch.zeros(t_len, top_k, dtype=torch.long)
    for start in range(0, t_len, block_size):
        block = rows[start : start + block_size]
        best = [max(row[e] for row in block) for e in range(n_exp)]
        admitted = sorted(range(n_exp), key=lambda e: (-best[e], e))[:capacity]
        for j, row in enumerate(block):
            chosen = sorted(admitted, key=lambda e: (-row[e], e))[:top_k]
            idx[start + j] = torch.tensor(chosen)
    weights = scores.gather(1, idx)  # [T, k], unbiased
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return idx, weights * routed_scaling_factor


# ----------------------------------------------------------------------------------------------
# the model
# ----------------------------------------------------------------------------------------------

def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint, single file or sharded (model.safetensors.index.json)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors in {model_dir}")
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(model_dir / name)))
    return tensors


class NaiveLLaDA2:
    """LLaDA2-MoE forward with a full recompute and the block-causal mask; official tensor names."""

    def __init__(self, model_dir: str | Path, dtype: torch.dtype = torch.float64, block: int = BLOCK) -> None:
        model_dir = Path(model_dir)
        self.cfg: dict[str, Any] = json.loads((model_dir / "config.json").read_text())
        self.dtype = dtype
        self.block = block
        # router and expert_bias: fp32 at least, float64 when the whole model is float64
        self.router_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        raw = _read_safetensors(model_dir)
        self.w: dict[str, torch.Tensor] = {}
        for name, t in raw.items():
            if name.endswith("mlp.gate.expert_bias") or name.endswith("mlp.gate.weight"):
                self.w[name] = t.to(self.router_dtype)
            else:
                self.w[name] = t.to(dtype)

        c = self.cfg
        self.n_layers: int = c["num_hidden_layers"]
        self.n_heads: int = c["num_attention_heads"]
        self.n_kv: int = c.get("num_key_value_heads", self.n_heads)
        self.head_dim: int = c.get("head_dim") or c["hidden_size"] // self.n_heads
        self.rotary_dim: int = int(self.head_dim * c.get("partial_rotary_factor", 0.5))
        self.theta: float = float(c.get("rope_theta", 600000.0))
        self.eps: float = float(c.get("rms_norm_eps", 1e-6))
        self.first_dense: int = c.get("first_k_dense_replace", 1)
        self.use_qk_norm: bool = c.get("use_qk_norm", True)
        self.n_group: int = c.get("n_group", 1) or 1
        self.topk_group: int = c.get("topk_group", 1) or 1
        self.top_k: int = c["num_experts_per_tok"]
        self.scale_routed: float = float(c.get("routed_scaling_factor", 1.0))
        self.norm_topk_prob: bool = c.get("norm_topk_prob", True)
        # LLaDA2.2: experts admitted per routing block of `route_block` positions (0 or absent: grouped routing)
        self.expert_capacity: int = c.get("expert_capacity", 0) or 0
        self.route_block: int = c.get("block_size", BLOCK) or BLOCK
        if "lm_head.weight" not in self.w and c.get("tie_word_embeddings", False):
            self.w["lm_head.weight"] = self.w["model.word_embeddings.weight"]

    # -- pieces ---------------------------------------------------------------------------------
    def _linear(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """x @ W^T (+ b when the checkpoint has a bias, e.g. use_qkv_bias)."""
        y = x @ self.w[prefix + ".weight"].T
        bias = self.w.get(prefix + ".bias")
        return y if bias is None else y + bias

    def _swiglu(self, x: torch.Tensor, prefix: str) -> torch.Tensor:
        """down(silu(gate(x)) * up(x)); x: [T, H] -> [T, H]."""
        gate = self._linear(x, prefix + ".gate_proj")
        up = self._linear(x, prefix + ".up_proj")
        return self._linear(torch.nn.functional.silu(gate) * up, prefix + ".down_proj")

    def _attention(self, i: int, x: torch.Tensor, mask: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.attention"
        L = x.shape[0]
        hq, hkv, d = self.n_heads, self.n_kv, self.head_dim
        qkv = self._linear(x, p + ".query_key_value")  # [L, (hq + 2 hkv) * d], packed Q | K | V
        q = qkv[:, : hq * d].reshape(L, hq, d)
        k = qkv[:, hq * d : (hq + hkv) * d].reshape(L, hkv, d)
        v = qkv[:, (hq + hkv) * d :].reshape(L, hkv, d)
        if self.use_qk_norm:  # per-head RMSNorm, BEFORE rotary
            q = rms_norm(q, self.w[p + ".query_layernorm.weight"], self.eps)
            k = rms_norm(k, self.w[p + ".key_layernorm.weight"], self.eps)
        q = apply_partial_rotary(q, cos, sin)
        k = apply_partial_rotary(k, cos, sin)
        # GQA: query head h reads kv head h // (hq // hkv)
        rep = hq // hkv
        k = k.repeat_interleave(rep, dim=1)  # [L, hq, d]
        v = v.repeat_interleave(rep, dim=1)  # [L, hq, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)  # [hq, Lq, Lk]
        soft_dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        scores = scores.to(soft_dtype).masked_fill(~mask[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(self.dtype)  # [hq, Lq, Lk]
        out = torch.einsum("hqk,khd->qhd", probs, v).reshape(L, hq * d)  # [L, hq * d]
        return self._linear(out, p + ".dense")

    def _moe(self, i: int, x: torch.Tensor) -> torch.Tensor:
        p = f"model.layers.{i}.mlp"
        T = x.shape[0]
        # router in fp32 (float64 when the model is float64)
        logits = x.to(self.router_dtype) @ self.w[p + ".gate.weight"].T  # [T, E]
        scores = torch.sigmoid(logits)
        if self.expert_capacity > 0:  # LLaDA2.2: the sequence's tokens sit at positions 0..T-1
            idx, weights = block_route(
                scores,
                self.w.get(p + ".gate.expert_bias"),
                block_size=self.route_block,
                capacity=self.expert_capacity,
                top_k=self.top_k,
                routed_scaling_factor=self.scale_routed,
                norm_topk_prob=self.norm_topk_prob,
            )
        else:
            idx, weights = route(
                scores,
                self.w.get(p + ".gate.expert_bias"),
                n_group=self.n_group,
                topk_group=self.topk_group,
                top_k=self.top_k,
                routed_scaling_factor=self.scale_routed,
                norm_topk_prob=self.norm_topk_prob,
            )  # [T, k], [T, k]
        # plain loop over experts: routed[t, j] = expert idx[t, j] applied to token t
        routed = torch.zeros(T, self.top_k, x.shape[1], dtype=self.router_dtype)  # [T, k, H]
        n_experts = self.w[p + ".gate.weight"].shape[0]
        for e in range(n_experts):
            tok, slot = (idx == e).nonzero(as_tuple=True)  # the (token, slot) pairs that chose e
            if tok.numel():
                routed[tok, slot] = self._swiglu(x[tok], f"{p}.experts.{e}").to(self.router_dtype)
        # weighted sum over the k chosen experts, then the shared expert (unweighted)
        mixed = (routed * weights[:, :, None]).sum(dim=1).to(x.dtype)  # [T, H]
        return mixed + self._swiglu(x, p + ".shared_experts")

    # -- the whole forward ----------------------------------------------------------------------
    @torch.no_grad()
    def forward_logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """ids: LongTensor [L] -> logits [L, V] (fp32, or float64 for a float64 model). mask: [L, L] bool
        (True = visible), block-causal when not given."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        L = ids.shape[0]
        h = self.w["model.word_embeddings.weight"][ids]  # [L, H]
        if mask is None:
            mask = block_causal_mask(L, self.block)  # [L, L]
        cos, sin = rotary_cos_sin(L, self.rotary_dim, self.theta, self.dtype)  # [L, rd] each
        for i in range(self.n_layers):
            pre = f"model.layers.{i}"
            h = h + self._attention(i, rms_norm(h, self.w[pre + ".input_layernorm.weight"], self.eps), mask, cos, sin)
            normed = rms_norm(h, self.w[pre + ".post_attention_layernorm.weight"], self.eps)
            if i < self.first_dense:
                h = h + self._swiglu(normed, pre + ".mlp")
            else:
                h = h + self._moe(i, normed)
        h = rms_norm(h, self.w["model.norm.weight"], self.eps)
        logits = h @ self.w["lm_head.weight"].T  # [L, V]
        return logits.to(torch.float64 if self.dtype == torch.float64 else torch.float32)


# ----------------------------------------------------------------------------------------------
# the official draft-and-edit loop (batch 1, temperature 0)
# ----------------------------------------------------------------------------------------------

class LogitsModel(Protocol):
    def forward_logits(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor: ...


def _layout(input_ids: list[int], max_new_tokens: int, mask_id: int, block: int
            ) -> tuple[int, int, int, torch.Tensor, torch.Tensor]:
    """(P, first block, last block, x: the prompt then MASK through the last block [total], is_prompt [total])."""
    P = len(input_ids)
    first_block = P // block
    last_block = (P + max_new_tokens - 1) // block
    total = (last_block + 1) * block
    x = torch.full((total,), mask_id, dtype=torch.long)  # [total]
    x[:P] = torch.tensor(input_ids, dtype=torch.long)
    is_prompt = torch.arange(total) < P  # [total]
    return P, first_block, last_block, x, is_prompt


def _draft_and_edit(logits: torch.Tensor, old: torch.Tensor, masked: torch.Tensor, editable: torch.Tensor,
                    threshold: float, edit_threshold: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One forward's decision on logits [n, V] (MASK already -inf): (proposals v, M2T, T2T), each [n]."""
    v = logits.argmax(dim=-1)  # [n]
    p = torch.softmax(logits, dim=-1).gather(1, v[:, None])[:, 0]  # [n]
    m2t = masked & (p > threshold)
    if masked.any() and int(m2t.sum()) < 1:
        # fallback: the single masked position with the highest confidence
        best = torch.where(masked, p, torch.full_like(p, -1.0)).argmax()
        m2t = torch.zeros_like(masked)
        m2t[best] = True
    t2t = ~masked & editable & (v != old) & (p > edit_threshold)
    return v, m2t, t2t


def _output(x: torch.Tensor, P: int, max_new_tokens: int, eos_id: int) -> list[int]:
    """The output ids: max_new_tokens after the prompt, cut after the first EOS."""
    out = x[P : P + max_new_tokens].tolist()
    if eos_id in out:
        out = out[: out.index(eos_id) + 1]
    return out


def naive_generate(
    model: LogitsModel,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    threshold: float,
    edit_threshold: float,
    max_post_steps: int,
    mask_id: int,
    eos_id: int,
    block: int = BLOCK,
    controls: Any = None,
) -> tuple[list[int], int]:
    """Returns (output_ids, steps); steps counts forwards. Written line for line after facts §3. `controls`:
    fn(logits [positions, V], x, first position, end of the committed output) -> logits (NaiveControls)."""
    P, first_block, last_block, x, is_prompt = _layout(input_ids, max_new_tokens, mask_id, block)
    steps = 0

    for b in range(first_block, last_block + 1):
        lo, hi = b * block, (b + 1) * block
        prompt_here = is_prompt[lo:hi]  # [block]
        post = 0
        while True:
            old = x[lo:hi].clone()  # [block]
            masked = (old == mask_id) & ~prompt_here
            if not masked.any():
                post += 1
            if post > max_post_steps:  # checked before the forward
                break
            logits = model.forward_logits(x[:hi])[lo:hi].clone()  # [block, V], everything up to the block's end
            logits[:, mask_id] = float("-inf")  # MASK is never a proposal
            if controls is not None:
                logits = controls(logits, x, lo, max(P, lo))
            steps += 1
            v, m2t, t2t = _draft_and_edit(logits, old, masked, ~prompt_here, threshold, edit_threshold)
            update = m2t | t2t
            x[lo:hi] = torch.where(update, v, old)
            if not masked.any() and not t2t.any():
                break
            if masked.any() and torch.equal(x[lo:hi], old):
                # only possible when the model proposes the MASK id itself: the next forward would see
                # the same input and do the same, forever (the official loop has no guard against this)
                raise RuntimeError(f"no progress in block {b}: the model keeps proposing the MASK id")
        generated = x[P:hi]
        if not (generated == mask_id).any() and (generated == eos_id).any():
            break

    return _output(x, P, max_new_tokens, eos_id), steps


# ----------------------------------------------------------------------------------------------
# multi-block editing (redraft's definition, docs/mbe.md): a window of W open blocks
# ----------------------------------------------------------------------------------------------

def naive_mbe_generate(
    model: LogitsModel,
    input_ids: list[int],
    *,
    max_new_tokens: int,
    threshold: float,
    edit_threshold: float,
    max_post_steps: int,
    window: int,
    mask_id: int,
    eos_id: int,
    block: int = BLOCK,
    controls: Any = None,
) -> tuple[list[int], int]:
    """Returns (output_ids, steps). Written from the definition, independently of the engine: every forward
    recomputes the whole sequence up to the active block under `mbe_mask`; M2T fills masks of the active
    block, T2T edits any non-prompt token of the open window. window=1 is naive_generate exactly."""
    P, first_block, last_block, x, is_prompt = _layout(input_ids, max_new_tokens, mask_id, block)
    steps = 0

    for b in range(first_block, last_block + 1):
        s = max(first_block, b - window + 1)  # the open window is blocks [s, b]
        lo, hi = s * block, (b + 1) * block
        editable = ~is_prompt[lo:hi]  # [window tokens]
        attend = mbe_mask(hi, s, b, block)  # [hi, hi]
        post = 0
        while True:
            old = x[lo:hi].clone()
            masked = (old == mask_id) & editable  # only the active block can hold masks
            if not masked.any():
                post += 1
            if post > max_post_steps:  # checked before the forward
                break
            logits = model.forward_logits(x[:hi], attend)[lo:hi].clone()  # [window tokens, V]
            logits[:, mask_id] = float("-inf")
            if controls is not None:
                logits = controls(logits, x, lo, max(P, lo))  # committed output: [P, window start)
            steps += 1
            v, m2t, t2t = _draft_and_edit(logits, old, masked, editable, threshold, edit_threshold)
            x[lo:hi] = torch.where(m2t | t2t, v, old)
            if not masked.any() and not t2t.any():
                break
        generated = x[P:hi]
        if not (generated == mask_id).any() and (generated == eos_id).any():
            break

    return _output(x, P, max_new_tokens, eos_id), steps


class NaiveControls:
    """The logit controls written from their definitions (docs/openai.md), one position at a time, for the
    naive loops: repetition, frequency and presence penalties over the committed output (and the prompt for
    repetition), the stutter penalty on the token the previous position holds now, logit_bias, min_tokens."""

    def __init__(self, prompt_len: int, mask_id: int, eos_id: int, *, stutter: float = 0.0, frequency: float = 0.0,
                 presence: float = 0.0, repetition: float = 1.0, logit_bias: dict[int, float] | None = None,
                 min_tokens: int = 0, stop_token_ids: tuple[int, ...] = ()) -> None:
        self.P, self.mask_id, self.eos_id = prompt_len, mask_id, eos_id
        self.stutter, self.frequency, self.presence, self.repetition = stutter, frequency, presence, repetition
        self.logit_bias = dict(logit_bias or {})
        self.min_tokens, self.stop_token_ids = min_tokens, stop_token_ids

    def __call__(self, logits: torch.Tensor, x: torch.Tensor, first: int, committed_end: int) -> torch.Tensor:
        out = logits.clone()
        output = x[self.P : committed_end].tolist()
        counts: dict[int, int] = {}
        for t in output:
            counts[t] = counts.get(t, 0) + 1
        seen = set(output) | set(x[: self.P].tolist())
        for j in range(out.shape[0]):
            pos = first + j
            row = out[j]
            if self.repetition != 1.0:
                for t in seen:
                    row[t] = row[t] / self.repetition if row[t] > 0 else row[t] * self.repetition
            for t, c in counts.items():
                row[t] = row[t] - self.frequency * c - self.presence
            if self.stutter and pos >= 1 and int(x[pos - 1]) != self.mask_id:
                row[int(x[pos - 1])] -= self.stutter
            for t, b in self.logit_bias.items():
                row[t] += b
            if pos - self.P < self.min_tokens:
                for t in {self.eos_id, *self.stop_token_ids}:
                    row[t] = float("-inf")
        return out
