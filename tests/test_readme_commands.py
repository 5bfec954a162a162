"""The commands in README.md and docs/*.md name flags and files that exist: every `redraft CMD --flag` against the
real argparse parser of CMD, every `python benchmarks/x.py --flag` (scripts/, training/, `-m redraft...` too)
against the flags its source declares, every repo path a command, a code span or a link names. A renamed flag
or a moved file breaks this test, not a newcomer's first hour."""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# a path is the repo's when it starts with one of its folders (or is a top-level file); others (/tmp, DIR, ...) are
# the reader's
REPO_DIRS = ("benchmarks", "clients", "deploy", "docker", "docs", "engine", "evals", "kernels", "protocol",
             "redraft", "scheduler", "scripts", "server", "tests", "training", ".ci")
REPO_FILES = ("README.md", "pyproject.toml")
SCRIPT_DIRS = ("benchmarks", "scripts", "training", "clients")  # where a script's shared argument helpers live
# written by the command that names them, not shipped
GENERATED = re.compile(r"(^|/)(gpu-out|runs|\.whl)(/|$)|\*")
SHELL_LANGUAGES = ("", "bash", "sh", "console", "shell")
CODE_SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
LINK = re.compile(r"\]\(([^)\s]+)\)")
PATH_TOKEN = re.compile(r"[\w.\-/]+")


def _doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


# ---- where the commands are ---------------------------------------------------------------------------------------
def fenced_blocks(text: str) -> tuple[list[tuple[str, str]], str]:
    """([(language, body)] of the ``` blocks, the prose around them)."""
    blocks, prose, body, language = [], [], None, ""
    for line in text.splitlines(keepends=True):
        fence = re.match(r"\s*```(\w*)", line)
        if fence and body is None:
            body, language = [], fence.group(1)
        elif fence:
            blocks.append((language, "".join(body)))
            body = None
        elif body is None:
            prose.append(line)
        else:
            body.append(line)
    return blocks, "".join(prose)


def _prose(text: str) -> str:
    return fenced_blocks(text)[1]


def _shell_lines(text: str) -> list[str]:
    """Command lines of the shell blocks (continuations joined, comments dropped) and the code spans that are
    commands."""
    blocks, prose = fenced_blocks(text)
    lines = []
    for language, block in blocks:
        if language in SHELL_LANGUAGES:
            joined = re.sub(r"\\\n\s*", " ", block)
            lines += [line for line in joined.splitlines() if line.strip()]
    lines += [span for span in CODE_SPAN.findall(prose) if re.match(r"(redraft|python3?) ", span)]
    return lines


def _commands(line: str) -> list[list[str]]:
    """The simple commands of one line, as words (a line shlex cannot split, e.g. with an unclosed quote, is split
    on spaces)."""
    line = re.sub(r"\s#.*$", "", line.strip())
    line = re.sub(r"\$\([^)]*\)", "X", line)  # $(...) substitutions: a word
    try:
        words = shlex.split(line, comments=True)
    except ValueError:
        words = line.split()
    commands, current = [], []
    for word in words:
        if word in ("&&", "||", "|", ";", "&") or word.endswith(";"):
            if word.endswith(";") and word != ";":
                current.append(word[:-1])
            commands.append(current)
            current = []
        else:
            current.append(word.rstrip("&") if word.endswith("&") and len(word) > 1 else word)
    commands.append(current)
    return [c for c in commands if c]


def _strip_env(words: list[str]) -> list[str]:
    """Drop leading VAR=value assignments and wrappers (timeout N, nice, sudo, ...)."""
    while words and (re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]) or words[0] in ("nice", "sudo", "exec", "time")):
        words = words[1:]
    if words and words[0] == "timeout" and len(words) > 1:
        words = words[2:]
    return words


class Unknown(Exception):
    """A command names a program that does not exist."""


# ---- the flags each program takes -------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@cache
def _redraft_flags() -> dict[str, set[str]]:
    from redraft.cli import build_parser

    flags = {name: {o for a in sub._actions for o in a.option_strings}
             for name, sub in _subparsers(build_parser()).items()}
    flags["train-demo"] = _declared_flags(ROOT / "training" / "train.py")
    flags["eval-demo"] = _declared_flags(ROOT / "training" / "evaluate.py")
    return flags


@cache
def _declared_flags(source: Path) -> frozenset[str]:
    """The --flags a script declares: string constants of its add_argument calls, and of the argument helpers it
    imports from the scripts' own folders (benchmarks share some), one level deep."""
    flags: set[str] = {"-h", "--help"}
    modules = [source]
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules += [m for m in _repo_modules(node, source) if m.parent.name in SCRIPT_DIRS]
    for module in modules:
        for node in ast.walk(ast.parse(module.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                flags |= {a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")}
    return frozenset(flags)


def _repo_modules(node: ast.Import | ast.ImportFrom, source: Path) -> list[Path]:
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    found = []
    for name in names:
        parts = name.split(".")
        if parts[0] == "redraft":
            parts = parts[1:]
        for base in (ROOT, source.parent):
            candidate = base.joinpath(*parts).with_suffix(".py") if parts else None
            if candidate is not None and candidate.is_file() and candidate != source:
                found.append(candidate)
                break
    return found


def _program(words: list[str]) -> tuple[str, set[str], list[str]] | None:
    """(name, the flags it takes, its arguments) of a command this test knows how to check, else None."""
    words = _strip_env(words)
    if not words:
        return None
    if words[0] == "redraft" or words[:3] == ["python", "-m", "redraft"]:
        rest = words[1:] if words[0] == "redraft" else words[3:]
        if not rest or rest[0].startswith("-"):
            return None
        flags = _redraft_flags().get(rest[0])
        if flags is None:
            raise Unknown(f"`redraft {rest[0]}` is not a command")
        return f"redraft {rest[0]}", flags, rest[1:]
    if words[0] in ("python", "python3") and len(words) > 1:
        if words[1] == "-m" and len(words) > 2 and words[2].startswith("redraft."):
            module = ROOT.joinpath(*words[2].split(".")[1:]).with_suffix(".py")
            return (words[2], _declared_flags(module), words[3:]) if module.is_file() else None
        script = ROOT / words[1]
        if words[1].endswith(".py") and words[1].split("/")[0] in REPO_DIRS:
            if not script.is_file():
                raise Unknown(f"{words[1]} does not exist")
            return words[1], _declared_flags(script), words[2:]
    return None


# ---- what the docs name -------------------------------------------------------------------------------------------
def _flag_problems(text: str) -> list[str]:
    problems = []
    for line in _shell_lines(text):
        for words in _commands(line):
            try:
                program = _program(words)
            except Unknown as exc:
                problems.append(f"{exc}: {line.strip()}")
                continue
            if program is None:
                continue
            name, flags, args = program
            for arg in args:
                flag = arg.split("=", 1)[0]
                if re.fullmatch(r"--?[a-zA-Z][\w-]*", flag) and flag not in flags:
                    problems.append(f"{name} has no {flag}: {line.strip()}")
    return problems


def _repo_path(token: str) -> str | None:
    token = token.strip("'\"`.,;:()").split("#")[0].split("::")[0]
    token = re.sub(r":\d+(-\d+)?$", "", token)
    if token.startswith("./"):
        token = token[2:]
    first = token.split("/")[0]
    if token in REPO_FILES or (first in REPO_DIRS and "/" in token):
        if GENERATED.search(token) or "<" in token or "{" in token or token.endswith("/..."):
            return None
        return token
    return None


def _path_problems(doc: Path, text: str) -> list[str]:
    problems = []
    names: set[str] = set()
    for line in _shell_lines(text):
        names |= {p for w in PATH_TOKEN.findall(line) if (p := _repo_path(w))}
    for span in CODE_SPAN.findall(_prose(text)):
        names |= {p for w in span.split() if (p := _repo_path(w))}
    for name in sorted(names):
        if not (ROOT / name).exists():
            problems.append(f"{name} does not exist")
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        if not path.exists():
            problems.append(f"link to {target}: no such file")
    return problems


# other tools' flags the docs name on their own: hadolint's, slime's, SGLang's
FOREIGN_FLAGS = {"--failure-threshold", "--rollout-external", "--rollout-external-engine-addrs", "--offload-rollout",
                 "--enable-weights-cpu-backup"}


@cache
def _every_flag() -> frozenset[str]:
    scripts = [*ROOT.glob("benchmarks/*.py"), *ROOT.glob("scripts/*.py"), *ROOT.glob("training/*.py")]
    return frozenset().union(*_redraft_flags().values(), *map(_declared_flags, scripts), FOREIGN_FLAGS)


def _prose_flag_problems(text: str) -> list[str]:
    """A code span in prose that is a flag (`--mbe-window 3`) names one that some command here takes."""
    flags = [m.group(1) for span in CODE_SPAN.findall(_prose(text))
             if (m := re.fullmatch(r"(--[a-z][\w-]*)(?:[ =].*)?", span))]
    return [f"no command takes {flag}" for flag in flags if flag not in _every_flag()]


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_commands_name_flags_that_exist(doc: Path) -> None:
    text = doc.read_text()
    assert _flag_problems(text) + _prose_flag_problems(text) == []


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_named_files_and_links_exist(doc: Path) -> None:
    assert _path_problems(doc, doc.read_text()) == []


def test_the_checker_catches_a_wrong_flag_and_a_missing_file() -> None:
    text = ("```bash\nredraft serve --modle x --port 1\npython benchmarks/bench_offline.py --batchez 2\n"
            "redraft generate --mode S \"hi\" && python benchmarks/nope.py\n```\nsee `engine/runtime/gone.py` and "
            "[this](docs/missing.md); `--trace-edits` and `--mbe-window 2`\n")
    assert _flag_problems(text) == [
        "redraft serve has no --modle: redraft serve --modle x --port 1",
        "benchmarks/bench_offline.py has no --batchez: python benchmarks/bench_offline.py --batchez 2",
        "benchmarks/nope.py does not exist: redraft generate --mode S \"hi\" && python benchmarks/nope.py"]
    assert _prose_flag_problems(text) == ["no command takes --trace-edits"]
    assert _path_problems(ROOT / "README.md", text) == [
        "benchmarks/nope.py does not exist", "engine/runtime/gone.py does not exist",
        "link to docs/missing.md: no such file"]


def test_ci_runs_the_readmes_test_commands() -> None:
    """.ci/run runs, in a fresh clone, the very pytest commands the README gives a newcomer."""
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    readme = [words for line in _shell_lines((ROOT / "README.md").read_text()) for words in _commands(line)
              if words[:3] == ["python", "-m", "pytest"]]
    ran = [words for line in ci for words in _commands(line) if words[:3] == ["python", "-m", "pytest"]]
    assert readme and {tuple(w) for w in readme} == {tuple(w) for w in ran}
