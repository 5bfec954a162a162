"""Scheduler: continuous batching at block granularity, driven by a deterministic fake model. Torch-free.

The fake model stands in for LLaDA2's forward + joint-threshold step. For every position of a request's
active block it proposes a token and a confidence from a hash of what the real model would see: the K/V of
everything before the active block, the active block's current tokens, and the position. The K/V are faked
too, as a hash chain (a block's fake K/V hashes the previous block's K/V and its own tokens), and they are
really stored in and read from the KV pages the scheduler hands out. So a stale, missing, shared-by-mistake
or overwritten page changes the proposals and the outputs, exactly as it would on the real model.

`reference()` runs one request alone through the same fake step with the official loop (llada2-facts.md,
section 3): no scheduler, no cache, the prefix K/V recomputed from the final tokens every time. Every
scheduled run must give each request exactly the output, finish reason and step count it gets alone.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from dataclasses import dataclass, field

import pytest

from redraft.protocol.sampling_params import ResolvedParams, SamplingParams, resolve
from redraft.scheduler.request import FinishReason, Request, Status
from redraft.scheduler.scheduler import (
    StepOutput,
    QueueFull,
    RequestTooLarge,
    Scheduler,
    SchedulerConfig,
    WorkItem,
)

B = 32  # block size = tokens per KV page
EOS = 1
MASK = 2
LO, HI = 10, 4000  # ordinary token ids


# ------------------------------------------------------------------------------------------ the fake model
def _h(*parts: bytes) -> bytes:
    d = hashlib.blake2b(digest_size=16)
    for p in parts:
        d.update(p)
    return d.digest()


def _pack(tokens: list[int]) -> bytes:
    return array("q", tokens).tobytes()


KV_ROOT = bytes(16)  # "K/V" before block 0


def kv_of_block(prev_kv: bytes, block_tokens: list[int]) -> bytes:
    """Fake K/V of one block: a function of every token of the blocks <= it (chained through prev_kv)."""
    assert len(block_tokens) == B
    return _h(b"kv", prev_kv, _pack(block_tokens))


def kv_chain(tokens: list[int], nblocks: int) -> bytes:
    """The exact fake K/V of block nblocks-1, recomputed from tokens (what an uncached forward would see)."""
    kv = KV_ROOT
    for j in range(nblocks):
        kv = kv_of_block(kv, tokens[j * B : (j + 1) * B])
    return kv


def propose(prefix_kv: bytes, block: list[int]) -> list[tuple[int, float]]:
    """(argmax token, its probability) per position of the active block.

    A masked position gets a fresh token (an EOS now and then). A filled position mostly keeps its token
    (a real model tends to agree with itself) and 1 time in 8 proposes another one, so T2T edits happen,
    blocks usually settle, and some keep changing until max_post_steps cuts them off."""
    base = _h(b"step", prefix_kv, _pack(block))
    out = []
    for i, cur in enumerate(block):
        h = int.from_bytes(_h(base, i.to_bytes(2, "little")), "little")
        p = (h & 0xFFFF) / 65536.0
        fresh = EOS if (h >> 16) % 89 == 0 else LO + (h >> 24) % (HI - LO)
        tok = fresh if cur == MASK or (h >> 56) % 8 == 0 else cur
        out.append((tok, p))
    return out


def joint_step(
    block: list[int], editable: list[bool], props: list[tuple[int, float]], threshold: float, edit_threshold: float
) -> tuple[list[int], bool, int, int]:
    """The joint-threshold rule: M2T (masked, p > threshold, else the single most confident masked position)
    and T2T (editable, not masked, another token, p > edit_threshold), from the same proposals."""
    masked = [t == MASK for t in block]
    had_mask = any(masked)
    m2t = [m and p > threshold for m, (_, p) in zip(masked, props)]
    if had_mask and not any(m2t):
        best = max((i for i in range(len(block)) if masked[i]), key=lambda i: props[i][1])  # first on ties
        m2t[best] = True
    t2t = [
        (not masked[i]) and editable[i] and props[i][0] != block[i] and props[i][1] > edit_threshold
        for i in range(len(block))
    ]
    new = [props[i][0] if (m2t[i] or t2t[i]) else block[i] for i in range(len(block))]
    return new, had_mask, sum(m2t), sum(t2t)


class FakeRunner:
    """Plays the model runner: one 'forward' per schedule(), K/V kept in the pages the scheduler hands out."""

    def __init__(self, sched: Scheduler, minimal_windows: bool = False):
        self.sched = sched
        self.kv: dict[int, bytes] = {}  # page id -> fake K/V of the block last written there
        # Also require that no window recomputes a block whose page already holds exact K/V. Valid only with the
        # prefix cache on and nothing evicted or preempted: else a freed page may come back to the same block
        # still holding exact K/V by luck.
        self.minimal_windows = minimal_windows

    def run(self, items: list[WorkItem]) -> StepOutput:
        pool = self.sched.pool
        out = StepOutput()
        written: dict[int, str] = {}
        for it in items:
            req = it.req
            if req.finished:  # aborted between schedule() and the forward: its pages are gone
                if it.decodes:
                    out.tokens.append(req.active_tokens())
                    out.had_mask.append(True)
                    out.m2t.append(0)
                    out.t2t.append(0)
                continue
            act = req.state.active_block
            assert it.first == req.book.exact_blocks, "a window must start at the first block without exact K/V"
            assert 0 <= it.first <= it.last <= act
            assert it.decodes == (it.last == act)
            assert len(req.book.pages) >= it.last + 1, f"{req.rid}: no page for block {it.last}"
            assert all(pool.is_allocated(p) for p in req.book.pages[: it.last + 1]), f"{req.rid} reads a free page"
            assert MASK not in req.state.tokens[: act * B], "blocks before the active one must be final"
            # K/V of the block before the window come from the cache and must be exact.
            prev = KV_ROOT if it.first == 0 else self.kv.get(req.book.pages[it.first - 1])
            assert prev == kv_chain(req.state.tokens, it.first), f"{req.rid}: stale or foreign K/V before block {it.first}"
            if self.minimal_windows:
                exact, kv = 0, KV_ROOT
                while exact < act:
                    kv = kv_of_block(kv, req.state.tokens[exact * B : (exact + 1) * B])
                    if self.kv.get(req.book.pages[exact]) != kv:
                        break
                    exact += 1
                assert it.first == exact, f"{req.rid}: window starts at {it.first}, blocks < {exact} are exact"
            for j in range(it.first, it.last + 1):
                assert j >= req.book.tree_blocks, f"{req.rid} would overwrite a tree-owned page (block {j})"
                page = req.book.pages[j]
                assert page not in written, f"page {page} written by {written.get(page)} and {req.rid}"
                written[page] = req.rid
                blk = req.state.tokens[j * B : (j + 1) * B]
                if j == act:  # the active block: its proposals see the prefix K/V and its current tokens
                    start = act * B
                    editable = [start + i >= req.prompt_len for i in range(B)]
                    new, had, m2t, t2t = joint_step(
                        blk, editable, propose(prev, blk), req.params.threshold, req.params.edit_threshold
                    )
                    out.tokens.append(new)
                    out.had_mask.append(had)
                    out.m2t.append(m2t)
                    out.t2t.append(t2t)
                prev = kv_of_block(prev, blk)  # K/V written from the tokens this forward saw
                self.kv[page] = prev
        return out


# ------------------------------------------------------------------------------------------ the reference
@dataclass
class Ref:
    output: list[int]
    finish: str  # "stop" | "length"
    steps: int
    tokens: list[int]  # prompt + every decoded block
    block_steps: list[int] = field(default_factory=list)  # cumulative steps after each generated block
    block_stale: list[bool] = field(default_factory=list)  # ended by max_post_steps
    m2t: int = 0
    t2t: int = 0


def reference(prompt: list[int], sp: SamplingParams | ResolvedParams) -> Ref:
    """One request alone, the official loop (batch 1, no cache), with the fake model's step."""
    rp = sp if isinstance(sp, ResolvedParams) else resolve(sp)
    P, n = len(prompt), rp.max_new_tokens
    last = (P + n - 1) // B
    stops = set(rp.stop_token_ids) | (set() if rp.ignore_eos else {EOS})
    x = list(prompt) + [MASK] * ((last + 1) * B - P)
    ref = Ref([], "length", 0, [])
    end = P
    for b in range(P // B, last + 1):
        lo = b * B
        end = lo + B
        prefix_kv = kv_chain(x, b)  # recomputed from the final tokens: the no-cache forward
        editable = [lo + i >= P for i in range(B)]
        post, stale = 0, False
        while True:
            old = x[lo:end]
            if MASK not in old:
                post += 1
            if post > rp.max_post_steps:
                stale = True
                break
            new, had, m2t, t2t = joint_step(old, editable, propose(prefix_kv, old), rp.threshold, rp.edit_threshold)
            ref.steps += 1
            ref.m2t += m2t
            ref.t2t += t2t
            x[lo:end] = new
            if not had and t2t == 0:
                break
        ref.block_steps.append(ref.steps)
        ref.block_stale.append(stale)
        gen = x[P:end]
        if MASK not in gen and any(t in stops for t in gen):
            break
    out = x[P : min(end, P + n)]
    for i, t in enumerate(out):
        if t in stops:
            out = out[: i + 1]
            ref.finish = "stop"
            break
    ref.output = out
    ref.tokens = x[:end]
    return ref


# ------------------------------------------------------------------------------------------ harness
def sparams(**kw) -> SamplingParams:
    return SamplingParams(**kw)  # validated on construction


def make_req(rid: str, prompt: list[int], sp: SamplingParams) -> Request:
    return Request(rid=rid, prompt_ids=list(prompt), params=resolve(sp), mask_id=MASK, eos_id=EOS, block_size=B)


def tree_pages(cache, tokens: list[int]) -> list[int]:
    """Pages the tree holds for the whole blocks of tokens, read without touching the tree (no split, no LRU)."""
    blocks = [tuple(tokens[i : i + B]) for i in range(0, len(tokens) // B * B, B)]
    node, i, pages = cache.root, 0, []
    while i < len(blocks):
        child = node.children.get(blocks[i])
        if child is None:
            break
        k = 0
        while k < len(child.blocks) and i + k < len(blocks) and child.blocks[k] == blocks[i + k]:
            k += 1
        pages += child.pages[:k]
        i += k
        if k < len(child.blocks):
            break
        node = child
    return pages


def all_tree_pages(cache) -> list[int]:
    out, stack = [], list(cache.root.children.values())
    while stack:
        node = stack.pop()
        out += node.pages
        stack += node.children.values()
    return out


def check_accounting(sched: Scheduler) -> None:
    pool, cache = sched.pool, sched.cache
    cache.check_invariants()
    owned: list[int] = []
    for r in sched.running:
        assert r.state.status is Status.RUNNING and not r.finished
        assert 0 <= r.book.tree_blocks <= r.book.exact_blocks <= r.state.active_block
        assert len(r.book.pages) <= r.state.active_block + 1
        assert r.book.tree_blocks == 0 or r.book.cache_node is not None
        # the tree-owned head of the page table is exactly what the tree holds for those blocks
        assert r.book.pages[: r.book.tree_blocks] == tree_pages(cache, r.state.tokens[: r.book.tree_blocks * B])
        owned += r.book.pages[r.book.tree_blocks :]
    assert len(owned) == len(set(owned)), "a page is owned by two running requests"
    tree = all_tree_pages(cache)
    assert not set(owned) & set(tree), "a request frees/owns a page the tree owns"
    assert all(pool.is_allocated(p) for p in owned)
    assert pool.num_free + cache.cached_pages + len(owned) == pool.capacity
    for r in sched.waiting:
        assert r.state.status is Status.WAITING and r.book.pages == [] and r.book.cache_node is None and r.book.tree_blocks == 0


class Harness:
    def __init__(self, minimal_windows: bool = False, **cfg):
        cfg.setdefault("num_pages", 1000)
        cfg.setdefault("max_running_requests", 256)
        self.sched = Scheduler(SchedulerConfig(block_size=B, **cfg))
        self.runner = FakeRunner(self.sched, minimal_windows)
        self.iterations = 0
        self.history: list[list[tuple[str, int, int, bool]]] = []
        self.admitted: list[str] = []  # rids in order of first admission
        self.evicted = 0
        evict = self.sched.cache.evict

        def counting_evict(n: int) -> int:
            freed = evict(n)
            self.evicted += freed
            return freed

        self.sched.cache.evict = counting_evict  # type: ignore[method-assign]
        preempt = self.sched._preempt

        def checked_preempt(req: Request) -> None:  # the newest running request goes first
            assert req.book.arrival == max(r.book.arrival for r in self.sched.running)
            preempt(req)

        self.sched._preempt = checked_preempt  # type: ignore[method-assign]

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.sched.add_request(r)

    def schedule(self) -> list[WorkItem]:
        before = [(r, r.state.stats.blocks) for r in self.sched.running]
        items = self.sched.schedule()
        # Blocks that end in schedule() end before a forward: cut off by max_post_steps (stale K/V).
        for r, blocks in before:
            r.cutoffs = getattr(r, "cutoffs", 0) + r.state.stats.blocks - blocks  # type: ignore[attr-defined]
        check_accounting(self.sched)
        for r in self.sched.running:
            if r.rid not in self.admitted:
                self.admitted.append(r.rid)
        for it in items:
            assert it.req in self.sched.running
        assert len({id(it.req) for it in items}) == len(items), "a request got two items in one batch"
        self.history.append([(it.req.rid, it.first, it.last, it.decodes) for it in items])
        return items

    def finish_step(self, items: list[WorkItem]) -> None:
        self.sched.update(items, self.runner.run(items))
        check_accounting(self.sched)
        self.iterations += 1

    def step(self) -> list[WorkItem]:
        items = self.schedule()
        self.finish_step(items)
        return items

    def run_all(self, arrivals: dict[int, list[Request]] | None = None, max_iters: int = 20000) -> None:
        arrivals = dict(arrivals or {})
        while self.sched.has_work() or arrivals:
            self.add(*arrivals.pop(self.iterations, []))
            self.step()
            assert self.iterations < max_iters, "no progress"

    def assert_drained(self, reqs: list[Request]) -> None:
        sched, pool, cache = self.sched, self.sched.pool, self.sched.cache
        assert not sched.running and not sched.waiting and not sched.has_work()
        for r in reqs:
            assert r.finished and r.book.pages == [] and r.book.cache_node is None and r.book.tree_blocks == 0
        assert cache.protected_pages == 0
        assert pool.num_free + cache.cached_pages == pool.capacity
        assert sched.flush_cache() is True
        assert pool.num_free == pool.capacity and cache.cached_pages == 0


def assert_same_as_reference(req: Request, ref: Ref) -> None:
    assert req.finished
    assert req.output_ids() == ref.output, req.rid
    assert req.state.finish_reason is not None and req.state.finish_reason.kind == ref.finish, req.rid
    assert req.state.stats.steps == ref.steps, req.rid
    assert req.state.stats.blocks == len(ref.block_steps), req.rid
    assert getattr(req, "cutoffs", 0) == sum(ref.block_stale), req.rid
    assert (req.state.stats.m2t, req.state.stats.edits) == (ref.m2t, ref.t2t), req.rid


def workload(n: int, seed: int, max_total: int = 250) -> list[tuple[str, list[int], SamplingParams]]:
    """Prompts of many lengths (some sharing a system-prompt-like prefix), S and Q modes, short and long outputs,
    max_post_steps from 0 up. Every request fits in max_total tokens."""
    rng = random.Random(seed)
    shared = [rng.randrange(LO, HI) for _ in range(96)]
    out = []
    for k in range(n):
        plen = min(rng.choice([1, 5, 31, 32, 33, 40, 64, 70, 100, 130]), max_total - 1)
        if k % 3 == 0:
            prompt = shared[: min(plen, 96)] + [rng.randrange(LO, HI) for _ in range(max(0, plen - 96))]
        elif k % 3 == 1 and plen > 64:
            prompt = shared[:64] + [rng.randrange(LO, HI) for _ in range(plen - 64)]
        else:
            prompt = [rng.randrange(LO, HI) for _ in range(plen)]
        max_new = min(rng.choice([1, 7, 32, 40, 64, 90, 120]), max_total - plen)
        sp = sparams(
            max_new_tokens=max_new,
            mode=rng.choice(["S", "Q"]),
            max_post_steps=rng.choice([0, 1, 2, 3, None]),
            ignore_eos=(k % 7 == 3),
        )
        out.append((f"r{k}", prompt, sp))
    return out


WORK = workload(24, seed=7)
REFS = {rid: reference(p, sp) for rid, p, sp in WORK}


def fresh(work=WORK) -> list[Request]:
    return [make_req(rid, p, sp) for rid, p, sp in work]


# ------------------------------------------------------------------------------------------ tests
def test_fake_model_exercises_every_path() -> None:
    """The workload is only a good test if it reaches EOS, length, cutoffs (stale blocks), settled blocks,
    T2T edits, multi-block outputs and single-step M2T fallbacks."""
    refs = list(REFS.values())
    assert any(r.finish == "stop" for r in refs) and any(r.finish == "length" for r in refs)
    assert any(any(r.block_stale) for r in refs) and any(not all(r.block_stale) for r in refs)
    assert sum(r.t2t for r in refs) > 0
    assert any(len(r.block_steps) >= 3 for r in refs)
    assert any(r.output and r.output[-1] == EOS for r in refs)
    # the official loop ends a block only after a mask-free forward unless cut off, so steps >= blocks
    assert all(r.steps >= len(r.block_steps) - sum(r.block_stale) for r in refs)


def test_reference_is_deterministic_and_context_sensitive() -> None:
    rid, p, sp = WORK[5]
    assert reference(p, sp) == REFS[rid]
    other = reference([p[0] + 1] + p[1:], sp)  # one prompt token differs -> a different output
    assert other.output != REFS[rid].output


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_batched_outputs_equal_solo_reference(policy: str, prefix_cache: bool) -> None:
    # without the prefix cache a freed page may come back to the same block holding exact K/V by luck
    h = Harness(policy=policy, enable_prefix_cache=prefix_cache, minimal_windows=prefix_cache)
    reqs = fresh()
    # continuous batching: requests arrive while others are mid-way
    arrivals = {0: reqs[:8], 3: reqs[8:14], 7: reqs[14:20], 20: reqs[20:]}
    h.run_all(arrivals)
    for r in reqs:
        assert_same_as_reference(r, REFS[r.rid])
    assert max(len(b) for b in h.history) >= 8  # really batched
    assert h.sched.num_preemptions == 0
    h.assert_drained(reqs)


@pytest.mark.parametrize(
    "cfg",
    [
        dict(num_pages=12, max_running_requests=8),
        dict(num_pages=9, max_running_requests=16, max_prefill_tokens=64),
        dict(num_pages=16, max_running_requests=6, policy="lpm", max_prefill_tokens=32),
    ],
    ids=["12pages", "9pages-chunked", "16pages-lpm"],
)
def test_small_pool_evicts_and_preempts_without_changing_outputs(cfg: dict) -> None:
    h = Harness(**cfg)
    reqs = fresh()
    assert max(r.total_blocks for r in reqs) <= cfg["num_pages"]
    h.run_all({0: reqs[:12], 5: reqs[12:]})
    assert h.sched.num_preemptions > 0
    assert h.evicted > 0
    for r in reqs:
        assert_same_as_reference(r, REFS[r.rid])
    h.assert_drained(reqs)


def test_stats_survive_preemption() -> None:
    """Preemption restarts the active block; the step count is restored, and so must the M2T/T2T counters be,
    or meta_info/metrics count the discarded attempt."""
    h = Harness(num_pages=9, max_running_requests=16, max_prefill_tokens=64)
    reqs = fresh()
    h.run_all({0: reqs})
    assert h.sched.num_preemptions > 0
    for r in reqs:
        ref = REFS[r.rid]
        assert (r.state.stats.steps, r.state.stats.m2t, r.state.stats.edits) == (ref.steps, ref.m2t, ref.t2t), r.rid


def test_no_page_held_twice_and_pool_balances_every_iteration() -> None:
    """check_accounting runs after every schedule() and update(); here also check the page tables directly."""
    h = Harness(num_pages=12, max_running_requests=8)
    reqs = fresh()
    h.add(*reqs)
    while h.sched.has_work():
        items = h.schedule()
        tables = [it.req.book.pages[: it.last + 1] for it in items]
        for it in items:  # every block of a window has its own page
            assert len(set(it.req.book.pages)) == len(it.req.book.pages)
        owned = [p for it in items for p in it.req.book.pages[it.req.book.tree_blocks :]]
        assert len(owned) == len(set(owned))
        assert all(len(t) == it.last + 1 for t, it in zip(tables, items))
        h.finish_step(items)
        assert h.iterations < 5000
    h.assert_drained(reqs)


def test_flush_cache_refused_while_a_request_reads_the_tree() -> None:
    h = Harness()
    prompt = [LO + i for i in range(100)]
    a = make_req("a", prompt, sparams(max_new_tokens=64))
    h.add(a)
    h.run_all()
    b = make_req("b", prompt, sparams(max_new_tokens=64))
    h.add(b)
    h.step()
    assert b.book.prefix_cached_tokens == 96 and b.book.tree_blocks >= 3
    used = h.sched.pool.num_free
    assert h.sched.flush_cache() is False
    assert h.sched.pool.num_free == used
    h.run_all()
    h.assert_drained([a, b])


def test_prefix_cache_reuses_prompt_then_generated_blocks() -> None:
    h = Harness()
    rng = random.Random(3)
    prompt = [rng.randrange(LO, HI) for _ in range(100)]
    sp = sparams(max_new_tokens=92, ignore_eos=True, mode="Q")  # 100 + 92 = 6 whole blocks
    ref = reference(prompt, sp)

    a = make_req("a", prompt, sp)
    h.add(a)
    h.run_all()
    assert a.book.prefix_cached_tokens == 0
    assert_same_as_reference(a, ref)

    b = make_req("b", prompt, sp)
    h.add(b)
    h.step()
    assert b.book.prefix_cached_tokens == 96  # 3 whole prompt blocks; the partial 4th is never shared
    assert b.book.exact_blocks == 3 and b.book.pages[:3] == tree_pages(h.sched.cache, prompt)
    h.run_all()
    assert_same_as_reference(b, ref)

    # next chat turn: the previous prompt, the answer, and a new user message
    turn2 = prompt + a.output_ids() + [rng.randrange(LO, HI) for _ in range(40)]
    sp2 = sparams(max_new_tokens=40, mode="Q")
    c = make_req("c", turn2, sp2)
    h.add(c)
    h.step()
    # blocks 3..5 hold generated tokens; a block cut off by max_post_steps at the very end has stale K/V
    expected_blocks = 6 - (1 if ref.block_stale[-1] else 0)
    assert c.book.prefix_cached_tokens == expected_blocks * B > 3 * B
    h.run_all()
    assert_same_as_reference(c, reference(turn2, sp2))
    h.assert_drained([a, b, c])


def test_prefix_cache_hit_when_first_request_still_running() -> None:
    """The prompt blocks enter the tree as soon as they are prefilled, not when the request ends."""
    h = Harness()
    prompt = [LO + 3 * i for i in range(100)]
    sp = sparams(max_new_tokens=120, mode="Q", threshold=0.99)  # many steps per block
    a = make_req("a", prompt, sp)
    h.add(a)
    h.step()
    h.step()
    assert not a.finished
    b = make_req("b", prompt, sp)
    h.add(b)
    h.step()
    assert b.book.prefix_cached_tokens == 96
    assert b.book.pages[:3] == a.book.pages[:3]  # the very same pages, read by both
    h.run_all()
    ref = reference(prompt, sp)
    assert_same_as_reference(a, ref)
    assert_same_as_reference(b, ref)
    h.assert_drained([a, b])


def test_prefill_budget_chunks_a_long_prompt_while_others_keep_decoding() -> None:
    h = Harness(max_prefill_tokens=64)
    rng = random.Random(11)
    sp = sparams(max_new_tokens=120, mode="Q", threshold=0.95, ignore_eos=True)
    d1 = make_req("d1", [rng.randrange(LO, HI) for _ in range(20)], sp)
    d2 = make_req("d2", [rng.randrange(LO, HI) for _ in range(50)], sp)
    h.add(d1, d2)
    h.step()
    h.step()
    long_sp = sparams(max_new_tokens=40, mode="S")
    r = make_req("long", [rng.randrange(LO, HI) for _ in range(300)], long_sp)
    h.add(r)
    chunks = []
    while True:
        items = h.schedule()
        by_rid = {it.req.rid: it for it in items}
        for d in (d1, d2):  # the decoding requests are never starved by the prefill
            assert not d.finished
            assert d.rid in by_rid and by_rid[d.rid].decodes
        it = by_rid["long"]
        chunks.append((it.first, it.last, it.decodes))
        prefill = sum(
            (i.last - i.first + 1) * B for i in items if not i.decodes
        )  # prefill-only chunks respect the budget
        assert prefill <= 64
        h.finish_step(items)
        if it.decodes:
            break
    assert r.first_block == 9
    prefill_chunks = [c for c in chunks if not c[2]]
    assert len(prefill_chunks) >= 3
    expect_first = 0
    for first, last, _ in prefill_chunks:  # contiguous whole-block chunks from block 0, <= 64 tokens each
        assert first == expect_first and (last - first + 1) * B <= 64
        expect_first = last + 1
    first, last, decodes = chunks[-1]
    assert decodes and first == expect_first and last == 9
    # the decoding window may carry one uncached block beyond the budget (the same allowance a stale block gets)
    assert (last - first) * B <= 64 + B
    assert chunks == [(0, 1, False), (2, 3, False), (4, 5, False), (6, 9, True)]
    assert r.state.stats.steps == 1
    h.run_all()
    for q in (d1, d2, r):
        assert_same_as_reference(q, reference(q.prompt_ids, q.params))
    h.assert_drained([d1, d2, r])


def test_max_running_requests_and_fcfs_admission() -> None:
    h = Harness(max_running_requests=3)
    reqs = fresh(WORK[:10])
    h.add(*reqs)
    while h.sched.has_work():
        items = h.schedule()
        assert len(h.sched.running) <= 3 and len(items) <= 3
        if h.sched.waiting:  # work-conserving: a free slot is filled at once
            assert len(h.sched.running) == 3
        h.finish_step(items)
    assert h.admitted == [r.rid for r in reqs]
    for r in reqs:
        assert_same_as_reference(r, REFS[r.rid])
    h.assert_drained(reqs)


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
def test_lpm_admits_longest_cached_prefix_first(policy: str) -> None:
    h = Harness(max_running_requests=1, policy=policy)
    rng = random.Random(5)
    x = [rng.randrange(LO, HI) for _ in range(130)]
    seed = make_req("seed", x, sparams(max_new_tokens=8))
    h.add(seed)
    h.run_all()
    sp = sparams(max_new_tokens=40)
    a = make_req("a", [rng.randrange(LO, HI) for _ in range(100)], sp)  # nothing cached
    b = make_req("b", x[:40] + [rng.randrange(LO, HI) for _ in range(60)], sp)  # 1 block cached
    c = make_req("c", x[:128] + [rng.randrange(LO, HI) for _ in range(10)], sp)  # 4 blocks cached
    h.admitted.clear()
    h.add(a, b, c)
    h.run_all()
    if policy == "lpm":
        assert h.admitted == ["c", "b", "a"]
    else:
        assert h.admitted == ["a", "b", "c"]
    assert (a.book.prefix_cached_tokens, b.book.prefix_cached_tokens, c.book.prefix_cached_tokens) == (0, 32, 128)
    for r in (a, b, c):
        assert_same_as_reference(r, reference(r.prompt_ids, sp))
    h.assert_drained([seed, a, b, c])


def test_queue_full_and_request_too_large() -> None:
    h = Harness(num_pages=6, max_queued_requests=2, max_running_requests=1)
    sp = sparams(max_new_tokens=32)
    r = [make_req(f"q{i}", [LO + i] * 10, sp) for i in range(5)]
    h.add(r[0], r[1])
    with pytest.raises(QueueFull):
        h.add(r[2])
    assert [q.rid for q in h.sched.waiting] == ["q0", "q1"]
    h.step()  # q0 admitted: one waiting slot frees up
    h.add(r[2])
    with pytest.raises(QueueFull):
        h.add(r[3])
    # 6 pages = 192 tokens of KV: 100 + 100 needs 7 blocks, 100 + 92 exactly 6
    too_big = make_req("big", [LO] * 100, sparams(max_new_tokens=100))
    h2 = Harness(num_pages=6)
    with pytest.raises(RequestTooLarge):
        h2.add(too_big)
    assert not h2.sched.waiting
    fits = make_req("fits", [LO + 1] * 100, sparams(max_new_tokens=92, ignore_eos=True))
    assert fits.total_blocks == 6
    # the cache also holds someone else's blocks: they must be evicted, not make "fits" fail
    other = make_req("other", [LO + 2] * 64, sparams(max_new_tokens=64, ignore_eos=True))
    h2.add(other)
    h2.run_all()
    assert h2.sched.cache.cached_pages > 0
    h2.add(fits)
    h2.run_all()
    assert_same_as_reference(fits, reference(fits.prompt_ids, fits.params))
    h2.assert_drained([other, fits])
    h.run_all()
    h.assert_drained(r[:3])


def _assert_aborted(h: Harness, req: Request) -> None:
    assert req.finished and req.state.finish_reason is not None and req.state.finish_reason.kind == "abort"
    assert req.book.pages == [] and req.book.cache_node is None
    assert req not in h.sched.running and req not in h.sched.waiting
    check_accounting(h.sched)
    free, cached = h.sched.pool.num_free, h.sched.cache.cached_pages
    assert h.sched.abort(req.rid) is False  # idempotent
    assert (h.sched.pool.num_free, h.sched.cache.cached_pages) == (free, cached)
    assert req.state.finish_reason.kind == "abort"


def _abort_admitted_then_partly_prefilled(h: "Harness", rng: random.Random) -> tuple:
    """Stages 2 and 3 of test_abort_at_every_stage; returns (a1, a2)."""
    # 2. admitted, no forward yet: aborted between schedule() and update() (while its forward runs)
    a1 = make_req("a1", [rng.randrange(LO, HI) for _ in range(200)], sparams(max_new_tokens=64))
    h.add(a1)
    items = h.schedule()
    assert a1 in h.sched.running and a1.state.stats.steps == 0
    assert any(it.req is a1 for it in items)
    used_before = h.sched.pool.num_used
    assert h.sched.abort("a1") is True
    assert h.sched.pool.num_used < used_before
    h.finish_step(items)
    _assert_aborted(h, a1)
    assert a1.state.stats.steps == 0

    # 3. admitted and partly prefilled (in chunks), still no denoising step, aborted between iterations
    a2 = make_req("a2", [rng.randrange(LO, HI) for _ in range(260)], sparams(max_new_tokens=64))
    h.add(a2)
    h.step()
    assert a2 in h.sched.running and a2.state.stats.steps == 0 and 0 < a2.book.exact_blocks < a2.state.active_block
    assert h.sched.abort("a2") is True
    _assert_aborted(h, a2)
    return a1, a2


def test_abort_at_every_stage() -> None:
    h = Harness(max_running_requests=4, max_prefill_tokens=64)
    rng = random.Random(9)
    others = [
        make_req("o0", [rng.randrange(LO, HI) for _ in range(40)], sparams(max_new_tokens=100, mode="Q")),
        make_req("o1", [rng.randrange(LO, HI) for _ in range(70)], sparams(max_new_tokens=80, mode="S")),
        make_req("o2", [rng.randrange(LO, HI) for _ in range(33)], sparams(max_new_tokens=120, ignore_eos=True)),
    ]
    h.add(others[0], others[1])

    # 1. still waiting, never scheduled
    w = make_req("w", [rng.randrange(LO, HI) for _ in range(50)], sparams(max_new_tokens=64))
    h.add(w)
    assert h.sched.abort("w") is True
    _assert_aborted(h, w)

    h.step()  # o0 and o1 admitted (their prefill uses this iteration's budget)
    assert len(h.sched.running) == 2

    a1, a2 = _abort_admitted_then_partly_prefilled(h, rng)

    # 4. waiting because every slot is taken
    h.add(others[2])
    f1 = make_req("f1", [rng.randrange(LO, HI) for _ in range(10)], sparams(max_new_tokens=20))
    w2 = make_req("w2", [rng.randrange(LO, HI) for _ in range(10)], sparams(max_new_tokens=20))
    h.add(f1, w2)
    h.step()
    assert len(h.sched.running) == 4 and w2 in h.sched.waiting
    assert h.sched.abort("w2") is True
    _assert_aborted(h, w2)

    # 5. mid-block: some steps done, masks left in the active block
    m = make_req("m", [rng.randrange(LO, HI) for _ in range(33)], sparams(max_new_tokens=90, threshold=0.99))
    h.add(m)
    while not (m.state.stats.steps >= 2 and MASK in m.active_tokens() and m in h.sched.running):
        h.step()
        assert not m.finished and h.iterations < 500
    assert h.sched.abort("m") is True
    _assert_aborted(h, m)

    # 6. after it finished on its own: abort changes nothing
    while not f1.finished:
        h.step()
    out, reason = f1.output_ids(), f1.state.finish_reason
    assert h.sched.abort("f1") is False
    assert f1.output_ids() == out and f1.state.finish_reason is reason
    assert h.sched.abort("no-such-request") is False

    h.run_all()
    for r in others + [f1]:
        assert_same_as_reference(r, reference(r.prompt_ids, r.params))
    h.assert_drained(others + [w, a1, a2, w2, m, f1])


def test_abort_everything_mid_run_frees_all_pages() -> None:
    h = Harness(num_pages=12, max_running_requests=8)
    reqs = fresh()
    h.add(*reqs)
    for _ in range(15):
        h.step()
    assert h.sched.running and h.sched.waiting
    for r in reversed(reqs):
        h.sched.abort(r.rid)
        check_accounting(h.sched)
    h.assert_drained(reqs)


def test_abort_with_a_reason_ends_a_request_where_told() -> None:
    """What a consumer that matched a stop string does: end the request at once, as `stop`, its output cut to
    the tokens it had seen; the other request is untouched."""
    h = Harness()
    rng = random.Random(2)
    sp = sparams(max_new_tokens=200, ignore_eos=True, mode="Q")
    s = make_req("stopme", [rng.randrange(LO, HI) for _ in range(20)], sp)
    o = make_req("other", [rng.randrange(LO, HI) for _ in range(20)], sp)
    h.add(s, o)
    while s.state.stats.blocks < 3:  # block 0 ends with 12 generated tokens, block 1 with 44, block 2 with 76
        h.step()
    ref = reference(s.prompt_ids, sp)
    assert h.sched.abort("stopme", FinishReason("stop", matched="</s>"), keep_tokens=50)
    assert not h.sched.abort("stopme")  # idempotent
    h.run_all()
    assert s.state.finish_reason == FinishReason("stop", matched="</s>")
    assert s.state.stats.blocks == 3
    assert s.output_ids() == ref.tokens[20 : 20 + 50]
    assert s.state.stats.steps == ref.block_steps[2]
    assert_same_as_reference(o, reference(o.prompt_ids, sp))
    h.assert_drained([s, o])


def test_stop_token_ids_end_a_request_at_their_block() -> None:
    rng = random.Random(4)
    prompt = [rng.randrange(LO, HI) for _ in range(20)]
    base = sparams(max_new_tokens=90, ignore_eos=True, mode="Q")
    free_run = reference(prompt, base)
    tok = free_run.output[40]  # generated in block 1
    f = free_run.output.index(tok)
    sp = sparams(max_new_tokens=90, ignore_eos=True, mode="Q", stop_token_ids=(tok,))
    ref = reference(prompt, sp)
    assert ref.output == free_run.output[: f + 1] and ref.finish == "stop"
    blk = (len(prompt) + f) // B
    assert ref.steps == free_run.block_steps[blk]  # decoding stops after the block that holds it
    h = Harness()
    r = make_req("r", prompt, sp)
    o = make_req("o", prompt, base)
    h.add(r, o)
    h.run_all()
    assert_same_as_reference(r, ref)
    assert r.state.finish_reason.matched == tok
    assert_same_as_reference(o, free_run)
    h.assert_drained([r, o])


def _find_prompt(pred, sp: SamplingParams, plen: int, seed: int) -> tuple[list[int], Ref]:
    rng = random.Random(seed)
    for _ in range(400):
        prompt = [rng.randrange(LO, HI) for _ in range(plen)]
        ref = reference(prompt, sp)
        if pred(prompt, ref):
            return prompt, ref
    raise AssertionError("no prompt with the wanted property")


def test_max_new_tokens_cuts_inside_the_last_block() -> None:
    sp = sparams(max_new_tokens=40, mode="Q")
    # EOS decoded in the last block, but only after max_new_tokens: the output is cut, finish is "length"
    p1, ref1 = _find_prompt(
        lambda p, r: EOS not in r.tokens[10:50] and EOS in r.tokens[50:64], sp, plen=10, seed=21
    )
    # EOS inside the kept part of the last block: finish "stop", the output ends with it
    p2, ref2 = _find_prompt(lambda p, r: EOS not in r.tokens[10:32] and EOS in r.tokens[32:50], sp, plen=10, seed=22)
    h = Harness()
    r1, r2 = make_req("r1", p1, sp), make_req("r2", p2, sp)
    r3 = make_req("r3", p1, sparams(max_new_tokens=40, mode="Q", ignore_eos=True))
    h.add(r1, r2, r3)
    h.run_all()
    assert r1.state.finish_reason.kind == "length" and len(r1.output_ids()) == 40
    assert len(r1.state.tokens) == 64 and MASK not in r1.state.tokens  # the whole last block was decoded
    assert_same_as_reference(r1, ref1)
    assert r2.state.finish_reason == FinishReason("stop", matched=EOS) and r2.output_ids()[-1] == EOS
    assert len(r2.output_ids()) < 40
    assert_same_as_reference(r2, ref2)
    assert r3.output_ids() == r1.output_ids() and r3.state.finish_reason.kind == "length"
    h.assert_drained([r1, r2, r3])


def test_one_token_and_one_block_requests() -> None:
    h = Harness()
    cases = [
        make_req("t1", [LO] * 32, sparams(max_new_tokens=1, ignore_eos=True)),  # a whole block for one token
        make_req("t2", [LO + 1] * 31, sparams(max_new_tokens=1, max_post_steps=0)),  # shares the prompt block
        make_req("t3", [LO + 2], sparams(max_new_tokens=31, mode="S")),
    ]
    h.add(*cases)
    h.run_all()
    for r in cases:
        assert_same_as_reference(r, reference(r.prompt_ids, r.params))
        assert len(r.output_ids()) <= r.params.max_new_tokens
    h.assert_drained(cases)



def test_recompute_prefix_starts_every_query_at_block_zero() -> None:
    """The benchmark baseline (SchedulerConfig.recompute_prefix): no K/V is reused, not even a request's own
    earlier blocks, and nothing enters the tree; the output is unchanged."""
    sched = Scheduler(SchedulerConfig(num_pages=100, block_size=B, recompute_prefix=True))
    req = make_req("a", list(range(LO, LO + 70)), sparams(max_new_tokens=70, ignore_eos=True))
    sched.add_request(req)
    firsts = []
    while sched.has_work():
        items = sched.schedule()
        firsts += [it.first for it in items]
        out = StepOutput()
        for it in items:
            if it.decodes:
                window = it.req.window_tokens()
                out.tokens.append([LO if t == MASK else t for t in window])
                out.had_mask.append(MASK in window)
                out.m2t.append(window.count(MASK))
                out.t2t.append(0)
        sched.update(items, out)
    assert firsts and set(firsts) == {0}
    assert req.output_ids() == [LO] * 70 and req.book.prefix_cached_tokens == 0 and sched.cache.cached_pages == 0
