"""`EngineCore`: the one engine loop. Admission (every check and every default, once), then per iteration
schedule -> one forward for the whole batch -> update -> incremental outputs.

The offline `redraft.Engine` and the engine process (`engine_process.py`, behind the HTTP server) both drive
this class and nothing else: a request is validated, resolved, scheduled, decoded and reported here only.
Start-up (model, scheduler, runner) is engine/runtime/startup.py's; likelihood jobs are engine/runtime/scoring.py's; the core
wires them into the loop.

    core = EngineCore(ServerArgs(...))
    core.add_request(rid, input_ids, SamplingParams(...))   # -> Accepted, or raises RequestError
    while core.has_work():
        for out in core.step():                             # RequestOutput: what each request committed
            ...
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from redraft.engine.decoding.constrained import Constraint
from redraft.engine.decoding.registry import decoder_class
from redraft.engine.runtime.faults import FaultInjector
from redraft.engine.text.grammar import GrammarError, Grammars, max_output_tokens
from redraft.engine.text.grammar_sandbox import GrammarSandbox
from redraft.engine.text.likelihood import MAX_VARIANTS as MAX_SCORE_VARIANTS  # (the HTTP routes check it first)
from redraft.engine.runtime.overlap import Overlap, off_reason
from redraft.engine.runtime.scoring import CHUNK_TOKENS, ScoreJob, Scoring, Values
from redraft.engine.runtime.startup import resolve_placement, start_engine
from redraft.engine.runtime.weight_update import WeightControl
from redraft.protocol.errors import RequestError, duplicate_request_id
from redraft.protocol.messages import Accepted, RequestOutput, ScoreResult
from redraft.protocol.sampling_params import BLOCK_SIZE, ResolvedParams, SamplingParams, resolve
from redraft.protocol.server_args import ServerArgs
from redraft.scheduler.request import FinishReason, Request, Status, stop_ids
from redraft.scheduler.scheduler import QueueFull, RequestTooLarge, StepOutput, WorkItem, describe, error_reason

Batch = list[tuple[list[WorkItem], StepOutput]]  # a batch's items (in parts, when isolating a failure), each's step

log = logging.getLogger("redraft.engine")


FAULT_STREAK = 3  # batch failures in a row, each of a whole batch and alike, that make an engine fault


class EngineFault(RuntimeError):
    """A failure of the engine itself (not of one request): the loop lets it propagate."""


@dataclass
class _Progress:
    """The core's own record of a request in flight: when it was queued, how long it waited, and how many output
    tokens its messages have carried."""

    enqueued: float
    queue_time: float | None = None
    first_forward: int | None = None  # the engine's forward count when it first ran (equal for one batch's)
    sent_tokens: int = 0


class EngineCore:
    def __init__(self, args: ServerArgs):
        self.args = args = resolve_placement(args)  # device and kernel backend "auto" decided here, with torch
        parts = start_engine(args)
        self.model_path, self.model_config, self.tokenizer = parts.model_path, parts.model_config, parts.tokenizer
        self.default_levels = parts.default_levels
        self.model, self.scheduler, self.runner = parts.model, parts.scheduler, parts.runner
        self._tp_workers = parts.tp_workers
        self.quantization = self.model.quantization  # "fp8" also when the checkpoint itself is FP8
        # seeds of sampled requests that bring none: fresh randomness, or replayable with --random-seed
        self._seeds = random.Random(args.random_seed) if args.random_seed is not None else random.SystemRandom()
        self._grammars: Grammars | None = None  # structured output's compiler, built on first use
        self._grammar_sandbox: GrammarSandbox | None = None  # checks a constraint before _grammars compiles it
        self._requests: dict[str, Request] = {}  # every request not yet reported finished
        self._progress: dict[str, _Progress] = {}
        self.num_forwards = 0
        self.faults = FaultInjector.from_env()  # a test hook, inert unless REDRAFT_FAULT_INJECT is set
        self.runner.faults = self.scheduler.fault_hook = self.faults
        # likelihood jobs, advanced round-robin one chunk per step (engine/runtime/scoring.py)
        chunk = min(args.chunked_prefill_size, CHUNK_TOKENS.get(torch.device(args.device).type, CHUNK_TOKENS["cuda"]))
        self.scoring = Scoring(self.scheduler, self.runner, chunk, self.tokenizer.mask_token_id)
        self.scheduler.pages_held_elsewhere = lambda: self.scoring.leases.count > 0
        self._fault_streak: tuple[str, set[str]] = ("", set())  # forward failures alike in a row, their rids
        self.num_request_failures = 0
        self._streaming: set[str] = set()  # requests in flight that stream their forwards (stream_denoise)
        # the next forward runs while the host finishes this iteration (engine/runtime/overlap.py)
        self.overlap = Overlap(self.runner, self.scheduler, off_reason(args))
        log.info("overlap scheduler: %s", "on" if self.overlap.enabled else f"off ({self.overlap.reason_off})")
        self.weights = WeightControl(self)  # weight versions and updates, pause/continue (docs/rl.md)

    @property
    def overlap(self) -> Overlap:
        return self._overlap

    @overlap.setter
    def overlap(self, overlap: Overlap) -> None:
        """The overlap scheduler, which wraps the runner when on: the loop calls `_run_batch` and nothing else."""
        self._overlap = overlap
        self._run_batch = (lambda items: overlap.run(items, busy=bool(self.scoring.jobs))) if overlap.enabled \
            else self.runner.run

    @property
    def num_overlapped_forwards(self) -> int:
        """Forwards that ran while the host finished the iteration before, and whose result a step used."""
        return self.overlap.num_used

    @property
    def max_model_len(self) -> int:
        """The checkpoint's context, or the operator's lower cap (--context-length)."""
        return min(self.model_config.max_position_embeddings, self.args.context_length or 2**62)

    # ---- admission: the one place a request is checked and its defaults resolved ----------------------
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> Accepted:
        """Validate, resolve and queue one request; RequestError says why not."""
        return self.add_requests([(rid, input_ids, params)])[0]

    def add_requests(self, batch: list[tuple[str, list[int], SamplingParams]]) -> list[Accepted]:
        """Validate, resolve and queue the engine requests of one HTTP request (its choices, its prompts) together:
        all or none (the RequestError of the first refusal), and all before the next forward, so they are
        scheduled in the same iteration when the batch has room."""
        seen: set[str] = set()
        for rid, _, _ in batch:
            if rid in seen:
                raise duplicate_request_id(rid, param="rid")
            seen.add(rid)
        reqs = [self._prepare(rid, ids, params) for rid, ids, params in batch]
        try:
            self.scheduler.add_requests(reqs)
        except QueueFull as exc:
            raise RequestError(str(exc), status=503, code="queue_full") from exc
        except RequestTooLarge as exc:
            raise RequestError(str(exc), param="max_new_tokens") from exc
        now = time.monotonic()
        for req in reqs:
            self._requests[req.rid] = req
            self._progress[req.rid] = _Progress(now)
            if req.params.stream_denoise:
                self._streaming.add(req.rid)
        return [Accepted(req.rid, req.params.mode, req.params.max_new_tokens) for req in reqs]

    def _prepare(self, rid: str, input_ids: list[int], params: SamplingParams) -> Request:
        """One request checked and resolved (not queued yet); RequestError says why not."""
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
        decoder_class(resolved.decoder).admit(resolved, self.model_config)
        if resolved.temperature > 0 and resolved.seed is None:  # sampled, unseeded: a fresh seed of its own
            resolved = replace(resolved, seed=self._seeds.getrandbits(62))
        constraint = self._constraint(rid, len(ids), resolved) if resolved.grammar is not None else None
        return Request(rid, ids, resolved, mask_id, self.tokenizer.eos_token_ids, trace_edits=self.args.trace_edits,
                       constraint=constraint, max_trace_changes=self.args.max_trace_changes,
                       max_forwards_per_token=self.args.max_forwards_per_token)

    def _constraint(self, rid: str, prompt_len: int, params: ResolvedParams) -> Constraint:
        """The grammar state of a constrained request; RequestError naming the field when it does not compile."""
        if self._grammars is None:  # built on first use: it reads the whole vocabulary
            t0 = time.perf_counter()
            self._grammars = Grammars.for_tokenizer(self.tokenizer, self.model_config.vocab_size)
            log.info("structured output: grammar compiler ready (%d closer tokens) in %.2fs",
                     len(self._grammars.closers), time.perf_counter() - t0)
        if self._grammar_sandbox is None:  # its worker starts on the first check
            self._grammar_sandbox = GrammarSandbox.for_tokenizer(self.tokenizer, self.model_config.vocab_size,
                                                                 workers=1)
        field, source = params.grammar
        try:
            # native code may crash or stall on a hostile grammar: only one a worker has compiled and played
            # (cached: the HTTP process's check passed it already, a repeat costs nothing) is built here
            self._grammar_sandbox.check(field, source)
            longest = max_output_tokens(field, source)
            if longest is not None and params.min_tokens > longest:
                raise GrammarError(f"min_tokens ({params.min_tokens}) cannot be met: no output of this {field} "
                                   f"is longer than {longest} tokens, and the grammar ends the output first",
                                   "min_tokens")
            matcher = self._grammars.matcher(field, source)
        except GrammarError as exc:
            log.warning("request %s: %s refused: %s", rid, field, exc)
            raise RequestError(str(exc), param=exc.param) from exc
        return Constraint(matcher, prompt_len, frozenset(stop_ids(params, self.tokenizer.eos_token_ids)),
                          self.tokenizer.eos_token_id,
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
        """Whether `step` would do something now (a paused engine's queued requests wait, and so do likelihood jobs
        while memory is released: docs/rl.md)."""
        return self.scheduler.can_progress() or (bool(self.scoring.jobs) and self.weights.serving())

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule -> run (one forward for the whole batch and its decoding step) -> update ->
        report, with one chunk of likelihood work between update and report; the output of every request that
        committed a block or finished (aborts and error finishes included) since the last call. A failure that
        concerns one request ends that request alone (see `fail`); EngineFault when the engine itself is broken."""
        items = self.scheduler.schedule() if self.scheduler.has_work() else []
        if items:
            now = time.monotonic()
            self._started(items, now)
            for part, out in self._run_isolating(items, self._run_batch):
                self._update(part, out)
            self.num_forwards += 1
            self.scoring.decoded(time.monotonic() - now)
        else:
            self.overlap.settle()
        self._score_chunk(decoding=bool(items))
        return self._report(items)

    def _started(self, items: list[WorkItem], now: float) -> None:
        for it in items:  # a request's first batch ends its time in the queue
            t = self._progress.get(it.req.rid)
            if t is not None and t.queue_time is None:
                t.queue_time, t.first_forward = now - t.enqueued, self.num_forwards

    def _update(self, items: list[WorkItem], out: StepOutput) -> None:
        for rid, (stage, exc) in out.failed.items():
            self.fail(rid, exc, stage)
        self.scheduler.update(items, out)

    def _score_chunk(self, decoding: bool) -> None:
        if self.scoring.jobs and self.weights.serving():
            self.overlap.settle()  # (none was started: likelihood chunks never run beside a forward)
            self.scoring.advance(decoding=decoding, faults=self.faults)

    def _report(self, items: list[WorkItem]) -> list[RequestOutput]:
        updated = self.scheduler.drain_updates()
        streaming = self._streaming_requests(items, updated) if self._streaming else []
        outs = [self._output_guarded(req) for req in updated + streaming]
        # A block that ended inside an open MBE window committed nothing yet: no message until something does.
        return [o for o in outs if o.new_ids or o.finished or o.denoise]

    @staticmethod
    def _streaming_requests(items: list[WorkItem], updated: list[Request]) -> list[Request]:
        """stream_denoise: the requests of this batch with a forward event waiting that are not in `updated`
        already (those get their message anyway)."""
        seen = {r.rid for r in updated}
        out = []
        for it in items:
            r = it.req
            if r.params.stream_denoise and r.state.trace is not None and r.state.trace.pending and r.rid not in seen:
                seen.add(r.rid)
                out.append(r)
        return out

    def _run_isolating(self, items: list[WorkItem], run: Any = None) -> Batch:
        """The forward and step of `items` (`run`: ModelRunner.run, or the overlap scheduler's wrapper of it);
        when it raises, the same items in halves (recursively, serially), so that only the requests whose
        forward fails on their own end (error finish) and the rest run as they would have. A half's rows are
        reloaded from its requests first (the failed attempt may have advanced them)."""
        try:
            out = (run or self.runner.run)(items)
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
        for it in items:  # a decoder's own row state is not in the request: its block starts over
            req = it.req
            if decoder_class(req.params.decoder).keeps_block_state and req.state.status is Status.RUNNING \
                    and not req.finished:
                req.restart_block()
        self.runner.slots.forget([it.req for it in items])  # resynced from the requests before their next forward

    def _output_guarded(self, req: Request) -> RequestOutput:
        """`_output`, or, when building it fails, an error finish for that request alone."""
        try:
            self.faults.check("output", req.rid)
            return self._output(req)
        except Exception as exc:  # noqa: BLE001 - one request's failure must not stop the others' messages
            self.fail(req.rid, exc, "output")
            self.scheduler.forget_update(req.rid)  # this is its last message
            self._requests.pop(req.rid, None)
            self._progress.pop(req.rid, None)
            self._streaming.discard(req.rid)
            finish = req.state.finish_reason
            reason = finish if finish is not None and finish.kind == "error" else error_reason(exc)
            return RequestOutput(req.rid, [], True, reason.to_json(), None, None,
                                 {"prompt_tokens": req.prompt_len, "completion_tokens": 0,
                                  **self.weights.request_meta(req.rid)})

    def _output(self, req: Request) -> RequestOutput:
        ids = req.output_ids()
        progress = self._progress.get(req.rid) or _Progress(time.monotonic())
        start = min(progress.sent_tokens, len(ids))
        lp = req.output_logprobs(start)
        progress.sent_tokens = len(ids)
        meta: dict[str, Any] = {"steps": req.state.stats.steps, "blocks": req.state.stats.blocks}
        if req.finished:
            self._requests.pop(req.rid, None)
            self._streaming.discard(req.rid)
            meta = self._final_meta(req, len(ids), self._progress.pop(req.rid, None))
            meta.update(self.weights.request_meta(req.rid))  # the weight version it ran on
        events = req.state.trace.take_events() if req.state.trace is not None and req.params.stream_denoise else None
        return RequestOutput(req.rid, ids[start:], req.finished, self._finish_json(req, len(ids)),
                             lp[0] if lp else None, lp[1] if lp else None, meta, events or None)

    @staticmethod
    def _finish_json(req: Request, n_out: int) -> dict[str, Any] | None:
        finish = req.state.finish_reason
        if finish is None:
            return None
        out = finish.to_json()
        if finish.kind == "length":
            out["length"] = n_out
        return out

    @staticmethod
    def _final_meta(req: Request, n_out: int, timing: _Progress | None) -> dict[str, Any]:
        """SGLang-style meta_info of a finished request, with its diffusion figures."""
        stats = req.state.stats
        steps = stats.steps
        meta = {
            "prompt_tokens": req.prompt_len,
            "completion_tokens": n_out,
            "cached_tokens": req.book.prefix_cached_tokens,
            "steps": steps,
            "tokens_per_forward": n_out / max(steps, 1),
            "edits": stats.edits,
            "mbe_edits": stats.mbe_edits,
            "deletions": stats.deletions,
            "insertions": stats.insertions,
            "decoder": req.params.decoder,
            "blocks": stats.blocks,
            "mode": req.params.mode,
            "mbe_window": req.params.mbe_window,
            "domain": req.params.domain,
            "queue_time": timing.queue_time if timing else None,
            "first_forward": timing.first_forward if timing else None,
            "e2e_latency": time.monotonic() - timing.enqueued if timing else None,
        }
        trace = req.state.trace
        if trace is not None and req.trace_edits:
            meta["edit_trace"] = trace.edit_trace()
        if trace is not None and req.params.return_step_maps:
            meta["step_maps"] = trace.step_maps(n_out, req.block_size)
        if isinstance(req.state.constraint, Constraint):
            g = req.state.constraint.stats
            meta["grammar"] = {"rejected": g.rejected, "remasked": g.remasked, "forced": g.forced,
                               "seconds": g.seconds}
        return meta

    # ---- likelihoods (engine/text/likelihood.py, engine/runtime/scoring.py) --------------------------------------------
    def _new_score_job(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int = 0,
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
        return self.scoring.start(token, sequences, variants, top_k, max_tokens)

    def add_score_job(self, token: str, sequences: list[list[int]], variants: list[Any], top_k: int = 0) -> None:
        """Queue a likelihood job; the loop advances it one chunk per step, between decoding iterations, and
        its ScoreResult comes out of take_score_results. RequestError as in _new_score_job."""
        if token in self.scoring.jobs:
            raise RequestError(f"score job {token!r} is already running", code="duplicate_request_id")
        limit = self.scheduler.config.max_queued_requests  # (jobs wait for the engine as requests do: one bound)
        if limit is not None and len(self.scoring.jobs) >= limit:
            raise RequestError(f"the queue is full ({limit} likelihood jobs running)", status=503, code="queue_full")
        self.scoring.add(self._new_score_job(token, sequences, variants, top_k))

    def cancel_score(self, token: str) -> bool:
        """Drop a likelihood job (its client left): its leased pages are released now. Idempotent."""
        return self.scoring.cancel(token)

    def take_score_results(self) -> list[ScoreResult]:
        return self.scoring.take_results()

    def score_variants(self, sequences: list[list[int]], variants: list[Any], top_k: int = 0,
                       max_tokens: int | None = None) -> list[Values]:
        """A likelihood job run to its end at once (the offline Engine): per variant, (logprob, top
        alternatives) at each target. RequestError as in _new_score_job."""
        if not self.weights.serving():
            raise RuntimeError("the weights or the KV cache are released: resume_memory_occupation first")
        self.overlap.settle()
        return self.scoring.run_to_end(self._new_score_job("offline", sequences, variants, top_k, max_tokens))

    # ---- service -------------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the radix cache; refused (False) while requests run or wait to run, as SGLang refuses (a paused
        engine's retracted requests do not count: their K/V is recomputed anyway)."""
        s = self.scheduler
        if s.running or self.scoring.jobs or (s.waiting and not s.hold_admission):
            return False
        return s.flush_cache()

    def stats(self) -> dict[str, Any]:
        return {**self.scheduler.stats(), "num_score_jobs": len(self.scoring.jobs),
                "num_request_failures": self.num_request_failures, **self.weights.memory_stats()}

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
            "overlap": "on" if self.overlap.enabled else f"off: {self.overlap.reason_off}",
            # what SGLang reports and RL frameworks read (slime checks the parallel sizes of an external engine)
            "tp_size": a.tp_size, "ep_size": a.ep_size, "dp_size": 1, "pp_size": 1,
            **self.weights.info(),
        }

    def shutdown(self) -> None:
        self.overlap.shutdown()
        self.scoring.shutdown()
        for rid in list(self._requests):
            self.scheduler.abort(rid)
        self.scheduler.drain_updates()
        self._requests.clear()
        self._streaming.clear()
        if getattr(self, "_tp_workers", None) is not None:
            self._tp_workers.stop()
            self._tp_workers = None
        self.runner = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]


