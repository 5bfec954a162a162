"""`redraft.Engine`: the offline engine (SGLang-style `generate`), all requests advancing together.

A step: every running request runs its pre-forward check, contributes its window (uncached blocks + the
active block) to one batched forward, and the decoding step is applied to all of them at once.
"""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Sequence

import torch

from redraft.engine.config import BLOCK_SIZE, ModelConfig
from redraft.engine.defaults import default_model_path
from redraft.engine.loader import load_model, resolve_dtype
from redraft.engine.model_runner import ModelRunner
from redraft.engine.sampling_params import SamplingParams
from redraft.engine.tokenizer import Tokenizer
from redraft.scheduler.request import FinishReason, Request
from redraft.scheduler.scheduler import Scheduler, SchedulerConfig

log = logging.getLogger("redraft.engine")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    kernel_backend: str = "torch"
    quantization: str | None = None
    load_format: str = "auto"
    max_total_tokens: int | None = None  # KV cache capacity in tokens; default: sized for the device
    mem_fraction_static: float = 0.85  # GPU: fraction of memory for weights + KV cache
    chunked_prefill_size: int = 8192  # prefill-token budget of one iteration
    max_running_requests: int = 256
    max_queued_requests: int | None = None
    schedule_policy: str = "fcfs"
    enable_prefix_cache: bool = True
    default_mode: str = "Q"
    seed: int = 0  # for load_format="dummy"
    progress: bool = True
    # Baseline for benchmarks: every forward recomputes the whole prefix (the official generate() without a
    # KV cache). Outputs are the same; only the work differs.
    recompute_prefix: bool = False
    # torch's intra-op threads on CPU (None: torch's default). On a busy machine, 1 avoids OpenMP threads
    # spinning against each other, which can cost an order of magnitude.
    cpu_threads: int | None = None
    # CUDA graphs for the denoising step (device="cuda" with kernel_backend="triton" only), captured at
    # batch-size buckets up to this size (capped by max_running_requests); larger batches run eagerly.
    cuda_graph_max_bs: int = 64
    disable_cuda_graph: bool = False
    # Record every T2T edit (position, old id, new id) in meta_info["edit_trace"] (evaluation of editing).
    trace_edits: bool = False


class Engine:
    def __init__(self, model_path: str | None = None, **kwargs: Any):
        self.config = cfg = EngineConfig(model_path=model_path, **kwargs)
        if cfg.default_mode not in ("S", "Q", "auto"):
            raise ValueError(f"default_mode must be S, Q or auto, got {cfg.default_mode!r}")
        if torch.device(cfg.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={cfg.device!r}, but this torch ({torch.__version__}) sees no CUDA device")
        if cfg.quantization not in (None, "none", "fp8"):
            raise ValueError(f"unknown quantization {cfg.quantization!r}: choose fp8 (or none)")
        if cfg.cpu_threads:
            torch.set_num_threads(cfg.cpu_threads)
        path = Path(model_path) if model_path else (None if cfg.load_format == "dummy" else default_model_path())
        if path is not None and not path.is_dir():
            raise FileNotFoundError(f"model directory {path} does not exist")
        self.model_path = path
        self.model_config = ModelConfig.from_pretrained(path) if path else None
        if self.model_config is None:
            raise ValueError("load_format='dummy' still needs a model directory with config.json")
        self.tokenizer = Tokenizer.from_pretrained(path)
        t0 = time.perf_counter()
        self.model = load_model(
            path, self.model_config, dtype=cfg.dtype, device=cfg.device, load_format=cfg.load_format,
            seed=cfg.seed, progress=cfg.progress, quantization=cfg.quantization,
        )
        # kernel_backend="triton": Triton attention and the fused Triton MoE (sync-free: the denoising step can be
        # captured in a CUDA graph); "torch": the plain-torch twins. FP8 linears follow the same choice.
        self.model.set_kernel_backend(cfg.kernel_backend)
        self.quantization = self.model.quantization  # "fp8" also when the checkpoint itself is FP8
        on_gpu = torch.device(cfg.device).type == "cuda"
        log.info(
            "loaded %s (%.1fM params, %s%s, %s) in %.1fs",
            path, self.model_config.num_params() / 1e6, cfg.dtype, ", fp8 weights" if self.quantization else "",
            cfg.device, time.perf_counter() - t0,
        )
        dtype = resolve_dtype(cfg.dtype)
        max_tokens = cfg.max_total_tokens or self._default_kv_tokens(dtype)
        num_pages = max(1, max_tokens // BLOCK_SIZE)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=num_pages, block_size=BLOCK_SIZE, max_running_requests=cfg.max_running_requests,
                max_queued_requests=cfg.max_queued_requests, max_prefill_tokens=cfg.chunked_prefill_size, policy=cfg.schedule_policy,
                enable_prefix_cache=cfg.enable_prefix_cache and not cfg.recompute_prefix,
            ),
            stop_checker=self.stop_string_hit,
        )
        graph_bs = 0
        if on_gpu and cfg.kernel_backend == "triton" and not cfg.disable_cuda_graph:
            graph_bs = max(0, min(cfg.cuda_graph_max_bs, cfg.max_running_requests))
        self.runner = ModelRunner(self.model, num_pages, self.tokenizer.mask_token_id, cfg.device,
                                  cuda_graph_max_bs=graph_bs)

    @property
    def pool(self):
        return self.scheduler.pool

    def _default_kv_tokens(self, dtype: torch.dtype) -> int:
        per_token = ModelRunner.kv_bytes_per_token(self.model_config, dtype)
        if torch.device(self.config.device).type == "cuda":
            # SGLang's rule: weights + KV cache take mem_fraction_static of the GPU; the rest is activations.
            free, total = torch.cuda.mem_get_info()
            budget = int(total * self.config.mem_fraction_static) - (total - free)
            if budget <= 0:
                raise ValueError(f"mem_fraction_static={self.config.mem_fraction_static} leaves no room for the KV cache")
            return budget // per_token
        budget = 512 * 2**20  # CPU: 512 MiB of KV cache at most
        return int(min(max(budget // per_token, 4096), 262144))

    @property
    def max_model_len(self) -> int:
        return self.model_config.max_position_embeddings

    # ---- public API ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict | SamplingParams | Sequence[dict | SamplingParams] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
    ) -> dict | list[dict]:
        if (prompt is None) == (input_ids is None):
            raise ValueError("give exactly one of prompt= or input_ids=")
        if prompt is not None:
            single = isinstance(prompt, str)
            prompts = [prompt] if single else list(prompt)
            id_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            single = len(input_ids) == 0 or isinstance(input_ids[0], int)
            id_lists = [list(input_ids)] if single else [list(x) for x in input_ids]
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(id_lists):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(id_lists)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
        reqs = [self.make_request(ids, p) for ids, p in zip(id_lists, params)]
        t0 = time.perf_counter()
        self._run_to_completion(reqs)
        latency = time.perf_counter() - t0
        outs = [self._output(r, latency) for r in reqs]
        return outs[0] if single else outs

    def shutdown(self) -> None:
        self.runner = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------
    def make_request(self, ids: list[int], params: SamplingParams, rid: str | None = None) -> Request:
        """Validate one prompt + parameters into a Request (ValueError with a clear message otherwise)."""
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if self.tokenizer.mask_token_id in ids:
            raise ValueError(
                f"the prompt contains the mask token (id {self.tokenizer.mask_token_id}); redraft generates after "
                "the prompt and does not infill masks inside it"
            )
        if len(ids) + params.max_new_tokens > self.max_model_len:
            raise ValueError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt has "
                f"{len(ids)} and max_new_tokens is {params.max_new_tokens}"
            )
        if params.temperature > 0 and params.seed is None:
            params = replace(params, seed=secrets.randbits(62))
        req = Request(
            rid=rid or uuid.uuid4().hex, prompt_ids=list(ids), params=params.resolved(self.config.default_mode),
            mask_id=self.tokenizer.mask_token_id, eos_id=self.tokenizer.eos_token_id,
            edit_trace=[] if self.config.trace_edits else None,
        )
        return req

    def _run_to_completion(self, reqs: list[Request]) -> None:
        sched = self.scheduler
        for req in reqs:
            sched.add_request(req)
        try:
            while sched.has_work():
                self.step()
        finally:  # an exception must not leak pages
            for req in reqs:
                sched.abort(req.rid)
            sched.drain_updates()

    def step(self) -> None:
        """One iteration: schedule, one forward for the whole batch, apply the decoding step."""
        items = self.scheduler.schedule()
        if self.config.recompute_prefix:  # benchmark baseline: nothing is ever cached
            for it in items:
                it.req.cached_blocks = 0
                it.first = 0
        if items:
            self.scheduler.update(items, self.runner.run(items))

    def stop_string_hit(self, req: Request) -> FinishReason | None:
        stops = req.params.params.stop
        if not stops:
            return None
        text = self.tokenizer.decode(req.output_ids())
        hits = [(text.find(s), s) for s in stops if s in text]
        return FinishReason("stop", matched=min(hits)[1]) if hits else None

    def _output(self, req: Request, latency: float) -> dict:
        ids = req.output_ids()
        text = self.tokenizer.decode(ids)
        reason = req.finish_reason or FinishReason("abort")
        if reason.kind == "stop" and isinstance(reason.matched, str):
            text = text[: text.find(reason.matched)]
        meta = request_meta(req) | {"e2e_latency": latency}
        return {"text": text, "output_ids": ids, "meta_info": meta}


def finish_reason_json(req: Request) -> dict | None:
    if req.finish_reason is None:
        return None
    out = req.finish_reason.to_json()
    if req.finish_reason.kind == "length":
        out["length"] = len(req.output_ids())
    return out


def request_meta(req: Request) -> dict:
    """SGLang-style meta_info, plus the diffusion figures of the request."""
    n = len(req.output_ids())
    return {
        "id": req.rid,
        "finish_reason": finish_reason_json(req),
        "prompt_tokens": req.prompt_len,
        "completion_tokens": n,
        "cached_tokens": req.prefix_cached_tokens,
        "steps": req.stats.steps,
        "tokens_per_forward": n / max(req.stats.steps, 1),
        "edits": req.stats.edits,
        "blocks": req.stats.blocks,
        "mode": req.params.mode,
        "domain": req.params.params.domain,
    } | logprob_meta(req) | ({"edit_trace": [list(e) for e in req.edit_trace]} if req.edit_trace is not None else {})


def logprob_meta(req: Request) -> dict:
    """SGLang's shapes: output_token_logprobs [[logprob, id], ...], output_top_logprobs [[[logprob, id], ...], ...]."""
    lp = req.output_logprobs()
    if lp is None:
        return {}
    ids = req.output_ids()
    return {
        "output_token_logprobs": [[v, t] for v, t in zip(lp[0], ids)],
        "output_top_logprobs": [[[v, t] for t, v in alts] for alts in lp[1]],
    }
