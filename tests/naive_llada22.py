"""A deliberately naive reference of LLaDA2.2's Levenshtein block loop (insert/delete on top of M2T and T2T).

Written line for line from ../shared/reference/llada22-decoding.md, "Decoding one block", steps 1-13, for one
request at temperature 0: every forward recomputes the whole sequence through the active block (no cache), and
every rule is scalar Python over the block's positions. Shares no code with redraft; the logits come from any
`LogitsModel` (tests/naive_llada2.py's NaiveLLaDA2). Decisions taken where the definition leaves room are the
ones docs/llada22.md lists ("Decisions where the definition was ambiguous"); keep the two in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from naive_llada2 import BLOCK, LogitsModel

ANTI_LOOP_ROUNDS = 5


@dataclass
class Settings:
    threshold: float = 0.5
    edit_threshold: float = 0.0
    steps: int = 32
    max_post_steps: int = 16
    max_steps_per_block: int = 1000


@dataclass
class Counts:
    forwards: int = 0
    deletions: int = 0  # DELETE written by a step (dropped by its scan)
    insertions: int = 0  # SPLIT written by a step (a mask inserted by its scan)
    blocks: int = 0
    escapes: int = 0  # anti-loop replacements (step 11)
    final_rounds: int = 0
    converged: int = 0  # blocks that ended on a forward that found no mask and changed nothing
    forwards_per_block: list[int] = field(default_factory=list)


def structural_scan(x: list[int], y: list[int], orig: list[bool], prompt: list[bool], *, mask_id: int, del_id: int,
                    spl_id: int) -> tuple[list[int], list[bool]]:
    """Step 12, the scalar oracle: the block after DELETE drops its position and SPLIT puts a mask before the
    position's previous token, cut or padded to the block's length."""
    z: list[int] = []
    zo: list[bool] = []
    for i in range(len(y)):
        if prompt[i]:
            z.append(y[i])
            zo.append(False)
        elif y[i] == del_id:
            continue
        elif y[i] == spl_id:
            z += [mask_id, x[i]]
            zo += [False, orig[i]]
        else:
            z.append(y[i])
            zo.append(orig[i])
    z, zo = z[: len(y)], zo[: len(y)]
    return z + [mask_id] * (len(y) - len(z)), zo + [False] * (len(y) - len(zo))


def _argmax_excluding(row: torch.Tensor, excluded: set[int]) -> int:
    """The lowest id with the largest logit among ids not in `excluded` (row: [V])."""
    best, best_val = -1, float("-inf")
    for t in range(row.shape[0]):
        if t in excluded:
            continue
        val = float(row[t])
        if best < 0 or val > best_val:
            best, best_val = t, val
    return best


class Block:
    """The state of one block (the spec's `x, orig, N, step, post, finalized, seen`) and its iterations."""

    def __init__(self, tokens: list[int], prompt: list[bool], s: Settings, ids: tuple[int, int, int]):
        self.mask_id, self.del_id, self.spl_id = ids
        self.x, self.prompt, self.s = list(tokens), prompt, s
        self.orig = [tokens[i] == self.mask_id and not prompt[i] for i in range(len(tokens))]
        self.N = sum(self.orig)
        self.step = 0
        self.post = 0
        self.finalized = self.N == 0
        self.seen: list[list[int]] = []

    def iterate(self, logits: torch.Tensor, counts: Counts) -> bool:
        """Steps 2-13 on this forward's logits [B, V] (fp32 or wider); returns True when the block commits."""
        B, s, MASK = len(self.x), self.s, self.mask_id
        x, orig, prompt = self.x, self.orig, self.prompt
        # 2, 3
        self.post = 0 if any(orig[i] and x[i] == MASK for i in range(B)) else self.post + 1
        final = (s.max_post_steps > 0 and self.post >= s.max_post_steps) or self.step >= s.max_steps_per_block - 1
        # 4
        logits = logits.clone()
        logits[:, MASK] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        v = [_argmax_excluding(logits[i], set()) for i in range(B)]
        p = [float(probs[i, v[i]]) for i in range(B)]
        # 5
        masked = [x[i] == MASK and not prompt[i] for i in range(B)]
        new = sum(1 for i in range(B) if masked[i] and not orig[i])
        n_masked = sum(masked)
        # 6
        m2t = self._scheduled(masked, p, new, n_masked, final)
        # 7
        if s.max_post_steps == 0 and not any(orig[i] and masked[i] and not m2t[i] for i in range(B)):
            final = True
            m2t = list(masked)
        # 8
        t2t = [not masked[i] and not prompt[i] and v[i] != x[i] and p[i] > s.edit_threshold for i in range(B)]
        # 9
        w = [m2t[i] or t2t[i] for i in range(B)]
        if final:
            for i in range(B):
                if w[i] and v[i] in (self.del_id, self.spl_id):
                    v[i] = _argmax_excluding(logits[i], {MASK, self.del_id, self.spl_id})
        # 10
        y = [v[i] if w[i] else x[i] for i in range(B)]
        # 11
        if not final:
            self._escape(logits, x, y, p, counts)
            self.seen.append(list(y))
        counts.deletions += sum(1 for i in range(B) if not prompt[i] and y[i] == self.del_id)
        counts.insertions += sum(1 for i in range(B) if not prompt[i] and y[i] == self.spl_id)
        # 12
        z, zo = structural_scan(x, y, orig, prompt, mask_id=MASK, del_id=self.del_id, spl_id=self.spl_id)
        # 13
        changed_any = z != x
        had_mask = any(masked)
        self.x, self.orig = z, zo
        self.step += 1
        if final:
            counts.final_rounds += 1
            self.finalized = True
            return False
        return not had_mask and not changed_any


    def _scheduled(self, masked: list[bool], p: list[float], new: int, n_masked: int, final: bool) -> list[bool]:
        """Step 6: which masks are written (every one in a final round or past the schedule)."""
        B, s = len(self.x), self.s
        if final or self.step >= s.steps:
            return list(masked)
        need = self.N // s.steps + (1 if self.step < self.N % s.steps else 0) + new
        hi = [masked[i] and p[i] > s.threshold for i in range(B)]
        if sum(hi) >= need:
            return hi
        order = sorted((i for i in range(B) if masked[i]), key=lambda i: (-p[i], i))
        chosen = set(order[: min(need, n_masked)])
        return [i in chosen for i in range(B)]

    def _escape(self, logits: torch.Tensor, x: list[int], y: list[int], p: list[float], counts: Counts) -> None:
        """Step 11, in place on y: while y repeats an earlier pre-scan block, its least confident changed position
        takes its next-best token (MASK and the tokens tried there left out)."""
        tried: dict[int, set[int]] = {}
        for _ in range(ANTI_LOOP_ROUNDS):
            if y not in self.seen:
                break
            changed = [i for i in range(len(x)) if y[i] != x[i]]
            if not changed:
                break
            c = min(changed, key=lambda i: (p[i], i))
            counts.escapes += 1
            tried.setdefault(c, set()).add(y[c])
            y[c] = _argmax_excluding(logits[c], {self.mask_id} | tried[c])

def naive_generate_llada22(model: LogitsModel, input_ids: list[int], *, max_new_tokens: int, settings: Settings,
                           mask_id: int, del_id: int, spl_id: int, stop_ids: set[int],
                           block: int = BLOCK) -> tuple[list[int], Counts]:
    """Returns (output ids, counts); counts.forwards is meta_info.steps (every forward, stability ones included)."""
    P = len(input_ids)
    first_block, last_block = P // block, (P + max_new_tokens - 1) // block
    x = list(input_ids) + [mask_id] * ((last_block + 1) * block - P)
    counts = Counts()
    for b in range(first_block, last_block + 1):
        lo, hi = b * block, (b + 1) * block
        prompt = [i < P for i in range(lo, hi)]
        blk = Block(x[lo:hi], prompt, settings, (mask_id, del_id, spl_id))
        n = 0
        while True:
            logits = model.forward_logits(torch.tensor(x[:lo] + blk.x))[lo:hi]  # [B, V], the whole prefix again
            counts.forwards += 1
            n += 1
            if blk.finalized:  # 1: the stability forward
                break
            if blk.iterate(logits, counts):
                counts.converged += 1
                break
        x[lo:hi] = blk.x
        counts.blocks += 1
        counts.forwards_per_block.append(n)
        assert not {mask_id, del_id, spl_id} & set(x[max(P, lo):hi]), "a committed block holds MASK/DEL/SPL"
        if any(t in stop_ids for t in x[P:hi]):
            break
    out = x[P : P + max_new_tokens]
    cut = next((i for i, t in enumerate(out) if t in stop_ids), None)
    return (out if cut is None else out[: cut + 1]), counts
