"""Engine start-up: from ServerArgs to the parts `EngineCore` runs (tokenizer, model, scheduler, model runner),
in order: check the device, resolve and read the checkpoint, start the other tensor-parallel ranks (they load
their shards meanwhile), load rank 0's weights, size the KV cache, meet the other ranks, build the scheduler and
the runner.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from redraft.engine.decoding.registry import implied_decoder
from redraft.engine.model.config import ModelConfig
from redraft.engine.text.model_path import resolve_model_path
from redraft.engine.model.loader import load_model, resolve_dtype, resolve_quantization
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.runtime.model_runner import ModelRunner
from redraft.engine.model.sharding import RankLayout, check_layout
from redraft.engine.text.tokenizer import Tokenizer
from redraft.protocol.sampling_params import BLOCK_SIZE, Defaults
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("redraft.engine")


@dataclass
class EngineParts:
    """What start-up builds. `tp_workers`: the other tensor-parallel ranks (None without tensor parallelism)."""

    model_path: Path
    model_config: ModelConfig
    tokenizer: Tokenizer
    default_levels: tuple[Defaults, ...]  # the defaults chain below the request
    model: LLaDA2Model
    scheduler: Scheduler
    runner: ModelRunner
    tp_workers: Any | None


def read_generation_config(model_path: Path | None) -> Defaults:
    """The checkpoint's generation_config.json as a level of the defaults chain (empty if absent)."""
    path = model_path / "generation_config.json" if model_path else None
    if path is None or not path.is_file():
        return Defaults()
    try:
        raw = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from exc
    return Defaults.from_generation_config(raw if isinstance(raw, dict) else {})


def pick_placement(device: str, kernel_backend: str, cuda_available: bool, triton_available: bool
                   ) -> tuple[str, str, str]:
    """(device, kernel backend, why) for the requested values, "auto" resolved: cuda when torch sees one, and the
    Triton kernels on cuda (the CUDA-graph denoising step needs them) when triton imports; torch on cpu, where
    Triton only runs interpreted."""
    why = []
    if device == "auto":
        device = "cuda" if cuda_available else "cpu"
        why.append("torch sees a CUDA device" if cuda_available else "torch sees no CUDA device")
    if kernel_backend == "auto":
        on_gpu = torch.device(device).type == "cuda"
        kernel_backend = "triton" if on_gpu and triton_available else "torch"
        why.append("the backend follows the device" if not on_gpu or triton_available
                   else "triton does not import: pip install triton for the fused kernels and CUDA graphs")
    return device, kernel_backend, "; ".join(why) or "as given"


def resolve_placement(args: ServerArgs) -> ServerArgs:
    """`args` with device and kernel backend decided (never "auto"), said in one log line."""
    if args.device != "auto" and args.kernel_backend != "auto":
        return args
    import importlib.util

    device, backend, why = pick_placement(args.device, args.kernel_backend, torch.cuda.is_available(),
                                          importlib.util.find_spec("triton") is not None)
    name = f" ({torch.cuda.get_device_name(torch.device(device))})" if torch.device(device).type == "cuda" else ""
    log.info("device %s%s, kernel backend %s (%s; --device / --kernel-backend to choose)", device, name, backend,
             why)
    return args.replace(device=device, kernel_backend=backend)


def start_engine(args: ServerArgs) -> EngineParts:
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={args.device!r}, but this torch ({torch.__version__}) sees no CUDA device")
    if args.cpu_threads or args.tp_size > 1:  # else torch's own choice stands
        from redraft.engine.runtime.tensor_parallel import set_threads  # (one rule for every rank)

        set_threads(args)
    path = resolve_model_path(args.model_path, args.revision)
    config = ModelConfig.from_pretrained(path)
    if args.context_length is not None and args.context_length > config.max_position_embeddings:
        raise ValueError(f"--context-length {args.context_length} is longer than this checkpoint's "
                         f"max_position_embeddings ({config.max_position_embeddings})")
    tokenizer = Tokenizer.from_pretrained(path, args.chat_template)
    # The defaults chain below the request: the operator's explicit flags, then generation_config.json, then
    # what the checkpoint itself implies (a decoding rule of its own: engine/decoding/registry.py).
    implied = implied_decoder(config)
    levels = (args.request_defaults(), read_generation_config(path),
              Defaults(decoder=implied) if implied else Defaults())
    t0 = time.perf_counter()
    # tensor parallelism: this process is rank 0 and loads only its shard (engine/model/sharding.py) while the other
    # ranks, started first, load theirs (engine/runtime/tensor_parallel.py)
    layout, workers = None, None
    if args.tp_size > 1:
        from redraft.engine.runtime.tensor_parallel import Workers

        check_layout(config, args.tp_size, args.ep_size, resolve_quantization(config, args.quantization))
        layout, workers = RankLayout(0, args.tp_size, args.ep_size), Workers(args)
    try:
        model = _load(args, path, config, layout, t0)
        num_pages = max(1, (args.max_total_tokens or default_kv_tokens(args, config)) // BLOCK_SIZE)
        scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, block_size=BLOCK_SIZE, max_running_requests=args.max_running_requests,
            max_queued_requests=args.max_queued_requests, max_prefill_tokens=args.chunked_prefill_size,
            policy=args.schedule_policy, enable_prefix_cache=args.enable_prefix_cache,
            recompute_prefix=args.recompute_prefix,
        ))
        runner = _runner(args, model, tokenizer, num_pages, workers)
    except BaseException:
        if workers is not None:
            workers.kill()
        raise
    return EngineParts(path, config, tokenizer, levels, model, scheduler, runner, workers)


def _load(args: ServerArgs, path: Path, config: ModelConfig, layout: RankLayout | None, t0: float) -> LLaDA2Model:
    """Rank 0's weights (all of them without tensor parallelism), on their kernel backend."""
    model = load_model(path, config, dtype=args.resolved_dtype, device=args.device, load_format=args.load_format,
                       seed=args.seed, progress=args.progress, quantization=args.quantization, layout=layout)
    # kernel_backend="triton": Triton attention and the fused Triton MoE (sync-free: the denoising step can be
    # captured in a CUDA graph); "torch": the plain-torch twins. FP8 linears follow the same choice.
    model.set_kernel_backend(args.kernel_backend)
    log.info("loaded %s (%.1fM params, %s%s, %s) in %.1fs", path, config.num_params() / 1e6, args.resolved_dtype,
             ", fp8 weights" if model.quantization else "", args.device, time.perf_counter() - t0)
    return model


def _runner(args: ServerArgs, model: LLaDA2Model, tokenizer: Tokenizer, num_pages: int,
            workers: Any | None) -> ModelRunner:
    """Meet the other ranks (each sizes the same KV cache), then the runner, with CUDA graphs where they apply."""
    on_gpu = torch.device(args.device).type == "cuda"
    graph_bs = 0
    # (not with tensor parallelism: a captured graph would skip the forward hooks that talk to the other ranks)
    if on_gpu and args.kernel_backend == "triton" and not args.disable_cuda_graph and args.tp_size == 1:
        graph_bs = max(0, min(args.cuda_graph_max_bs, args.max_running_requests))
    if workers is not None:
        workers.join(model, num_pages, args.max_running_requests)
        from redraft.engine.runtime.tensor_parallel import backend_for

        log.info("tensor parallel: %d ranks (expert parallel %d), %s", args.tp_size, args.ep_size,
                 backend_for(args.device))
    runner = ModelRunner(model, num_pages, args.max_running_requests, tokenizer.mask_token_id,
                         tokenizer.eos_token_id, args.device, cuda_graph_max_bs=graph_bs)
    if args.tp_size > 1:
        from redraft.engine.model.sharding import is_vocab_parallel

        runner.vocab_reduce = not is_vocab_parallel(model)  # the ranks' logits hook serves full rows only
        from redraft.engine.runtime.tensor_parallel import log_rank_memory

        log_rank_memory(0, model, runner.k_cache)
    return runner


def default_kv_tokens(args: ServerArgs, config: ModelConfig) -> int:
    """KV cache tokens when --max-total-tokens is not given."""
    per_token = ModelRunner.kv_bytes_per_token(config, resolve_dtype(args.resolved_dtype))
    if torch.device(args.device).type == "cuda":
        # SGLang's rule: weights + KV cache take mem_fraction_static of the GPU; the rest is activations.
        free, total = torch.cuda.mem_get_info()
        # memory this process's caching allocator holds but no tensor uses (an earlier engine's, freed) is free to us
        free += torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
        budget = int(total * args.mem_fraction_static) - (total - free)
        if budget <= 0:
            raise ValueError(f"mem_fraction_static={args.mem_fraction_static} leaves no room for the KV cache "
                             f"({(total - free) / 2**30:.1f} of {total / 2**30:.1f} GiB in use: another engine in "
                             "this process or on this GPU?); pass max_total_tokens, or raise mem_fraction_static")
        return budget // per_token
    budget = 512 * 2**20  # CPU: 512 MiB of KV cache at most
    return int(min(max(budget // per_token, 4096), 262144))
