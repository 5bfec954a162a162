"""Suite-wide settings and the shared tiny-checkpoint fixtures."""

from __future__ import annotations

import hashlib
import importlib.metadata
import inspect
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

TinyCheckpoint = Callable[..., Path]  # tiny_checkpoint(seed=0, *, dtype=..., shards=..., config_overrides=...)

# The served model name is the checkpoint folder's name; tests that look at /metrics expect "tiny".
_CHECKPOINT_DIR_NAME = "tiny"
_MANIFEST = "manifest.json"


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread() -> Iterator[None]:
    """Every in-process model here is tiny: with several OpenMP threads on a busy 2-core machine a forward takes
    up to 100x longer. Servers started by tests set OMP_NUM_THREADS=1 themselves (tests/live_server.py)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- tiny checkpoints ------------------------------------------------------------------------------------------
def _tiny_module() -> ModuleType:
    # imported when first asked for, so collecting tests that never build a checkpoint stays as light as before
    from redraft.engine.model import tiny

    return tiny


def _generator_fingerprint() -> str:
    """What a tiny checkpoint's bytes depend on besides its options: the generator's source, the redraft modules
    it takes names from (tokenizer trainer, config), the chat template it ships, and the libraries that draw and
    write the weights. Any change here gives new cache keys, so a stale checkpoint is never reused."""
    tiny_module = _tiny_module()
    files = {Path(inspect.getfile(tiny_module))}
    for value in vars(tiny_module).values():
        module = inspect.getmodule(value)
        if module is not None and module.__name__.startswith("redraft.") and getattr(module, "__file__", None):
            files.add(Path(module.__file__))
    h = hashlib.sha256()
    for path in sorted(files):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(tiny_module.load_default_chat_template().encode())
    for lib in ("torch", "safetensors", "tokenizers"):
        h.update(f"{lib}=={importlib.metadata.version(lib)}".encode())
    return h.hexdigest()


def _options_key(seed: int, options: dict[str, Any], fingerprint: str) -> tuple[str, str]:
    """(cache key, readable options) for make_tiny_checkpoint's arguments with its defaults filled in, so that
    `tiny_checkpoint()` and `tiny_checkpoint(seed=0, dtype="float32")` are the same checkpoint."""
    bound = inspect.signature(_tiny_module().make_tiny_checkpoint).bind("-", seed, **options)
    bound.apply_defaults()
    resolved = {k: v for k, v in bound.arguments.items() if k != "out_dir"}
    readable = json.dumps(resolved, sort_keys=True)
    return hashlib.sha256(f"{fingerprint}\0{readable}".encode()).hexdigest()[:24], readable


def _digest(folder: Path) -> dict[str, str]:
    """sha256 of every file of a checkpoint folder (about 1 MB: a millisecond or two)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


class TinyCheckpoints:
    """Tiny checkpoints built once per options and kept under `root` across runs.

    Layout: root/<key>/tiny (the checkpoint) and root/<key>/manifest.json (its options and file digests). A
    checkpoint is written into a private temporary folder and renamed into place in one step, so two pytest
    processes sharing the cache never see half a checkpoint: the loser of the race keeps the winner's copy.
    The folders are shared by every test that asks for the same options: tests must not write into them (copy
    one with shutil.copytree first); each hand-out checks the files are still the ones written."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fingerprint = _generator_fingerprint()
        self.handed_out: dict[str, Path] = {}

    def get(self, seed: int = 0, **options: Any) -> Path:
        key, readable = _options_key(seed, options, self.fingerprint)
        if key in self.handed_out:
            self.check_unchanged([key])
            return self.handed_out[key]
        path = self._valid(key) or self._build(key, seed, options, readable)
        self.handed_out[key] = path
        return path

    def check_unchanged(self, keys: Iterable[str] | None = None) -> None:
        """Fail if a test wrote into a checkpoint handed out this session (it would leak into later tests)."""
        changed = [str(self.handed_out[k]) for k in (self.handed_out if keys is None else keys)
                   if _digest(self.handed_out[k]) != self._manifest(k)["files"]]
        if changed:
            raise AssertionError(f"shared tiny checkpoints changed by a test: {changed}; a test that edits a "
                                 "checkpoint must copy it first (shutil.copytree)")

    def _manifest(self, key: str) -> dict[str, Any]:
        return json.loads((self.root / key / _MANIFEST).read_text())

    def _valid(self, key: str) -> Path | None:
        """The cached checkpoint for `key` if it is complete and unchanged; a damaged one is moved aside."""
        entry = self.root / key
        if not entry.exists():
            return None
        try:
            if _digest(entry / _CHECKPOINT_DIR_NAME) == self._manifest(key)["files"]:
                return entry / _CHECKPOINT_DIR_NAME
        except (OSError, ValueError, KeyError):
            pass
        stale = self.root / f".stale-{key}-{uuid.uuid4().hex}"
        try:  # rename first: a rename is atomic, so no process sees the key half deleted
            os.rename(entry, stale)
        except OSError:
            return None  # another process moved it already
        shutil.rmtree(stale, ignore_errors=True)
        return None

    def _build(self, key: str, seed: int, options: dict[str, Any], readable: str) -> Path:
        staging = self.root / f".building-{key}-{uuid.uuid4().hex}"
        path = _tiny_module().make_tiny_checkpoint(staging / _CHECKPOINT_DIR_NAME, seed, **options)
        manifest = {"options": json.loads(readable), "files": _digest(path)}
        (staging / _MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        try:
            os.rename(staging, self.root / key)  # atomic; fails if another process got there first
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if (found := self._valid(key)) is None:
                raise
            return found
        return self.root / key / _CHECKPOINT_DIR_NAME


@pytest.fixture(scope="session")
def tiny_checkpoint(request: pytest.FixtureRequest,
                    tmp_path_factory: pytest.TempPathFactory) -> Iterator[TinyCheckpoint]:
    """`tiny_checkpoint(seed=0, **options)` -> the path of a tiny random checkpoint built by
    redraft.engine.model.tiny.make_tiny_checkpoint with those arguments (dtype, shards, config_overrides, llada22: a
    LLaDA2.2 checkpoint with DELETE/SPLIT and block routing), read-only.

    Built once per options and session, kept across runs in pytest's cache folder (`--cache-clear` empties it;
    with `-p no:cacheprovider` it lives in this session's temporary folder). The folder is always named `tiny`."""
    cache = getattr(request.config, "cache", None)
    if cache is not None:
        root = cache.mkdir("redraft-tiny-checkpoints")
    else:
        root = tmp_path_factory.mktemp("tiny-checkpoints")
    checkpoints = TinyCheckpoints(Path(root))
    yield checkpoints.get
    checkpoints.check_unchanged()


@pytest.fixture(scope="session")
def ckpt(tiny_checkpoint: TinyCheckpoint) -> Path:
    """The tiny checkpoint most tests use: seed 0, float32, one file (modules needing another seed override it)."""
    return tiny_checkpoint(seed=0)


@pytest.fixture(scope="module")
def demo_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """`redraft serve` of the bundled demo model with one CPU thread, one per test module (its own log folder,
    named after the module), stopped when the module's tests are done."""
    from live_server import RedraftServer

    name = request.module.__name__.rsplit(".", 1)[-1]
    srv = RedraftServer(None, tmp_path_factory.mktemp(name), ["--cpu-threads", "1"])
    try:
        yield srv.start()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def demo_client(demo_server: Any) -> Iterator[Any]:
    """The real `openai` SDK pointed at `demo_server` (no retries: a failure shows at once)."""
    import openai

    with openai.OpenAI(base_url=f"{demo_server.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as c:
        yield c
