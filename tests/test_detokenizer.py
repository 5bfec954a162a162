"""Streaming text: deltas never break a UTF-8 character and never show any part of a stop string."""

from __future__ import annotations

import pytest

from redraft.engine.tiny import make_tiny_checkpoint
from redraft.engine.tokenizer import Tokenizer
from redraft.server.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(make_tiny_checkpoint(tmp_path_factory.mktemp("d") / "t", seed=0))


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per byte (the byte-level vocabulary has all 256), so a character can be split anywhere."""
    ids = []
    for b in text.encode():
        matches = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([b])]
        ids.append(matches[0])
    return ids


def stream(detok: IncrementalDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feed cumulative prefixes ending at `cuts` (the last one finished); return the deltas."""
    out = []
    for i, end in enumerate(cuts):
        out.append(detok.delta(ids[:end], finished=i == len(cuts) - 1))
    return out


def test_multibyte_character_split_across_blocks_is_held_back(tok):
    text = "ab\u00e9c\U0001F600d"  # é is 2 bytes, the emoji 4
    ids = byte_tokens(tok, text)
    # cut inside é (after its first byte) and inside the emoji (after 2 of its 4 bytes)
    deltas = stream(IncrementalDetokenizer(tok), ids, [3, 7, len(ids)])
    assert deltas[0] == "ab"
    assert deltas[1] == "\u00e9c"
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_every_split_point_reassembles_exactly(tok):
    text = "x\u4e2d\u6587y\u00e9"
    ids = byte_tokens(tok, text)
    for cut in range(1, len(ids)):
        deltas = stream(IncrementalDetokenizer(tok), ids, [cut, len(ids)])
        assert "".join(deltas) == text, cut
        assert "\ufffd" not in deltas[0]


def test_stop_string_prefix_is_held_until_decided(tok):
    ids = tok.encode("hello wor")
    more = tok.encode("hello world and more")
    detok = IncrementalDetokenizer(tok, stop=["world"])
    first = detok.delta(ids, finished=False)
    assert first == "hello "  # "wor" could begin "world": held back
    rest = detok.delta(more, finished=True)
    assert first + rest == "hello "  # the stop string and everything after it never appear


def test_held_text_is_released_when_it_is_not_a_stop(tok):
    detok = IncrementalDetokenizer(tok, stop=["world"])
    a = detok.delta(tok.encode("say wo"), finished=False)
    b = detok.delta(tok.encode("say wonder"), finished=False)
    c = detok.delta(tok.encode("say wonderful"), finished=True)
    assert a == "say " and a + b + c == "say wonderful"
