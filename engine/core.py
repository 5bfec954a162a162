"""`EngineCore`: the one engine loop. Admission (every check and every default, once), then per iteration
schedule -> one forward for the whole batch -> update -> incremental outputs.

The offline `redraft.Engine` and the engine process (`engine_process.py`, behind the HTTP server) both drive
this class and nothing else: a request is validated, resolved, scheduled, decoded and reported here only.

    core = EngineCore(ServerArgs(...))
    core.add_request(rid, input_ids, SamplingParams(...))   # -> Accepted, or raises RequestError
    while core.has_work():
        for out in core.step():                             # RequestOutput: what each request committed
            ...
"""

from __future__ import annotations

import json
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from redraft.engine.config import ModelConfig
from redraft.engine.constrained import Constraint
from redraft.engine.defaults import resolve_model_path
from redraft.engine.faults import FaultInjector
from redraft.engine.grammar import GrammarError, Grammars, max_output_tokens
from redraft.engine.grammar_sandbox import GrammarSandbox
from redraft.engine.likelihood import MAX_VARIANTS as MAX_SCORE_VARIANTS  # (the HTTP routes check it first)
from redraft.engine.loader import load_model, resolve_dtype, resolve_quantization
from redraft.engine.sharding import RankLayout, check_layout
from redraft.engine.model_runner import ModelRunner
from redraft.engine.scoring import CHUNK_TOKENS, ScoreJob, TimeShare
from redraft.engine.tokenizer import Tokenizer
from redraft.protocol.errors import RequestError, duplicate_request_id
from redraft.protocol.messages import Accepted, RequestOutput, ScoreResult
from redraft.protocol.sampling_params import BLOCK_SIZE, Defaults, SamplingParams, resolve
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.request import FinishReason, Request
from redraft.scheduler.scheduler import (
    QueueFull, RequestTooLarge, Scheduler, SchedulerConfig, StepOutput, WorkItem, describe, error_reason,
)

log = logging.getLogger("redraft.engine")


FAULT_STREAK = 3  # batch failures in a row, each of a whole batch and alike, that make an engine fault


class EngineFault(RuntimeError):
    """A failure of the engine itself (not of one request): the loop lets it propagate."""


@dataclass
class _Timing:
    enqueued: float
    queue_time: float | None = None


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


class EngineCore:
    def __init__(self, args: ServerArgs):
        self.args = args
        if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={args.device!r}, but this torch ({torch.__version__}) sees no CUDA device")
        from redraft.engine.tensor_parallel import set_threads  # (one rule for every rank)

        set_threads(args)
        path = resolve_model_path(args.model_path, args.revision)
        self.model_path = path
        self.model_config = ModelConfig.from_pretrained(path)
        if args.context_length is not None and args.context_length > self.model_config.max_position_embeddings:
            raise ValueError(f"--context-length {args.context_length} is longer than this checkpoint's "
                             f"max_position_embeddings ({self.model_config.max_position_embeddings})")
        # seeds of sampled requests that bring none: fresh randomness, or replayable with --random-seed
        self._seeds = random.Random(args.random_seed) if args.random_seed is not None else random.SystemRandom()
        self.tokenizer = Tokenizer.from_pretrained(path, args.chat_template)
        # The defaults chain below the request: the operator's explicit flags, then generation_config.json.
        self.default_levels = (args.request_defaults(), read_generation_config(path))
        t0 = time.perf_counter()
        # tensor parallelism: this process is rank 0 and loads only its shard (engine/sharding.py) while the other
        # ranks, started first, load theirs (engine/tensor_parallel.py)
        layout, self._tp_workers = None, None
        if args.tp_size > 1:
            from redraft.engine.tensor_parallel import Workers

            check_layout(self.model_config, args.tp_size, args.ep_size,
                         resolve_quantization(self.model_config, args.quantization))
            layout, self._tp_workers = RankLayout(0, args.tp_size, args.ep_size), Workers(args)
        try:
            self._load_and_start(path, layout, t0)
        except BaseException:
            if self._tp_workers is not None:
                self._tp_workers.kill()
            raise

    def _load_and_start(self, path: Any, layout: RankLayout | None, t0: float) -> None:
        """The rest of the start-up: load (rank 0's shard), size the KV cache, meet the other ranks, build the
        scheduler and the runner."""
        args = self.args
        self.model = load_model(path, self.model_config, dtype=args.resolved_dtype, device=args.device,
                                load_format=args.load_format, seed=args.seed, progress=args.progress,
                                quantization=args.quantization, layout=layout)
        # kernel_backend="triton": Triton attention and the fused Triton MoE (sync-free: the denoising step can be
        # captured in a CUDA graph); "torch": the plain-torch twins. FP8 linears follow the same choice.
        self.model.set_kernel_backend(args.kernel_backend)
        self.quantization = self.model.quantization  # "fp8" also when the checkpoint itself is FP8
        log.info("loaded %s (%.1fM params, %s%s, %s) in %.1fs", path, self.model_config.num_params() / 1e6,
                 args.resolved_dtype, ", fp8 weights" if self.quantization else "", args.device,
                 time.perf_counter() - t0)
        num_pages = max(1, (args.max_total_tokens or self._default_kv_tokens()) // BLOCK_SIZE)
        self.scheduler = Scheduler(SchedulerConfig(
            num_pages=num_pages, block_size=BLOCK_SIZE, max_running_requests=args.max_running_requests,
            max_queued_requests=args.max_queued_requests, max_prefill_tokens=args.chunked_prefill_size,
            policy=args.schedule_policy, enable_prefix_cache=args.enable_prefix_cache and not args.recompute_prefix,
        ))
        on_gpu = torch.device(args.device).type == "cuda"
        graph_bs = 0
        # (not with tensor parallelism: a captured graph would skip the forward hooks that talk to the other ranks)
        if on_gpu and args.kernel_backend == "triton" and not args.disable_cuda_graph and args.tp_size == 1:
            graph_bs = max(0, min(args.cuda_graph_max_bs, args.max_running_requests))
        if self._tp_workers is not None:
            self._tp_workers.join(self.model, num_pages, args.max_running_requests)
            from redraft.engine.tensor_parallel import backend_for

            log.info("tensor parallel: %d ranks (expert parallel %d), %s", args.tp_size, args.ep_size,
                     backend_for(args.device))
        self.runner = ModelRunner(self.model, num_pages, args.max_running_requests, self.tokenizer.mask_token_id,
                                  self.tokenizer.eos_token_id, args.device, cuda_graph_max_bs=graph_bs)
        if args.tp_size > 1:
            from redraft.engine.tensor_parallel import log_rank_memory

            log_rank_memory(0, self.model, self.runner.k_cache)
        self._grammars: Grammars | None = None  # structured output's compiler, built on first use
        self._grammar_sandbox: GrammarSandbox | None = None  # checks a constraint before _grammars compiles it
        self._requests: dict[str, Request] = {}  # every request not yet reported finished
        self._timing: dict[str, _Timing] = {}
        self.num_forwards = 0
        self.faults = FaultInjector.from_env()  # a test hook, inert unless REDRAFT_FAULT_INJECT is set
        self.runner.faults = self.scheduler.fault_hook = self.faults
        self._jobs: dict[str, ScoreJob] = {}  # likelihood jobs by token, advanced round-robin one chunk per step
        self._score_results: list[ScoreResult] = []  # finished jobs not yet taken (take_score_results)
        self._score_share = TimeShare()  # scoring's share of the engine's time while requests decode
        self._fault_streak: tuple[str, set[str]] = ("", set())  # forward failures alike in a row, their rids
        self.num_request_failures = 0

    def _default_kv_tokens(self) -> int:
        per_token = ModelRunner.kv_bytes_per_token(self.model_config, resolve_dtype(self.args.resolved_dtype))
        if torch.device(self.args.device).type == "cuda":
            # SGLang's rule: weights + KV cache take mem_fraction_static of the GPU; the rest is activations.
            free, total = torch.cuda.mem_get_info()
            budget = int(total * self.args.mem_fraction_static) - (total - free)
            if budget <= 0:
                raise ValueError(f"mem_fraction_static={self.args.mem_fraction_static} leaves no room for the KV cache")
            return budget // per_token
        budget = 512 * 2**20  # CPU: 512 MiB of KV cache at most
        return int(min(max(budget // per_token, 4096), 262144))

    @property
    def max_model_len(self) -> int:
        """The checkpoint's context, or the operator's lower cap (--context-length)."""
        return min(self.model_config.max_position_embeddings, self.args.context_length or 2**62)

    # ---- admission: the one place a request is checked and its defaults resolved ----------------------
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> Accepted:
        """Validate, resolve and queue one request; RequestError says why not."""
        self.faults.check("admit", rid)
        ids = list(input_ids)
        if not ids:
            raise RequestError("the prompt is empty", param="input_ids")
        vocab = self.model_config.vocab_size
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None)
        if bad is not None:
            raise RequestError(f"token id {bad!r} is outside the vocabulary [0, {vocab})", param="input_ids")
        mask_id = self.tokenizer.mask_token_id
        if mask_id in ids:
            raise RequestError(
                f"the prompt contains the mask token (id {mask_id}); redraft generates after the prompt and does "
                "not infill masks inside it", param="input_ids")
        if rid in self._requests:
            raise duplicate_request_id(rid, param="rid")
        if len(ids) >= self.max_model_len:  # no room for even one output token, whatever max_new_tokens says
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens, and the prompt alone has "
                f"{len(ids)}: no room is left for the completion. Please shorten the prompt.",
                code="context_length_exceeded", param="input_ids")
        resolved = resolve(params, self.default_levels, prompt_len=len(ids), max_model_len=self.max_model_len)
        if len(ids) + resolved.max_new_tokens > self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + resolved.max_new_tokens} tokens ({len(ids)} in the prompt, {resolved.max_new_tokens} "
                "for the completion). Please reduce the length of the prompt or completion.",
                code="context_length_exceeded", param="max_new_tokens")
        bad_bias = next((t for t, _ in resolved.logit_bias if t >= vocab), None)
        if bad_bias is not None:
            raise RequestError(f"logit_bias token id {bad_bias} is outside the vocabulary [0, {vocab})",
                               param="logit_bias")
        if resolved.min_tokens > resolved.max_new_tokens:
            raise RequestError(f"min_tokens ({resolved.min_tokens}) is larger than max_new_tokens "
                               f"({resolved.max_new_tokens})", param="min_tokens")
        if resolved.temperature > 0 and resolved.seed is None:  # sampled, unseeded: a fresh seed of its own
            resolved = _with_seed(resolved, self._seeds.getrandbits(62))
        req = Request(rid=rid, prompt_ids=ids, params=resolved, mask_id=mask_id,
                      eos_id=self.tokenizer.eos_token_id, edit_trace=[] if self.args.trace_edits else None)
        if resolved.grammar is not None:
            req.constraint = self._constraint(req)
        try:
            self.scheduler.add_request(req)
        except QueueFull as exc:
            raise RequestError(str(exc), status=503, code="queue_full") from exc
        except RequestTooLarge as exc:
            raise RequestError(str(exc), param="max_new_tokens") from exc
        self._requests[rid] = req
        self._timing[rid] = _Timing(time.monotonic())
        return Accepted(rid, resolved.mode, resolved.max_new_tokens)

    def _constraint(self, req: Request) -> Constraint:
        """The grammar state of a constrained request; RequestError naming the field when it does not compile."""
        if self._grammars is None:  # built on first use: it reads the whole vocabulary
            t0 = time.perf_counter()
            self._grammars = Grammars.for_tokenizer(self.tokenizer, self.model_config.vocab_size)
            log.info("structured output: grammar compiler ready (%d closer tokens) in %.2fs",
                     len(self._grammars.closers), time.perf_counter() - t0)
        if self._grammar_sandbox is None:  # its worker starts on the first check
            self._grammar_sandbox = GrammarSandbox.for_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                                 workers=1)
        field, source = req.params.grammar
        try:
            # native code may crash or stall on a hostile grammar: only one a worker has compiled and played
            # (cached: the HTTP process's check passed it already, a repeat costs nothing) is built here
            self._grammar_sandbox.check(field, source)
            longest = max_output_tokens(field, source)
            if longest is not None and req.params.min_tokens > longest:
                raise GrammarError(f"min_tokens ({req.params.min_tokens}) cannot be met: no output of this {field} "
                                   f"is longer than {longest} tokens, and the grammar ends the output first",
                                   "min_tokens")
            matcher = self._grammars.matcher(field, source)
        except GrammarError as exc:
            log.warning("request %s: %s refused: %s", req.rid, field, exc)
            raise RequestError(str(exc), param=exc.param) from exc
        return Constraint(matcher, req.prompt_len, frozenset(req.stop_ids()), self.tokenizer.eos_token_id,
                          self.model_config.vocab_size, self._grammars.closers)

    def abort(self, rid: str, finish: dict[str, Any] | None = None, keep_tokens: int | None = None) -> bool:
        """End a request (idempotent); `finish` and `keep_tokens` as in AbortReq."""
        reason = FinishReason(finish["type"], matched=finish.get("matched")) if finish else None
        return self.scheduler.abort(rid, reason, keep_tokens)

    def fail(self, rid: str, exc: BaseException, stage: str) -> None:
        """End one request with an error finish (`finish_reason` error, the reason in its message): a failure
        inside the engine that concerns it alone. Its pages are released at once; the batch runs on."""
        if self._tp_workers is not None and any(not p.is_alive() for p in self._tp_workers.procs):
            # not this request's failure: a rank is gone, and a collective broke on it; restart the ranks
            raise EngineFault(f"a tensor-parallel rank died ({stage} of request {rid}: {describe(exc)})") from exc
        log.error("request %s failed in %s: %s", rid, stage, describe(exc))
        log.debug("request %s failed in %s", rid, stage, exc_info=exc)
        self.num_request_failures += 1
        self.scheduler.fail(rid, exc)

    # ---- the loop ------------------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._jobs)

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, one forward for the whole batch, apply the decoding step, one chunk of
        likelihood work; then the output of every request that committed a block or finished (aborts and
        error finishes included) since the last call. A failure that concerns one request ends that request
        alone (see `fail`); EngineFault when the engine itself is broken."""
        items = self.scheduler.schedule() if self.scheduler.has_work() else []
        if self.args.recompute_prefix:  # benchmark baseline: nothing is ever cached
            for it in items:
                it.req.cached_blocks = 0
                it.first = 0
        if items:
            now = time.monotonic()
            for it in items:  # a request's first batch ends its time in the queue
                t = self._timing.get(it.req.rid)
                if t is not None and t.queue_time is None:
                    t.queue_time = now - t.enqueued
            for part, out in self._run_isolating(items):
                for rid, (stage, exc) in out.failed.items():
                    self.fail(rid, exc, stage)
                self.scheduler.update(part, out)
            self.num_forwards += 1
            self._score_share.decoded(time.monotonic() - now)
        self._advance_scoring(decoding=bool(items))
        outs = [self._output_guarded(req) for req in self.scheduler.drain_updates()]
        # A block that ended inside an open MBE window committed nothing yet: no message until something does.
        return [o for o in outs if o.new_ids or o.finished]

    def _run_isolating(self, items: list[WorkItem]) -> list[tuple[list[WorkItem], StepOutput]]:
        """The forward of `items`; when it raises, the same items in halves (recursively), so that only the
        requests whose forward fails on their own end (error finish) and the rest run as they would have.
        A half's rows are reloaded from its requests first (the failed attempt may have advanced them)."""
        try:
            out = self.runner.run(items)
            self._fault_streak = ("", set())
            return [(items, out)]
        except Exception as exc:  # noqa: BLE001 - attributed below, or an EngineFault
            if self._tp_workers is not None:  # the ranks are out of step (or one is gone): restart them all
                raise EngineFault(f"a tensor-parallel forward failed: {describe(exc)}") from exc
            if len(items) == 1:
                self._note_batch_failure(items[0].req.rid, exc)
                self.fail(items[0].req.rid, exc, "forward")
                return []
            log.warning("a batch of %d requests failed (%s): running it in halves to find the cause", len(items),
                        describe(exc))
            self._reset_rows(items)
            mid = len(items) // 2
            return self._run_isolating(items[:mid]) + self._run_isolating(items[mid:])

    def _note_batch_failure(self, rid: str, exc: BaseException) -> None:
        """A forward of one request alone failed. The same failure for FAULT_STREAK different requests in a
        row, with no forward succeeding in between, is the engine's own (a broken device): EngineFault."""
        key = f"{type(exc).__name__}: {exc}".replace(rid, "<rid>")
        last, rids = self._fault_streak
        rids = (rids | {rid}) if key == last else {rid}
        self._fault_streak = (key, rids)
        if len(rids) >= FAULT_STREAK:
            raise EngineFault(f"the forward failed alike for {len(rids)} requests in a row: {key}") from exc

    def _reset_rows(self, items: list[WorkItem]) -> None:
        self.runner.slots.forget([it.req for it in items])
        for it in items:
            if isinstance(it.req.constraint, Constraint):
                it.req.constraint.version = -1  # re-synced to the request's tokens before the next forward

    def _output_guarded(self, req: Request) -> RequestOutput:
        """`_output`, or, when building it fails, an error finish for that request alone."""
        try:
            self.faults.check("output", req.rid)
            return self._output(req)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others' messages
            self.fail(req.rid, exc, "output")
            self.scheduler.forget_update(req.rid)  # this is its last message
            self._requests.pop(req.rid, None)
            self._timing.pop(req.rid, None)
            reason = error_reason(exc) if req.finish_reason is None or req.finish_reason.kind != "error" \
                else req.finish_reason
            req.finish_reason = reason
            return RequestOutput(req.rid, [], True, reason.to_json(), None, None,
                                 {"prompt_tokens": req.prompt_len, "completion_tokens": 0})

    def _output(self, req: Request) -> RequestOutput:
        ids = req.output_ids()
        start = min(req.sent_tokens, len(ids))
        lp = req.output_logprobs(start)
        req.sent_tokens = len(ids)
        meta: dict[str, Any] = {"steps": req.stats.steps, "blocks": req.stats.blocks}
        if req.finished:
            self._requests.pop(req.rid, None)
            timing = self._timing.pop(req.rid, None)
            meta = self._final_meta(req, len(ids), timing)
        return RequestOutput(req.rid, ids[start:], req.finished, self._finish_json(req, len(ids)),
                             lp[0] if lp else None, lp[1] if lp else None, meta)

    @staticmethod
    def _finish_json(req: Request, n_out: int) -> dict[str, Any] | None:
        if req.finish_reason is None:
            return None
        out = req.finish_reason.to_json()
        if req.finish_reason.kind == "length":
            out["length"] = n_out
        return out

    @staticmethod
    def _final_meta(req: Request, n_out: int, timing: _Timing | None) -> dict[str, Any]:
        """SGLang-style meta_info of a finished request, with its diffusion figures."""
        steps = req.stats.steps
        meta = {
            "prompt_tokens": req.prompt_len,
            "completion_tokens": n_out,
            "cached_tokens": req.prefix_cached_tokens,
            "steps": steps,
            "tokens_per_forward": n_out / max(steps, 1),
            "edits": req.stats.edits,
            "mbe_edits": req.stats.mbe_edits,
            "blocks": req.stats.blocks,
            "mode": req.params.mode,
            "mbe_window": req.params.mbe_window,
            "domain": req.params.domain,
            "queue_time": timing.queue_time if timing else None,
            "e2e_latency": time.monotonic() - timing.enqueued if timing else None,
        }
        if req.edit_trace is not None:
            meta["edit_trace"] = [list(e) for e in req.edit_trace]
        if isinstance(req.constraint, Constraint):
            g = req.constraint.stats
            meta["grammar"] = {"rejected": g.rejected, "remasked": g.remasked, "forced": g.forced,
                               "seconds": g.seconds}
        return meta

    # ---- likelihoods (engine/likelihood.py, engine/scoring.py) --------------------------------------------
    def new_score_job(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int = 0,
                      max_tokens: int | None = None) -> ScoreJob:
        """A started likelihood job: masked variants of blocks (likelihood.Variant: block k of a sequence, some
        positions masked, attending the clean blocks before it and itself), read at their targets. The clean
        prefixes come from the radix cache where it has them, are computed block-causally (and cached) where
        not; each variant writes its own K/V to a scratch page, freed after. RequestError when the input is
        invalid, and (503) when the KV cache cannot hold the work now."""
        vocab = self.model_config.vocab_size
        for seq in sequences:
            if not seq or any(not isinstance(t, int) or not 0 <= t < vocab for t in seq):
                raise RequestError(f"token ids must be in [0, {vocab}) and the text non-empty", param="input_ids")
            if len(seq) > self.max_model_len:
                raise RequestError(f"This model's maximum context length is {self.max_model_len} tokens; the text "
                                   f"has {len(seq)}", code="context_length_exceeded", param="input_ids")
        if len(variants) > MAX_SCORE_VARIANTS:
            raise RequestError(f"this request needs {len(variants)} block forwards; at most {MAX_SCORE_VARIANTS}",
                               param="variants")
        budget = max_tokens or min(self.args.chunked_prefill_size,
                                   CHUNK_TOKENS.get(torch.device(self.args.device).type, CHUNK_TOKENS["cuda"]))
        job = ScoreJob(token, sequences, variants, top_k, budget, BLOCK_SIZE, self.tokenizer.mask_token_id,
                       RequestError)
        try:
            job.start(self.scheduler)
        except BaseException:
            job.release(self.scheduler)  # the prefixes leased before the one that did not fit
            raise
        return job

    def add_score_job(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int = 0) -> None:
        """Queue a likelihood job; the loop advances it one chunk per step, between decoding iterations, and
        its ScoreResult comes out of take_score_results. RequestError as in new_score_job."""
        if token in self._jobs:
            raise RequestError(f"score job {token!r} is already running", code="duplicate_request_id")
        self._jobs[token] = self.new_score_job(token, sequences, variants, top_k)

    def cancel_score(self, token: str) -> bool:
        """Drop a likelihood job (its client left): its leased pages are released now. Idempotent."""
        job = self._jobs.pop(token, None)
        if job is None:
            return False
        job.release(self.scheduler)
        log.info("score job %s cancelled after %d chunks", token, job.chunks_run)
        return True

    def take_score_results(self) -> list[ScoreResult]:
        out, self._score_results = self._score_results, []
        return out

    def _advance_scoring(self, decoding: bool) -> None:
        """One chunk of the oldest job, which then goes to the back of the line (round-robin: a small echo
        request does not wait behind a large /score). While requests decode (`decoding`: this iteration ran a
        forward), only within scoring's share of the time (scoring.TimeShare). A job that fails ends alone with
        an error result."""
        if not self._jobs or not self._score_share.may_run(decoding):
            return
        token, job = next(iter(self._jobs.items()))
        del self._jobs[token]
        t0 = time.monotonic()
        try:
            self.faults.check("score", token)
            done = job.advance(self.scheduler, self.runner)
            self._score_share.scored(time.monotonic() - t0, decoding)
        except RequestError as exc:
            job.release(self.scheduler)
            self._score_results.append(ScoreResult.failed(token, exc))
            return
        except Exception as exc:  # noqa: BLE001 - one job's failure must not stop the loop
            log.error("score job %s failed: %s", token, describe(exc))
            log.debug("score job %s failed", token, exc_info=True)
            job.release(self.scheduler)
            self._score_results.append(ScoreResult(token, None, 500, f"scoring failed: {describe(exc)}",
                                                   "internal_error"))
            return
        if done:
            job.release(self.scheduler)
            self._score_results.append(ScoreResult(token, job.results))
        else:
            self._jobs[token] = job  # to the back of the line

    def score_variants(self, sequences: list[list[int]], variants: list[Any], top_k: int = 0,
                       max_tokens: int | None = None) -> list[list[tuple[float, list[tuple[int, float]]]]]:
        """A likelihood job run to its end at once (the offline Engine): per variant, (logprob, top
        alternatives) at each target. RequestError as in new_score_job."""
        job = self.new_score_job("offline", sequences, variants, top_k, max_tokens)
        try:
            while True:
                before = job.chunks_run
                if job.advance(self.scheduler, self.runner):
                    break
                if job.chunks_run == before:  # no scratch page (requests hold them): nothing frees one here
                    raise RequestError("the KV cache is full: try again", status=503, code="cache_full")
        finally:
            job.release(self.scheduler)
        return job.results

    # ---- service -------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        return self.scheduler.flush_cache()

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats(), "num_score_jobs": len(self._jobs),
                "num_request_failures": self.num_request_failures}

    def info(self) -> dict[str, Any]:
        """What the HTTP process shows about this engine (/get_server_info, /v1/models, startup log)."""
        a, s = self.args, self.scheduler
        return {
            "model_path": str(self.model_path),
            "max_model_len": self.max_model_len,
            "max_total_tokens": s.pool.capacity * BLOCK_SIZE,
            "block_size": BLOCK_SIZE,
            "device": a.device,
            "dtype": a.resolved_dtype,
            "kernel_backend": a.kernel_backend,
            # what a request that names no mode gets: the operator's flag, generation_config.json's, else Q
            "default_mode": next((level.mode for level in self.default_levels if level.mode), "Q"),
            "max_running_requests": a.max_running_requests,
            "max_queued_requests": a.max_queued_requests,
            "num_params": self.model_config.num_params(),
            "vocab_size": self.model_config.vocab_size,
        }

    def shutdown(self) -> None:
        for token in list(self._jobs):
            self.cancel_score(token)
        for rid in list(self._requests):
            self.scheduler.abort(rid)
        self.scheduler.drain_updates()
        self._requests.clear()
        if getattr(self, "_tp_workers", None) is not None:
            self._tp_workers.stop()
            self._tp_workers = None
        self.runner = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]


def _with_seed(params: Any, seed: int) -> Any:
    from dataclasses import replace

    return replace(params, seed=seed)

