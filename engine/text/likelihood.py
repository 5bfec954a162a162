"""Likelihoods of given text under a block-diffusion model (docs/likelihood.md). Torch-free: this module plans
which masked variants of which blocks to run and turns their log-probabilities into scores; the engine runs
the variants (engine/runtime/scoring.py: a job per request, advanced a chunk per engine iteration; the offline Engine
runs one to its end with `EngineCore.score_variants`).

A *variant* is one block k of a sequence with some of its positions masked, run attending to the clean blocks
before it and to itself (bidirectional inside the block), the model's training-time view. The block is always
whole: positions past the end of the text are MASK (as in a block being decoded), so no value depends on what
comes after the text. Its log-probabilities
at the masked positions are the terms of every estimator here:

- staircase (the `echo` values): l_i = log p(x_i | x_<i, positions i .. end of i's block masked). It depends on
  x_<=i only, so any suffix sum is an exact left-to-right log-probability of that suffix.
- elbo: the block-level ELBO the LLaDA2.1 report trains with (its Eq. 5, EBPO): for timesteps t_n with weights
  w_n, each response block b gets a mask m_{n,b}; estimate = sum_n w_n sum_b scale_{n,b} sum_{i in m} l_i(m),
  scale 1/t (bernoulli), L_b/l (count: exactly l = round(t L_b) positions), or the average of a mask at t and
  its complement at 1 - t (complementary).
- exact: every mask of every size per block (count form, uniform size): the exact ELBO, for short blocks.
Masks are a pure function of (seed, timestep index, absolute position) through `uniform`, so a trainer can
reproduce them: position p is in the bernoulli mask of timestep n iff uniform(seed, p, n) < t_n.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

_MASK32 = 0xFFFFFFFF
MAX_EXACT_BLOCK = 8  # response tokens per block the `exact` estimator enumerates (2^8 - 1 masks)
# Variants (block forwards of 32 tokens) one likelihood request may need: /score's plan, or the prompt
# log-probabilities of all the prompts of one echo / input-logprobs request. The engine runs them in bounded
# chunks between decoding iterations, so this bounds how long one request occupies a share of the engine.
MAX_VARIANTS = 65536


def _mix32(x: int) -> int:
    x &= _MASK32
    x ^= x >> 16
    x = (x * 0x7FEB352D) & _MASK32
    x ^= x >> 15
    x = (x * 0x46C8A68B) & _MASK32
    return x ^ (x >> 16)


def uniform(seed: int, position: int, step: int) -> float:
    """U[0, 1) from (seed, absolute position, step): the same hash as engine/decoding.uniform_noise (so sampling
    and masking share one definition), in plain integers."""
    s = seed & (2**64 - 1)
    x = _mix32(_mix32(_mix32(s ^ 0x1B873593) ^ (s >> 32)) ^ (position & (2**64 - 1)))
    x = _mix32(x ^ ((step * 0x2545F491) & (2**64 - 1)))
    hi, lo = _mix32(x ^ 0x68E31DA4), _mix32(x ^ 0x1B56C4E9)
    return ((hi >> 5) * 67108864.0 + (lo >> 6)) / 9007199254740992.0


def _mix32_np(x):
    """_mix32 over a uint32 numpy array (multiplication wraps mod 2^32, as the `& _MASK32` does)."""
    import numpy as np

    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x46C8A68B)
    return x ^ (x >> np.uint32(16))


def uniform_grid(seed: int, positions: Sequence[int], steps: int) -> list[list[float]]:
    """[uniform(seed, p, n) for p in positions] for each n in range(steps), vectorised (a maximal /score plan
    needs millions of values: seconds one by one). Positions are non-negative."""
    import numpy as np

    s = seed & (2**64 - 1)
    base = _mix32(_mix32(s ^ 0x1B873593) ^ (s >> 32))
    with np.errstate(over="ignore"):
        xp = _mix32_np(np.uint32(base) ^ np.array([p & _MASK32 for p in positions], dtype=np.uint32))  # [P]
        ks = np.array([(n * 0x2545F491) & _MASK32 for n in range(steps)], dtype=np.uint32)  # [N]
        x = _mix32_np(xp[None, :] ^ ks[:, None])  # [N, P]
        hi, lo = _mix32_np(x ^ np.uint32(0x68E31DA4)), _mix32_np(x ^ np.uint32(0x1B56C4E9))
    u = ((hi >> np.uint32(5)).astype(np.float64) * 67108864.0 + (lo >> np.uint32(6))) / 9007199254740992.0
    return u.tolist()


class Variant(NamedTuple):
    """Block `block` of sequence `seq`, `masked` positions (absolute) replaced by MASK; read at `targets`. (A named
    tuple: a maximal request has 65,536 of them, pickled to the engine five times faster than a dataclass.)"""

    seq: int
    block: int
    masked: tuple[int, ...]
    targets: tuple[int, ...]


@dataclass
class Term:
    """One (timestep, block) term of an estimate: sum of the masked tokens' log-probabilities, their count."""

    timestep: int
    t: float
    weight: float
    block: int
    scale: float
    variant: int  # index into the plan's variants
    logprob_sum: float = 0.0
    masked: int = 0


@dataclass
class Plan:
    variants: list[Variant] = field(default_factory=list)
    terms: list[list[Term]] = field(default_factory=list)  # per item


def blocks_of(start: int, end: int, block_size: int) -> range:
    """Blocks that hold positions [start, end)."""
    return range(start // block_size, (end - 1) // block_size + 1) if end > start else range(0)


def staircase_variants(seq: int, length: int, first: int, block_size: int) -> list[Variant]:
    """One variant per position i in [first, length): positions i .. end of i's block masked, read at i."""
    out = []
    for i in range(max(first, 0), length):
        k = i // block_size
        end = min((k + 1) * block_size, length)
        out.append(Variant(seq, k, tuple(range(i, end)), (i,)))
    return out


def staircase_values(length: int, variants: Sequence[Variant], rows: Sequence[Sequence]) -> list:
    """Per position of a sequence of `length`: the row its staircase variant read (None where none ran)."""
    out: list = [None] * length
    for v, row in zip(variants, rows):
        out[v.targets[0]] = row[0]
    return out


def timesteps(n: int, rule: str, seed: int) -> list[tuple[float, float]]:
    """(t_n, w_n) for n = 0..N-1: stratified, t_n = (n + 1 - u_n) / N with u_n = uniform(seed, -1, n), w = 1/N;
    or Gauss-Legendre nodes and weights on (0, 1]."""
    if n < 1:
        raise ValueError("num_timesteps must be >= 1")
    if rule == "stratified":
        return [((k + 1 - uniform(seed, -1, k)) / n, 1.0 / n) for k in range(n)]
    if rule == "gauss_legendre":
        nodes, weights = _gauss_legendre(n)
        return [((x + 1) / 2, w / 2) for x, w in zip(nodes, weights)]
    raise ValueError(f"timestep_rule must be stratified or gauss_legendre, not {rule!r}")


def _gauss_legendre(n: int) -> tuple[list[float], list[float]]:
    """Nodes and weights on [-1, 1] (Newton on the Legendre polynomial; exact to float precision)."""
    nodes, weights = [], []
    for i in range(1, n + 1):
        x = math.cos(math.pi * (i - 0.25) / (n + 0.5))
        for _ in range(100):
            p0, p1 = 1.0, x
            for k in range(2, n + 1):
                p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
            dp = n * (x * p1 - p0) / (x * x - 1) if n > 1 else 1.0
            step = p1 / dp
            x -= step
            if abs(step) < 1e-15:
                break
        p0, p1 = 1.0, x
        for k in range(2, n + 1):
            p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
        dp = n * (x * p1 - p0) / (x * x - 1) if n > 1 else 1.0
        nodes.append(x)
        weights.append(2.0 / ((1 - x * x) * dp * dp))
    return nodes, weights


def elbo_plan(items: Sequence[tuple[int, int]], *, estimator: str, num_timesteps: int = 1,
              timestep_rule: str = "stratified", masking: str = "bernoulli", seed: int = 0,
              block_size: int = 32) -> Plan:
    """Variants and terms for items given as (prompt length, total length): the response is [prompt, total)."""
    plan = Plan()
    for seq, (prompt_len, total) in enumerate(items):
        terms: list[Term] = []
        if estimator == "staircase":
            for v in staircase_variants(seq, total, prompt_len, block_size):
                terms.append(Term(0, 1.0, 1.0, v.block, 1.0, len(plan.variants)))
                plan.variants.append(v)
        elif estimator == "exact":
            for b in blocks_of(prompt_len, total, block_size):
                resp = [p for p in range(b * block_size, min((b + 1) * block_size, total)) if p >= prompt_len]
                if len(resp) > MAX_EXACT_BLOCK:
                    raise ValueError(f"estimator exact enumerates every mask: at most {MAX_EXACT_BLOCK} response "
                                     f"tokens per block, block {b} has {len(resp)}")
                size = len(resp)
                for l in range(1, size + 1):
                    subsets = list(itertools.combinations(resp, l))
                    for m in subsets:  # E_l~U{1..L} E_m~U(size l) [L/l sum]: weight (1/L) (1/C(L,l)) (L/l)
                        terms.append(Term(l, l / size, 1.0 / (size * len(subsets)), b, size / l, len(plan.variants)))
                        plan.variants.append(Variant(seq, b, m, m))
        elif estimator == "elbo":
            grids = {}  # block -> its response positions and, per timestep, their uniform values
            for b in blocks_of(prompt_len, total, block_size):
                resp = [p for p in range(b * block_size, min((b + 1) * block_size, total)) if p >= prompt_len]
                grids[b] = (resp, uniform_grid(seed, resp, num_timesteps))
            for n, (t, w) in enumerate(timesteps(num_timesteps, timestep_rule, seed)):
                for b, (resp, grid) in grids.items():
                    un = grid[n]  # u of resp[j] at timestep n: un[j]
                    if masking == "bernoulli":
                        masks = [(tuple(p for p, x in zip(resp, un) if x < t), 1.0 / t, 1.0)]
                    elif masking == "count":
                        l = min(len(resp), max(1, round(t * len(resp))))
                        masks = [(tuple(sorted(p for _, p in sorted(zip(un, resp))[:l])), len(resp) / l, 1.0)]
                    elif masking == "complementary":
                        m = tuple(p for p, x in zip(resp, un) if x < t)
                        rest = tuple(p for p, x in zip(resp, un) if x >= t)
                        masks = [(m, 1.0 / t, 0.5)] + ([(rest, 1.0 / (1.0 - t), 0.5)] if t < 1.0 else [])
                    else:
                        raise ValueError(f"masking must be bernoulli, count or complementary, not {masking!r}")
                    for mask, scale, share in masks:
                        terms.append(Term(n, t, w * share, b, scale, len(plan.variants)))
                        plan.variants.append(Variant(seq, b, mask, mask))
        else:
            raise ValueError(f"estimator must be elbo, staircase or exact, not {estimator!r}")
        plan.terms.append(terms)
    return plan


def mask_plan(items: Sequence[tuple[int, int]], masks: Sequence[Sequence[Sequence[int]]],
              block_size: int = 32) -> Plan:
    """Variants and terms for masks the client chose (docs/rl.md): per item, a list of masks, each the response
    positions (0 = the first response token) to mask together. A mask is run block by block, each block of the
    response with the mask's positions in it masked (the clean blocks before it visible); a term per (mask, block)
    with t = the share of the response the mask holds, weight 1 / number of masks and scale 1, so the estimate is
    the mean over the masks of their masked log-probability sums (a trainer applies its own weights to the terms).
    ValueError names the first position outside the response, or one given twice."""
    plan = Plan()
    for seq, ((prompt_len, total), item_masks) in enumerate(zip(items, masks)):
        terms: list[Term] = []
        n_resp = total - prompt_len
        for n, mask in enumerate(item_masks):
            if len(set(mask)) != len(mask):
                raise ValueError(f"masks.{seq}.{n}: a position is given twice")
            bad = next((p for p in mask if not 0 <= p < n_resp), None)
            if bad is not None:
                raise ValueError(f"masks.{seq}.{n}: position {bad} is outside the response (0..{n_resp - 1})")
            absolute = sorted(prompt_len + p for p in mask)
            for b in blocks_of(prompt_len, total, block_size):
                inside = tuple(p for p in absolute if b * block_size <= p < (b + 1) * block_size)
                if inside:
                    terms.append(Term(n, len(mask) / n_resp, 1.0 / len(item_masks), b, 1.0, len(plan.variants)))
                    plan.variants.append(Variant(seq, b, inside, inside))
        plan.terms.append(terms)
    return plan


def min_variants(items: Sequence[tuple[int, int]], *, estimator: str, num_timesteps: int = 1,
                 block_size: int = 32) -> int:
    """A lower bound on the variants `elbo_plan` makes for these items (exact but for complementary masking, which
    may double it), cheap to compute: a request over the cap is refused before its plan is built."""
    blocks = [len(blocks_of(p, t, block_size)) for p, t in items]
    if estimator == "staircase":
        return sum(t - p for p, t in items)
    if estimator == "elbo":
        return num_timesteps * sum(blocks)
    return sum(blocks)


def fill_terms(plan: Plan, logprobs: Sequence[Sequence[float]],
               prompt_lens: Sequence[int] | None = None) -> list[dict]:
    """Per item: the terms with their sums, and the weighted estimate. `logprobs[v]` are variant v's
    log-probabilities at its targets (an empty mask contributes 0). With `prompt_lens` (per item), every term
    also lists its masked tokens: their response positions and each one's log-probability."""
    out = []
    for item, terms in enumerate(plan.terms):
        estimate = 0.0
        rows = []
        for term in terms:
            lp = logprobs[term.variant]
            term.logprob_sum, term.masked = float(sum(lp)), len(lp)
            estimate += term.weight * term.scale * term.logprob_sum
            rows.append({"timestep": term.timestep, "t": term.t, "weight": term.weight, "block": term.block,
                         "scale": term.scale, "logprob_sum": term.logprob_sum, "masked": term.masked})
            if prompt_lens is not None:
                rows[-1]["positions"] = [p - prompt_lens[item] for p in plan.variants[term.variant].targets]
                rows[-1]["token_logprobs"] = [float(x) for x in lp]
        out.append({"estimate": estimate, "terms": rows})
    return out
