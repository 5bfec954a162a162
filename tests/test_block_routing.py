"""LLaDA2.2's block routing (the LLaDA2.2 page, "Block routing"; docs/llada22.md) against the naive twin
(tests/naive_llada2.py `block_route`, full recompute), on tiny checkpoints written with an `expert_capacity`.

  - the naive routing on a hand example; the torch router (kernels/moe.py) against it on packed batches;
  - routing-block isolation: a request's routing never depends on another request of the batch, however the
    batch packs them (lengths that sum to a multiple of 32 while each is misaligned);
  - the engine's forward (float64, a packed batch of ragged prefills) against the naive forward, per request;
  - exact generation: the engine's ids and forward counts equal naive_generate's, alone, batched and with
    chunked prefill, on a prefix-cache hit and (ids) under preemption; an MBE window equals the naive MBE loop;
    two misaligned requests batched give their tokens alone; likelihood forwards route each variant by itself;
  - the layer's FP8 twin routes the same way.
The Triton router's twin checks are in tests/test_moe_kernel.py, tensor parallelism in test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from naive_llada2 import NaiveLLaDA2, block_route, naive_generate, naive_mbe_generate, route

import redraft
from redraft.engine.model.config import ModelConfig
from redraft.engine.model.loader import load_model
from redraft.kernels.attention import AttentionMetadata
from redraft.kernels.moe import route_blocks_torch, routing_blocks

CAPACITY = 3  # of the tiny checkpoints' 8 experts (top-2): a block's tokens share few experts
BLOCK = 32


def block_ckpt(tiny_checkpoint: Callable[..., Path], seed: int = 0, capacity: int = CAPACITY, **kw: Any) -> Path:
    return tiny_checkpoint(seed=seed, config_overrides={"expert_capacity": capacity}, **kw)


# ---- the routing function ---------------------------------------------------------------------------------
def test_naive_block_route_by_hand() -> None:
    """Two blocks of two tokens, 4 experts, capacity 2, top-1. Block 0's best scores per expert are (.9, .7, .5, .1):
    it admits experts 0 and 1, so token 1, whose own best is expert 2, takes expert 1. Block 1's are (.7, .2, .6, .6):
    experts 2 and 3 tie for the second seat and the lower id, 2, gets it."""
    s = torch.tensor([[0.9, 0.7, 0.1, 0.1],
                      [0.1, 0.2, 0.5, 0.0],
                      [0.5, 0.1, 0.6, 0.6],
                      [0.7, 0.2, 0.1, 0.1]], dtype=torch.float64)
    idx, w = block_route(s, None, block_size=2, capacity=2, top_k=1, routed_scaling_factor=1.0, norm_topk_prob=False)
    assert idx[:, 0].tolist() == [0, 1, 2, 0]
    assert w[:, 0].tolist() == [0.9, 0.2, 0.6, 0.7]


def packed(lengths: list[int], starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(positions [T], cu_q [N + 1]) of a flat batch of requests with these query lengths and first positions."""
    pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)])
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    return pos, cu


def naive_ids(scores: torch.Tensor, bias: torch.Tensor, lengths: list[int], starts: list[int], top_k: int,
              capacity: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive routing of each request on its own (its query starts on a block boundary)."""
    ids, ws, off = [], [], 0
    for n, s in zip(lengths, starts):
        assert s % BLOCK == 0
        i, w = block_route(scores[off : off + n], bias, block_size=BLOCK, capacity=capacity, top_k=top_k,
                           routed_scaling_factor=2.5)
        ids.append(i)
        ws.append(w)
        off += n
    return torch.cat(ids), torch.cat(ws)


@pytest.mark.parametrize("e,k,capacity", [(8, 2, 3), (16, 3, 5), (256, 8, 48), (8, 2, 8)])
def test_torch_block_routing_equals_the_naive_twin(e: int, k: int, capacity: int) -> None:
    g = torch.Generator().manual_seed(e + capacity)
    lengths, starts = [20, 64, 33, 7], [32, 0, 96, 64]  # prefill chunks and decoding windows, ragged
    pos, cu = packed(lengths, starts)
    x = torch.randn(pos.numel(), 24, generator=g, dtype=torch.float64)
    w = torch.randn(e, 24, generator=g, dtype=torch.float64)
    bias = torch.randn(e, generator=g, dtype=torch.float64) * 0.05
    got_ids, got_w = route_blocks_torch(x, w, bias, routing_blocks(pos, cu, BLOCK), top_k=k, capacity=capacity,
                                        routed_scaling_factor=2.5)
    want_ids, want_w = naive_ids(torch.sigmoid(x @ w.t()), bias, lengths, starts, k, capacity)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-12, atol=1e-12)


def test_ties_go_to_the_lower_expert_id() -> None:
    """Every score equal: each block admits experts 0..capacity-1 and each token takes 0..k-1."""
    x = torch.zeros(40, 4, dtype=torch.float64)
    ids, _ = route_blocks_torch(x, torch.zeros(8, 4, dtype=torch.float64), torch.zeros(8, dtype=torch.float64),
                                routing_blocks(*packed([40], [0]), BLOCK), top_k=2, capacity=3,
                                routed_scaling_factor=1.0)
    assert ids.tolist() == [[0, 1]] * 40


def test_block_routing_is_not_grouped_routing() -> None:
    """The tiny router with capacity 3 chooses other experts than LLaDA2.1's grouped routing on some tokens (so the
    engine tests below can tell the two apart)."""
    g = torch.Generator().manual_seed(5)
    s = torch.sigmoid(torch.randn(64, 8, generator=g, dtype=torch.float64))
    bias = torch.zeros(8, dtype=torch.float64)
    blocked, _ = block_route(s, bias, block_size=BLOCK, capacity=CAPACITY, top_k=2, routed_scaling_factor=1.0)
    grouped, _ = route(s, bias, n_group=4, topk_group=2, top_k=2, routed_scaling_factor=1.0)
    assert not torch.equal(blocked.sort(-1).values, grouped.sort(-1).values)


@pytest.mark.parametrize("lengths", [[20, 44], [45, 19], [1, 63]])
def test_routing_blocks_are_never_shared_between_requests(lengths: list[int]) -> None:
    """Two requests packed back to back whose lengths sum to 64 (each misaligned: a flat 32-token window would
    straddle them): changing request A's tokens never changes request B's routing, and B's routing is the one it
    gets alone."""
    g = torch.Generator().manual_seed(sum(lengths[:1]))
    starts = [0, 0]
    pos, cu = packed(lengths, starts)
    labels = routing_blocks(pos, cu, BLOCK)
    assert set(labels[: lengths[0]].tolist()).isdisjoint(labels[lengths[0] :].tolist())
    w = torch.randn(8, 16, generator=g, dtype=torch.float64)
    bias = torch.randn(8, generator=g, dtype=torch.float64) * 0.05
    x = torch.randn(sum(lengths), 16, generator=g, dtype=torch.float64)
    kw = dict(top_k=2, capacity=CAPACITY, routed_scaling_factor=2.5)
    ids, wts = route_blocks_torch(x, w, bias, labels, **kw)
    y = x.clone()
    y[: lengths[0]] = torch.randn(lengths[0], 16, generator=g, dtype=torch.float64) * 3  # request A changes
    ids2, wts2 = route_blocks_torch(y, w, bias, labels, **kw)
    b = slice(lengths[0], None)
    assert torch.equal(ids2[b], ids[b]) and torch.equal(wts2[b], wts[b])
    alone_ids, alone_w = route_blocks_torch(x[b], w, bias, routing_blocks(*packed(lengths[1:], [0]), BLOCK), **kw)
    assert torch.equal(alone_ids, ids[b]) and torch.equal(alone_w, wts[b])


def test_a_neighbour_that_floods_its_block_does_not_reach_the_next_request() -> None:
    """Request A (20 tokens) scores experts 5, 6, 7 near 1; request B (44 tokens, all scores 0.5) alone admits
    experts 0, 1, 2 and takes 0 and 1. Packed after A, B still takes 0 and 1 at every token; labelling the flat
    batch in 32-token windows instead (A's 20 tokens + B's first 12 in one block) would hand B's first 12 tokens
    A's experts, which this construction makes visible."""
    w = torch.eye(8, 16, dtype=torch.float64)  # expert e reads hidden coordinate e
    x = torch.zeros(64, 16, dtype=torch.float64)
    x[:20, 5:8] = 10.0
    bias = torch.zeros(8, dtype=torch.float64)
    kw = dict(top_k=2, capacity=CAPACITY, routed_scaling_factor=1.0)
    ids, _ = route_blocks_torch(x, w, bias, routing_blocks(*packed([20, 44], [0, 0]), BLOCK), **kw)
    assert ids[20:].tolist() == [[0, 1]] * 44
    assert ids[:20].tolist() == [[5, 6]] * 20
    flat, _ = route_blocks_torch(x, w, bias, torch.arange(64) // BLOCK, **kw)
    assert flat[20:32].tolist() == [[5, 6]] * 12  # what sharing a block would do


def test_padded_rows_form_their_own_blocks() -> None:
    """CUDA graphs pad a batch with one-block rows at positions 0..31: each padded row is a request of its own."""
    pos = torch.arange(BLOCK).repeat(3)
    cu = torch.arange(4) * BLOCK
    labels = routing_blocks(pos, cu, BLOCK)
    assert [len(set(labels[i * BLOCK : (i + 1) * BLOCK].tolist())) for i in range(3)] == [1, 1, 1]
    assert len(set(labels.tolist())) == 3


# ---- the model's forward ----------------------------------------------------------------------------------
def forward_batch(model: torch.nn.Module, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Each sequence prefilled from position 0 in ONE packed forward (block-causal): its logits [L, V]."""
    cfg = model.cfg
    pages, tables = 0, []
    for s in seqs:
        n = -(-len(s) // BLOCK)
        tables.append(list(range(pages, pages + n)))
        pages += n
    dtype = next(model.parameters()).dtype
    shape = (cfg.num_hidden_layers, pages, BLOCK, cfg.num_key_value_heads, cfg.head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    meta = AttentionMetadata.build([0] * len(seqs), [len(s) for s in seqs], tables, BLOCK, "cpu")
    ids = torch.tensor([t for s in seqs for t in s])
    with torch.inference_mode():
        logits = model.logits(model(ids, meta, k_cache, v_cache))  # [T, V]
    return list(logits.split([len(s) for s in seqs]))


def test_engine_forward_equals_the_naive_forward_float64(tiny_checkpoint: Callable[..., Path]) -> None:
    """A packed batch of ragged prefills (lengths 40, 64, 7, 33) through the engine's model in float64 equals the
    naive model run on each sequence alone; the grouped router on the same weights would not."""
    path = block_ckpt(tiny_checkpoint)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.block_routing and cfg.expert_capacity == CAPACITY
    model = load_model(path, cfg, dtype=torch.float64, progress=False)
    naive = NaiveLLaDA2(path, dtype=torch.float64)
    rng = random.Random(7)
    seqs = [[rng.randrange(300) for _ in range(n)] for n in (40, 64, 7, 33)]
    got = forward_batch(model, seqs)
    for s, logits in zip(seqs, got):
        want = naive.forward_logits(torch.tensor(s))
        torch.testing.assert_close(logits, want, rtol=1e-10, atol=1e-10)
    naive.expert_capacity = 0  # the same weights under grouped routing: other logits
    assert not torch.allclose(naive.forward_logits(torch.tensor(seqs[0])), got[0], rtol=1e-6, atol=1e-6)


def test_a_checkpoint_whose_routing_block_straddles_a_forward_block_is_refused(tmp_path: Path,
                                                                              tiny_checkpoint: Callable[..., Path]):
    path = tiny_checkpoint(seed=0, config_overrides={"expert_capacity": CAPACITY, "block_size": 48})
    with pytest.raises(ValueError, match="block_size that divides 32"):
        load_model(path, ModelConfig.from_pretrained(path), dtype=torch.float64, progress=False)


def test_a_22_config_keeps_unused_groups() -> None:
    """n_group / topk_group are ignored under block routing: values grouped routing could not take load."""
    raw = {"vocab_size": 64, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 1, "intermediate_size": 32, "moe_intermediate_size": 8, "num_experts": 6,
           "num_experts_per_tok": 2, "n_group": 4, "topk_group": 1}  # 6 experts do not split into 4 groups
    with pytest.raises(ValueError, match="n_group"):
        ModelConfig.from_dict(raw)
    cfg = ModelConfig.from_dict({**raw, "expert_capacity": 4})
    assert cfg.block_routing and cfg.n_group == 4


# ---- exact generation -------------------------------------------------------------------------------------
class BlockTiny:
    """A block-routing tiny checkpoint with its float64 engines (plain, and chunked prefill of 64 tokens) and its
    float64 naive model."""

    def __init__(self, path: Path) -> None:
        self.path = path
        added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
        by_content = {t["content"]: t["id"] for t in added}
        tok_cfg = json.loads((path / "tokenizer_config.json").read_text())
        content = lambda e: e["content"] if isinstance(e, dict) else e  # noqa: E731
        self.mask_id = by_content[content(tok_cfg["mask_token"])]
        self.eos_id = by_content[content(tok_cfg["eos_token"])]
        self.specials = set(by_content.values())
        self.vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        self.engine = redraft.Engine(model_path=str(path), device="cpu", dtype="float64", progress=False)
        self.chunked = redraft.Engine(model_path=str(path), device="cpu", dtype="float64", progress=False,
                                      chunked_prefill_size=64)
        self.naive = NaiveLLaDA2(path, dtype=torch.float64)

    def prompt(self, length: int, salt: int = 0) -> list[int]:
        rng = random.Random(f"block/{length}/{salt}")
        ordinary = [i for i in range(self.vocab) if i not in self.specials]
        return [rng.choice(ordinary) for _ in range(length)]

    def reference(self, ids: list[int], n: int, threshold: float, edit_threshold: float,
                  max_post_steps: int) -> tuple[list[int], int]:
        return naive_generate(self.naive, ids, max_new_tokens=n, threshold=threshold, edit_threshold=edit_threshold,
                              max_post_steps=max_post_steps, mask_id=self.mask_id, eos_id=self.eos_id)


@pytest.fixture(scope="module")
def btiny(tiny_checkpoint: Callable[..., Path]) -> Iterator[BlockTiny]:
    t = BlockTiny(block_ckpt(tiny_checkpoint, seed=1))
    yield t
    t.engine.shutdown()
    t.chunked.shutdown()


# (prompt length, max_new_tokens, threshold, edit_threshold, max_post_steps): prompts ending mid-block, on a
# boundary and spanning several blocks (chunked at 64 tokens), outputs inside one block and across several
GEN_CASES = [(1, 7, 0.5, 0.0, 16), (20, 40, 0.7, 0.5, 16), (32, 33, 0.5, 0.0, 0), (100, 40, 0.7, 0.5, 1),
             (150, 20, 0.9, 0.3, 16)]


def _params(n: int, th: float, ed: float, post: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0.0, "threshold": th, "edit_threshold": ed, "max_post_steps": post}


@pytest.mark.parametrize("case", GEN_CASES, ids=[f"prompt{c[0]}-new{c[1]}" for c in GEN_CASES])
def test_engine_generation_equals_naive(btiny: BlockTiny, case: tuple) -> None:
    """Ids and forward counts equal naive_generate's, with whole-prompt prefill and with 64-token prefill chunks."""
    p, n, th, ed, post = case
    ids = btiny.prompt(p)
    want = btiny.reference(ids, n, th, ed, post)
    for eng in (btiny.engine, btiny.chunked):
        out = eng.generate(input_ids=ids, sampling_params=_params(n, th, ed, post))
        assert (out["output_ids"], out["meta_info"]["steps"]) == want


def test_batched_generation_equals_naive(btiny: BlockTiny) -> None:
    """Every case in one batch (packed, ragged, some prefilling while others decode): each request's ids and
    forward counts are the naive reference's."""
    prompts = [btiny.prompt(c[0], salt=1) for c in GEN_CASES]
    params = [_params(*c[1:]) for c in GEN_CASES]
    for eng in (btiny.engine, btiny.chunked):
        outs = eng.generate(input_ids=prompts, sampling_params=params)
        for ids, c, out in zip(prompts, GEN_CASES, outs):
            assert (out["output_ids"], out["meta_info"]["steps"]) == btiny.reference(ids, *c[1:]), c


@pytest.mark.parametrize("lengths", [(20, 44), (45, 51)])
def test_misaligned_requests_batched_give_their_tokens_alone(btiny: BlockTiny, lengths: tuple[int, int]) -> None:
    """Two requests whose prompt lengths sum to a multiple of 32, each misaligned, batched: each one's tokens and
    forwards are those it gets alone (and the naive reference's)."""
    prompts = [btiny.prompt(n, salt=2) for n in lengths]
    sp = _params(24, 0.5, 0.0, 16)
    together = btiny.engine.generate(input_ids=prompts, sampling_params=[sp, sp])
    for ids, out in zip(prompts, together):
        alone = btiny.engine.generate(input_ids=ids, sampling_params=sp)
        assert (out["output_ids"], out["meta_info"]["steps"]) == (alone["output_ids"], alone["meta_info"]["steps"])
        assert (alone["output_ids"], alone["meta_info"]["steps"]) == btiny.reference(ids, 24, 0.5, 0.0, 16)


def test_likelihood_forwards_route_each_variant_by_itself(btiny: BlockTiny) -> None:
    """The staircase (echo) values run every masked variant of a block as a request of its own, many in one forward:
    each value equals the naive model's on that variant alone (block routing over the variant's own tokens)."""
    ids = btiny.prompt(45, salt=3)
    got = btiny.engine.prompt_logprobs(ids)
    for i in range(1, len(ids)):
        k = i // BLOCK * BLOCK
        seq = ids[:i] + [btiny.mask_id] * (k + BLOCK - i)  # i .. the end of its block masked
        logits = btiny.naive.forward_logits(torch.tensor(seq))[i].clone()
        logits[btiny.mask_id] = float("-inf")
        want = torch.log_softmax(logits, -1)[ids[i]].item()
        assert got[i][0] == pytest.approx(want, abs=1e-10), i


def test_prefix_cache_hits_and_mbe_windows(btiny: BlockTiny) -> None:
    """A repeated prompt is served from the radix cache (its blocks' K/V were computed with whole routing blocks)
    with the same ids and forwards; a multi-block-editing window (several routing blocks in one decoding query)
    equals the naive MBE loop."""
    ids = btiny.prompt(100, salt=4)
    sp = _params(40, 0.5, 0.0, 16)
    first = btiny.engine.generate(input_ids=ids, sampling_params=sp)
    again = btiny.engine.generate(input_ids=ids, sampling_params=sp)
    assert again["meta_info"]["cached_tokens"] >= 96
    assert (again["output_ids"], again["meta_info"]["steps"]) == (first["output_ids"], first["meta_info"]["steps"])
    assert (first["output_ids"], first["meta_info"]["steps"]) == btiny.reference(ids, 40, 0.5, 0.0, 16)
    ids = btiny.prompt(20, salt=5)
    out = btiny.engine.generate(input_ids=ids, sampling_params={**_params(70, 0.7, 0.5, 16), "mbe_window": 2})
    want = naive_mbe_generate(btiny.naive, ids, max_new_tokens=70, threshold=0.7, edit_threshold=0.5,
                              max_post_steps=16, window=2, mask_id=btiny.mask_id, eos_id=btiny.eos_id)
    assert (out["output_ids"], out["meta_info"]["steps"]) == want


def test_preemption_keeps_the_tokens(btiny: BlockTiny) -> None:
    """A KV cache of 7 blocks for three requests that each grow to 3-4 blocks: requests are preempted and resume
    (their blocks recomputed whole, block routing included), with the naive reference's ids."""
    prompts = [btiny.prompt(n, salt=6) for n in (20, 40, 33)]
    sp = {**_params(64, 0.5, 0.0, 16), "ignore_eos": True}
    with redraft.Engine(model_path=str(btiny.path), device="cpu", dtype="float64", progress=False,
                        max_total_tokens=7 * BLOCK) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=[sp] * 3)
        assert tight.core.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        want = naive_generate(btiny.naive, ids, max_new_tokens=64, threshold=0.5, edit_threshold=0.0,
                              max_post_steps=16, mask_id=btiny.mask_id, eos_id=-1)  # ignore_eos: no stop id
        assert out["output_ids"] == want[0]
