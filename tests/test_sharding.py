"""What a tensor-/expert-parallel rank loads (engine/model/sharding.py): only its shard, read from the checkpoint in
slices, equal to the same part cut out of the whole model; FP8 weights and their block scales shard the same
way. No processes here (test_tensor_parallel.py runs the ranks)."""

from __future__ import annotations

import pytest
import torch

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.loader import load_model
from redraft.engine.model.sharding import RankLayout, check_layout, shard_model_
from redraft.engine.runtime.tensor_parallel import weight_bytes

# head_dim 128 and intermediates of 256: every rank's share is whole 128-blocks, as FP8 with tp 2 needs
ALIGNED = {"num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 128, "intermediate_size": 256,
           "moe_intermediate_size": 256}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint(seed=3, shards=3)


@pytest.fixture(scope="module")
def aligned(tiny_checkpoint):
    return tiny_checkpoint(seed=4, config_overrides=ALIGNED)


def by_heads_and_experts(full: dict[str, torch.Tensor], cfg: ModelConfig, rank: int, tp: int, ep: int):
    """The shard, written independently of engine/model/sharding.py: heads, intermediate columns, experts, and the
    token rows of embedding and lm_head (vocab_size / tp each; tp divides the tiny vocabulary of 448)."""
    d, nq, nkv, h = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size

    def heads(w: torch.Tensor, n: int) -> torch.Tensor:  # [n * d, h] -> this rank's heads
        return w.reshape(n, d, h)[rank * n // tp:(rank + 1) * n // tp].reshape(-1, h)

    my_q_heads = range(rank * nq // tp, (rank + 1) * nq // tp)
    my_kv_heads = sorted({j // (nq // nkv) for j in my_q_heads})  # the KV heads they read (grouped-query)

    def kv_heads(w: torch.Tensor) -> torch.Tensor:
        return w.reshape(nkv, d, h)[my_kv_heads].reshape(-1, h)

    def swiglu(gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i = down.shape[-1]
        lo, hi = rank * i // tp, (rank + 1) * i // tp
        gate, up = gate_up[..., :i, :], gate_up[..., i:, :]
        return torch.cat([gate[..., lo:hi, :], up[..., lo:hi, :]], dim=-2), down[..., lo:hi]

    out = dict(full)
    for name, w in full.items():
        if name.endswith("attn.qkv.weight"):
            q, k, v = w.split([nq * d, nkv * d, nkv * d])
            out[name] = torch.cat([heads(q, nq), kv_heads(k), kv_heads(v)])
        elif name.endswith("attn.o_proj.weight"):
            out[name] = w.t().reshape(nq, d, h)[rank * nq // tp:(rank + 1) * nq // tp].reshape(-1, h).t()
        elif name.endswith("gate_up"):
            out[name], out[name[:-len("gate_up")] + "down"] = swiglu(w, full[name[:-len("gate_up")] + "down"])
        elif name in ("embed.weight", "lm_head.weight"):
            rows = cfg.vocab_size // tp
            out[name] = w[rank * rows:(rank + 1) * rows]
        elif name.endswith("mlp.w13"):
            w2 = full[name[:-3] + "w2"]
            if ep > 1:
                n = cfg.num_experts // ep
                out[name], out[name[:-3] + "w2"] = w[rank * n:(rank + 1) * n], w2[rank * n:(rank + 1) * n]
            else:
                out[name], out[name[:-3] + "w2"] = swiglu(w, w2)
    return out


@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2), (4, 1), (4, 4)], ids=["tp2", "tp2-ep2", "tp4", "tp4-ep4"])
def test_a_rank_loads_its_heads_columns_and_experts(ckpt, tp, ep):
    """(tp 4 on the tiny model's 2 KV heads: each KV head is kept by the two ranks whose query heads read it.)"""
    cfg = ModelConfig.from_pretrained(ckpt)
    whole = load_model(ckpt, cfg, dtype="float64", progress=False)
    full = dict(whole.named_parameters())
    full = {n: p.detach() for n, p in full.items()}
    for rank in range(tp):
        shard = load_model(ckpt, cfg, dtype="float64", progress=False, layout=RankLayout(rank, tp, ep))
        want = by_heads_and_experts(full, cfg, rank, tp, ep)
        got = {n: p.detach() for n, p in shard.named_parameters()}
        assert got.keys() == want.keys()
        for name in got:
            assert torch.equal(got[name], want[name]), name
        moe = shard.layers[1].mlp
        assert moe.first_expert == (rank * cfg.num_experts // ep if ep > 1 else 0)
        assert shard.layers[0].attn.n_q == cfg.num_attention_heads // tp
        assert shard.cfg.num_key_value_heads == shard.layers[0].attn.n_kv == max(1, cfg.num_key_value_heads // tp)
        assert weight_bytes(shard) < 0.75 * weight_bytes(whole)


@pytest.mark.parametrize("stored", ["quantised at load", "e4m3 checkpoint"])
@pytest.mark.parametrize("tp,ep", [(2, 1), (2, 2)], ids=["tp2", "tp2-ep2"])
def test_fp8_weights_and_block_scales_shard_the_same_way(aligned, tmp_path, tp, ep, stored):
    """Loading a rank's FP8 shard (quantising its slices, or slicing e4m3 tensors and their `_scale_inv`
    grids in blocks) gives exactly the e4m3 bytes and scales of that part of the whole FP8 model."""
    path = aligned
    if stored == "e4m3 checkpoint":
        from test_fp8 import write_deepseek_fp8

        path = write_deepseek_fp8(aligned, tmp_path / "fp8")
    cfg = ModelConfig.from_pretrained(path)
    for rank in range(tp):
        layout = RankLayout(rank, tp, ep)
        cut_whole = shard_model_(load_model(path, cfg, dtype="float32", progress=False, quantization="fp8"), layout)
        shard = load_model(path, cfg, dtype="float32", progress=False, quantization="fp8", layout=layout)
        want = dict(cut_whole.state_dict())
        got = dict(shard.state_dict())
        assert got.keys() == want.keys()
        assert any(t.dtype == torch.float8_e4m3fn for t in got.values())
        for name in got:
            assert got[name].shape == want[name].shape, name
            assert torch.equal(got[name].view(torch.uint8) if got[name].dtype == torch.float8_e4m3fn else got[name],
                               want[name].view(torch.uint8) if want[name].dtype == torch.float8_e4m3fn
                               else want[name]), name


def test_fp8_layouts_must_cut_on_block_boundaries(ckpt):
    cfg = ModelConfig.from_pretrained(ckpt)  # head_dim 16: 2 heads per rank are 32 rows, not a 128 block
    with pytest.raises(ValueError, match="whole 128-wide blocks"):
        check_layout(cfg, 2, 2, "fp8")
    check_layout(cfg, 2, 2, None)  # fine without FP8
    with pytest.raises(ValueError, match="whole 128-wide blocks"):
        load_model(ckpt, cfg, dtype="float32", progress=False, quantization="fp8", layout=RankLayout(0, 2, 2))


def test_which_real_layouts_take_fp8():
    """docs/scaling.md's claim, from the published configs: flash takes FP8 at TP 2, 4 and 8; mini up to TP 4
    (at 8 its 512-wide shared expert would give each rank 64 columns, half a block)."""
    from redraft.clients.memory_plan import PRESETS
    from redraft.engine.model.tiny import TINY_CONFIG

    def cfg(name):
        return ModelConfig.from_dict({**TINY_CONFIG, **PRESETS[name], "n_group": 8, "topk_group": 4,
                                      "num_experts_per_tok": 8})

    for tp in (2, 4, 8):
        check_layout(cfg("LLaDA2.1-flash"), tp, tp, "fp8")
        check_layout(cfg("LLaDA2.1-mini"), tp, tp, None)
    check_layout(cfg("LLaDA2.1-mini"), 4, 4, "fp8")
    with pytest.raises(ValueError, match="moe_intermediate_size x num_shared_experts"):
        check_layout(cfg("LLaDA2.1-mini"), 8, 8, "fp8")


@pytest.mark.parametrize("vocab,tied", [(448, True), (449, False)], ids=["tied", "indivisible"])
def test_vocabulary_rows_shard_when_tp_divides_them(vocab, tied):
    """Tied embeddings stay one tensor when cut (lm_head reads the rank's embedding rows); a vocabulary tp does
    not divide is replicated whole, embedding and lm_head alike."""
    import torch.nn as nn

    from redraft.engine.model.loader import build_model
    from redraft.engine.model.sharding import VocabShardEmbedding, is_vocab_parallel
    from redraft.engine.model.tiny import TINY_CONFIG

    cfg = ModelConfig.from_dict({**TINY_CONFIG, "vocab_size": vocab, "tie_word_embeddings": tied})
    model = build_model(cfg, torch.float32, "cpu", layout=RankLayout(1, 2, 1))
    if tied:
        assert isinstance(model.embed, VocabShardEmbedding) and model.embed.start == vocab // 2
        assert model.lm_head.weight is model.embed.weight and model.embed.weight.shape[0] == vocab // 2
    else:
        assert not is_vocab_parallel(model) and isinstance(model.embed, nn.Embedding)
        assert model.embed.weight.shape[0] == model.lm_head.weight.shape[0] == vocab


def test_a_vocabulary_shard_looks_up_only_its_rows():
    """The ranks' embedding rows sum to the whole lookup, exactly (each id is found on one rank, zeros elsewhere)."""
    from redraft.engine.model.sharding import VocabShardEmbedding

    whole = torch.randn(12, 5, dtype=torch.float64)
    ids = torch.tensor([0, 11, 3, 6, 5, 9, 6])
    ranks = [VocabShardEmbedding(whole[r * 4:(r + 1) * 4].clone(), r * 4) for r in range(3)]
    assert torch.equal(sum(e(ids) for e in ranks), whole[ids])
