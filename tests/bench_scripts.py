"""The benchmark scripts (benchmarks/ beside the package: run as `python benchmarks/bench_x.py`, never installed)
as modules, for the tests that check them. They import each other by plain name, so their folder joins
sys.path, as it does when one of them runs as a script."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def bench_module(name: str) -> ModuleType:
    """benchmarks/<name>.py, imported."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    return importlib.import_module(name)


def bench_script(name: str) -> str:
    """The path of benchmarks/<name>.py, to run in a subprocess."""
    return str(BENCHMARKS / f"{name}.py")
