"""The command line a newcomer meets: every flag has a line of help, `serve --help` is in sections (the SGLang /
vLLM spellings beside redraft's), `--device` / `--kernel-backend` follow the machine unless given, and
`redraft generate` writes only the answer and one summary line when its stderr is not a terminal."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys

import pytest

from redraft.cli import REFUSED_FLAGS, build_parser
from redraft.protocol.server_args import CLI_GROUPS, ServerArgs, _opt


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "generate", "make-tiny", "bench", "plan"])
def test_every_flag_has_a_line_of_help(command: str) -> None:
    sub = _subparsers(build_parser())[command]
    silent = [a.option_strings or [a.dest] for a in sub._actions
              if a.dest != "help" and (not a.help or a.help == argparse.SUPPRESS)]
    assert silent == []


def _sections(help_text: str) -> list[str]:
    return [line[:-1] for line in help_text.splitlines() if line.endswith(":") and not line.startswith(" ")]


def test_serve_help_is_in_sections_with_the_other_servers_names_visible() -> None:
    text = _subparsers(build_parser())["serve"].format_help()
    sections = _sections(text)
    assert [s for s in sections if s in CLI_GROUPS.values()] == list(CLI_GROUPS.values())
    for field in dataclasses.fields(ServerArgs):  # each flag in its own section, its aliases on its line
        meta = field.metadata
        if meta.get("cli") not in ("engine", "serve"):
            continue
        flag = meta["flag"] or "--" + field.name.replace("_", "-")
        section = text.split(CLI_GROUPS[meta["group"]] + ":")[1].split("\n\n")[0]
        assert flag in section, (flag, meta["group"])
        for alias in meta["aliases"]:
            assert alias in section, alias
    compat = text.split(CLI_GROUPS["compatibility"] + ":")[1]
    assert all(flag in compat for flag in REFUSED_FLAGS) and "--trust-remote-code" in compat


def test_a_flag_must_name_a_known_section() -> None:
    with pytest.raises(ValueError, match="not one of"):
        _opt("a flag nobody grouped", group="misc")
    _opt("a Python-only field needs none", cli="")


def test_device_and_backend_follow_the_machine_unless_given() -> None:
    from redraft.engine.runtime.startup import pick_placement

    assert pick_placement("auto", "auto", cuda_available=True, triton_available=True)[:2] == ("cuda", "triton")
    assert pick_placement("auto", "auto", cuda_available=False, triton_available=True)[:2] == ("cpu", "torch")
    device, backend, why = pick_placement("auto", "auto", cuda_available=True, triton_available=False)
    assert (device, backend) == ("cuda", "torch") and "triton" in why
    assert pick_placement("auto", "torch", True, True)[:2] == ("cuda", "torch")  # a given backend stands
    assert pick_placement("cpu", "auto", True, True)[:2] == ("cpu", "torch")  # so does a given device
    assert pick_placement("cuda", "auto", True, True)[:2] == ("cuda", "triton")
    assert pick_placement("cpu", "triton", False, True) == ("cpu", "triton", "as given")


def test_the_command_lines_device_is_auto_and_the_engine_process_decides(caplog) -> None:
    import torch

    from redraft.engine.runtime.startup import resolve_placement

    args = build_parser().parse_args(["serve"])
    assert (args.device, args.kernel_backend) == ("auto", "auto")
    assert ServerArgs().device == "cpu"  # redraft.Engine() stays on the CPU unless told
    with caplog.at_level(logging.INFO, logger="redraft.engine"):
        resolved = resolve_placement(ServerArgs(device="auto"))
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolved.device == want and resolved.kernel_backend in ("torch", "triton")
    assert f"device {want}" in caplog.text and f"kernel backend {resolved.kernel_backend}" in caplog.text


def test_generate_on_a_pipe_prints_the_answer_and_one_summary_line() -> None:
    res = subprocess.run([sys.executable, "-m", "redraft", "generate", "What is 12 + 30?"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert res.returncode == 0, res.stderr
    assert res.stdout == "42\n"  # the bundled demo model's answer
    (summary,) = res.stderr.splitlines()  # no progress bar, no INFO lines
    assert summary.startswith("[2 tokens,") and summary.endswith("finish stop]")


def test_train_demo_flags_have_help_too() -> None:
    from redraft.training.train import build_parser as train_parser

    assert [a.option_strings for a in train_parser()._actions if a.dest != "help" and not a.help] == []
