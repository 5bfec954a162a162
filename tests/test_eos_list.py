"""`eos_token_id` as a list in generation_config.json (LLaDA2.2-flash lists two ids, the second `<|role_end|>`):
every id in it is a stop id for the engine, the stream, the detokenized text and the OpenAI finish_reason.

The checkpoint: the tiny one with generation_config.json's eos_token_id set to [EOS, X], X an ordinary token the
model writes early in an answer it gives without the list. With the list, the answer must end right after the
first X (finish "stop", matched X), X's text left out of the text as an EOS's is; unchanged under ignore_eos."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest

import redraft
from live_server import RedraftServer
from redraft.engine.text.tokenizer import Tokenizer, generation_eos_ids

PROMPT_TEXT = "The quick brown fox"
PARAMS = {"max_new_tokens": 64, "temperature": 0.0, "mode": "S"}


class EosList:
    def __init__(self, src: Path, dst: Path) -> None:
        tok = Tokenizer.from_pretrained(src)
        self.eos = tok.eos_token_id
        self.prompt = tok.encode(PROMPT_TEXT)
        with redraft.Engine(str(src), progress=False) as eng:
            self.baseline: list[int] = eng.generate(input_ids=self.prompt, sampling_params=PARAMS)["output_ids"]
        before_eos = self.baseline[: self.baseline.index(self.eos)] if self.eos in self.baseline else self.baseline
        # a word token first written after a few others: the answer has text before it, and X's text is plain
        self.x = next(t for j, t in enumerate(before_eos) if j >= 3 and self.baseline.index(t) == j
                      and tok.decode([t]).strip().isalpha())
        self.cut = self.baseline.index(self.x) + 1  # the answer ends right after the first X
        self.text = tok.decode(self.baseline[: self.cut - 1])
        shutil.copytree(src, dst)
        gen = json.loads((dst / "generation_config.json").read_text())
        gen["eos_token_id"] = [self.eos, self.x]
        (dst / "generation_config.json").write_text(json.dumps(gen))
        self.path = dst


@pytest.fixture(scope="module")
def eos_list(ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> EosList:
    return EosList(ckpt, tmp_path_factory.mktemp("eos-list") / "tiny")


def test_tokenizer_reads_every_eos_id(eos_list: EosList, tmp_path: Path) -> None:
    assert Tokenizer.from_pretrained(eos_list.path).eos_token_ids == {eos_list.eos, eos_list.x}
    assert generation_eos_ids(eos_list.path) == [eos_list.eos, eos_list.x]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["</s>"]}))
    with pytest.raises(ValueError, match="eos_token_id"):
        generation_eos_ids(tmp_path)


def test_engine_stops_at_the_second_eos_id(eos_list: EosList) -> None:
    assert eos_list.x in eos_list.baseline and eos_list.cut < len(eos_list.baseline)
    with redraft.Engine(str(eos_list.path), progress=False) as eng:
        out = eng.generate(input_ids=eos_list.prompt, sampling_params=PARAMS)
        assert out["output_ids"] == eos_list.baseline[: eos_list.cut]
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos_list.x}
        assert out["text"] == eos_list.text and eos_list.text  # the stop id's text is left out, as an EOS's
        free = eng.generate(input_ids=eos_list.prompt, sampling_params={**PARAMS, "ignore_eos": True})
        assert free["output_ids"] == eos_list.baseline  # ignore_eos covers every EOS id
        # min_tokens holds every EOS id back: X cannot end the answer inside the first cut + 1 tokens
        held = eng.generate(input_ids=eos_list.prompt, sampling_params={**PARAMS, "min_tokens": eos_list.cut + 1})
        assert eos_list.x not in held["output_ids"][: eos_list.cut + 1]


def test_http_finish_reason_is_stop_for_the_second_eos_id(eos_list: EosList, tmp_path: Path) -> None:
    srv = RedraftServer(eos_list.path, tmp_path, [])
    try:
        srv.start()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
        kw: dict[str, Any] = dict(model="tiny", prompt=eos_list.prompt, max_tokens=64, temperature=0.0,
                                  extra_body={"mode": "S"})
        whole = client.completions.create(**kw)
        assert whole.choices[0].finish_reason == "stop"
        assert whole.choices[0].text == eos_list.text
        assert whole.usage.completion_tokens == eos_list.cut
        chunks = list(client.completions.create(**kw, stream=True))
        assert "".join(c.choices[0].text for c in chunks if c.choices) == eos_list.text
        assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
        client.close()
    finally:
        srv.stop()
