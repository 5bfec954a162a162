"""Load LLaDA2-MoE weights from Hugging Face safetensors (single or sharded) into `LLaDA2Model`.

Official tensor names are mapped onto our packed/stacked parameters: gate_proj|up_proj -> one [2I, H]
matrix, the experts of a layer -> [E, 2I, H] and [E, H, I]. Every tensor is checked: a missing, unexpected or
mis-shaped one is an error that names it.

FP8 (kernels/fp8.py): with quantization="fp8" the model is built with e4m3 weights and float32 block scales
(`<param>_scale`) for attention qkv/o, dense MLPs, routed and shared experts; bf16/fp32 tensors of those are
quantised one by one as they are read (128x128 blocks; never a full-precision copy of the model). A
checkpoint whose config.json carries a DeepSeek-style `quantization_config` (quant_method fp8, e4m3, dynamic
activations, 128x128 blocks) is loaded as FP8 whatever `quantization` says: its e4m3 tensors are copied as
they are and each `<name>_scale_inv` [ceil(N/128), ceil(K/128)] (the dequantising multiplier) goes to the
matching block rows of the scale buffer; a quantisable tensor stored in full precision there is quantised.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from safetensors import safe_open
from tqdm.auto import tqdm

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.model import fp8_model
from redraft.engine.model.sharding import SKIP, RankLayout, shard_model_
from redraft.kernels import fp8 as fp8q

log = logging.getLogger("redraft.loader")

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float64": torch.float64,  # for exactness tests only
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[dtype]


class CheckpointError(ValueError):
    """The checkpoint does not match the model its config describes."""


@dataclass(frozen=True)
class Target:
    """Where an official tensor lands: a parameter, optionally a slice of it along dims 0/1."""

    param: str
    shape: tuple[int, ...]
    index: tuple = ()  # e.g. (expert,) or (slice(0, I),) or (expert, slice(I, 2I))


def expected_tensors(cfg: ModelConfig, fp8_checkpoint: bool = False) -> dict[str, Target]:
    """Official name -> target, for every tensor a checkpoint of this config must contain; with fp8_checkpoint
    also the `<name>_scale_inv` block scales an FP8 checkpoint may hold beside each quantisable weight
    (required for the weights stored in e4m3; see load_weights)."""
    h, d, v = cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    nq, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    t: dict[str, Target] = {"model.word_embeddings.weight": Target("embed.weight", (v, h))}
    for li, moe in enumerate(cfg.is_moe_layer):
        src, dst = f"model.layers.{li}", f"layers.{li}"
        t[f"{src}.input_layernorm.weight"] = Target(f"{dst}.input_norm.weight", (h,))
        t[f"{src}.post_attention_layernorm.weight"] = Target(f"{dst}.post_norm.weight", (h,))
        t[f"{src}.attention.query_key_value.weight"] = Target(f"{dst}.attn.qkv.weight", ((nq + 2 * nkv) * d, h))
        if cfg.use_qkv_bias:
            t[f"{src}.attention.query_key_value.bias"] = Target(f"{dst}.attn.qkv.bias", ((nq + 2 * nkv) * d,))
        if cfg.use_qk_norm:
            t[f"{src}.attention.query_layernorm.weight"] = Target(f"{dst}.attn.q_norm.weight", (d,))
            t[f"{src}.attention.key_layernorm.weight"] = Target(f"{dst}.attn.k_norm.weight", (d,))
        t[f"{src}.attention.dense.weight"] = Target(f"{dst}.attn.o_proj.weight", (h, nq * d))
        if cfg.use_bias:
            t[f"{src}.attention.dense.bias"] = Target(f"{dst}.attn.o_proj.bias", (h,))
        if not moe:
            _swiglu_targets(t, f"{src}.mlp", f"{dst}.mlp", h, cfg.intermediate_size)
            continue
        i = cfg.moe_intermediate_size
        t[f"{src}.mlp.gate.weight"] = Target(f"{dst}.mlp.router", (cfg.num_experts, h))
        if cfg.moe_router_enable_expert_bias:
            t[f"{src}.mlp.gate.expert_bias"] = Target(f"{dst}.mlp.expert_bias", (cfg.num_experts,))
        for e in range(cfg.num_experts):
            ex = f"{src}.mlp.experts.{e}"
            t[f"{ex}.gate_proj.weight"] = Target(f"{dst}.mlp.w13", (i, h), (e, slice(0, i)))
            t[f"{ex}.up_proj.weight"] = Target(f"{dst}.mlp.w13", (i, h), (e, slice(i, 2 * i)))
            t[f"{ex}.down_proj.weight"] = Target(f"{dst}.mlp.w2", (h, i), (e,))
        if cfg.num_shared_experts:
            _swiglu_targets(t, f"{src}.mlp.shared_experts", f"{dst}.mlp.shared", h, i * cfg.num_shared_experts)
    t["model.norm.weight"] = Target("norm.weight", (h,))
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = Target("lm_head.weight", (v, h))
    if fp8_checkpoint:
        for name, target in list(t.items()):
            try:
                seg = fp8_model.fp8_segment_rows(cfg, target.param)
            except KeyError:
                continue  # not quantised (embeddings, lm_head, norms, router, biases)
            n, k = target.shape
            t[name + SCALE_SUFFIX] = Target(fp8_model.scale_name(target.param), (fp8q.cdiv(n, fp8q.BLOCK),
                                                                             fp8q.cdiv(k, fp8q.BLOCK)),
                                            fp8_model.scale_index(target.index, seg))
    return t


SCALE_SUFFIX = "_scale_inv"  # DeepSeek-V3's name for the dequantising block scale beside an e4m3 weight


def checkpoint_quantization(cfg: ModelConfig) -> str | None:
    """'fp8' when config.json declares a DeepSeek-style block-FP8 checkpoint, else None (ValueError for a
    quantization_config redraft cannot read)."""
    return fp8q.check_quantization_config(cfg.extra.get("quantization_config"))


def resolve_quantization(cfg: ModelConfig, quantization: str | None) -> str | None:
    """The quantization the model is built with: the requested one, or the checkpoint's own."""
    if quantization in (None, "none"):
        quantization = None
    elif quantization != "fp8":
        raise ValueError(f"unknown quantization {quantization!r}: choose fp8 (or none)")
    return "fp8" if checkpoint_quantization(cfg) == "fp8" else quantization


def _swiglu_targets(t: dict[str, Target], src: str, dst: str, h: int, inter: int) -> None:
    t[f"{src}.gate_proj.weight"] = Target(f"{dst}.gate_up", (inter, h), (slice(0, inter),))
    t[f"{src}.up_proj.weight"] = Target(f"{dst}.gate_up", (inter, h), (slice(inter, 2 * inter),))
    t[f"{src}.down_proj.weight"] = Target(f"{dst}.down", (h, inter))


def checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({model_dir / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index.name} names shard(s) that do not exist: {', '.join(missing)}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
        if pickles:
            raise CheckpointError(f"{model_dir} holds only pickle weights ({', '.join(pickles[:3])}): redraft loads "
                                  "safetensors only (a pickle can run code when loaded); convert them first, e.g. "
                                  "safetensors.torch.save_file(torch.load(f, weights_only=True), 'model.safetensors')")
        raise CheckpointError(f"no *.safetensors in {model_dir}")
    return files


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: str | torch.device,
                quantization: str | None = None, layout: RankLayout | None = None) -> LLaDA2Model:
    """Allocate (uninitialised) parameters directly in `dtype` on `device`: no random init, no second copy.
    quantization="fp8": the quantisable weights are e4m3 with float32 block scales instead. With a tensor-
    parallel `layout`, only the rank's shard is allocated (engine/model/sharding.py)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            model = LLaDA2Model(cfg)
            if quantization == "fp8":
                fp8_model.convert_model_fp8(model)
            if layout is not None:
                shard_model_(model, layout)
    finally:
        torch.set_default_dtype(previous)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty allocates the shared parameter twice: tie them again
        model.lm_head.weight = model.embed.weight
    for layer in model.layers:  # expert_bias is routing-critical: keep it fp32 whatever the dtype
        if hasattr(layer.mlp, "expert_bias"):
            layer.mlp.expert_bias.data = layer.mlp.expert_bias.data.float()
    return model.eval().requires_grad_(False)


class _LoadState:
    """What load_weights has read so far, for the checks that need the whole checkpoint."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.stored_fp8: set[str] = set()  # weights read as e4m3: their `_scale_inv` must come too
        self.quantized: set[str] = set()  # weights quantised here: a `_scale_inv` for them would be stale


def _copy_tensor(model: LLaDA2Model, params: dict[str, torch.Tensor], name: str, tensor: torch.Tensor,
                 target: Target, index: tuple, state: _LoadState) -> None:
    """One checkpoint tensor into its parameter (at `index` within it): copied, or quantised to e4m3 here."""
    dest = params[target.param].data
    view = dest[index] if index else dest
    if tensor.dtype == fp8q.FP8_DTYPE and view.dtype != fp8q.FP8_DTYPE:
        raise CheckpointError(f"tensor {name!r} is float8 but {target.param} is not a quantised weight")
    if view.dtype == fp8q.FP8_DTYPE and tensor.dtype != fp8q.FP8_DTYPE:
        fp8_model.quantize_into(model, target.param, tensor, index)  # bf16/fp32 -> e4m3 + scales
        state.quantized.add(name)
    else:
        view.copy_(tensor.to(device=view.device, dtype=view.dtype))
        if tensor.dtype == fp8q.FP8_DTYPE:
            state.stored_fp8.add(name)


def _check_complete(targets: dict[str, Target], state: _LoadState, model_dir: Path) -> None:
    """Every expected tensor came, and FP8 weights and their scales came in pairs."""
    scales = {n[: -len(SCALE_SUFFIX)] for n in state.seen if n.endswith(SCALE_SUFFIX)}
    if stale := sorted(scales & state.quantized):
        raise CheckpointError(f"{stale[0]!r} is stored in full precision but has a {SCALE_SUFFIX} tensor")
    if unscaled := sorted(state.stored_fp8 - scales):
        raise CheckpointError(f"float8 tensor {unscaled[0]!r} has no {unscaled[0]}{SCALE_SUFFIX} beside it")
    missing = [n for n in targets if n not in state.seen and not n.endswith(SCALE_SUFFIX)]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise CheckpointError(f"checkpoint {model_dir} lacks tensor(s): {', '.join(missing[:5])}{more}")


def load_weights(model: LLaDA2Model, model_dir: str | Path, progress: bool = True, *,
                 cfg: ModelConfig | None = None, layout: RankLayout | None = None) -> None:
    """Copy every checkpoint tensor into `model` (checked against the full config `cfg`, default model.cfg).
    With a `layout`, the model is that rank's shard: each tensor is read only in the rows or columns the rank
    holds (safetensors slices), and other ranks' experts are not read at all."""
    model_dir = Path(model_dir)
    cfg = cfg or model.cfg
    targets = expected_tensors(cfg, fp8_checkpoint=checkpoint_quantization(cfg) == "fp8")
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    state = _LoadState()
    files = checkpoint_files(model_dir)
    total = sum(not n.endswith(SCALE_SUFFIX) for n in targets)
    # disable=None: tqdm draws only on a terminal (a pipe or a log file gets no half-drawn bar)
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=None if progress else True, leave=False)
    for path in files:
        try:
            handle = safe_open(str(path), framework="pt")
        except Exception as exc:  # noqa: BLE001 - safetensors' own error type is not importable everywhere
            raise CheckpointError(f"{path.name} is not a valid safetensors file ({exc})") from None
        with handle as f:
            for name in f.keys():
                target = targets.get(name)
                if target is None:
                    raise CheckpointError(f"unexpected tensor {name!r} in {path.name}: not part of this config")
                if name in state.seen:
                    raise CheckpointError(f"tensor {name!r} appears twice (again in {path.name})")
                piece = f.get_slice(name)
                shape = tuple(piece.get_shape())
                if shape != target.shape:
                    raise CheckpointError(f"tensor {name!r} has shape {shape}, expected {target.shape} from config.json")
                state.seen.add(name)
                if not name.endswith(SCALE_SUFFIX):
                    bar.update(1)
                cut = layout.cut(name, cfg) if layout is not None else None
                if cut is SKIP:  # another rank's expert
                    continue
                tensor = f.get_tensor(name) if cut is None else cut.apply(piece)
                index = layout.local_index(target.index, cut, cfg.num_experts) if layout else target.index
                _copy_tensor(model, params, name, tensor, target, index, state)
    bar.close()
    _check_complete(targets, state, model_dir)
    log.info("loaded %d tensors from %d file(s) in %s", len(state.seen), len(files), model_dir)


def load_named_tensors(model: LLaDA2Model, named: Iterable[tuple[str, torch.Tensor]], *,
                       cfg: ModelConfig | None = None, layout: RankLayout | None = None) -> int:
    """Copy full (unsharded) tensors under their official names into `model` (a weight update: any subset of the
    checkpoint's tensors), each checked by name and shape as load_weights checks a checkpoint's, cut to the
    rank's shard with a `layout`, quantised where the model holds e4m3. Returns the number of tensors copied
    into this rank (another rank's expert is skipped). CheckpointError names the first bad tensor."""
    cfg = cfg or model.cfg
    targets = expected_tensors(cfg, fp8_checkpoint=checkpoint_quantization(cfg) == "fp8")
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    state, copied = _LoadState(), 0
    for name, tensor in named:
        target = targets.get(name)
        if target is None:
            raise CheckpointError(f"unexpected tensor {name!r}: not part of this config")
        if tuple(tensor.shape) != target.shape:
            raise CheckpointError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {target.shape}")
        cut = layout.cut(name, cfg) if layout is not None else None
        if cut is SKIP:
            continue
        index = layout.local_index(target.index, cut, cfg.num_experts) if layout else target.index
        _copy_tensor(model, params, name, tensor if cut is None else cut.apply(tensor), target, index, state)
        copied += 1
    return copied


def init_dummy_weights(model: LLaDA2Model, seed: int = 0) -> None:
    """Random weights of the right shapes (`load_format="dummy"`): benchmarks at real shapes, no checkpoint.

    On CPU the draws come from one CPU generator (the tests' checkpoints depend on them); on a GPU they are drawn
    there (a CPU generator takes minutes at 16B parameters), e4m3 weights one expert at a time."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        _init_dummy_on_device(model, seed, device)
        return
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.data.fill_(1.0)
        elif p.dtype == fp8q.FP8_DTYPE:  # e4m3 weights: quantise full-precision random ones
            fp8_model.quantize_into(model, name, torch.randn(p.shape, generator=gen) * 0.02)
        else:
            p.data.copy_((torch.randn(p.shape, generator=gen) * 0.02).to(p.dtype))
    for layer in model.layers:
        if hasattr(layer.mlp, "expert_bias"):
            layer.mlp.expert_bias.data.copy_(torch.randn(layer.mlp.expert_bias.shape, generator=gen) * 0.01)


@torch.no_grad()
def _init_dummy_on_device(model: LLaDA2Model, seed: int, device: torch.device) -> None:
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dtype == fp8q.FP8_DTYPE:
            for e in range(p.shape[0]) if p.dim() == 3 else [None]:  # one expert at a time: small temporaries
                w = torch.empty(p.shape[-2:], device=device).normal_(0.0, 0.02, generator=gen)
                fp8_model.quantize_into(model, name, w, (e,) if e is not None else ())
        else:
            p.normal_(0.0, 0.02, generator=gen)
    for layer in model.layers:
        if hasattr(layer.mlp, "expert_bias"):
            layer.mlp.expert_bias.normal_(0.0, 0.01, generator=gen)


def load_model(
    model_dir: str | Path | None,
    cfg: ModelConfig,
    *,
    dtype: str | torch.dtype = "float32",
    device: str = "cpu",
    load_format: str = "auto",
    seed: int = 0,
    progress: bool = True,
    quantization: str | None = None,
    layout: RankLayout | None = None,
) -> LLaDA2Model:
    """Build and fill the model; with a tensor-parallel `layout`, only that rank's shard (engine/model/sharding.py)."""
    torch_dtype = resolve_dtype(dtype)
    quantization = resolve_quantization(cfg, quantization)
    model = build_model(cfg, torch_dtype, device, quantization, layout)
    if load_format == "dummy":
        init_dummy_weights(model, seed)  # (with a layout: random weights of the shard's shapes)
    elif load_format in ("auto", "safetensors"):
        if model_dir is None:
            raise ValueError("a model directory is needed unless load_format='dummy'")
        load_weights(model, model_dir, progress=progress, cfg=cfg, layout=layout)
    else:
        raise ValueError(f"unknown load_format {load_format!r}: use 'auto', 'safetensors' or 'dummy'")
    return model
