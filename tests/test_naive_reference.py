"""Checks of the naive reference itself (tests/naive_llada2.py) against hand-computable facts.

The decoding checks drive `naive_generate` with scripted fake models whose logits are chosen by hand,
so every expected step count and token can be worked out on paper. The model checks use a small
synthetic checkpoint written here with safetensors directly (independent of redraft.engine.model.tiny).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import save_file

from naive_llada2 import (
    NaiveLLaDA2,
    apply_partial_rotary,
    block_causal_mask,
    naive_generate,
    rms_norm,
    rotary_cos_sin,
    route,
)


# ----------------------------------------------------------------------------------------------
# scripted fake models for the decoding loop
# ----------------------------------------------------------------------------------------------

V = 10  # fake vocabulary: 0..7 ordinary tokens, 8 = EOS, 9 = MASK
EOS, MASK = 8, 9
NEG = float("-inf")


def peaked(token: int, p: float) -> torch.Tensor:
    """Logits over V whose argmax is `token` with softmax probability exactly-ish `p` (0 < p < 1)."""
    # token gets log(p); the other V-1 tokens share (1 - p) equally
    out = torch.full((V,), math.log((1 - p) / (V - 1)), dtype=torch.float64)
    out[token] = math.log(p)
    return out


class Scripted:
    """A fake model: logits_fn(ids, call_index) -> [L, V]; records every call's input."""

    def __init__(self, logits_fn: Callable[[torch.Tensor, int], torch.Tensor]) -> None:
        self.fn = logits_fn
        self.calls: list[torch.Tensor] = []

    def forward_logits(self, ids: torch.Tensor) -> torch.Tensor:
        self.calls.append(ids.clone())
        return self.fn(ids, len(self.calls) - 1)


def gen(model: Scripted, prompt: list[int], **kw) -> tuple[list[int], int]:
    args = dict(max_new_tokens=32, threshold=0.5, edit_threshold=0.0, max_post_steps=16, mask_id=MASK, eos_id=EOS)
    args.update(kw)
    return naive_generate(model, prompt, **args)


def test_mask_rule_matches_definition() -> None:
    m = block_causal_mask(70)
    for q in range(70):
        for k in range(70):
            assert bool(m[q, k]) == (k // 32 <= q // 32)
    # hand-picked corners: inside a block everything sees everything, incl. later positions
    assert m[0, 31] and m[31, 0] and not m[31, 32] and m[32, 31] and m[69, 0] and not m[10, 64]


def test_confident_model_fills_a_block_in_one_forward_then_one_post_step() -> None:
    # every position: token 3 with p = 0.9 > 0.5; one forward fills all 32, then one mask-free forward
    # sees nothing to change (argmax equals the token) and ends the block
    model = Scripted(lambda ids, n: torch.stack([peaked(3, 0.9)] * len(ids)))
    out, steps = gen(model, [1, 2], max_new_tokens=30)
    assert out == [3] * 30
    assert steps == 2
    assert [len(c) for c in model.calls] == [32, 32]


def test_max_post_steps_zero_does_no_mask_free_forward() -> None:
    model = Scripted(lambda ids, n: torch.stack([peaked(3, 0.9)] * len(ids)))
    out, steps = gen(model, [1, 2], max_new_tokens=62, max_post_steps=0)
    assert out == [3] * 62
    assert steps == 2  # one unmasking forward per block, blocks 0 and 1, nothing else
    assert [len(c) for c in model.calls] == [32, 64]  # each forward covers everything up to the block's end


def test_m2t_fallback_picks_the_single_most_confident_masked_position() -> None:
    # nothing clears the threshold; confidence rises with the position, so the fallback fills the
    # last masked position each step, right to left
    def fn(ids: torch.Tensor, n: int) -> torch.Tensor:
        return torch.stack([peaked(i % 8, 0.2 + 0.01 * (i % 32)) for i in range(len(ids))])

    model = Scripted(fn)
    out, steps = gen(model, [5] * 4, max_new_tokens=28, threshold=0.9, max_post_steps=3)
    assert out == [i % 8 for i in range(4, 32)]
    # 28 masked positions -> 28 unmasking forwards (one token each) + 1 post forward that changes nothing
    assert steps == 29
    for step in range(1, 28):
        filled = (model.calls[step][4:] != MASK).nonzero()[:, 0] + 4
        assert filled.tolist() == list(range(32 - step, 32))


def test_threshold_is_strict() -> None:
    # tokens 2 and 3 tie at logit 0 (others -inf): argmax -> 2 (first), p = 0.5 exactly
    def fn(ids: torch.Tensor, n: int) -> torch.Tensor:
        row = torch.full((V,), NEG, dtype=torch.float64)
        row[2] = row[3] = 0.0
        return row.expand(len(ids), V).clone()

    _, steps_equal = gen(Scripted(fn), [1], max_new_tokens=31, threshold=0.5, max_post_steps=1)
    _, steps_below = gen(Scripted(fn), [1], max_new_tokens=31, threshold=0.4999, max_post_steps=1)
    assert steps_equal == 31 + 1  # p == threshold is not enough: one position per forward (fallback)
    assert steps_below == 1 + 1  # p > threshold: all 31 in one forward


def test_edit_threshold_is_strict_and_t2t_edits_while_masks_remain() -> None:
    # step 0: masked positions get token 1 at p = 0.6 except the last, p = 0.3 (left masked);
    # step 1: the model now wants token 4 everywhere at p = 0.5 exactly (4 and 5 tie, argmax -> 4)
    def fn(ids: torch.Tensor, n: int) -> torch.Tensor:
        if n == 0:
            rows = [peaked(1, 0.6) for _ in range(len(ids))]
            rows[-1] = peaked(1, 0.3)
            return torch.stack(rows)
        row = torch.full((V,), NEG, dtype=torch.float64)
        row[4] = row[5] = 0.0
        return row.expand(len(ids), V).clone()

    # edit_threshold 0.5: p = 0.5 is not > 0.5, no edit happens; the last mask is filled by fallback
    m = Scripted(fn)
    out, _ = gen(m, [7], max_new_tokens=31, threshold=0.55, edit_threshold=0.5, max_post_steps=0)
    assert out == [1] * 30 + [4]
    # edit_threshold 0.49: the same forward that fills the last mask also rewrites the other 30
    m = Scripted(fn)
    out, steps = gen(m, [7], max_new_tokens=31, threshold=0.55, edit_threshold=0.49, max_post_steps=0)
    assert out == [4] * 31
    assert steps == 2


def test_t2t_never_touches_prompt_positions_nor_earlier_blocks() -> None:
    # the model always wants token 6 with certainty; prompt positions (incl. the shared partial block)
    # and the finished first block must stay as they are
    model = Scripted(lambda ids, n: torch.stack([peaked(6, 0.99)] * len(ids)))
    prompt = [1, 2, 3] * 7  # 21 tokens, ends inside block 0
    out, steps = gen(model, prompt, max_new_tokens=40)
    assert out == [6] * 40
    for ids in model.calls:
        assert ids[:21].tolist() == prompt
    assert steps == 4  # per block: 1 unmasking forward + 1 post forward with nothing to change


def test_post_steps_are_capped_by_max_post_steps() -> None:
    # a model that always wants to flip the token it sees (0 <-> 1) never settles: the block ends only
    # when post > max_post_steps, i.e. after exactly max_post_steps mask-free forwards
    def fn(ids: torch.Tensor, n: int) -> torch.Tensor:
        return torch.stack([peaked(1 - int(t) if int(t) in (0, 1) else 0, 0.9) for t in ids])

    for k in (0, 1, 5):
        out, steps = gen(Scripted(fn), [3], max_new_tokens=31, max_post_steps=k)
        assert steps == 1 + k
        assert out == [k % 2] * 31  # filled with 0, flipped k times


def test_eos_stops_after_the_block_and_cuts_after_it() -> None:
    # block 0 is filled with 2 2 2 EOS 2 ...; generation must stop after block 0 even though
    # max_new_tokens asks for three blocks, and the output ends right after the EOS
    def fn(ids: torch.Tensor, n: int) -> torch.Tensor:
        rows = [peaked(2, 0.9) for _ in range(len(ids))]
        rows[8] = peaked(EOS, 0.9)
        return torch.stack(rows)

    model = Scripted(fn)
    out, steps = gen(model, [1] * 5, max_new_tokens=90)
    assert out == [2, 2, 2, EOS]
    assert steps == 2
    assert all(len(c) == 32 for c in model.calls)


def test_eos_in_prompt_part_of_shared_block_does_not_stop() -> None:
    model = Scripted(lambda ids, n: torch.stack([peaked(2, 0.9)] * len(ids)))
    out, steps = gen(model, [1, EOS, 1], max_new_tokens=40)
    assert out == [2] * 40
    assert steps == 4


def test_single_new_token_and_block_aligned_prompt() -> None:
    model = Scripted(lambda ids, n: torch.stack([peaked(5, 0.9)] * len(ids)))
    out, steps = gen(model, [1] * 32, max_new_tokens=1)
    assert out == [5]
    assert steps == 2
    assert [len(c) for c in model.calls] == [64, 64]  # the whole block 1 is decoded, then cut


def test_a_model_that_prefers_mask_still_finishes_the_block() -> None:
    # the official loop would spin forever (same input, same forward); MASK is never a proposal instead
    model = Scripted(lambda ids, n: torch.stack([peaked(MASK, 0.9)] * len(ids)))
    out, steps = gen(model, [1, 2], max_new_tokens=5)
    assert MASK not in out and len(out) == 5
    assert steps == len(model.calls) <= 30 + 16


# ----------------------------------------------------------------------------------------------
# model pieces
# ----------------------------------------------------------------------------------------------

def test_rms_norm_by_hand() -> None:
    x = torch.tensor([[3.0, 4.0]], dtype=torch.float64)  # mean square 12.5
    w = torch.tensor([1.0, 2.0], dtype=torch.float64)
    y = rms_norm(x, w, eps=0.0)
    s = math.sqrt(12.5)
    assert torch.allclose(y, torch.tensor([[3 / s, 8 / s]], dtype=torch.float64))


def test_partial_rotary_by_hand() -> None:
    # head_dim 6, rotary_dim 4: dims 4, 5 pass through; dims (0, 2) and (1, 3) rotate as pairs
    theta = 100.0
    cos, sin = rotary_cos_sin(3, 4, theta, torch.float64)
    x = torch.arange(1.0, 7.0, dtype=torch.float64).expand(3, 1, 6)  # [L=3, heads=1, D=6]
    y = apply_partial_rotary(x, cos, sin)
    assert torch.equal(y[0], x[0])  # position 0: identity
    assert torch.equal(y[:, :, 4:], x[:, :, 4:])
    for pos in range(3):
        for j, f in enumerate([1.0, 1.0 / theta ** 0.5]):  # inv_freq = 1/theta^(0/4), 1/theta^(2/4)
            a = pos * f
            x1, x2 = float(x[pos, 0, j]), float(x[pos, 0, j + 2])
            assert math.isclose(float(y[pos, 0, j]), x1 * math.cos(a) - x2 * math.sin(a), abs_tol=1e-12)
            assert math.isclose(float(y[pos, 0, j + 2]), x2 * math.cos(a) + x1 * math.sin(a), abs_tol=1e-12)


def test_router_by_hand() -> None:
    # 8 experts in 4 groups of 2, keep 2 groups, pick 2 experts
    s = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.2, 0.2, 0.3, 0.35]], dtype=torch.float64)
    # no bias: group scores 1.0, 1.0, 0.4, 0.65 -> groups 0 and 1; experts 0 (0.9) and 2 or 3 (0.5 tie)
    idx, w = route(s, None, n_group=4, topk_group=2, top_k=2, routed_scaling_factor=2.5)
    assert int(idx[0, 0]) == 0 and int(idx[0, 1]) in (2, 3)
    assert torch.allclose(w, torch.tensor([[0.9 / 1.4 * 2.5, 0.5 / 1.4 * 2.5]], dtype=torch.float64))
    # the bias demotes expert 0 (dropping group 0) and lifts group 3
    bias = torch.tensor([-1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.3, 0.3], dtype=torch.float64)
    idx, w = route(s, bias, n_group=4, topk_group=2, top_k=2, routed_scaling_factor=2.5)
    # biased: [-0.1, 0.1, 0.5, 0.5, 0.2, 0.2, 0.6, 0.65]; groups: 0.0, 1.0, 0.4, 1.25 -> keep 3 and 1
    # best two among experts 2, 3, 6, 7 by biased score: 7 (0.65), 6 (0.6)
    assert idx[0].tolist() == [7, 6]
    # the weights use the UNBIASED scores 0.35 and 0.3
    assert torch.allclose(w, torch.tensor([[0.35 / 0.65 * 2.5, 0.3 / 0.65 * 2.5]], dtype=torch.float64))


def test_router_never_picks_outside_kept_groups_even_with_negative_scores() -> None:
    # all biased scores negative: a 0-fill would let a dropped group win; -inf must not
    s = torch.tensor([[0.1, 0.1, 0.2, 0.2]], dtype=torch.float64)
    bias = torch.tensor([-1.0, -1.0, -0.5, -0.5], dtype=torch.float64)
    idx, _ = route(s, bias, n_group=2, topk_group=1, top_k=2, routed_scaling_factor=1.0)
    assert sorted(idx[0].tolist()) == [2, 3]


# ----------------------------------------------------------------------------------------------
# a small synthetic checkpoint (written here, independent of redraft)
# ----------------------------------------------------------------------------------------------

CFG = dict(
    architectures=["LLaDA2MoeModelLM"], model_type="llada2_moe",
    vocab_size=48, hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=8, intermediate_size=24, moe_intermediate_size=8, num_experts=8, num_experts_per_tok=2,
    num_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
    norm_topk_prob=True, score_function="sigmoid", moe_router_enable_expert_bias=True, rms_norm_eps=1e-6,
    rope_theta=600000.0, partial_rotary_factor=0.5, tie_word_embeddings=False, use_qkv_bias=False,
)


def synthetic_tensors(cfg: dict, seed: int, qkv_bias: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, std: float = 0.3) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * std).to(torch.float32)

    H, D, I, M = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"], cfg["moe_intermediate_size"]
    hq, hkv, E, Vc = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"], cfg["vocab_size"]
    t = {"model.word_embeddings.weight": rnd(Vc, H, std=1.0), "model.norm.weight": 1 + rnd(H, std=0.1),
         "lm_head.weight": rnd(Vc, H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = 1 + rnd(H, std=0.1)
        t[f"{p}.post_attention_layernorm.weight"] = 1 + rnd(H, std=0.1)
        t[f"{p}.attention.query_key_value.weight"] = rnd((hq + 2 * hkv) * D, H)
        if qkv_bias:  # its own generator, so the other weights stay those of the bias-free checkpoint
            gb = torch.Generator().manual_seed(seed + 1000 + i)
            t[f"{p}.attention.query_key_value.bias"] = torch.randn((hq + 2 * hkv) * D, generator=gb) * 0.3
        t[f"{p}.attention.query_layernorm.weight"] = 1 + rnd(D, std=0.1)
        t[f"{p}.attention.key_layernorm.weight"] = 1 + rnd(D, std=0.1)
        t[f"{p}.attention.dense.weight"] = rnd(H, hq * D)
        mlps = [f"{p}.mlp"] if i < cfg["first_k_dense_replace"] else (
            [f"{p}.mlp.experts.{e}" for e in range(E)] + [f"{p}.mlp.shared_experts"])
        inner = I if i < cfg["first_k_dense_replace"] else M
        for m in mlps:
            t[f"{m}.gate_proj.weight"] = rnd(inner, H)
            t[f"{m}.up_proj.weight"] = rnd(inner, H)
            t[f"{m}.down_proj.weight"] = rnd(H, inner)
        if i >= cfg["first_k_dense_replace"]:
            t[f"{p}.mlp.gate.weight"] = rnd(E, H)
            t[f"{p}.mlp.gate.expert_bias"] = rnd(E, std=0.1)
    return t


def write_checkpoint(d: Path, tensors: dict[str, torch.Tensor], cfg: dict, shards: int = 1) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    if shards == 1:
        save_file(tensors, str(d / "model.safetensors"))
        return d
    names = sorted(tensors)
    weight_map = {}
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, str(d / fname))
        weight_map.update({n: fname for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("naive_ckpt"), synthetic_tensors(CFG, seed=0), CFG)


def test_forward_respects_block_causal_mask(ckpt: Path) -> None:
    model = NaiveLLaDA2(ckpt)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 48, (80,), generator=g)
    base = model.forward_logits(ids)  # [80, V]
    assert base.shape == (80, 48) and base.dtype == torch.float64
    # changing a token of block 1 (position 40) leaves block 0 as it was, changes block 1 and block 2
    alt = ids.clone()
    alt[40] = (alt[40] + 1) % 48
    other = model.forward_logits(alt)
    assert torch.equal(other[:32], base[:32])
    assert not torch.allclose(other[32:40], base[32:40])  # earlier positions of the same block see it
    assert not torch.allclose(other[64:], base[64:])
    # the logits of a prefix do not depend on what comes after its last block
    assert torch.allclose(model.forward_logits(ids[:64]), base[:64], rtol=0, atol=1e-12)


def test_sharded_checkpoint_loads_the_same(ckpt: Path, tmp_path: Path) -> None:
    tensors = synthetic_tensors(CFG, seed=0)
    sharded = write_checkpoint(tmp_path / "sharded", tensors, CFG, shards=3)
    ids = torch.arange(40) % 48
    assert torch.equal(NaiveLLaDA2(sharded).forward_logits(ids), NaiveLLaDA2(ckpt).forward_logits(ids))


def test_qkv_bias_is_used(ckpt: Path, tmp_path: Path) -> None:
    cfg = dict(CFG, use_qkv_bias=True)
    tensors = synthetic_tensors(CFG, seed=0, qkv_bias=True)
    ids = torch.arange(20) % 48
    with_bias = NaiveLLaDA2(write_checkpoint(tmp_path / "b", tensors, cfg)).forward_logits(ids)
    zero = {n: (torch.zeros_like(t) if n.endswith(".bias") else t) for n, t in tensors.items()}
    zero_bias = NaiveLLaDA2(write_checkpoint(tmp_path / "z", zero, cfg)).forward_logits(ids)
    assert torch.allclose(zero_bias, NaiveLLaDA2(ckpt).forward_logits(ids), rtol=0, atol=1e-12)
    assert not torch.allclose(with_bias, zero_bias)


def test_float32_close_to_float64(ckpt: Path) -> None:
    ids = torch.arange(70) % 48
    l64 = NaiveLLaDA2(ckpt, dtype=torch.float64).forward_logits(ids)
    l32 = NaiveLLaDA2(ckpt, dtype=torch.float32).forward_logits(ids)
    assert l32.dtype == torch.float32
    assert torch.allclose(l32.double(), l64, rtol=0, atol=1e-4)


def test_moe_layer_matches_a_dense_over_all_experts_formulation(ckpt: Path) -> None:
    # the same MoE output written differently: every expert on every token, times a dense [T, E]
    # weight matrix that is zero for experts not chosen
    model = NaiveLLaDA2(ckpt)
    x = torch.randn(5, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    p = "model.layers.1.mlp"
    s = torch.sigmoid(x @ model.w[p + ".gate.weight"].T)  # [5, 8]
    b = s + model.w[p + ".gate.expert_bias"]
    dense_w = torch.zeros(5, 8, dtype=torch.float64)
    for t in range(5):
        # groups of two experts: the group score (sum of its top 2) is the sum of both
        groups = sorted(range(4), key=lambda gi: -float(b[t, 2 * gi] + b[t, 2 * gi + 1]))[:2]
        allowed = [e for gi in groups for e in (2 * gi, 2 * gi + 1)]
        chosen = sorted(allowed, key=lambda e: -float(b[t, e]))[:2]
        total = sum(float(s[t, e]) for e in chosen)
        for e in chosen:
            dense_w[t, e] = float(s[t, e]) / total * 2.5
    expected = model._swiglu(x, p + ".shared_experts")
    for e in range(8):
        expected = expected + dense_w[:, e : e + 1] * model._swiglu(x, f"{p}.experts.{e}")
    assert torch.allclose(model._moe(1, x), expected, rtol=0, atol=1e-12)


def test_naive_generate_runs_on_a_real_forward(ckpt: Path) -> None:
    model = NaiveLLaDA2(ckpt)
    # token 47 plays MASK, 46 EOS in this synthetic vocabulary. A random model may predict the MASK id
    # itself (the official loop does not forbid it; the position then stays masked), so the step count
    # is only bounded below here
    out, steps = naive_generate(model, [1, 2, 3, 4, 5], max_new_tokens=30, threshold=0.5, edit_threshold=0.0,
                                max_post_steps=2, mask_id=47, eos_id=46)
    assert 1 <= len(out) <= 30 and 47 not in out
    assert steps >= 2
