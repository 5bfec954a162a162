"""Weights from a trainer, on one rank: the checks before a weight is touched, the trainer's process group, the
broadcast receive, and the copy into the rank's shard. The engine side (when an update may run, versions, the
HTTP answer) is engine/runtime/weight_update.py; docs/rl.md says what the routes do.

The group is joined with the recipe the RL frameworks (and SGLang) use on both ends, so a trainer written for
SGLang meets this engine unchanged: a TCP store at `master_address:master_port` (the trainer, rank 0, hosts it),
wrapped in `PrefixStore(group_name)`, a new process group of `world_size` ranks over it, this rank being
`rank_offset + tp_rank`. Tensors then arrive by broadcast from rank 0, one per name in list order (or, with
load_format "flattened_bucket", all of them as one uint8 buffer, each tensor's bytes after the previous one's).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors import safe_open

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.loader import (CheckpointError, checkpoint_files, checkpoint_quantization,
                                         expected_tensors, load_named_tensors)
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.model.sharding import RankLayout

log = logging.getLogger("redraft.weight_sync")

GROUP_TIMEOUT = datetime.timedelta(minutes=30)  # as long as a trainer may take between two broadcasts
FLATTENED_BUCKET = "flattened_bucket"
_DTYPES = {name: getattr(torch, name) for name in (
    "float32", "float16", "bfloat16", "float64", "float8_e4m3fn", "float8_e5m2", "int8", "uint8", "int32", "int64")}
_DTYPES |= {"float": torch.float32, "half": torch.float16, "double": torch.float64}

Header = dict[str, tuple[tuple[int, ...], str]]  # official name -> (shape, dtype name)


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]


def parse_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' (what slime and AReaL send) -> torch.bfloat16; ValueError otherwise."""
    dtype = _DTYPES.get(str(name).removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(sorted(_DTYPES))}")
    return dtype


def dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


# ---- checks before any weight is touched -------------------------------------------------------------------
def checkpoint_header(model_dir: str | Path) -> Header:
    """Name, shape and dtype of every tensor of a checkpoint, read from the safetensors headers only."""
    header: Header = {}
    for path in checkpoint_files(Path(model_dir)):
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    piece = f.get_slice(name)
                    header[name] = (tuple(piece.get_shape()), _safetensors_dtype(piece.get_dtype()))
        except CheckpointError:
            raise
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type is not importable everywhere
            raise CheckpointError(f"{path.name} is not a valid safetensors file ({exc})") from None
    return header


def _safetensors_dtype(code: str) -> str:
    return {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
            "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "I32": "int32", "I64": "int64"}.get(code, code)


def check_checkpoint(new_dir: str | Path, running: ModelConfig, running_header: Header | None) -> None:
    """CheckpointError unless `new_dir` can replace the running weights: the same config (architecture, sizes,
    quantisation), exactly the running checkpoint's tensor names, shapes and dtypes (without a running header,
    a launch with dummy weights: the names and shapes the config implies)."""
    new_dir = Path(new_dir)
    if not (new_dir / "config.json").is_file():
        raise CheckpointError(f"no checkpoint (config.json) in {new_dir}")
    try:
        cfg = ModelConfig.from_pretrained(new_dir)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{new_dir}/config.json cannot be read: {exc}") from None
    if cfg != running:
        diff = [f.name for f in dataclasses.fields(cfg) if f.compare and getattr(cfg, f.name) != getattr(running, f.name)]
        name = diff[0] if diff else "?"
        raise CheckpointError(f"config.json of {new_dir} differs from the running model's in {name} "
                              f"({getattr(cfg, name, None)!r}, running {getattr(running, name, None)!r})")
    if checkpoint_quantization(cfg) != checkpoint_quantization(running):
        raise CheckpointError(f"config.json of {new_dir} has another quantization_config than the running model")
    header = checkpoint_header(new_dir)
    if running_header is None:
        running_header = {n: (t.shape, "") for n, t in expected_tensors(running, checkpoint_quantization(running)
                                                                          == "fp8").items() if n in header}
    missing = sorted(set(running_header) - set(header))
    extra = sorted(set(header) - set(running_header))
    if missing or extra:
        what = f"lacks {missing[0]!r}" if missing else f"has a tensor the running one has not: {extra[0]!r}"
        raise CheckpointError(f"checkpoint {new_dir} {what}")
    for name, (shape, dtype) in header.items():
        run_shape, run_dtype = running_header[name]
        if shape != tuple(run_shape) or (run_dtype and dtype != run_dtype):
            raise CheckpointError(f"tensor {name!r} is {dtype} {list(shape)} in {new_dir}, the running one "
                                  f"{run_dtype or '?'} {list(run_shape)}")


def check_specs(specs: list[TensorSpec], cfg: ModelConfig) -> str | None:
    """Why a broadcast of these tensors cannot update this model (None when it can): every name an official tensor
    of the config, its full shape, a dtype we know."""
    targets = expected_tensors(cfg, fp8_checkpoint=checkpoint_quantization(cfg) == "fp8")
    seen: set[str] = set()
    for spec in specs:
        target = targets.get(spec.name)
        if target is None:
            return f"names: {spec.name!r} is not a tensor of this model (Hugging Face names, e.g. {next(iter(targets))!r})"
        if spec.name in seen:
            return f"names: {spec.name!r} is given twice"
        seen.add(spec.name)
        if tuple(spec.shape) != target.shape:
            return f"shapes: {spec.name!r} is {list(target.shape)} in this model, not {list(spec.shape)}"
    return None


# ---- the trainer's group -------------------------------------------------------------------------------------
def join_group(master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
               backend: str, timeout: datetime.timedelta = GROUP_TIMEOUT) -> Any:
    """Join the trainer's group as `rank` (blocks until all `world_size` ranks have joined)."""
    from torch.distributed.distributed_c10d import PrefixStore, _new_process_group_helper, _world

    url = f"tcp://{master_address}:{master_port}"
    store, rank, world_size = next(dist.rendezvous(url, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group = _new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name, timeout=timeout)
    if isinstance(group, tuple):  # (older torch returned the group with its backend)
        group = group[0]
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}  # group ranks are the global ranks here
    return group


def destroy_group(group: Any) -> None:
    dist.destroy_process_group(group)


def receive(group: Any, specs: list[TensorSpec], device: torch.device | str, load_format: str | None
            ) -> list[tuple[str, torch.Tensor]]:
    """Every tensor of `specs`, broadcast from the group's rank 0 in list order (one uint8 buffer for a
    flattened bucket)."""
    empties = [(s.name, torch.empty(s.shape, dtype=parse_dtype(s.dtype), device=device)) for s in specs]
    if load_format == FLATTENED_BUCKET:
        sizes = [t.numel() * t.element_size() for _, t in empties]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)  # [total bytes]
        dist.broadcast(flat, src=0, group=group)
        out, start = [], 0
        for (name, t), size in zip(empties, sizes):
            out.append((name, flat[start:start + size].view(t.dtype).view(t.shape)))
            start += size
        return out
    works = [dist.broadcast(t, src=0, group=group, async_op=True) for _, t in empties]
    for work in works:
        work.wait()
    return empties


def apply(model: LLaDA2Model, named: list[tuple[str, torch.Tensor]], cfg: ModelConfig,
          layout: RankLayout | None) -> int:
    """Copy received full tensors into this rank's shard (re-quantised where it serves FP8)."""
    with torch.no_grad():
        return load_named_tensors(model, named, cfg=cfg, layout=layout)


def save_checkpoint(named: dict[str, torch.Tensor], config_dir: str | Path, out_dir: str | Path) -> Path:
    """The weights a rank received, as a checkpoint a restarted engine can load: config.json (and the other json
    files) copied from `config_dir`, one model.safetensors. Written beside and renamed into place."""
    from safetensors.torch import save_file

    out_dir, config_dir = Path(out_dir), Path(config_dir)
    staging = out_dir.with_name(out_dir.name + ".partial")
    staging.mkdir(parents=True, exist_ok=True)
    for path in config_dir.glob("*.json"):
        if not path.name.startswith("model.safetensors"):
            (staging / path.name).write_bytes(path.read_bytes())
    save_file({n: t.detach().contiguous().cpu() for n, t in named.items()}, str(staging / "model.safetensors"))
    staging.rename(out_dir)
    return out_dir


def rank_command(command: tuple, model: LLaDA2Model, cfg: ModelConfig, layout: RankLayout,
                 device: torch.device | str, groups: dict[str, Any]) -> None:
    """A tensor-parallel rank > 0 does its share of a weight command rank 0 announced
    (engine/runtime/weight_update.py): load a checkpoint ("disk"), join or leave a trainer's group, receive a
    broadcast and copy its shard ("receive"), or receive and drop it ("drain")."""
    op = command[0]
    if op == "disk":
        from redraft.engine.model.loader import load_weights

        load_weights(model, command[1], progress=False, cfg=cfg, layout=layout)
    elif op == "join":
        msg = command[1]
        groups[msg.group_name] = join_group(msg.master_address, msg.master_port, msg.rank_offset + layout.rank,
                                            msg.world_size, msg.group_name, msg.backend)
    elif op in ("receive", "drain"):
        _, name, specs, load_format = command
        named = receive(groups[name], specs, device, load_format)
        if op == "receive":
            apply(model, named, cfg, layout)
    elif op == "destroy":
        destroy_group(groups.pop(command[1]))
    else:
        raise ValueError(f"unknown weight command {op!r}")
