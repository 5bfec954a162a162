"""Write a trained demo model in the Hugging Face layout that `redraft.Engine(model_path=...)` loads.

config.json (the LLaDA2 fields), model.safetensors (official tensor names: our packed gate|up matrices and
stacked experts are cut back into per-expert gate_proj / up_proj / down_proj, the exact inverse of
`engine/model/loader.py`'s mapping; expert_bias stays float32), tokenizer.json + tokenizer_config.json (with the
chat template) and generation_config.json.

    python -m redraft.training.export --run-dir runs/demo --out engine/demo_model
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from redraft.engine.model.config import ModelConfig
from redraft.engine.model.loader import expected_tensors
from redraft.engine.model.model import LLaDA2Model
from redraft.engine.text.tokenizer import BOS_TOKEN, Tokenizer, save_pretrained_tokenizer

log = logging.getLogger("redraft.export")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def official_state_dict(model: LLaDA2Model, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Official name -> tensor, un-packing and un-stacking with the loader's own targets (so the round trip is
    exact by construction)."""
    params = dict(model.named_parameters()) | dict(model.named_buffers())
    out: dict[str, torch.Tensor] = {}
    for name, target in expected_tensors(model.cfg).items():
        src = params[target.param].detach()
        t = src[target.index] if target.index else src
        if tuple(t.shape) != target.shape:
            raise ValueError(f"{name}: got shape {tuple(t.shape)} from {target.param}, expected {target.shape}")
        t = t.float() if name.endswith(".expert_bias") else t.to(dtype)
        out[name] = t.contiguous().clone()
    return out


def config_json(cfg: ModelConfig, tok: Tokenizer, dtype: str) -> dict:
    raw = {
        "architectures": ["LLaDA2MoeModelLM"],
        "model_type": "llada2_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "num_shared_experts": cfg.num_shared_experts,
        "first_k_dense_replace": cfg.first_k_dense_replace,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "score_function": cfg.score_function,
        "moe_router_enable_expert_bias": cfg.moe_router_enable_expert_bias,
        "router_dtype": "fp32",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "partial_rotary_factor": cfg.partial_rotary_factor,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_qk_norm": cfg.use_qk_norm,
        "use_qkv_bias": cfg.use_qkv_bias,
        "use_bias": cfg.use_bias,
        "hidden_act": "silu",
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "use_cache": False,
        "output_router_logits": False,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": tok.eos_token_id,
        "bos_token_id": tok.token_to_id(BOS_TOKEN),
        "torch_dtype": dtype,
    }
    return raw


def export_model(model: LLaDA2Model, tok: Tokenizer, out_dir: str | Path, dtype: str = "float32",
                 metadata: dict | None = None, suite: str | None = None) -> Path:
    """Write the HF layout of `model` + `tok` to `out_dir` (replacing any previous export there). `suite`: the
    task suite it was trained on, recorded in config.json (`redraft_task_suite`) for the evaluation."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, not {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for old in list(out.glob("model*.safetensors")) + [out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    tensors = official_state_dict(model, _DTYPES[dtype])
    meta = {"format": "pt", **{k: str(v) for k, v in (metadata or {}).items()}}
    save_file(tensors, str(out / "model.safetensors"), metadata=meta)
    (out / "model.safetensors").chmod(0o644)  # package data: readable like the other files
    save_pretrained_tokenizer(tok.backend, out, tok.chat_template,
                              model_max_length=model.cfg.max_position_embeddings)
    config = config_json(model.cfg, tok, dtype) | ({"redraft_task_suite": suite} if suite else {})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    bos = tok.token_to_id(BOS_TOKEN)
    generation = {"bos_token_id": bos, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
                  "block_length": 32, "threshold": 0.7, "editing_threshold": 0.5, "max_post_steps": 16,
                  "temperature": 0.0}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return out


def export_run(run_dir: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Export the latest checkpoint of a training run folder."""
    from redraft.training.train import TrainConfig, init_model, model_config

    run = Path(run_dir)
    if not (run / "ckpt.pt").is_file():
        raise FileNotFoundError(f"no checkpoint in {run} (expected {run / 'ckpt.pt'})")
    tcfg = TrainConfig.from_dict(json.loads((run / "config.json").read_text()))
    tcfg.run_dir = str(run)
    state = torch.load(run / "ckpt.pt", map_location="cpu", weights_only=False)
    tok = Tokenizer.from_pretrained(run / "tokenizer")
    model = init_model(model_config(tcfg, tok), tcfg.seed)
    model.load_state_dict(state["model"])
    return export_model(model, tok, out_dir, dtype, metadata={"redraft_train_step": state["step"]},
                        suite=tcfg.suite)


def export_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="redraft export-demo",
                                description="Write a training run's latest checkpoint as a Hugging Face checkpoint.")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--out", required=True, help="output directory (e.g. engine/demo_model to bundle it)")
    p.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    out = export_run(args.run_dir, args.out, args.dtype)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"wrote {out} ({size / 1e6:.1f} MB of weights)")
    return 0


if __name__ == "__main__":
    sys.exit(export_main())
