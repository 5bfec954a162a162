"""The layers point one way (docs/architecture.md), checked on the source of every module, imports inside
functions included:

    protocol/         imports no other part of redraft, and no torch        (shared by both processes)
    kernels/          imports no other part of redraft                       (leaves)
    scheduler/        imports only protocol/, and no torch                   (plain data structures)
    engine/text/      the front room: protocol/ only, and no torch           (what the HTTP process loads)
    engine/model/     protocol/, kernels/, the text room                     (the model and its weights)
    engine/decoding/  protocol/, scheduler/, kernels/, the model and text rooms   (the decoding rules)
    engine/runtime/   everything above                                       (the engine process)
    server/           protocol/ and the text room, and no torch              (the HTTP process)

Two imports go against an arrow, each inside one named function and listed in DEFERRED with the reason: the
engine process's entry point (it runs in the child) and the tiny-checkpoint fallback of an install without the
bundled demo model.
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
ROOMS = ("engine.text", "engine.model", "engine.decoding", "engine.runtime")

# part or room -> the parts and rooms it may import (itself always allowed), and whether it may import torch/triton.
ALLOWED: dict[str, tuple[set[str], bool]] = {
    "protocol": (set(), False),
    "kernels": (set(), True),
    "scheduler": ({"protocol"}, False),
    "engine.text": ({"protocol"}, False),
    "engine.model": ({"protocol", "kernels", "engine.text"}, True),
    "engine.decoding": ({"protocol", "kernels", "scheduler", "engine.model", "engine.text"}, True),
    "engine.runtime": ({"protocol", "kernels", "scheduler", "engine.model", "engine.decoding", "engine.text"}, True),
    "server": ({"protocol", "engine.text"}, False),
}

# (file, the function the import sits in, the module) -> why it may go against the arrows
DEFERRED: dict[tuple[str, str, str], str] = {
    ("engine/text/launch.py", "run_engine_process", "redraft.engine.runtime.engine_process"):
        "the engine process's entry point: multiprocessing runs it in the child, never in the HTTP process",
    ("engine/text/model_path.py", "default_model_path", "redraft.engine.model.tiny"):
        "an install without the bundled demo model makes a tiny checkpoint on the spot (torch) when asked to serve",
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
    """'redraft.server.common' -> 'server'; 'redraft.engine.model.model' -> 'engine.model' (a room);
    'redraft' -> 'redraft'; anything outside redraft -> None."""
    bits = module.split(".")
    if bits[0] != "redraft":
        return None
    if len(bits) > 2 and f"{bits[1]}.{bits[2]}" in ROOMS:
        return f"{bits[1]}.{bits[2]}"
    return bits[1] if len(bits) > 1 and bits[1] in PARTS else "redraft"


def function_at(tree: ast.AST, line: int) -> str | None:
    """The innermost function whose body holds `line` (None: module level)."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.lineno < line <= node.end_lineno:
            if best is None or node.lineno > best.lineno:
                best = node
    return best.name if best else None


def violations(part: str) -> list[str]:
    allowed, torch_ok = ALLOWED[part]
    bad = []
    for path in sorted((ROOT / part.replace(".", "/")).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        tree = ast.parse(path.read_text(), filename=str(path))
        for line, module in imports_of(path):
            where = f"{rel}:{line} imports {module}"
            if module.startswith("<relative"):
                bad.append(where)
            top = module.split(".")[0]
            if top in ("torch", "triton") and not torch_ok:
                bad.append(where)
            target = part_of(module)
            if target is not None and target != part and target not in allowed \
                    and (rel, function_at(tree, line), module) not in DEFERRED:
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
    assert part_of("redraft.engine.decoding.decoder") == "engine.decoding" and part_of("redraft.engine") == "engine"
    assert function_at(ast.parse(src.read_text()), 2) == "f" and function_at(ast.parse("import os\n"), 1) is None


def test_every_room_has_rules_and_the_deferred_imports_exist() -> None:
    """Every room of engine/ is a package with its one-line purpose and a row in ALLOWED (nothing of engine/
    escapes the rules), and each DEFERRED import is still where the table says."""
    rooms = sorted(f"engine.{p.name}" for p in (ROOT / "engine").iterdir() if (p / "__init__.py").is_file())
    assert rooms == sorted(ROOMS) and set(ROOMS) <= set(ALLOWED)
    assert all((ROOT / r.replace(".", "/") / "__init__.py").read_text().startswith('"""') for r in ROOMS)
    assert sorted(p.name for p in (ROOT / "engine").glob("*.py")) == ["__init__.py"]
    for (rel, func, module) in DEFERRED:
        path = ROOT / rel
        tree = ast.parse(path.read_text())
        assert [func] == [function_at(tree, line) for line, m in imports_of(path) if m == module], (rel, module)


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


def _redraft_modules_after_server_imports(first: str = "") -> list[str]:
    """The redraft modules a fresh interpreter holds after running `first`, then importing every module of server/."""
    modules = sorted(f"redraft.server.{p.stem}" for p in (ROOT / "server").glob("*.py") if p.stem != "__init__")
    code = ("import importlib, sys\n" + first +
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "print('\\n'.join(sorted(m for m in sys.modules if m.split('.')[0] == 'redraft')))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    return res.stdout.split()


def test_the_http_process_loads_only_the_front_room_of_the_engine() -> None:
    """A fresh interpreter imports every module of server/: of redraft it then holds server/, protocol/ and the
    text room alone (no runtime, model, decoding room or scheduler, not even torch-free ones)."""
    loaded = _redraft_modules_after_server_imports()
    front = ("redraft.server", "redraft.protocol", "redraft.engine.text")
    assert {"redraft.engine.text.tokenizer", "redraft.engine.text.launch", "redraft.protocol.processes"} <= set(loaded)
    assert [m for m in loaded if m not in ("redraft", "redraft.engine") and not m.startswith(front)] == []


def test_the_serve_command_loads_nothing_of_the_client_tools() -> None:
    """`redraft serve`'s way in (the command line read by `redraft.cli.parse_args`, then the server modules)
    loads of redraft only the command line, server/, protocol/ and the text room: not clients/ (bench, plan),
    whose flags the full parser would import, nor training/."""
    serve_command_line = "import redraft.cli\nredraft.cli.parse_args(['serve', '--port', '0'])\n"
    loaded = _redraft_modules_after_server_imports(serve_command_line)
    front = ("redraft.server", "redraft.protocol", "redraft.engine.text")
    assert "redraft.cli" in loaded and "redraft.server.launch" in loaded
    assert [m for m in loaded if m not in ("redraft", "redraft.engine", "redraft.cli")
            and not m.startswith(front)] == []


def test_redraft_imports_resolve_by_file_paths() -> None:
    """Tools that follow plain file paths can follow redraft's imports: every `redraft.*` module an import names
    anywhere in the checkout is a file under redraft/ (its links lead to the top-level folders); and from a fresh
    checkout, with nothing installed (`python -S`: no site-packages, so no editable-install finder) and only the
    checkout root on the path, modules of every part import from the checkout's own files."""
    missing = []
    for path in sorted(ROOT.rglob("*.py")):
        if ".git" in path.parts or path.relative_to(ROOT).parts[0] == "redraft":
            continue
        for line, module in imports_of(path):
            if module.split(".")[0] != "redraft":
                continue
            base = ROOT.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
                missing.append(f"{path.relative_to(ROOT)}:{line} {module}")
    assert missing == []
    names = ["redraft.protocol.server_args", "redraft.protocol.processes", "redraft.scheduler.scheduler",
             "redraft.engine.text.launch", "redraft.engine.runtime", "redraft.engine.decoding", "redraft.server"]
    code = (f"import importlib, sys\nsys.path.insert(0, {str(ROOT)!r})\n"
            "assert not any('editable' in type(f).__module__.lower() for f in sys.meta_path), sys.meta_path\n"
            f"print('\\n'.join(importlib.import_module(n).__file__ for n in {names!r}))\n")
    res = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    files = res.stdout.split()
    assert len(files) == len(names) and all(f.startswith(str(ROOT / "redraft")) for f in files), files


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


@pytest.mark.parametrize("folder", ["engine/runtime", "scheduler"])
def test_the_runtime_and_the_scheduler_name_no_decoder(folder: str) -> None:
    """The runner, the core and the rest of engine/runtime/ reach a decoding rule only through the registry
    (engine/decoding/registry.py) and the `Decoder` interface, the scheduler only through the traits a request's
    rule declares (protocol/sampling_params.py `DECODER_TRAITS`, resolved into its `ResolvedParams`): no rule's
    name, class or state there, comments included (a rule is one file in engine/decoding/)."""
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / folder).glob("*.py"))
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


def test_the_host_side_traits_of_each_decoder_agree_with_its_class() -> None:
    """The torch-free traits table (protocol/, read by the scheduler and `resolve`) says of each rule what its
    class does: a rule whose blocks end only after a forward is the one that reports that verdict (`ended`)."""
    from redraft.engine.decoding.registry import DECODER_CLASSES
    from redraft.protocol.sampling_params import DECODER_TRAITS

    assert sorted(DECODER_TRAITS) == sorted(DECODER_CLASSES)
    for name, cls in DECODER_CLASSES.items():
        reports = {r.name for r in cls.reports}
        assert DECODER_TRAITS[name].ends_blocks_after_forward == ("ended" in reports), name


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


# ---- docs/architecture.md names only what exists ---------------------------------------------------------------
ARCH_DOC = ROOT / "docs" / "architecture.md"
# Backticked names on that page that are not redraft's own: Python, FastAPI/Starlette, HTTP fields, a checkpoint
# file, an environment variable
OUTSIDE_NAMES = {"None", "StreamingResponse", "TestClient", "APIRouter", "request.state.request_id",
                 "input_token_logprobs", "sampling_params.custom_params", "generation_config.json",
                 "REDRAFT_FAULT_INJECT"}


def defined_names() -> tuple[set[str], dict[str, set[str]], dict[str, set[str]]]:
    """Every name the project defines (modules, classes, functions, arguments, assigned names and attributes),
    each class's members (methods, class-level and self. attributes) and each module's top-level names."""
    names: set[str] = set()
    members: dict[str, set[str]] = {}
    top: dict[str, set[str]] = {}
    for path in ROOT.rglob("*.py"):
        if ".git" in path.parts or path.relative_to(ROOT).parts[0] == "redraft" and path.parent.name != "redraft":
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        names.add(path.stem)
        top.setdefault(path.stem, set()).update(_bound(tree.body))
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                names.add(node.name)
            if isinstance(node, ast.ClassDef):
                own = members.setdefault(node.name, set())
                own.update(_bound(node.body))
                own.update(n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                           and isinstance(n.value, ast.Name) and n.value.id == "self" and isinstance(n.ctx, ast.Store))
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, (ast.Name, ast.Attribute)) and isinstance(node.ctx, ast.Store):
                names.add(node.id if isinstance(node, ast.Name) else node.attr)
    return names, members, top


def _bound(body: list[ast.stmt]) -> set[str]:
    out: set[str] = set()
    for node in body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return out


def unknown_names(text: str) -> list[str]:
    """The backticked paths that do not exist and identifiers that redraft does not define (a dotted one: each
    part, a class's member or a module's top-level name where the part before is one). Spans that are neither
    (code, values, flags, HTTP paths) are not checked."""
    names, members, top = defined_names()
    bad = []
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        if span in OUTSIDE_NAMES:
            continue
        if re.fullmatch(r"[\w.-]+(/[\w.-]*)+", span):
            if not ((ROOT / span).exists() or (ROOT / "docs" / span).exists()):
                bad.append(span)
        elif re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", span):
            parts = span.split(".")
            ok = all(p in names for p in parts)
            for a, b in zip(parts, parts[1:]):
                scope = members.get(a, set()) | top.get(a, set())
                ok = ok and (not scope or b in scope)
            if not ok:
                bad.append(span)
    return bad


def test_the_architecture_page_names_only_what_exists() -> None:
    """Every module, class, function and file docs/architecture.md names in backticks exists, a class's member
    in that class, a module's name in that module."""
    assert unknown_names(ARCH_DOC.read_text()) == []


def test_the_name_check_catches_stale_names() -> None:
    stale = "`ModelRunner._sync_rows`, `_decide_from_hidden`, `EngineConfig`, `engine/runtime/child_process.py`, " \
            "`ModelRunner.run`, `engine/runtime/core.py`, `SlotState.sync`, `decision.decide`"
    assert unknown_names(stale) == ["ModelRunner._sync_rows", "_decide_from_hidden", "EngineConfig",
                                    "engine/runtime/child_process.py"]
