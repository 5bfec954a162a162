"""Tensor and expert parallelism over torch.distributed (gloo on CPU, NCCL on GPUs): docs/scaling.md.

Layout (Megatron-style, one all-reduce after attention and one after the MLP of every layer):
- attention: each rank keeps num_attention_heads / tp query heads and num_key_value_heads / tp KV heads (the
  packed qkv rows of its heads, the o_proj columns of its heads), so its KV cache holds only its heads;
- dense MLP and shared expert: each rank keeps intermediate / tp of the SwiGLU (gate and up rows, down columns);
- routed experts: ep_size 1 splits every expert's intermediate the same way; ep_size == tp places whole experts
  (experts [r E / tp, (r + 1) E / tp) on rank r): the router runs everywhere on the full hidden state, each rank
  applies only its experts, and the all-reduce sums them;
- embedding, norms, router and lm_head are replicated: every rank has the full hidden state after each
  all-reduce, and rank 0 alone turns it into logits and decisions (a vocabulary-parallel lm_head would need an
  all-gather of logits every step for a matrix that is 1-2% of the MoE's weights).

Rank 0 is the engine: it schedules, and before each forward broadcasts the forward's inputs (token ids and
attention metadata) to the other ranks, which run the same forward on their shards and their own KV caches
(`worker_main`). Every rank therefore schedules identically by construction: only rank 0 schedules at all.
Each rank loads the checkpoint and keeps its shard (memory at load time is not yet reduced).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from typing import Any

import torch
import torch.distributed as dist

from redraft.engine.config import ModelConfig
from redraft.engine.model import DenseMLP, LLaDA2Model, MoE
from redraft.kernels.moe import combine_experts_torch, swiglu

log = logging.getLogger("redraft.tp")
STOP = "stop"


def check_layout(cfg: ModelConfig, tp: int, ep: int) -> None:
    """Clear errors for a layout the model cannot take."""
    if tp < 1 or ep not in (1, tp):
        raise ValueError(f"ep_size must be 1 or equal to tp_size ({tp}), not {ep}")
    for name, n in (("num_attention_heads", cfg.num_attention_heads), ("num_key_value_heads", cfg.num_key_value_heads),
                    ("intermediate_size", cfg.intermediate_size), ("moe_intermediate_size", cfg.moe_intermediate_size)):
        if n % tp:
            raise ValueError(f"tp_size {tp} does not divide {name} = {n}")
    if cfg.num_experts % ep:
        raise ValueError(f"ep_size {ep} does not divide num_experts = {cfg.num_experts}")
    if cfg.use_qkv_bias or cfg.use_bias:
        raise ValueError("tensor parallelism does not support checkpoints with linear biases yet")


def _split_rows(w: torch.Tensor, parts: list[int], rank: int, tp: int) -> torch.Tensor:
    """Rows of `w` grouped as `parts` (e.g. gate | up), each group cut in tp and rank's slice kept."""
    out, start = [], 0
    for size in parts:
        chunk = size // tp
        out.append(w[start + rank * chunk : start + (rank + 1) * chunk])
        start += size
    return torch.cat(out).contiguous()


def shard_model_(model: LLaDA2Model, rank: int, tp: int, ep: int) -> LLaDA2Model:
    """Cut `model` down to rank's shard in place (dtypes, buffers and device untouched) and install its
    all-reduces; model.cfg becomes the rank's view (its heads and intermediate sizes)."""
    cfg = model.cfg
    check_layout(cfg, tp, ep)
    d, nq, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    with torch.no_grad():
        for layer in model.layers:
            attn = layer.attn
            attn.qkv.weight = _param(_split_rows(attn.qkv.weight, [nq * d, nkv * d, nkv * d], rank, tp))
            attn.o_proj.weight = _param(attn.o_proj.weight[:, rank * (nq // tp) * d : (rank + 1) * (nq // tp) * d])
            attn.n_q, attn.n_kv = nq // tp, nkv // tp
            if isinstance(layer.mlp, MoE):
                _shard_moe(layer.mlp, rank, tp, ep)
            else:
                _shard_dense(layer.mlp, rank, tp)
            layer.attn.register_forward_hook(_all_reduce_output)  # partial sums -> the full result everywhere
            layer.mlp.register_forward_hook(_all_reduce_output)
    model.cfg = dataclasses.replace(cfg, num_attention_heads=nq // tp, num_key_value_heads=nkv // tp,
                                    intermediate_size=cfg.intermediate_size // tp,
                                    moe_intermediate_size=cfg.moe_intermediate_size // tp)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters and buffers a rank holds."""
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def log_rank_memory(rank: int, model: torch.nn.Module, k_cache: torch.Tensor) -> None:
    kv = 2 * k_cache.numel() * k_cache.element_size()
    log.info("rank %d holds %.1f MB of weights and %.1f MB of KV cache (%d KV heads)", rank,
             weight_bytes(model) / 1e6, kv / 1e6, k_cache.shape[3])


def _param(t: torch.Tensor) -> torch.nn.Parameter:
    return torch.nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _shard_dense(mlp: DenseMLP, rank: int, tp: int) -> None:
    inter = mlp.down.shape[1]
    mlp.gate_up = _param(_split_rows(mlp.gate_up, [inter, inter], rank, tp))
    mlp.down = _param(mlp.down[:, rank * (inter // tp) : (rank + 1) * (inter // tp)])


def _shard_moe(moe: MoE, rank: int, tp: int, ep: int) -> None:
    if moe.shared is not None:
        _shard_dense(moe.shared, rank, tp)
    e, inter = moe.w13.shape[0], moe.w2.shape[2]
    if ep == 1:  # every expert, rank's slice of its intermediate
        moe.w13 = _param(torch.stack([_split_rows(w, [inter, inter], rank, tp) for w in moe.w13]))
        moe.w2 = _param(moe.w2[:, :, rank * (inter // tp) : (rank + 1) * (inter // tp)])
        return
    n = e // ep  # whole experts [first, first + n)
    first = rank * n
    moe.w13, moe.w2 = _param(moe.w13[first : first + n]), _param(moe.w2[first : first + n])
    moe.experts = _local_experts(first, n)
    moe.impl = None  # the torch router + these experts (the fused Triton MoE knows no expert subset yet)


def _local_experts(first: int, n: int):
    """moe_experts_torch for experts [first, first + n) only: other experts' slots go to a null expert n."""
    def experts(x, w13, w2, topk_ids, topk_weights):
        local = (topk_ids >= first) & (topk_ids < first + n)
        ids = torch.where(local, topk_ids - first, torch.full_like(topk_ids, n))
        weights = torch.where(local, topk_weights, torch.zeros_like(topk_weights))

        def fn(expert: int, xs: torch.Tensor) -> torch.Tensor:
            return swiglu(xs, w13[expert], w2[expert]) if expert < n else torch.zeros_like(xs)

        return combine_experts_torch(x, ids, weights, n + 1, fn)

    return experts


def _all_reduce_output(module: torch.nn.Module, args: Any, out: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(out)
    return out


# ---- processes ---------------------------------------------------------------------------------------------
def free_init_method() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def backend_for(device: str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def init(rank: int, tp: int, device: str, init_method: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=tp)


def install_leader(model: LLaDA2Model) -> None:
    """Rank 0: every forward first sends its inputs to the other ranks, which run it too."""
    def send(module: torch.nn.Module, args: tuple) -> None:
        ids, meta = args[0], args[1]
        dist.broadcast_object_list([("forward", ids.cpu(), _tensors_to(meta, "cpu"))], src=0)

    model.register_forward_pre_hook(send)


def _tensors_to(obj: Any, device: str | torch.device) -> Any:
    """A dataclass (attention metadata) with its tensor fields on `device`: each rank reads its own copy."""
    changes = {f.name: getattr(obj, f.name).to(device) for f in dataclasses.fields(obj)
               if isinstance(getattr(obj, f.name), torch.Tensor)}
    return dataclasses.replace(obj, **changes)


def stop_workers() -> None:
    if dist.is_initialized():
        dist.broadcast_object_list([(STOP, None, None)], src=0)
        dist.destroy_process_group()


def worker_main(rank: int, tp: int, ep: int, args: Any, init_method: str, num_pages: int, num_slots: int) -> None:
    """A rank > 0: load, shard, then run every forward rank 0 announces, on its own KV cache."""
    from redraft.engine.loader import load_model
    from redraft.engine.defaults import resolve_model_path
    from redraft.engine.model_runner import ModelRunner

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.cpu_threads:
        torch.set_num_threads(args.cpu_threads)
    device = f"cuda:{rank}" if torch.device(args.device).type == "cuda" else args.device
    init(rank, tp, args.device, init_method)
    path = resolve_model_path(args.model_path, args.revision)
    model = load_model(path, ModelConfig.from_pretrained(path), dtype=args.resolved_dtype, device=device,
                       load_format=args.load_format, seed=args.seed, progress=False)
    model.set_kernel_backend(args.kernel_backend)
    shard_model_(model, rank, tp, ep)
    runner = ModelRunner(model, num_pages, num_slots, 0, 0, device)
    log_rank_memory(rank, model, runner.k_cache)
    with torch.inference_mode():
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=0)
            kind, ids, meta = box[0]
            if kind == STOP:
                break
            model(ids.to(device), _tensors_to(meta, device), runner.k_cache, runner.v_cache)
    dist.destroy_process_group()
    os._exit(0)
