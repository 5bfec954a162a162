"""`redraft generate --show-steps`: the forward events of a request (docs/denoise.md) drawn in a terminal, as the
playground draws them in a browser. On a TTY each forward redraws the picture in place (ANSI): the committed text,
then the open window with masks as grey cells, drafts coloured by confidence (red low, green high) and edits as
[old>new]. Elsewhere (a pipe, a log) one plain line per forward."""

from __future__ import annotations

import shutil
from typing import TextIO

RESET = "\x1b[0m"
MASK_CELL = "\x1b[48;5;250m \x1b[0m"
# newline and tab drawn as arrows, every other control or line-breaking character as a middle dot: a cell is
# always one printed character wide and never moves the cursor
CONTROLS = {c: "\u00b7" for c in [*range(32), 0x7F, 0x85, 0x2028, 0x2029]} | {10: "\u21b5", 9: "\u21e5"}


def _piece(text: str | None) -> str:
    if not text:
        return "\u2205"
    if text.startswith("<|") and text.endswith("|>"):
        return "\u2038" if text == "<|endoftext|>" else "\u25c6"  # special tokens drawn short
    return text.translate(CONTROLS)


def _conf_colour(conf: float | None) -> str:
    """A 256-colour background from red (low confidence) through yellow to green (high)."""
    c = 0.5 if conf is None else max(0.0, min(1.0, conf))
    return f"\x1b[48;5;{(217, 223, 229, 193, 157, 120)[min(5, int(c * 6))]}m\x1b[30m"


class StepPrinter:
    def __init__(self, out: TextIO, tty: bool | None = None):
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self._lines = 0  # lines of the picture drawn last (TTY: erased before the next)

    def __call__(self, event: dict) -> None:
        if self.tty:
            self._redraw(event)
        else:
            self.out.write(self._line(event) + "\n")
        self.out.flush()

    # ---- one line per forward -------------------------------------------------------------------------
    def _line(self, event: dict) -> str:
        head = f"forward {event['forward']:>4}  committed {event['committed_tokens']:>5}"
        if event["event"] != "forward":
            return f"{head}  (committed without a forward)"
        w = event["window"]
        states = w["states"]
        cells = []
        for piece, state, old in zip(w["pieces"], states, w["replaced_pieces"]):
            cells.append("_" if state == "mask" else f"[{_piece(old)}>{_piece(piece)}]" if state == "edited"
                         else _piece(piece))
        counts = (f"drafted {states.count('drafted'):>3}  edited {states.count('edited'):>2}  "
                  f"masks {states.count('mask'):>3}")
        return f"{head}  {counts}  | {''.join(cells)}"

    # ---- redrawn in place --------------------------------------------------------------------------------
    def _redraw(self, event: dict) -> None:
        width = shutil.get_terminal_size((100, 24)).columns
        text = event["committed_text"]
        body = [text[-width * 6 :]] if text else []  # the tail of a long answer
        if event["event"] == "forward":
            body.append(self._cells(event["window"], event["committed_tokens"]))
            w = event["window"]["states"]
            status = (f"forward {event['forward']}: {w.count('drafted')} drafted, {w.count('edited')} edited, "
                      f"{w.count('mask')} masks left")
        else:
            status = f"forward {event['forward']}: committed"
        picture = "\n".join(body + [f"\x1b[2m{status}{RESET}"])
        rows = sum(max(1, -(-len(_strip_ansi(line)) // width)) for line in picture.split("\n"))
        if self._lines:
            self.out.write(f"\x1b[{self._lines}F\x1b[J")  # back to the picture's first line, erase below
        self.out.write(picture + "\n")
        self._lines = rows

    @staticmethod
    def _cells(w: dict, committed: int) -> str:
        parts = []
        for i, (piece, state, conf, old) in enumerate(zip(w["pieces"], w["states"], w["confidence"],
                                                          w["replaced_pieces"])):
            if w["offset"] + i < committed:
                continue
            if state == "mask":
                parts.append(MASK_CELL)
            elif state == "edited":
                parts.append(f"\x1b[43m\x1b[30m\x1b[9m{_piece(old)}\x1b[29m>{_piece(piece)}{RESET}")
            elif state == "drafted":
                parts.append(f"{_conf_colour(conf)}{_piece(piece)}{RESET}")
            else:
                parts.append(f"\x1b[4m{_piece(piece)}{RESET}")
        return "".join(parts)

    def finish(self) -> None:
        """Erase the picture (TTY): the answer is printed after it, as without --show-steps."""
        if self.tty and self._lines:
            self.out.write(f"\x1b[{self._lines}F\x1b[J")
            self.out.flush()
        self._lines = 0


def _strip_ansi(s: str) -> str:
    out, skip = [], False
    for ch in s:
        if ch == "\x1b":
            skip = True
        elif skip and ch.isalpha():
            skip = False
        elif not skip:
            out.append(ch)
    return "".join(out)
