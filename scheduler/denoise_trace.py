"""What each denoising forward did to one request's window: the one recorder behind `--trace-edits`
(meta_info.edit_trace), step maps (`return_step_maps`) and per-forward events (`stream_denoise`). Torch-free.

A request holds a `DenoiseTrace` only when one of the three asked for it; `Request.apply_step` hands it the
window before and after each forward. It keeps

    changes  every change of an output position, in order: (forward, position, old id, new id). old == MASK:
             the token was placed (M2T, or a token structured output's grammar forced in before the forward);
             otherwise an edit (T2T; new == MASK when the grammar re-masked it). Forwards count from 1, as
             meta_info.steps does: forward f is the request's f-th denoising forward.
    blocks   per block, the first and last forward it was the active block in
    pending  (stream_denoise) the raw event of each forward not yet sent; the engine core drains them into
             its RequestOutput (`RequestOutput.denoise`), the HTTP side adds the text (server/denoise.py)

The trace is bounded: past `max_changes` recorded changes (--max-trace-changes) only a position's first
placement is still recorded (at most one per output position, so step maps can still place every token); every
later edit is left out and counted, and step_maps says so (`truncated`: the first forward that lost one, and how
many). The raw events of stream_denoise leave with each message and are bounded by the stream's backlog limit.

A preempted block starts over from its start: `mark` / `rollback` drop what its forwards recorded (events
already sent stay sent; the block's forwards are then numbered again from where it began).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from redraft.protocol.server_args import ServerArgs

MASK_STATE, DRAFTED, EDITED, KEPT = "mask", "drafted", "edited", "kept"


@dataclass
class DenoiseTrace:
    prompt_len: int
    mask_id: int
    output_end: int  # prompt_len + max_new_tokens: positions past it are never output
    block_size: int
    events: bool = False  # stream_denoise: keep a raw event per forward
    changes: list[tuple[int, int, int, int]] = field(default_factory=list)
    blocks: dict[int, list[int]] = field(default_factory=dict)  # block -> [first forward, last forward]
    pending: list[dict] = field(default_factory=list)
    # logprob_mode "placement": beside each change, the log-probability of its new token in that forward
    change_logprobs: list[float | None] | None = None
    _placed: set[int] = field(default_factory=set)  # absolute positions that hold (or held) a token
    max_changes: int = ServerArgs.max_trace_changes  # about 6 MB of records for one request
    left_out: int = 0  # changes past max_changes not recorded
    left_out_from: int = 0  # the first forward that had one left out (0: none)

    def record(self, forward: int, block: int, start: int, old: list[int], new: list[int],
               confidence: list[float] | None, logprobs: list[float] | None = None) -> None:
        """Forward `forward` (of active block `block`) turned the window at absolute position `start` from `old`
        into `new`; `confidence`: p of each position's proposal (None where not copied back, < 0: none);
        `logprobs`: each window position's log-probability of its token after the step, in this forward."""
        span = self.blocks.setdefault(block, [forward, forward])
        span[1] = forward
        lo = max(start, self.prompt_len)
        states: list[str] = []
        for pos in range(lo, start + len(new)):
            a, b = old[pos - start], new[pos - start]
            lp = logprobs[pos - start] if logprobs is not None else None  # (of b, this forward's token)
            if a != self.mask_id and pos not in self._placed:  # forced in by the grammar before this forward
                self._change(forward, pos, self.mask_id, a, lp if a == b else None)
                states.append(DRAFTED if a == b else EDITED)
            elif a == self.mask_id:
                states.append(MASK_STATE if b == self.mask_id else DRAFTED)
            else:
                states.append(KEPT if a == b else (MASK_STATE if b == self.mask_id else EDITED))
            if a != b:
                self._change(forward, pos, a, b, lp)
        if self.events:  # cells through the last position that can be output
            states = states[: max(0, self.output_end - lo)]
            self.pending.append(self._event(forward, lo, start, old, new, states, confidence))

    def _change(self, forward: int, pos: int, old: int, new: int, logprob: float | None = None) -> None:
        first_placement = old == self.mask_id and new != self.mask_id and pos not in self._placed
        if len(self.changes) >= self.max_changes and not first_placement:
            self.left_out += 1
            self.left_out_from = self.left_out_from or forward
            return
        self.changes.append((forward, pos - self.prompt_len, old, new))
        if self.change_logprobs is not None:
            self.change_logprobs.append(logprob)
        if new != self.mask_id:
            self._placed.add(pos)

    def _event(self, forward: int, lo: int, start: int, old: list[int], new: list[int], states: list[str],
               confidence: list[float] | None) -> dict:
        """The engine's half of a forward event: ids and states of the output positions of the window."""
        cut = slice(lo - start, lo - start + len(states))
        conf: list[float | None] = [None] * len(states)
        if confidence is not None:
            for i, (c, s) in enumerate(zip(confidence[cut], states)):
                if s in (DRAFTED, EDITED) and c >= 0:
                    conf[i] = round(c, 4)
        replaced = [a if s == EDITED else None for a, s in zip(old[cut], states)]
        return {"forward": forward, "offset": lo - self.prompt_len, "tokens": new[cut], "states": states,
                "confidence": conf, "replaced": replaced, "block_size": self.block_size,
                "prompt_tokens": self.prompt_len}

    def take_events(self) -> list[dict]:
        out, self.pending = self.pending, []
        return out

    # ---- preemption ------------------------------------------------------------------------------------
    def mark(self) -> tuple[int, dict[int, list[int]]]:
        return len(self.changes), {b: list(s) for b, s in self.blocks.items()}

    def rollback(self, mark: tuple[int, dict[int, list[int]]]) -> None:
        n, blocks = mark
        del self.changes[n:]
        if self.change_logprobs is not None:
            del self.change_logprobs[n:]
        self.blocks = {b: list(s) for b, s in blocks.items()}
        self._placed = {p + self.prompt_len for _, p, _, new in self.changes if new != self.mask_id}
        # (a position re-masked later is still "placed": the grammar's re-placement is an edit from MASK)

    # ---- results ---------------------------------------------------------------------------------------
    def edit_trace(self) -> list[list[int]]:
        """meta_info.edit_trace (--trace-edits): every edit as [output position, old id, new id]."""
        return [[pos, old, new] for _, pos, old, new in self.changes if old != self.mask_id]

    def step_maps(self, n_out: int, block_size: int) -> dict:
        """meta_info.step_maps for the first n_out output tokens: enough to replay the decoding onto an all-mask
        canvas (docs/denoise.md)."""
        placed: list[list | None] = [None] * n_out
        edits: list[list] = []
        lps = self.change_logprobs
        for i, (f, pos, old, new) in enumerate(self.changes):
            if pos >= n_out:
                continue
            extra = [lps[i]] if lps is not None else []  # logprob_mode "placement"
            if old == self.mask_id and placed[pos] is None:
                placed[pos] = [f, new, *extra]
            else:
                edits.append([pos, f, old, new, *extra])
        first = self.prompt_len // block_size
        last = (self.prompt_len + n_out - 1) // block_size if n_out else first - 1
        blocks = [self.blocks.get(b, [0, 0]) for b in range(first, last + 1)]
        maps = {"placed": placed, "edits": edits, "blocks": blocks, "mask_id": self.mask_id}
        if self.left_out:  # the cap was met: the edits from this forward on are incomplete
            maps["truncated"] = {"from_forward": self.left_out_from, "edits_left_out": self.left_out,
                                 "max_trace_changes": self.max_changes}
        return maps
