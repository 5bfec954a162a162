"""Tools outside the [test] extra that some tests need: [dev]'s validators, routers, lm-eval and browser driver,
and Debian packages (chromium, prometheus). Where one is missing its tests are skipped with the reason in the
summary (pytest -rs, on in pyproject.toml), unless REDRAFT_REQUIRE_ALL=1 says every tool must be there (.ci/run
sets it): then they fail, so that a CI run never passes by skipping."""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import NoReturn

import pytest

REQUIRE_ALL = "REDRAFT_REQUIRE_ALL"
DEV = "pip install -e '.[dev]'"


def missing(what: str, install: str = DEV) -> NoReturn:
    """Skip (or, under REDRAFT_REQUIRE_ALL=1, fail) the calling test: `what` is not installed."""
    message = f"{what} is not installed ({install})"
    if os.environ.get(REQUIRE_ALL) == "1":
        pytest.fail(f"{message}, and {REQUIRE_ALL}=1 says it must be")
    pytest.skip(message, allow_module_level=True)  # (a module may ask at import)


def need_module(name: str, install: str = DEV) -> ModuleType:
    """The module `name`, or the calling test skipped (failed) by `missing`."""
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the Python package {name}", install)
