"""Which model to serve when none is named. Torch-free unless a tiny checkpoint must be made."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("redraft.engine")

BUNDLED_MODEL_DIR = Path(__file__).resolve().parent / "demo_model"


def default_model_path() -> Path:
    """The bundled demo model if this install has one, else a tiny random checkpoint made on the spot."""
    if (BUNDLED_MODEL_DIR / "config.json").is_file():
        return BUNDLED_MODEL_DIR
    cache = Path.home() / ".cache" / "redraft" / "tiny-random-seed0"
    if not (cache / "config.json").is_file():
        from redraft.engine.tiny import make_tiny_checkpoint  # needs torch

        make_tiny_checkpoint(cache, seed=0)
    log.warning("no bundled demo model in this install: serving a tiny RANDOM checkpoint (%s)", cache)
    return cache
