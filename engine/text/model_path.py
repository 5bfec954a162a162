"""Which model to serve: a local directory, a Hugging Face repo id (from the hub's cache or downloaded), or the
bundled demo model when none is named. Torch-free unless a tiny checkpoint must be made."""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("redraft.engine")

BUNDLED_MODEL_DIR = Path(__file__).resolve().parents[1] / "demo_model"


def default_model_path() -> Path:
    """The bundled demo model if this install has one, else a tiny random checkpoint made on the spot."""
    if (BUNDLED_MODEL_DIR / "config.json").is_file():
        return BUNDLED_MODEL_DIR
    cache = Path.home() / ".cache" / "redraft" / "tiny-random-seed0"
    if not (cache / "config.json").is_file():
        from redraft.engine.model.tiny import make_tiny_checkpoint  # needs torch

        make_tiny_checkpoint(cache, seed=0)
    log.warning("no bundled demo model in this install: serving a tiny RANDOM checkpoint (%s)", cache)
    return cache


# The files of a checkpoint redraft reads (weights as safetensors only: no pickles are ever fetched).
HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def resolve_model_path(model: str | None, revision: str | None = None) -> Path:
    """The local directory of `model`: an existing directory as it is (a local path always wins), else a Hugging
    Face repo id (`inclusionAI/LLaDA2.1-mini`) through huggingface_hub: its cache (HF_HOME / HF_HUB_CACHE),
    HF_HUB_OFFLINE=1 for the cache alone, `revision` for a branch, tag or commit, a progress bar while
    downloading. None: the bundled demo model."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    parts = model.split("/")
    looks_like_repo = len(parts) == 2 and all(parts) and not model.startswith((".", "/", "~"))
    if not looks_like_repo:
        raise FileNotFoundError(f"model directory {model} does not exist")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError as exc:  # pragma: no cover - a dependency of redraft
        raise FileNotFoundError(f"{model} is not a directory, and huggingface_hub is not installed to fetch it") from exc
    try:
        log.info("resolving %s%s through the Hugging Face hub cache", model, f" at {revision}" if revision else "")
        return Path(snapshot_download(repo_id=model, revision=revision, allow_patterns=HUB_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise FileNotFoundError(f"{model} is neither a directory nor in the Hugging Face cache, and the hub cannot be "
                                f"reached (HF_HUB_OFFLINE={__import__('os').environ.get('HF_HUB_OFFLINE', '0')})"
                                ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise FileNotFoundError(f"could not fetch {model} from the Hugging Face hub: {exc}") from exc
