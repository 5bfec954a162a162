"""`redraft generate --seed` is the request's sampling seed; `ServerArgs.seed` is the seed of dummy weights.
They once shared a name, and `ServerArgs.from_cli` copied any matching name: `--seed 7` changed the weights,
and `--load-format dummy` without `--seed` crashed on the CLI's None. Here on the bundled demo model's shape."""

from __future__ import annotations

import argparse
import json

import pytest

import redraft
from redraft.cli import main
from redraft.protocol.server_args import ServerArgs

PROMPT = "hi"
NEW_TOKENS = 8


def _cli_tokens(capsys, *extra: str) -> list[int]:
    rc = main(["generate", "--load-format", "dummy", "--raw", "--temperature", "0", "--max-new-tokens",
               str(NEW_TOKENS), "--log-level", "warning", "--json", *extra, PROMPT])
    assert rc == 0
    return json.loads(capsys.readouterr().out)["output_ids"]


def _engine_tokens(weight_seed: int) -> list[int]:
    engine = redraft.Engine(load_format="dummy", seed=weight_seed, progress=False)
    try:
        out = engine.generate(input_ids=engine.tokenizer.encode(PROMPT),
                              sampling_params={"max_new_tokens": NEW_TOKENS, "temperature": 0.0})
    finally:
        engine.shutdown()
    return out["output_ids"]


def test_generate_dummy_weights_without_seed_and_the_request_seed_never_reaches_the_weights(capsys):
    plain = _cli_tokens(capsys)  # crashed before: manual_seed got None
    assert len(plain) == NEW_TOKENS
    assert _cli_tokens(capsys, "--seed", "3") == plain
    assert _cli_tokens(capsys, "--seed", "7") == plain
    # The CLI's weights are the default weight seed's, and another weight seed would have shown up here.
    assert _engine_tokens(0) == plain
    assert _engine_tokens(7) != plain


def test_from_cli_reads_only_the_flags_of_server_args():
    args = argparse.Namespace(seed=None, request_seed=7, progress=False, device="cpu", load_format="dummy")
    got = ServerArgs.from_cli(args)
    assert (got.seed, got.progress) == (ServerArgs.seed, ServerArgs.progress)  # Python-only fields: untouched
    assert (got.device, got.load_format) == ("cpu", "dummy")


@pytest.mark.parametrize("flag", ["--random-seed", "--seed"])
def test_serve_keeps_random_seed_and_has_no_seed(flag):
    """`redraft serve --random-seed` (SGLang's name) seeds the seeds of unseeded sampled requests; serve has no
    `--seed`, so neither name can reach the weights' seed."""
    from redraft.cli import build_parser

    parser = build_parser()
    if flag == "--seed":
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", flag, "5"])
        return
    got = ServerArgs.from_cli(parser.parse_args(["serve", flag, "5"]))
    assert (got.random_seed, got.seed) == (5, ServerArgs.seed)
