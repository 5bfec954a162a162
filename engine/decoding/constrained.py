"""Structured output under draft-and-edit decoding: the frontier sweep (docs/structured-output.md).

Grammar matchers read text left to right; diffusion places tokens anywhere in a block and edits them later.
A constrained request keeps a frontier f: tokens[prompt_len:f] hold no mask and the matcher has consumed
exactly them. Invariant: nothing at or past f is streamed, committed, cached or allowed to leave an MBE
window. It holds by construction: a block ends only when its window has no mask and nothing changed, and
after every sweep the window either has a mask at f or f has passed the whole window (or the grammar has
ended), so a block never ends with a tentative token in it.

After the ordinary joint-threshold step (thresholds unchanged; its proposals at or past f are tentative):
  1. A T2T edit at j < f is kept only if the prefix with it, through f, still validates (roll back, validate,
     restore otherwise).
  2. Sweep from f: forced tokens are placed at once (fast-forward); a token the grammar accepts advances f;
     at a rejected or masked position the best grammar-allowed candidate among the model's top-k that passes
     the M2T threshold is placed; failing that, if nothing was placed yet in this forward, the grammar-masked
     argmax is (at least one token per forward: decoding always ends); otherwise the position is re-masked
     and the sweep stops.
  3. A stop token (EOS, the request's stop_token_ids) is accepted only where the grammar may end; after it
     the grammar is done and the rest of the window is free (it is cut from the output). A stop token the
     model places at the frontier where the grammar cannot end yet says the answer is complete: the grammar
     is closed there by the shortest run of punctuation tokens that lets it end (`}` after `{"answer":19`),
     found breadth-first within a fixed number of matcher probes, and the stop token follows it.
A grammar that allows nothing and cannot end (its matcher failed, or the constraint was unsatisfiable) raises
GrammarDeadEnd: the request ends with an error, never with unconstrained text.
Every decision reads only the request's own logits and its grammar: batch-invariant.
Torch-free; the model runner hands in the window, the top-k candidates and an argmax over allowed tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from redraft.engine.text.grammar import GrammarDeadEnd, GrammarMatcher

__all__ = ["Constraint", "GrammarDeadEnd", "GrammarStats"]


MAX_CLOSING = 4  # tokens in a closing run at most
CLOSING_PROBES = 512  # matcher probes a closing search may spend


@dataclass
class GrammarStats:
    rejected: int = 0  # tokens the model placed that the grammar refused (at or past f, or edits before it)
    remasked: int = 0  # of those, positions put back to MASK (the rest took an allowed candidate)
    forced: int = 0  # tokens the grammar forced (fast-forward) where the model had something else or a mask
    seconds: float = 0.0  # host time spent in sweeps


class Constraint:
    """One request's grammar state: the frontier (an absolute position) and a matcher that has consumed
    exactly tokens[prompt_len:frontier]. `done_at` (None while the grammar is open): where it ended, the
    position of the stop token that ended it (`stop_placed`), or, when it completed with no stop token to place
    (ignore_eos and no stop_token_ids), the first position after it; from there on the window is free."""

    def __init__(self, matcher: GrammarMatcher, prompt_len: int, stop_ids: frozenset[int], eos_id: int,
                 vocab_size: int, closers: tuple[int, ...] = ()):
        self.matcher = matcher
        self.closers = closers  # single-character punctuation tokens a closing run is made of (Grammars.closers)
        self.mask_bytes = (vocab_size + 31) // 32 * 4
        self.prompt_len = prompt_len
        self.stop_ids = stop_ids
        self.eos_id = eos_id
        self.frontier = prompt_len
        self.consumed: list[int] = []  # == tokens[prompt_len:frontier], up to done_at
        self.done_at: int | None = None
        self.stop_placed = False
        self.stats = GrammarStats()

    @property
    def done(self) -> bool:
        return self.done_at is not None

    # ---- keeping the matcher on the tokens ------------------------------------------------------------
    def restart(self, tokens: list[int], block_start: int) -> None:
        """A block (re)began with the request's `tokens` (a preempted request restarts its active block and
        restores its window): the frontier goes back to the block's start and the matcher to the common
        prefix of what it consumed and what is there now."""
        start = max(block_start, self.prompt_len)
        if self.done_at is not None and self.done_at < start:
            return  # the grammar ended in a committed block: nothing to redo
        self.done_at, self.stop_placed = None, False
        target = tokens[self.prompt_len : start]
        common = 0
        while common < min(len(target), len(self.consumed)) and target[common] == self.consumed[common]:
            common += 1
        self.matcher.rollback(len(self.consumed) - common)
        del self.consumed[common:]
        self._take(target[common:])
        self.frontier = start

    def begin_block(self, tokens: list[int], block_start: int, block_end: int) -> None:
        """Before the first forward of a block: `restart`, then the tokens the grammar forces are written into
        `tokens` at once, so that the forward already reads them."""
        self.restart(tokens, block_start)
        if self.done or self.matcher.is_stopped():
            return
        forced = self.matcher.forced_tokens()[: block_end - self.frontier]
        if forced:
            tokens[self.frontier : self.frontier + len(forced)] = forced
            self._take(forced)
            self.frontier += len(forced)
            self.stats.forced += len(forced)

    def _take(self, tokens: list[int]) -> None:
        self.matcher.consume(tokens)
        self.consumed += tokens

    def _drop(self, n: int) -> None:
        self.matcher.rollback(n)
        del self.consumed[len(self.consumed) - n :]

    def _fits(self, tokens: list[int]) -> tuple[bool, int | None]:
        """Whether `tokens` continue the consumed text validly, and the index of a stop token that ends the
        grammar inside them (everything after it is free). Leaves the matcher as it was."""
        stop = next((k for k, t in enumerate(tokens) if t in self.stop_ids), None)
        body = tokens if stop is None else tokens[:stop]
        if self.matcher.count_valid(body) < len(body):
            return False, None
        if stop is None:
            return True, None
        self.matcher.consume(body)
        accepting = self.matcher.is_accepting()
        self.matcher.rollback(len(body))
        return accepting, stop

    def _accept(self, token: int, pos: int) -> bool:
        """Consume one token at `pos` (== frontier) if the grammar allows it there."""
        ok, stop = self._fits([token])
        if not ok:
            return False
        if stop is not None:
            self.done_at, self.stop_placed = pos, True
        else:
            self._take([token])
        return True

    def allowed(self) -> bytes | None:
        """The bitmask of tokens allowed at the frontier: stop tokens exactly where the grammar may end
        (None: nothing is allowed; the grammar has ended and there is no stop token to place). GrammarDeadEnd
        when nothing is allowed and the grammar cannot end: no output can satisfy it from here."""
        accepting = self.matcher.is_accepting()
        if self.matcher.is_stopped():
            if not accepting:
                self._dead_end()
            if not self.stop_ids:
                return None
            mask = bytearray(self.mask_bytes)
        else:
            mask = bytearray(self.matcher.allowed_bitmask())
        for t in self.stop_ids:
            if t // 8 < len(mask):
                mask[t // 8] = mask[t // 8] | (1 << t % 8) if accepting else mask[t // 8] & ~(1 << t % 8) & 0xFF
        if any(mask):
            return bytes(mask)
        if not accepting:
            self._dead_end()
        return None

    def _dead_end(self) -> None:
        raise GrammarDeadEnd(f"the output constraint reached a dead end after {len(self.consumed)} tokens: no "
                             "continuation satisfies it (the request ends with an error, not unconstrained text)")

    def _closing(self, room: int) -> list[int] | None:
        """The shortest run of closer tokens (at most MAX_CLOSING, within `room`) after which the grammar may
        end, breadth-first in token order, within CLOSING_PROBES matcher probes (a fuel bound: deterministic)."""
        layer: list[list[int]] = [[]]
        probes = 0
        for _ in range(min(MAX_CLOSING, room)):
            grown = []
            for run in layer:
                for t in self.closers:
                    probes += 1
                    if probes > CLOSING_PROBES:
                        return None
                    trial = run + [t]
                    if self.matcher.count_valid(trial) < len(trial):
                        continue
                    self.matcher.consume(trial)
                    accepting = self.matcher.is_accepting()
                    self.matcher.rollback(len(trial))
                    if accepting:
                        return trial
                    grown.append(trial)
            layer = grown
        return None

    def _close(self, ws: int, i: int, out: list[int], stop: int) -> bool:
        """The model placed a stop token at the frontier where the grammar cannot end yet: it wants to stop.
        Close the grammar with the shortest run of closers (`}`, `"]}`, ...) and the stop token after it, when
        both fit in the window. Returns whether it did."""
        run = self._closing(len(out) - i - 1)
        if run is None:
            return False
        self.stats.forced += len(run)
        out[i : i + len(run)] = run
        self._take(run)
        out[i + len(run)] = stop
        self.done_at, self.stop_placed = ws + i + len(run), True
        return True

    # ---- the sweep ----------------------------------------------------------------------------------
    def sweep(self, window_start: int, before: list[int], after: list[int], mask_id: int,
              candidates: Callable[[int], list[tuple[int, float]]], threshold: float,
              masked_argmax: Callable[[int, bytes], int]) -> list[int]:
        """The window after this forward, corrected for the grammar. `before`/`after`: the window's tokens
        before and after the plain step; candidates(i): the model's top-k (token, probability in the step's
        distribution) at window index i, best first, asked only where the sweep needs them (a rejected or
        masked position: about one per forward); masked_argmax(i, bitmask): the best allowed token at i."""
        t0 = time.perf_counter()
        out = list(after)
        self._keep_valid_edits(window_start, before, out)
        if not self.done:
            self._advance(window_start, out, mask_id, candidates, threshold, masked_argmax)
        self.stats.seconds += time.perf_counter() - t0
        return out

    def _keep_valid_edits(self, ws: int, before: list[int], out: list[int]) -> None:
        """Step 1: T2T edits in the grammar's text (behind the frontier, or through the stop token once the
        grammar has ended), left to right, each kept only if the text through its end still validates with it
        and the edits kept before it. A placed stop token stays (or becomes another stop token)."""
        stop_at = self.done_at - ws if self.stop_placed else None  # window index of the stop token
        end = stop_at + 1 if stop_at is not None else self.frontier - ws  # the text: window[:end]
        edits = [j for j in range(max(0, self.prompt_len - ws), end) if out[j] != before[j]]
        if not edits:
            return
        text = before[:end]  # the validated text of the window, with the edits kept so far
        self._drop((end if stop_at is None else stop_at) - edits[0])
        done = edits[0]  # the matcher has consumed text[:done] of the window
        for j in edits:
            if j == stop_at:
                if out[j] in self.stop_ids:
                    text[j] = out[j]
                else:
                    self.stats.rejected += 1
                continue
            self._take(text[done:j])
            done = j
            ok, stop = self._fits([out[j]] + text[j + 1 : end])
            if ok and stop == 0:  # the edit is a stop token where the grammar may end: it ends here
                text[j] = out[j]
                stop_at, end = j, j + 1
                self.done_at, self.stop_placed = ws + j, True
                break
            if ok:
                text[j] = out[j]
            else:
                self.stats.rejected += 1
        self._take(text[done : end if stop_at is None else stop_at])
        out[:end] = text[:end]
        if stop_at is not None:
            self.frontier = self.done_at
        elif self.done_at is not None and not self.matcher.is_stopped():
            self.done_at = None  # the grammar had ended without a stop token; an edit reopened it

    def _advance(self, ws: int, out: list[int], mask_id: int, candidates: Callable[[int], list[tuple[int, float]]],
                 threshold: float, masked_argmax: Callable[[int, bytes], int]) -> None:
        """Step 2: the sweep from the frontier."""
        i, n = self.frontier - ws, len(out)
        placed = False
        while i < n and not self.done:
            if self.matcher.is_stopped():  # only the end may follow: a stop token, or free text if none is set
                if not self.matcher.is_accepting():  # stopped short of a sentence: the matcher failed
                    self._dead_end()
                if self.stop_ids and out[i] not in self.stop_ids:
                    self.stats.forced += 1
                    out[i] = self.eos_id if self.eos_id in self.stop_ids else min(self.stop_ids)
                self.done_at, self.stop_placed = ws + i, bool(self.stop_ids)
                break
            forced = self.matcher.forced_tokens()[: n - i]
            if forced:
                self.stats.forced += sum(out[i + k] != t for k, t in enumerate(forced))
                out[i : i + len(forced)] = forced
                self._take(forced)
                i += len(forced)
                placed = True
                continue
            token = out[i]
            if token != mask_id and self._accept(token, ws + i):
                i, placed = i + 1, True
                continue
            if token != mask_id:
                self.stats.rejected += 1
            if token in self.stop_ids and self._close(ws, i, out, token):
                break
            best = next((c for c, p in candidates(i)
                         if p > threshold and c != token and c != mask_id and self._fits([c])[0]), None)
            if best is None and not placed:
                allowed = self.allowed()
                if allowed is None:  # the grammar is complete and no stop token may end it (ignore_eos)
                    self.done_at = ws + i
                    break
                best = masked_argmax(i, allowed)
            if best is None:
                if token != mask_id:
                    self.stats.remasked += 1
                out[i] = mask_id
                break
            out[i] = best
            if not self._accept(best, ws + i):
                raise RuntimeError(f"the grammar refused token {best}, which it allowed")
            i, placed = i + 1, True
        self.frontier = ws + i if self.done_at is None else self.done_at
