"""Every Python block of README.md runs as written, against the bundled demo model, in a fresh interpreter
outside the checkout's root (so `import redraft` is the installed package, or this checkout through PYTHONPATH),
and prints what its comments say: `print(...)   # 42 2  (why)` promises the line `42 2`."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from test_readme_commands import fenced_blocks

ROOT = Path(__file__).resolve().parents[1]
SNIPPETS = [body for language, body in fenced_blocks((ROOT / "README.md").read_text())[0] if language == "python"]


def promised_lines(snippet: str) -> list[str]:
    """The output a snippet's `print(...)  # ...` comments promise: the comment up to a double space."""
    return [m.group(1).strip() for m in re.finditer(r"^\s*print\(.*\)\s+#\s*(.+?)(?:\s{2,}.*)?$", snippet, re.M)]


def test_the_readme_has_snippets_that_promise_output() -> None:
    assert SNIPPETS and any(promised_lines(s) for s in SNIPPETS)
    assert promised_lines('print(x)   # 42 2  (the answer)\nprint(y)\n') == ["42 2"]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[f"block{i}" for i in range(len(SNIPPETS))])
def test_readme_python_block_runs_as_written(snippet: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", snippet], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    for promised in promised_lines(snippet):
        assert promised in lines, (promised, res.stdout)
