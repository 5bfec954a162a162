"""Train the bundled demo model: a small LLaDA2-MoE learning the task suite with the LLaDA2.1 objective.

Not a general trainer. One step:
  1. draw a batch of train-split problems (curriculum: small problems first), encode them as block-aligned
     sequences, group them by block count;
  2. noise every sequence (drafting: mask a fraction t ~ U(0,1] of the response; editing, for some: also
     replace a few visible tokens with wrong ones);
  3. multi-turn forward (MTF), for some sequences: one no-grad forward drafts their masked positions, the most
     confident of those drafts are written back into the input (the model's own, partly wrong, tokens) and
     the sequence is scored at every response position: recover the truth from what decoding would see;
  4. one forward over the dual-copy layout (noisy copy + clean earlier blocks, data.dual_copy_mask), weighted
     cross-entropy on the scored positions, AdamW step with clipping and a warmup + cosine LR;
  5. the MoE routers are balanced without a loss (DeepSeek-V3 style): each expert's `expert_bias` moves by a
     small step towards equal load.
The model is `redraft.engine.model.model.LLaDA2Model` itself; only its attention function is swapped for a dense
masked one. Everything lives in a run folder (default runs/demo/): config.json, tokenizer/, ckpt.pt (model,
optimizer, step, RNG states; rewritten atomically), log.jsonl (one line per logged step, evals too),
train.log (when started with nohup). Re-running the same command resumes from ckpt.pt.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from redraft.engine.model.config import BLOCK_SIZE, ModelConfig
from redraft.engine.model.model import LLaDA2Model, MoE
from redraft.engine.text.tokenizer import (LLADA2_SPECIAL_TOKENS, Tokenizer, load_default_chat_template,
                                      save_pretrained_tokenizer)
from redraft.kernels.moe import route_torch
from redraft.training.data import (DEMO_VOCAB_SIZE, Bucket, WindowExample, add_noise, build_demo_tokenizer,
                                   dual_copy_mask, dual_copy_positions, encode_example, make_buckets, window_examples,
                                   window_mask)
from redraft.training.tasks import FAMILIES_V4, TaskGenerator

log = logging.getLogger("redraft.train")

# The demo architecture: LLaDA2's (QK-norm, partial NeoX rotary, first layer dense, grouped sigmoid MoE with a
# shared expert and expert bias), scaled down so that a training step is cheap on one CPU core.
DEMO_MODEL: dict[str, Any] = {
    "hidden_size": 160,
    "num_hidden_layers": 4,
    "num_attention_heads": 5,
    "num_key_value_heads": 5,
    "head_dim": 32,
    "intermediate_size": 384,
    "moe_intermediate_size": 96,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "score_function": "sigmoid",
    "moe_router_enable_expert_bias": True,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "partial_rotary_factor": 0.5,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": False,
    "use_qk_norm": True,
    "use_qkv_bias": False,
    "use_bias": False,
}


@dataclass
class TrainConfig:
    run_dir: str = "runs/demo"
    seed: int = 0
    steps: int = 60_000
    batch_size: int = 48
    lr: float = 2e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 300
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    betas: tuple[float, float] = (0.9, 0.98)
    curriculum_steps: int = 8_000  # the problem size grows to full over this many steps
    family_weights: dict[str, float] = field(default_factory=lambda: {
        "math": 1.6, "reverse": 1.0, "sort": 1.0, "code": 0.7, "chat": 0.9, "count": 1.5, "repeat": 1.2})
    digit_numbers: bool = False  # tokenize numbers digit by digit (data.build_demo_tokenizer)
    number_init: bool = True  # structured initial embeddings for number tokens (init_number_embeddings)
    number_features: str = "digits"  # "digits": place-digit features; "fourier": + cos/sin of the value
    init_from: str | None = None  # warm start: model weights of another run's ckpt.pt (number rows re-made)
    adaptive_mix: bool = True  # after each evaluation, sample families in proportion to their error
    invented_animals: float = 0.3  # share of chat problems about invented names (copying practice)
    long_counts: float = 0.0  # share of count problems with B - A in 3..64 (the suite: 10..40)
    low_count_starts: float = 0.0  # share of those long counts starting at A in 0..20 (TaskGenerator)
    eos_tail_weight: float = 1.0
    p_edit: float = 0.5  # share of sequences that also get the editing (T2T) noise
    max_edit_rate: float = 0.3
    p_mtf: float = 0.25  # share of sequences given the multi-turn-forward augmentation (after warm-up)
    mtf_start: int = 1_000
    bias_update_rate: float = 1e-3  # expert_bias step per training step (aux-loss-free balancing)
    vocab_size: int = DEMO_VOCAB_SIZE
    model: dict[str, Any] = field(default_factory=lambda: dict(DEMO_MODEL))
    threads: int = 1
    log_every: int = 25
    ckpt_every: int = 250
    eval_every: int = 2_000
    eval_per_family: int = 40
    suite: str = "v1"  # the task suite (training/tasks.py): "v1", or "v2" with multi-block answers
    p_mbe: float = 0.0  # share of multi-block sequences trained on a multi-block-editing window instead
    max_mbe_window: int = 3  # window sizes 1..this for those

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        raw = {k: v for k, v in raw.items() if k in names}
        if "betas" in raw:
            raw["betas"] = tuple(raw["betas"])
        return cls(**raw)


# ----- the model with a dense attention mask ----------------------------------------------------------
@dataclass
class Segment:
    start: int  # first flat token of this group of equal-length sequences
    count: int  # number of sequences
    length: int  # tokens per sequence
    mask: torch.Tensor  # [length, length] bool


@dataclass
class DenseMeta:
    """Stands in for AttentionMetadata: the model reads `.positions`; `dense_attention` reads the segments."""

    positions: torch.Tensor  # [T]
    segments: list[Segment]


def dense_attention(q, k, v, k_cache, v_cache, meta: DenseMeta) -> torch.Tensor:
    """Masked attention over groups of equal-length sequences; no KV cache. q: [T, Hq, D], k/v: [T, Hkv, D]."""
    outs = []
    hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
    for seg in meta.segments:
        sl = slice(seg.start, seg.start + seg.count * seg.length)
        qs = q[sl].view(seg.count, seg.length, hq, d).transpose(1, 2)  # [B, Hq, L, D]
        ks = k[sl].view(seg.count, seg.length, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        vs = v[sl].view(seg.count, seg.length, hkv, d).transpose(1, 2)
        if hkv != hq:
            ks, vs = ks.repeat_interleave(hq // hkv, 1), vs.repeat_interleave(hq // hkv, 1)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, scale=1.0 / d**0.5)
        outs.append(o.transpose(1, 2).reshape(seg.count * seg.length, hq, d))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def model_config(tcfg: TrainConfig, tok: Tokenizer) -> ModelConfig:
    raw = {"model_type": "llada2_moe", **tcfg.model, "vocab_size": tok.vocab_size,
           "pad_token_id": tok.eos_token_id, "torch_dtype": "float32"}
    return ModelConfig.from_dict(raw)


def init_model(cfg: ModelConfig, seed: int) -> LLaDA2Model:
    """LLaDA2Model with GPT-style init: N(0, 0.02), residual-output projections scaled by 1/sqrt(2 * layers)."""
    torch.manual_seed(seed)
    model = LLaDA2Model(cfg)
    model.attend = dense_attention
    out_std = 0.02 / math.sqrt(2 * cfg.num_hidden_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            torch.nn.init.ones_(p)
        elif name.endswith(("o_proj.weight", ".down", ".w2")):
            torch.nn.init.normal_(p, std=out_std)
        else:
            torch.nn.init.normal_(p, std=0.02)
    return model


NUMBER_PERIOD = 200  # every answer (0..198) and every |difference| (0..99) is below it: no aliasing
NUMBER_FREQUENCIES = (1, 2, 3, 4, 6, 8, 11, 15, 20, 27, 36, 48, 60, 72, 85, 97)


def fourier_features(value: int) -> torch.Tensor:
    """[2K] cos/sin of the value at K frequencies. Why: the sum of two operands is then one bilinear step away
    (cos(w(a+b)) = cos(wa)cos(wb) - sin(wa)sin(wb), which a gated MLP computes from the two operands' features),
    and an output row made of the same features scores sum_k cos(w_k (a + b - n)), highest exactly at n = a + b.
    Differences work the same way (|a - b| after a minus sign: the sign of the sin terms comes from a < b)."""
    w = torch.tensor(NUMBER_FREQUENCIES, dtype=torch.float64) * (2 * math.pi / NUMBER_PERIOD)
    return torch.cat([torch.cos(w * value), torch.sin(w * value)]).float()


def init_number_embeddings(model: LLaDA2Model, tok: Tokenizer, seed: int, features: str = "digits") -> int:
    """Give every number token (`7`, `42`, `197`, ` 42`, ...) an embedding and an output row built from
    shared features: one random vector per (place, digit) for hundreds, tens and units (with a "no digit"
    value), plus one for the leading space; with features="fourier" also the value's cos/sin features
    (fourier_features) through a fixed random orthonormal projection. `42` and ` 42` and `142` then start out
    related the way their values are, in the input and in the output alike, instead of as unrelated symbols:
    the model does not have to discover place value before it can add, subtract or sort. It is only an
    initialisation (the rows train freely afterwards). Returns how many tokens it set."""
    gen = torch.Generator().manual_seed(seed + 7)
    h = model.cfg.hidden_size
    digit = torch.randn(3, 11, h, generator=gen) * 0.02  # [place, 0..9 | none, H]
    space = torch.randn(h, generator=gen) * 0.02
    k2 = 2 * len(NUMBER_FREQUENCIES)
    proj = torch.linalg.qr(torch.randn(h, k2, generator=gen))[0].T  # [2K, H], orthonormal rows
    fourier_scale = 0.02 * math.sqrt(h) / math.sqrt(len(NUMBER_FREQUENCIES))  # the norm of a std-0.02 row
    n = 0
    with torch.no_grad():
        for i in range(tok.vocab_size):
            text = tok.decode([i], skip_special_tokens=False)
            body = text[1:] if text.startswith(" ") else text
            if not body.isdigit() or len(body) > 3 or (len(body) > 1 and body[0] == "0"):
                continue
            padded = [10] * (3 - len(body)) + [int(c) for c in body]
            row = sum(digit[p, d] for p, d in enumerate(padded)) + (space if text.startswith(" ") else 0)
            row = row / 2.0  # keep the per-dimension scale of the other rows (std 0.02)
            if features == "fourier":
                row = row / 2.0 + fourier_scale * (fourier_features(int(body)) @ proj)
            model.embed.weight[i] = row
            model.lm_head.weight[i] = row
            n += 1
    return n


def forward_logits(model: LLaDA2Model, inputs: list[tuple[Bucket, torch.Tensor]], rows: list[torch.Tensor]
                   ) -> torch.Tensor:
    """One forward over the dual-copy layout of several buckets; logits at the requested noisy positions.

    inputs: (bucket, noisy tokens [B, S]) per bucket; rows: per bucket, a [B, S] bool of positions to score.
    Returns [N, V] logits for the True positions, bucket by bucket, row-major.
    """
    ids, pos, segments, picks = [], [], [], []
    start = 0
    for (b, xt), want in zip(inputs, rows):
        nb, s = b.num_blocks, b.x0.shape[1]
        clean = b.x0[:, : s - BLOCK_SIZE]
        seq = torch.cat([xt, clean], dim=1)  # [B, L]
        length = seq.shape[1]
        ids.append(seq.reshape(-1))
        pos.append(dual_copy_positions(nb).repeat(b.size))
        segments.append(Segment(start, b.size, length, dual_copy_mask(nb)))
        r, c = want.nonzero(as_tuple=True)
        picks.append(start + r * length + c)
        start += b.size * length
    meta = DenseMeta(torch.cat(pos), segments)
    hidden = model(torch.cat(ids), meta, [None] * len(model.layers), [None] * len(model.layers))  # [T, H]
    return model.logits(hidden[torch.cat(picks)])  # [N, V]


def forward_windows(model: LLaDA2Model, examples: list[WindowExample]) -> torch.Tensor:
    """One forward over multi-block-editing windows (examples of one shape share a segment and its mask);
    logits [N, V] at every example's scored positions, example by example."""
    groups: dict[tuple[int, int, int], list[WindowExample]] = {}
    for ex in examples:
        groups.setdefault((len(ex.xt), ex.window_start, ex.active), []).append(ex)
    ids, pos, segments, picks = [], [], [], []
    start = 0
    for (length, window_start, active), exs in groups.items():
        ids += [ex.xt for ex in exs]
        pos.append(torch.arange(length).repeat(len(exs)))
        segments.append(Segment(start, len(exs), length, window_mask(length // BLOCK_SIZE, window_start, active)))
        for k, ex in enumerate(exs):
            picks.append(start + k * length + ex.scored.nonzero().flatten())
        start += len(exs) * length
    meta = DenseMeta(torch.cat(pos), segments)
    hidden = model(torch.cat(ids), meta, [None] * len(model.layers), [None] * len(model.layers))  # [T, H]
    return model.logits(hidden[torch.cat(picks)])  # [N, V]


def window_order(examples: list[WindowExample]) -> list[WindowExample]:
    """The order forward_windows returns their positions in (grouped by shape, first appearance first)."""
    groups: dict[tuple[int, int, int], list[WindowExample]] = {}
    for ex in examples:
        groups.setdefault((len(ex.xt), ex.window_start, ex.active), []).append(ex)
    return [ex for exs in groups.values() for ex in exs]


def sub_bucket(b: Bucket, keep: torch.Tensor) -> Bucket:
    """The rows of a bucket where `keep` ([B] bool) is True."""
    return Bucket(b.num_blocks, b.x0[keep], b.alt[keep], b.response[keep], b.weight[keep], b.content[keep],
                  [f for f, k in zip(b.family, keep.tolist()) if k])


# ----- load balancing of the routers ----------------------------------------------------------------------
class RouterLoad:
    """Counts how many tokens each expert received in the training forward (via forward hooks)."""

    def __init__(self, model: LLaDA2Model):
        self.moes = [layer.mlp for layer in model.layers if isinstance(layer.mlp, MoE)]
        self.counts = [torch.zeros(m.cfg.num_experts) for m in self.moes]
        self.enabled = False
        for i, m in enumerate(self.moes):
            m.register_forward_hook(self._hook(i))

    def _hook(self, i: int):
        def hook(module: MoE, inputs, output):
            if not self.enabled:
                return
            c = module.cfg
            with torch.no_grad():
                ids, _ = route_torch(inputs[0], module.router, module.expert_bias, top_k=c.num_experts_per_tok,
                                     n_group=c.n_group, topk_group=c.topk_group,
                                     routed_scaling_factor=c.routed_scaling_factor, norm_topk_prob=c.norm_topk_prob)
                self.counts[i] += torch.bincount(ids.flatten(), minlength=c.num_experts).float()
        return hook

    def balance(self, rate: float) -> float:
        """Nudge every expert_bias towards equal load; returns the worst max/mean load ratio seen."""
        worst = 0.0
        with torch.no_grad():
            for m, c in zip(self.moes, self.counts):
                if c.sum() == 0:
                    continue
                m.expert_bias += rate * torch.sign(c.mean() - c)
                worst = max(worst, float(c.max() / c.mean()))
                c.zero_()
        return worst


# ----- the trainer -------------------------------------------------------------------------------------
class Trainer:
    def __init__(self, tcfg: TrainConfig):
        self.tcfg = tcfg
        self.run = Path(tcfg.run_dir)
        self.run.mkdir(parents=True, exist_ok=True)
        self.tok = self._tokenizer()
        self.cfg = model_config(tcfg, self.tok)
        self.model = init_model(self.cfg, tcfg.seed)
        if tcfg.init_from and Path(tcfg.init_from).is_dir():
            # warm start from an exported model (Hugging Face layout, e.g. engine/demo_model): its weights are
            # trained already, number rows included
            from redraft.engine.model.loader import load_model

            src = Path(tcfg.init_from)
            loaded = load_model(src, ModelConfig.from_pretrained(src), dtype="float32", device="cpu", progress=False)
            self.model.load_state_dict(loaded.state_dict())
        elif tcfg.init_from:
            # warm start from another run of the same architecture and tokenizer: weights only (fresh optimizer)
            state = torch.load(tcfg.init_from, map_location="cpu", weights_only=False)
            self.model.load_state_dict(state["model"])
        if tcfg.number_init and not tcfg.digit_numbers and not (tcfg.init_from and Path(tcfg.init_from).is_dir()):
            init_number_embeddings(self.model, self.tok, tcfg.seed, tcfg.number_features)
        decay = [p for n, p in self.model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.dim() < 2]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": tcfg.weight_decay},
                                      {"params": no_decay, "weight_decay": 0.0}], lr=tcfg.lr, betas=tcfg.betas)
        self.load = RouterLoad(self.model)
        self.gen = TaskGenerator(tcfg.seed, "train", tcfg.family_weights, invented_animals=tcfg.invented_animals,
                                 suite=tcfg.suite, long_counts=tcfg.long_counts,
                                 low_count_starts=tcfg.low_count_starts)
        self.rng = random.Random(tcfg.seed + 1)
        self.torch_gen = torch.Generator().manual_seed(tcfg.seed + 2)
        specials = {self.tok.token_to_id(t) for t in LLADA2_SPECIAL_TOKENS}
        self.noise_vocab = torch.tensor(
            [i for i in range(self.tok.vocab_size) if i not in specials] + [self.tok.eos_token_id])
        self.step = 0
        self.stop_requested = False  # set by SIGTERM/SIGINT: finish the step, save, return

    def _tokenizer(self) -> Tokenizer:
        tdir = self.run / "tokenizer"
        source = None
        if self.tcfg.init_from:  # a warm start keeps the token ids its weights were trained with
            init = Path(self.tcfg.init_from)
            source = init if init.is_dir() else init.parent / "tokenizer"
        if not (tdir / "tokenizer.json").is_file() and source is not None and (source / "tokenizer.json").is_file():
            tdir.mkdir(parents=True, exist_ok=True)
            for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
                if (source / name).is_file():
                    shutil.copy2(source / name, tdir / name)
        if not (tdir / "tokenizer.json").is_file():
            hf = build_demo_tokenizer(self.tcfg.vocab_size, self.tcfg.seed, digits=self.tcfg.digit_numbers)
            save_pretrained_tokenizer(hf, tdir, load_default_chat_template(),
                                      model_max_length=self.tcfg.model["max_position_embeddings"])
        return Tokenizer.from_pretrained(tdir)

    # -- schedule --
    def lr_at(self, step: int) -> float:
        c = self.tcfg
        if step < c.warmup_steps:
            return c.lr * (step + 1) / c.warmup_steps
        progress = min(1.0, (step - c.warmup_steps) / max(1, c.steps - c.warmup_steps))
        return c.lr * (c.min_lr_ratio + (1 - c.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))

    def level_at(self, step: int) -> float:
        return min(1.0, 0.15 + 0.85 * step / max(1, self.tcfg.curriculum_steps))

    # -- one step --
    def make_batch(self, n: int) -> list[Bucket]:
        self.gen.level = self.level_at(self.step)
        seqs = [encode_example(ex, self.tok, self.rng) for ex in self.gen.batch(n)]
        return make_buckets(seqs, self.tcfg.eos_tail_weight)

    def noised(self, buckets: list[Bucket], mtf: bool) -> list[tuple[Bucket, torch.Tensor, torch.Tensor]]:
        """(bucket, noisy input, scored positions) per bucket, MTF applied to a share of the sequences."""
        c, mask_id = self.tcfg, self.tok.mask_token_id
        out = []
        for b in buckets:
            nz = add_noise(b, mask_id, self.noise_vocab, self.torch_gen, p_edit=c.p_edit,
                           max_edit_rate=c.max_edit_rate)
            out.append([b, nz.xt, nz.scored, nz.masked])
        if mtf and c.p_mtf > 0:
            self._multi_turn_forward(out)
        return [(b, xt, scored) for b, xt, scored, _ in out]

    @torch.no_grad()
    def _multi_turn_forward(self, items: list[list]) -> None:
        """Replace the noisy input of a share of the sequences by the model's own draft of it.

        items: [bucket, noisy input, scored, masked] per bucket, updated in place.
        """
        picked = []  # (item index, chosen rows, sub-bucket, its noisy input, its masked positions)
        for i, (b, xt, _, masked) in enumerate(items):
            ch = torch.rand(b.size, generator=self.torch_gen) < self.tcfg.p_mtf
            if ch.any():
                part = Bucket(b.num_blocks, b.x0[ch], b.alt[ch], b.response[ch], b.weight[ch], b.content[ch],
                              [f for f, keep in zip(b.family, ch.tolist()) if keep])
                picked.append((i, ch, part, xt[ch], masked[ch]))
        if not picked:
            return
        self.model.eval()
        logits = forward_logits(self.model, [(p, xt) for _, _, p, xt, _ in picked], [m for *_, m in picked])
        self.model.train()
        logits = logits.float()
        logits[:, self.tok.mask_token_id] = float("-inf")
        prob, pred = logits.softmax(-1).max(-1)
        offset = 0
        for i, ch, part, xt, masked in picked:
            n = int(masked.sum())
            conf = torch.full(masked.shape, -1.0)
            guess = xt.clone()
            conf[masked], guess[masked] = prob[offset: offset + n], pred[offset: offset + n]
            offset += n
            # Write back the k most confident drafts of each sequence, k ~ U{1..masked}, as decoding would.
            k = (torch.rand(masked.shape[0], 1, generator=self.torch_gen) * masked.sum(1, keepdim=True)).ceil()
            rank = conf.argsort(1, descending=True).argsort(1)
            fill = masked & (rank < k)
            b, xt_all, scored_all, _ = items[i]
            xt_all, scored_all = xt_all.clone(), scored_all.clone()
            xt_all[ch] = torch.where(fill, guess, xt)
            scored_all[ch] = part.response  # scored at every response position, as in the editing stream
            items[i][1], items[i][2] = xt_all, scored_all

    def split_windows(self, buckets: list[Bucket]) -> tuple[list[Bucket], list[WindowExample]]:
        """Send a share p_mbe of the sequences with two or more response blocks to the multi-block-editing window
        layout (window_examples); the rest stay in the dual-copy layout."""
        c = self.tcfg
        if c.p_mbe <= 0:
            return buckets, []
        dual, windows = [], []
        for b in buckets:
            first = b.response.float().argmax(1) // BLOCK_SIZE  # [B] the first response block
            multi = (b.num_blocks - first) >= 2
            pick = multi & (torch.rand(b.size, generator=self.torch_gen) < c.p_mbe)
            if pick.any():
                windows += window_examples(b, pick.nonzero().flatten(), self.tok.mask_token_id, self.noise_vocab,
                                           self.torch_gen, max_window=c.max_mbe_window, p_edit=c.p_edit,
                                           max_edit_rate=c.max_edit_rate)
            if (~pick).any():
                dual.append(sub_bucket(b, ~pick) if pick.any() else b)
        return dual, window_order(windows)

    def train_step(self, buckets: list[Bucket]) -> dict[str, float]:
        c = self.tcfg
        for g in self.opt.param_groups:
            g["lr"] = self.lr_at(self.step)
        buckets, windows = self.split_windows(buckets)
        noisy = self.noised(buckets, mtf=self.step >= c.mtf_start) if buckets else []
        self.model.train()
        self.load.enabled = True
        parts = []
        if noisy:
            parts.append(forward_logits(self.model, [(b, xt) for b, xt, _ in noisy], [sc for _, _, sc in noisy]))
        if windows:
            parts.append(forward_windows(self.model, windows))
        logits = torch.cat(parts)
        self.load.enabled = False
        target = torch.cat([b.x0[sc] for b, _, sc in noisy] + [ex.x0[ex.scored] for ex in windows])
        weight = torch.cat([b.weight[sc] for b, _, sc in noisy] + [ex.weight[ex.scored] for ex in windows])
        ce = F.cross_entropy(logits.float(), target, reduction="none")
        loss = (ce * weight).sum() / weight.sum().clamp(min=1e-6)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), c.grad_clip)
        self.opt.step()
        imbalance = self.load.balance(c.bias_update_rate)
        self.step += 1
        stats = {"loss": loss.item(), "gnorm": float(gnorm), "lr": self.opt.param_groups[0]["lr"],
                 "moe_max_load": imbalance, "level": self.gen.level}
        with torch.no_grad():  # argmax accuracy on the scored answer tokens, overall and per family
            right = logits.argmax(-1) == target
            content = torch.cat([b.content[sc] for b, _, sc in noisy] + [ex.content[ex.scored] for ex in windows])
            fam = torch.cat([torch.tensor([FAMILIES_V4.index(f) for f in b.family])[:, None].expand_as(sc)[sc]
                             for b, _, sc in noisy]
                            + [torch.full((int(ex.scored.sum()),), FAMILIES_V4.index(ex.family)) for ex in windows])
            stats["acc"] = float(right[content].float().mean())
            for i, f in enumerate(FAMILIES_V4):
                sel = content & (fam == i)
                if sel.any():
                    stats[f"acc_{f}"] = float(right[sel].float().mean())
            if windows:
                earlier = torch.cat([(torch.arange(len(ex.xt)) < ex.active * BLOCK_SIZE)[ex.scored] for ex in windows])
                wrong_in = torch.cat([(ex.xt != ex.x0)[ex.scored] for ex in windows])
                sel = torch.zeros_like(right)
                sel[-len(earlier):] = earlier & wrong_in
                if sel.any():  # how often an earlier window block's wrong token is repaired
                    stats["acc_mbe_repair"] = float(right[sel].float().mean())
        return stats

    # -- checkpoints --
    def save(self) -> None:
        state = {
            "step": self.step,
            "model": self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "gen": self.gen.state(),
            "mix": list(self.gen.weights),
            "rng": self.rng.getstate(),
            "torch_gen": self.torch_gen.get_state(),
            "torch_rng": torch.get_rng_state(),
            "train_config": dataclasses.asdict(self.tcfg),
        }
        tmp = self.run / "ckpt.pt.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.run / "ckpt.pt")

    def resume(self) -> bool:
        path = self.run / "ckpt.pt"
        if not path.is_file():
            return False
        state = torch.load(path, map_location="cpu", weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        self.step = state["step"]
        self.gen.set_state(state["gen"])
        if "mix" in state and len(state["mix"]) == len(self.gen.families):
            self.gen.weights = list(state["mix"])
        self.rng.setstate(state["rng"])
        self.torch_gen.set_state(state["torch_gen"])
        torch.set_rng_state(state["torch_rng"])
        self._trim_log(self.step)
        return True

    def _trim_log(self, step: int) -> None:
        """Drop log lines written after the checkpoint we resume from (they will be written again)."""
        path = self.run / "log.jsonl"
        if not path.is_file():
            return
        keep = [ln for ln in path.read_text().splitlines() if ln.strip() and json.loads(ln).get("step", 0) <= step]
        path.write_text("".join(ln + "\n" for ln in keep))

    def log(self, record: dict[str, Any]) -> None:
        with open(self.run / "log.jsonl", "a") as f:
            f.write(json.dumps(record) + "\n")

    # -- evaluation through the real engine --
    def evaluate(self, per_family: int, modes: tuple[str, ...] = ("Q", "S")) -> dict[str, Any]:
        """Export the current weights and decode held-out problems with `redraft.Engine`, in a subprocess
        (training/evaluate.py) so that it runs the engine code as it is now, whatever this process imported."""
        from redraft.training.export import export_model

        out_dir = self.run / "eval_model"
        export_model(self.model, self.tok, out_dir, metadata={"redraft_train_step": self.step}, suite=self.tcfg.suite)
        cmd = [sys.executable, "-m", "redraft.training.evaluate", "--model", str(out_dir), "--per-family",
               str(per_family), "--seed", str(self.tcfg.seed + 1000), "--modes", *modes, "--suite", self.tcfg.suite]
        env = dict(os.environ, OMP_NUM_THREADS=str(self.tcfg.threads))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
        if done.returncode != 0:
            raise RuntimeError(f"evaluation exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        return json.loads(done.stdout.strip().splitlines()[-1])

    # -- the loop --
    def fit(self, progress: bool = True, stop_at: int | None = None) -> None:
        c = self.tcfg
        end = c.steps if stop_at is None else min(stop_at, c.steps)
        bar = tqdm(total=c.steps, initial=self.step, desc="train-demo", unit="step", disable=not progress,
                   dynamic_ncols=True)
        window: list[dict[str, float]] = []
        t_last = time.time()
        while self.step < end and not self.stop_requested:
            stats = self.train_step(self.make_batch(c.batch_size))
            window.append(stats)
            bar.update(1)
            if self.step % c.log_every == 0:
                keys = sorted({k for w in window for k in w})
                avg = {k: sum(w[k] for w in window if k in w) / sum(k in w for w in window) for k in keys}
                now = time.time()
                rate = len(window) / max(1e-9, now - t_last)  # over this logging window (evals included)
                t_last = now
                rec = {"step": self.step, **{k: round(v, 5) for k, v in avg.items()}, "steps_per_s": round(rate, 3),
                       "time": round(time.time(), 1)}
                self.log(rec)
                bar.set_postfix(loss=f"{avg['loss']:.3f}", acc=f"{avg['acc']:.3f}", lr=f"{avg['lr']:.2e}")
                fams = " ".join(f"{f} {avg[f'acc_{f}']:.2f}" for f in FAMILIES_V4 if f"acc_{f}" in avg)
                log.info("step %d loss %.4f acc %.3f (%s) gnorm %.2f lr %.2e level %.2f moe_max_load %.2f %.2f steps/s",
                         self.step, avg["loss"], avg["acc"], fams, avg["gnorm"], avg["lr"], avg["level"],
                         avg["moe_max_load"], rate)
                window = []
            if self.step % c.ckpt_every == 0 or self.step in (c.steps, end):
                self.save()
            if c.eval_every and (self.step % c.eval_every == 0 or self.step == c.steps):
                self._logged_eval()
        bar.close()
        if self.stop_requested:
            log.info("stopping at step %d (signal): checkpoint saved", self.step)
            self.save()

    def rebalance(self, accuracy: dict[str, float]) -> None:
        """Adaptive family mix: each family's base weight times (0.25 + its held-out error), so steps go where
        the model is still wrong, and a solved family keeps a quarter of its share (not to forget it)."""
        base = self.tcfg.family_weights
        self.gen.weights = [base[f] * (0.25 + (1.0 - accuracy.get(f, 0.0))) for f in self.gen.families]

    def _logged_eval(self) -> None:
        t = time.time()
        try:
            res = self.evaluate(self.tcfg.eval_per_family)
        except Exception as exc:  # the engine is developed concurrently: an eval failure must not stop training
            log.exception("evaluation failed at step %d", self.step)
            self.log({"step": self.step, "eval_error": repr(exc)})
            return
        samples = res.pop("samples", [])
        res.pop("overrides", None)
        if self.tcfg.adaptive_mix and "Q" in res:
            self.rebalance(res["Q"])
        self.log({"step": self.step, "eval": res, "eval_seconds": round(time.time() - t, 1),
                  "mix": dict(zip(self.gen.families, [round(w, 3) for w in self.gen.weights]))})
        for mode, r in res.items():
            log.info("eval step %d mode %s: %s", self.step, mode,
                     " ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, (int, float))))
            if "edits" in r:
                log.info("eval step %d mode %s: edits %s", self.step, mode, r["edits"])
        for user, text in samples:
            log.info("  %r -> %r", user, text)


# ----- command line ----------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="redraft train-demo",
                                description="Train (or resume training) the bundled demo LLaDA2-MoE model on CPU.")
    p.add_argument("--run-dir", default="runs/demo", help="run folder: checkpoints, log, tokenizer (default runs/demo)")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (default 60000)")
    p.add_argument("--batch-size", type=int, default=None, help="sequences per optimizer step (default 48)")
    p.add_argument("--lr", type=float, default=None, help="peak learning rate (default 2e-3)")
    p.add_argument("--seed", type=int, default=None, help="seed of the weights and the problems (default 0)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default 1)")
    p.add_argument("--eval-every", type=int, default=None, help="steps between engine evaluations (0: never)")
    p.add_argument("--init-from", default=None, metavar="CKPT",
                   help="warm start a new run from another run's ckpt.pt (weights only; same tokenizer)")
    p.add_argument("--number-features", choices=["digits", "fourier"], default=None,
                   help="initial number-token rows: place digits, or digits + cos/sin of the value")
    p.add_argument("--curriculum-steps", type=int, default=None, help="steps over which problems grow to full size")
    p.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                   help="save and exit at this step (the LR schedule still spans --steps)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=JSON",
                   help='any other TrainConfig field, e.g. --set mtf_start=0 --set \'family_weights={"math": 2.5}\' '
                        "(a dict is merged into the current one)")
    p.add_argument("--fresh", action="store_true", help="start over: ignore (and overwrite) an existing checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (log lines only)")
    p.add_argument("--log-level", default="info", help="logging level (default: info)")
    return p


def apply_settings(tcfg: TrainConfig, settings: list[str]) -> TrainConfig:
    """`--set FIELD=JSON` overrides; dict fields merge (family_weights={"math": 2.5} keeps the other families)."""
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    changes: dict[str, Any] = {}
    for item in settings:
        key, sep, raw = item.partition("=")
        if not sep or key not in fields:
            raise SystemExit(f"redraft train-demo: --set {item!r}: expected FIELD=JSON with FIELD one of {sorted(fields)}")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw  # a bare string
        current = getattr(tcfg, key)
        changes[key] = {**current, **value} if isinstance(current, dict) and isinstance(value, dict) else value
    return TrainConfig.from_dict({**dataclasses.asdict(tcfg), **changes})


def _running_trainer(run: Path) -> int | None:
    """The pid in run/train.pid if that process is alive and is a trainer (so two never share a run)."""
    try:
        pid = int((run / "train.pid").read_text().strip())
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, ValueError):
        return None
    return pid if pid != os.getpid() and b"train" in cmdline else None


def train_main(argv: list[str] | None = None) -> int:
    """`redraft train-demo`: resumes runs/demo by default; its config.json fixes the run's settings."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run = Path(args.run_dir)
    cfg_path = run / "config.json"
    if cfg_path.is_file() and not args.fresh:
        tcfg = TrainConfig.from_dict(json.loads(cfg_path.read_text()))
    else:
        tcfg = TrainConfig(run_dir=str(run))
    overrides = {"steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
                 "threads": args.threads, "eval_every": args.eval_every, "init_from": args.init_from,
                 "number_features": args.number_features, "curriculum_steps": args.curriculum_steps}
    tcfg = dataclasses.replace(tcfg, run_dir=str(run), **{k: v for k, v in overrides.items() if v is not None})
    tcfg = apply_settings(tcfg, args.set)
    if args.fresh:
        for name in ("ckpt.pt", "log.jsonl"):
            (run / name).unlink(missing_ok=True)
    run.mkdir(parents=True, exist_ok=True)
    other = _running_trainer(run)
    if other is not None:
        print(f"redraft train-demo: a trainer (pid {other}) is already running in {run}", file=sys.stderr)
        return 1
    (run / "train.pid").write_text(f"{os.getpid()}\n")
    cfg_path.write_text(json.dumps(dataclasses.asdict(tcfg), indent=2) + "\n")
    torch.set_num_threads(tcfg.threads)
    trainer = Trainer(tcfg)
    resumed = trainer.resume()
    n_params = sum(p.numel() for p in trainer.model.parameters())
    log.info("%s at step %d of %d; model %.2fM parameters (%.1f MB fp32), vocab %d; run folder %s",
             "resumed" if resumed else "starting", trainer.step, tcfg.steps, n_params / 1e6, n_params * 4 / 1e6,
             trainer.cfg.vocab_size, run)
    progress = not args.no_progress and sys.stderr.isatty()

    def request_stop(signum, frame) -> None:
        trainer.stop_requested = True

    # `kill PID` (or Ctrl-C) ends the current step, saves a checkpoint and exits: nothing is lost.
    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    trainer.fit(progress=progress, stop_at=args.stop_at)
    if trainer.stop_requested:
        return 0
    log.info("done: %d steps; export with `python -m redraft.training.export --run-dir %s --out DIR`",
             trainer.step, run)
    return 0


if __name__ == "__main__":
    sys.exit(train_main())
