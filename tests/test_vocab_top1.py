"""The decoding step's argmax and probability without full logits, against the full-logits computation.

The chunked torch path must give the full path's ids exactly (every dtype; the lm_head's chunks are the same
GEMM's columns) and its probabilities to rounding; the Triton tile kernel (interpreted on CPU) the same ids
and probabilities to fp32 rounding. Ties go to the lowest id, the excluded (MASK) id never wins.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if "triton" not in sys.modules and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from redraft.kernels.vocab_top1 import full_logits_top1, lm_head_top1_torch, Top1Partials  # noqa: E402


def _full(hidden: torch.Tensor, weight: torch.Tensor, exclude: int | tuple[int, ...] | None) -> torch.Tensor:
    """What LLaDA2Model.logits + exclude_mask_ (+ the structural ids of a 2.2 checkpoint's 2.1 rows) compute:
    [R, V] >= fp32."""
    logits = torch.nn.functional.linear(hidden, weight).to(torch.promote_types(hidden.dtype, torch.float32))
    if exclude is not None:
        logits[:, [exclude] if isinstance(exclude, int) else list(exclude)] = float("-inf")
    return logits


def _case(dtype: torch.dtype, r: int = 37, v: int = 1000, h: int = 48, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(r, h, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(v, h, generator=g, dtype=torch.float64) / h**0.5).to(dtype)
    return hidden, weight


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [1, 7, 128, 1000, 4096])
def test_chunked_torch_equals_full_logits(dtype: torch.dtype, chunk: int) -> None:
    hidden, weight = _case(dtype)
    exclude = 513
    want = full_logits_top1(_full(hidden, weight, exclude))
    got = lm_head_top1_torch(hidden, weight, exclude, chunk=chunk).combine()
    assert torch.equal(got.ids, want.ids)
    assert not set(got.ids.tolist()) & ({exclude} if isinstance(exclude, int) else set(exclude))
    tol = {torch.float64: 1e-13, torch.float32: 2e-5, torch.bfloat16: 2e-5}[dtype]  # 1,000 sequential folds at chunk 1
    torch.testing.assert_close(got.prob, want.prob, rtol=tol, atol=0)


def test_ties_go_to_the_lowest_id_across_chunks() -> None:
    hidden = torch.ones(3, 4, dtype=torch.float32)
    weight = torch.zeros(20, 4)
    weight[[2, 9, 15]] = 1.0  # three equal best logits, in different chunks of 8
    weight[5] = 2.0  # the best, but excluded
    got = lm_head_top1_torch(hidden, weight, exclude=5, chunk=8).combine()
    assert got.ids.tolist() == [2, 2, 2]
    want = full_logits_top1(_full(hidden, weight, 5))
    assert want.ids.tolist() == [2, 2, 2]
    torch.testing.assert_close(got.prob, want.prob)


def test_several_ids_left_out() -> None:
    """MASK, DELETE and SPLIT at once (a LLaDA2.2 checkpoint's 2.1-step rows), each the best logit of some row,
    in different chunks: never chosen, and out of the probability's sum."""
    hidden, weight = _case(torch.float64, r=6, v=300, h=16, seed=9)
    gone = (7, 298, 299)
    for row, t in enumerate(gone):
        weight[t] = hidden[row] * 5  # token t wins row `row` by far, if it may
    want = full_logits_top1(_full(hidden, weight, gone))
    got = lm_head_top1_torch(hidden, weight, gone, chunk=64).combine()
    assert torch.equal(got.ids, want.ids) and not set(got.ids.tolist()) & set(gone)
    torch.testing.assert_close(got.prob, want.prob, rtol=1e-13, atol=0)
    assert not torch.equal(got.ids, lm_head_top1_torch(hidden, weight, 7, chunk=64).combine().ids)


def test_rank_slices_merge_like_the_whole_vocabulary() -> None:
    """Tensor parallelism: each rank reduces its vocabulary slice; the partials, in rank order, combine."""
    hidden, weight = _case(torch.float64, v=999)
    exclude = 400
    slices = [(0, 333), (333, 666), (666, 999)]
    parts = [lm_head_top1_torch(hidden, weight[a:b], exclude, chunk=100, vocab_offset=a) for a, b in slices]
    merged = Top1Partials(best=torch.cat([p.best for p in parts], -1), ids=torch.cat([p.ids for p in parts], -1),
                          sumexp=torch.cat([p.sumexp for p in parts], -1)).combine()
    want = full_logits_top1(_full(hidden, weight, exclude))
    assert torch.equal(merged.ids, want.ids)
    torch.testing.assert_close(merged.prob, want.prob, rtol=1e-14, atol=0)


@pytest.mark.kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("r,v,h,exclude", [(5, 300, 16, 17), (70, 517, 40, 17), (70, 517, 40, (17, 515, 516))])
def test_triton_tiles_equal_torch(dtype: torch.dtype, r: int, v: int, h: int, exclude) -> None:
    triton_top1 = pytest.importorskip("redraft.kernels.vocab_top1_triton")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hidden, weight = _case(dtype, r=r, v=v, h=h, seed=3)
    hidden, weight = hidden.to(device), weight.to(device)
    got = triton_top1.lm_head_top1_triton(hidden, weight, exclude, block_v=64).combine()
    want = full_logits_top1(_full(hidden, weight, exclude))
    logits = _full(hidden, weight, exclude)
    # A different accumulation order can round a bf16 logit to its neighbour: an id may differ only where the
    # full path's best two logits are that close.
    differ = got.ids != want.ids
    if differ.any():
        top2 = logits[differ].topk(2, -1).values
        assert ((top2[:, 0] - top2[:, 1]) <= top2[:, 0].abs() * 2**-7).all()
    assert differ.float().mean() <= (0.05 if dtype == torch.bfloat16 else 0.0)
    tol = 6e-2 if dtype == torch.bfloat16 else 1e-5  # a bf16 logit one ulp apart moves p by up to ~2^-8 * |logit|
    torch.testing.assert_close(got.prob[~differ], want.prob[~differ], rtol=tol, atol=1e-6)
    assert not set(got.ids.tolist()) & ({exclude} if isinstance(exclude, int) else set(exclude))
