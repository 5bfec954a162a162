"""The layers point one way (docs/architecture.md), checked on the source of every module, imports inside
functions included:

    protocol/   imports no other part of redraft, and no torch        (shared by both processes)
    kernels/    imports no other part of redraft                       (leaves)
    scheduler/  imports only protocol/, and no torch                   (plain data structures)
    engine/     never imports server/, clients/ or training/
    server/     imports no torch, here or through what it imports      (the HTTP process)
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("protocol", "kernels", "scheduler", "engine", "server", "clients", "training", "redraft")

# part -> the redraft parts it may import (itself always allowed), and whether it may import torch/triton.
ALLOWED: dict[str, tuple[set[str], bool]] = {
    "protocol": (set(), False),
    "kernels": (set(), True),
    "scheduler": ({"protocol"}, False),
    "engine": ({"protocol", "kernels", "scheduler"}, True),
    "server": ({"protocol", "engine"}, False),
}


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import statement anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative imports would hide the part they reach: redraft uses none
                out.append((node.lineno, f"<relative import level {node.level}>"))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def part_of(module: str) -> str | None:
    """'redraft.engine.model.model' -> 'engine'; 'redraft' -> 'redraft'; anything outside redraft -> None."""
    bits = module.split(".")
    if bits[0] != "redraft":
        return None
    return bits[1] if len(bits) > 1 and bits[1] in PARTS else "redraft"


def violations(part: str) -> list[str]:
    allowed, torch_ok = ALLOWED[part]
    bad = []
    for path in sorted((ROOT / part).rglob("*.py")):
        for line, module in imports_of(path):
            where = f"{path.relative_to(ROOT)}:{line} imports {module}"
            if module.startswith("<relative"):
                bad.append(where)
            top = module.split(".")[0]
            if top in ("torch", "triton") and not torch_ok:
                bad.append(where)
            target = part_of(module)
            if target is not None and target != part and target not in allowed:
                bad.append(where)
    return bad


@pytest.mark.parametrize("part", sorted(ALLOWED))
def test_imports_point_one_way(part: str) -> None:
    assert violations(part) == []


def test_the_checker_sees_imports_inside_functions(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from redraft.server.common import APIError\n    import torch\n")
    assert [m for _, m in imports_of(src)] == ["redraft.server.common", "torch"]
    assert part_of("redraft.server.common") == "server" and part_of("numpy") is None


def _imports_without_torch(modules: list[str], then: str = "") -> None:
    """Import `modules` (then run `then`) in a fresh interpreter; fail if torch or triton got loaded."""
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        f"{then}"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "print(bad[:5])\n"
        "sys.exit(1 if bad else 0)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr


def test_http_process_modules_import_no_torch() -> None:
    """A fresh interpreter imports every module of redraft.server (and the launcher): torch stays out."""
    modules = sorted(f"redraft.server.{p.stem}" for p in (ROOT / "server").glob("*.py") if p.stem != "__init__")
    assert len(modules) >= 8
    _imports_without_torch(modules, then="import redraft.cli\nredraft.cli.build_parser()\n")


def test_protocol_and_scheduler_modules_import_no_torch() -> None:
    """A fresh interpreter imports every module of protocol/ and scheduler/: torch stays out (this also catches
    torch arriving through a third-party import, which the source check above cannot see)."""
    modules = sorted(f"redraft.{part}.{p.stem}" for part in ("protocol", "scheduler")
                     for p in (ROOT / part).glob("*.py") if p.stem != "__init__")
    assert len(modules) >= 7
    _imports_without_torch(modules)


# ---- decoding rules are units: the runtime names none --------------------------------------------------------
DECODER_NAME = re.compile(r"levenshtein|[\"']threshold[\"']|threshold (step|rule|decoder)|ThresholdDecoder|"
                          r"LevenshteinDecoder|\.lev\b|structural", re.IGNORECASE)


def test_the_runtime_names_no_decoder() -> None:
    """The runner, the core and the rest of engine/runtime/ reach a decoding rule only through the registry
    (engine/decoding/registry.py) and the `Decoder` interface: no rule's name, class or state there, comments
    included (a rule is one file in engine/decoding/)."""
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "engine" / "runtime").glob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if DECODER_NAME.search(line)]
    assert hits == []


def test_the_checker_finds_decoder_names() -> None:
    for line in ('if r.params.decoder == "levenshtein":', "self.lev.advance(...)", "ThresholdDecoder(slots)",
                 "decoder = 'threshold'", "# the threshold step on a 2.2 checkpoint"):
        assert DECODER_NAME.search(line), line
    assert not DECODER_NAME.search("s.threshold[slots], s.edit_threshold[slots], r.params.threshold")


def test_every_decoder_name_has_one_registered_class() -> None:
    """The names a request may give (protocol/) are exactly the registered rules, each a Decoder subclass of its
    own file in engine/decoding/."""
    from redraft.engine.decoding.decoder import Decoder
    from redraft.engine.decoding.registry import DECODER_CLASSES
    from redraft.protocol.sampling_params import DECODERS

    assert sorted(DECODER_CLASSES) == sorted(DECODERS)
    files = {cls.__module__ for cls in DECODER_CLASSES.values()}
    assert len(files) == len(DECODER_CLASSES)
    assert all(issubclass(cls, Decoder) and cls.name == name and cls.__module__.startswith("redraft.engine.decoding.")
               for name, cls in DECODER_CLASSES.items())


# ---- short functions ----------------------------------------------------------------------------------------
MAX_FUNCTION_LINES = 60
LONG_FUNCTIONS_EXEMPT = ("kernels", "training")  # kernels and training loops read best whole


def long_functions(path: Path, root: Path = ROOT) -> list[str]:
    """Functions (methods, nested ones) of more than MAX_FUNCTION_LINES lines, docstring included."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_sixty_lines() -> None:
    """Outside kernels/ and training/, every function of the project's code fits on a screen: benchmarks,
    scripts and tests included."""
    files = [p for p in sorted(ROOT.rglob("*.py")) if p.relative_to(ROOT).parts[0] not in
             (*LONG_FUNCTIONS_EXEMPT, "redraft", ".git") and ".venv" not in p.parts]
    files += sorted((ROOT / "redraft").glob("*.py"))  # (its other entries are the linked parts)
    assert len(files) > 100
    assert [f for p in files for f in long_functions(p)] == []


def test_the_length_check_counts_lines(tmp_path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f():\n" + "    x = 1\n" * 60 + "\n\nclass C:\n    async def g(self):\n" + "        y = 2\n" * 59
                   + "\n\ndef h():\n    return 1\n")
    assert long_functions(src, tmp_path) == ["m.py:1 f (61 lines)"]
    src.write_text("class C:\n    async def g(self):\n" + "        y = 2\n" * 60)
    assert long_functions(src, tmp_path) == ["m.py:2 g (61 lines)"]
