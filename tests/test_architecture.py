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
