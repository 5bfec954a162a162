"""Tokenizer: byte-level BPE round trips, special-token ids read from the checkpoint, HF config formats."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from redraft.engine.text.tokenizer import (LLADA2_SPECIAL_TOKENS, Tokenizer, load_default_chat_template,
                                      save_pretrained_tokenizer)
from redraft.training.bpe import build_bpe_tokenizer

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "def add(a, b):\n    return a + b\n",
    "Question: what is 12 plus 30? Answer: 42.",
    "<role>HUMAN</role>Say hello.<|role_end|><role>ASSISTANT</role>Hello!<|role_end|>",
] * 20


def _save(tmp: Path, specials=LLADA2_SPECIAL_TOKENS, config_patch: dict | None = None,
          vocab_size: int = 360) -> Path:
    tok = build_bpe_tokenizer(CORPUS, vocab_size, special_tokens=specials)
    save_pretrained_tokenizer(tok, tmp, load_default_chat_template())
    if config_patch is not None:
        cfg_path = tmp / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        for key, value in config_patch.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        cfg_path.write_text(json.dumps(cfg))
    return tmp


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return _save(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(tok_dir)


@pytest.mark.parametrize("text", [
    "The quick brown fox.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\r\nlines\n\n",
    "unicode: café, naïve, Straße, 日本語, 中文, Ελληνικά, עברית",
    "emoji 😀👍🏽 and a ZWJ family 👨‍👩‍👧",
    "",
    "x",
])
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_encode_whole_and_decode(tok: Tokenizer) -> None:
    text = "<role>HUMAN</role>Hi there<|role_end|><role>ASSISTANT</role><|mask|><|mask|><|endoftext|>"
    ids = tok.encode(text)
    role, role_end = tok.token_to_id("<role>"), tok.token_to_id("<|role_end|>")
    assert ids[0] == role and role_end in ids
    assert ids[-3:] == [tok.mask_token_id, tok.mask_token_id, tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.decode(ids) == "HUMANHi thereASSISTANT"  # special markers dropped, as HF does
    assert {role, role_end, tok.mask_token_id, tok.eos_token_id} <= tok.special_token_ids


def test_every_llada2_special_token_is_one_special_id(tok: Tokenizer) -> None:
    for name in LLADA2_SPECIAL_TOKENS:
        tid = tok.token_to_id(name)
        assert tid is not None, name
        assert tok.encode(name) == [tid]
        assert tok.convert_ids_to_tokens([tid]) == [name]
        assert tid in tok.special_token_ids


def test_never_adds_bos_or_eos(tok: Tokenizer) -> None:
    ids = tok.encode("hello")
    assert tok.bos_token_id not in ids and tok.eos_token_id not in ids
    assert tok.encode("") == []


def test_ids_are_read_from_tokenizer_json(tok: Tokenizer, tok_dir: Path) -> None:
    raw = json.loads((tok_dir / "tokenizer.json").read_text())
    added = {t["content"]: t["id"] for t in raw["added_tokens"]}
    assert tok.mask_token_id == added["<|mask|>"]
    assert tok.eos_token_id == added["<|endoftext|>"]
    assert tok.pad_token_id == added["<|endoftext|>"]  # LLaDA2: pad is EOS
    assert tok.bos_token_id == added["<|startoftext|>"]
    assert tok.vocab_size == len(raw["model"]["vocab"]) == len(tok)
    assert tok.chat_template == load_default_chat_template()


def test_ids_follow_the_vocabulary_not_constants(tmp_path: Path) -> None:
    # Same names, another order: every id must move with it.
    d = _save(tmp_path, specials=tuple(reversed(LLADA2_SPECIAL_TOKENS)))
    t = Tokenizer.from_pretrained(d)
    n = len(LLADA2_SPECIAL_TOKENS)
    assert t.mask_token_id == n - 1 - LLADA2_SPECIAL_TOKENS.index("<|mask|>")
    assert t.eos_token_id == n - 1 - LLADA2_SPECIAL_TOKENS.index("<|endoftext|>")
    assert t.decode(t.encode("<|mask|>"), skip_special_tokens=False) == "<|mask|>"


def test_config_token_entries_may_be_dicts_and_choose_eos(tmp_path: Path) -> None:
    d = _save(tmp_path, config_patch={
        "eos_token": {"__type": "AddedToken", "content": "<|role_end|>", "lstrip": False, "normalized": False,
                      "rstrip": False, "single_word": False},
        "pad_token": {"content": "<|startoftext|>"},
        "mask_token": {"content": "<|mask|>", "special": True},
    })
    t = Tokenizer.from_pretrained(d)
    assert t.eos_token_id == t.token_to_id("<|role_end|>")
    assert t.pad_token_id == t.token_to_id("<|startoftext|>")
    assert t.mask_token_id == t.token_to_id("<|mask|>")


def test_defaults_when_config_lacks_entries(tmp_path: Path) -> None:
    d = _save(tmp_path, config_patch={"pad_token": None, "mask_token": None, "eos_token": None,
                                      "chat_template": None})
    t = Tokenizer.from_pretrained(d)
    assert t.mask_token_id == t.token_to_id("<|mask|>")
    assert t.eos_token_id == t.token_to_id("<|endoftext|>")
    assert t.pad_token_id == t.eos_token_id  # pad falls back to EOS
    assert t.chat_template is None


def test_missing_mask_token_is_a_clear_error(tmp_path: Path) -> None:
    d = _save(tmp_path, specials=tuple(s for s in LLADA2_SPECIAL_TOKENS if s != "<|mask|>"),
              config_patch={"mask_token": None})
    with pytest.raises(ValueError, match=r"mask token '<\|mask\|>'"):
        Tokenizer.from_pretrained(d)


def test_missing_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_saved_config_is_hf_compatible(tok_dir: Path) -> None:
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"], cfg["mask_token"]) == (
        "<|startoftext|>", "<|endoftext|>", "<|endoftext|>", "<|mask|>")
    assert cfg["add_bos_token"] is False and cfg["add_eos_token"] is False
    assert isinstance(cfg["chat_template"], str)
    contents = {v["content"] for v in cfg["added_tokens_decoder"].values()}
    assert contents == set(LLADA2_SPECIAL_TOKENS)


def test_build_rejects_too_small_vocab() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        build_bpe_tokenizer(CORPUS, 100)


def test_build_is_deterministic() -> None:
    a = build_bpe_tokenizer(CORPUS, 330).to_str()
    b = build_bpe_tokenizer(CORPUS, 330).to_str()
    assert a == b
