"""Streaming text: deltas never break a UTF-8 character and never show any part of a stop string; the text
fed block by block equals the whole output decoded at once."""

from __future__ import annotations

import pytest

from redraft.engine.text.tokenizer import Tokenizer
from redraft.engine.text.detokenizer import StreamingDetokenizer


@pytest.fixture(scope="module")
def tok(ckpt) -> Tokenizer:
    return Tokenizer.from_pretrained(ckpt)


def byte_tokens(tok: Tokenizer, text: str) -> list[int]:
    """One token per byte (the byte-level vocabulary has all 256), so a character can be split anywhere."""
    ids = []
    for b in text.encode():
        matches = [i for i in range(tok.vocab_size) if tok.token_bytes(i) == bytes([b])]
        ids.append(matches[0])
    return ids


def stream(detok: StreamingDetokenizer, ids: list[int], cuts: list[int]) -> list[str]:
    """Feed the ids in pieces ending at `cuts` (the last one finished); return the deltas."""
    out, start = [], 0
    for i, end in enumerate(cuts):
        out.append(detok.feed(ids[start:end], finished=i == len(cuts) - 1))
        start = end
    return out


def test_multibyte_character_split_across_blocks_is_held_back(tok):
    text = "ab\u00e9c\U0001F600d"  # é is 2 bytes, the emoji 4
    ids = byte_tokens(tok, text)
    # cut inside é (after its first byte) and inside the emoji (after 2 of its 4 bytes)
    deltas = stream(StreamingDetokenizer(tok), ids, [3, 7, len(ids)])
    assert deltas[0] == "ab"
    assert deltas[1] == "\u00e9c"
    assert "".join(deltas) == text
    assert all("\ufffd" not in d for d in deltas)


def test_every_split_point_reassembles_exactly(tok):
    text = "x\u4e2d\u6587y\u00e9"
    ids = byte_tokens(tok, text)
    for cut in range(1, len(ids)):
        deltas = stream(StreamingDetokenizer(tok), ids, [cut, len(ids)])
        assert "".join(deltas) == text, cut
        assert "\ufffd" not in deltas[0]


def test_stop_string_prefix_is_held_until_decided(tok):
    detok = StreamingDetokenizer(tok, stop=["world"])
    first = detok.feed(tok.encode("hello wor"), finished=False)
    assert first == "hello "  # "wor" could begin "world": held back
    rest = detok.feed(tok.encode("ld and more"), finished=True)
    assert first + rest == "hello "  # the stop string and everything after it never appear


def test_held_text_is_released_when_it_is_not_a_stop(tok):
    detok = StreamingDetokenizer(tok, stop=["world"])
    a = detok.feed(tok.encode("say wo"), finished=False)
    b = detok.feed(tok.encode("nder"), finished=False)
    c = detok.feed(tok.encode("ful"), finished=True)
    assert a == "say " and a + b + c == "say wonderful"


def test_block_by_block_equals_decoding_at_once(tok):
    """Any split into blocks gives exactly the text of the whole output, stop strings cut at their first
    occurrence (a stop string split across blocks included)."""
    import random

    rng = random.Random(0)
    vocab = [i for i in range(tok.vocab_size) if i not in tok.special_token_ids]
    for trial in range(60):
        ids = [rng.choice(vocab) for _ in range(rng.randint(1, 120))]
        whole = tok.decode(ids)
        stops = [whole[a : a + rng.randint(1, 6)] for a in (rng.randrange(len(whole)),)] if whole and trial % 2 else []
        stops = [s for s in stops if s]
        cuts = sorted({rng.randint(1, len(ids)) for _ in range(rng.randint(0, 6))} | {len(ids)})
        detok = StreamingDetokenizer(tok, stops)
        text = "".join(stream(detok, ids, cuts))
        want = whole[: min((whole.find(s) for s in stops), default=len(whole))] if stops else whole
        assert text == want == detok.text, (trial, stops, cuts)
        if stops:
            assert detok.stop_matched in stops


@pytest.mark.parametrize("keep", [False, True])
def test_no_stop_trim_keeps_the_stop_string_across_blocks(tok, keep):
    """SGLang's no_stop_trim: the text ends with the stop string instead of before it; nothing after it."""
    ids = byte_tokens(tok, "hello STOP world")
    detok = StreamingDetokenizer(tok, ["STOP"], keep_stop=keep)
    deltas = stream(detok, ids, [8, len(ids)])  # the stop string is cut in two by the block boundary
    want = "hello STOP" if keep else "hello "
    assert "".join(deltas) == detok.text == want and detok.stop_matched == "STOP"


def test_skip_special_tokens_false_shows_them(tok):
    eos = tok.eos_token_id
    ids = byte_tokens(tok, "ok") + [eos]
    shown = StreamingDetokenizer(tok, skip_special_tokens=False)
    hidden = StreamingDetokenizer(tok)
    assert "".join(stream(shown, ids, [len(ids)])) == "ok" + tok.eos_token
    assert "".join(stream(hidden, ids, [len(ids)])) == "ok"
