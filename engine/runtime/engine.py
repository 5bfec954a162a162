"""`redraft.Engine`: the offline engine (SGLang-style `generate`), all requests advancing together.

A thin driver of `EngineCore`: submit every prompt, step until all are finished, assemble each answer with
an `OutputStream` (the same assembly the HTTP routes use: text, stop strings, logprobs, meta_info).
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Mapping, Sequence

from redraft.engine.runtime.core import EngineCore
from redraft.engine.text.output_stream import OutputStream
from redraft.protocol.sampling_params import BLOCK_SIZE, SamplingParams
from redraft.protocol.server_args import ServerArgs


class Engine:
    def __init__(self, model_path: str | None = None, *, server_args: ServerArgs | None = None, **kwargs: Any):
        """kwargs: any ServerArgs field (device, dtype, kernel_backend, quantization, max_total_tokens, ...);
        or a whole `server_args`."""
        self.args = server_args or ServerArgs(model_path=model_path, **kwargs)
        self.core = EngineCore(self.args)
        self.tokenizer = self.core.tokenizer
        self.model_path = self.core.model_path
        self.model_config = self.core.model_config  # (the other parts are the core's: core.scheduler, core.runner)

    @property
    def quantization(self) -> str | None:
        return self.core.quantization

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    # ---- public API ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str | Sequence[str] | None = None,
        sampling_params: dict | SamplingParams | Sequence[dict | SamplingParams] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        on_event: Callable[[dict], None] | None = None,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]] | None = None,
    ) -> dict | list[dict]:
        """Generate for one prompt (a dict) or several (a list). Give exactly one of `messages` (a chat: a list
        of {"role", "content"} dicts, or a list of such chats; rendered with the model's chat template, as
        /v1/chat/completions does), `prompt` (raw text, no template) or `input_ids`. A request with
        `stream_denoise` gets its forward events (docs/denoise.md) in the result's `denoise` list, and each is
        passed to `on_event` as it comes (its `index`: the prompt's)."""
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise ValueError("give exactly one of messages=, prompt= or input_ids=")
        single, id_lists = self._encode(prompt, input_ids, messages)
        if isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(id_lists):
                raise ValueError(f"{len(sampling_params)} sampling_params for {len(id_lists)} prompts")
            params = [SamplingParams.from_dict(p) for p in sampling_params]
        else:
            params = [SamplingParams.from_dict(sampling_params)] * len(id_lists)
        events: list[list[dict]] = [[] for _ in id_lists]

        def collect(index: int, batch: list[dict]) -> None:
            events[index].extend(batch)
            for e in batch if on_event is not None else ():
                on_event(e)

        streams = self._run(id_lists, params, collect)
        outs = [{"text": s.text, "output_ids": s.ids, "meta_info": s.meta_info()} for s in streams]
        for out, p, e in zip(outs, params, events):
            if p.stream_denoise:
                out["denoise"] = e
        return outs[0] if single else outs

    # ---- likelihoods (docs/likelihood.md) ----------------------------------------------------------------
    def prompt_logprobs(self, input_ids: Sequence[int], start: int = 1, top_k: int = 0
                        ) -> list[tuple[float, list[tuple[int, float]]] | None]:
        """The staircase ("echo") value of every position from `start` (>= 1): log p(x_i | x_<i, positions
        i .. end of i's block masked), with the top_k alternatives of the same row; None before `start`."""
        from redraft.engine.text.likelihood import staircase_values, staircase_variants

        ids = list(input_ids)
        variants = staircase_variants(0, len(ids), max(1, start), BLOCK_SIZE)
        return staircase_values(len(ids), variants, self.core.score_variants([ids], variants, top_k))

    def score(self, items: Sequence[tuple[Sequence[int], Sequence[int]]], estimator: str = "elbo",
              num_timesteps: int = 1, timestep_rule: str = "stratified", masking: str = "bernoulli",
              seed: int = 0) -> list[dict]:
        """Likelihood terms of (prompt ids, response ids) items: the block ELBO (Monte Carlo, masks a pure
        function of seed, timestep and position), the exact staircase, or the exact ELBO (docs/likelihood.md)."""
        from redraft.engine.text.likelihood import elbo_plan, fill_terms

        seqs = [list(p) + list(r) for p, r in items]
        plan = elbo_plan([(len(p), len(p) + len(r)) for p, r in items], estimator=estimator,
                         num_timesteps=num_timesteps, timestep_rule=timestep_rule, masking=masking, seed=seed,
                         block_size=BLOCK_SIZE)
        rows = self.core.score_variants(seqs, plan.variants)
        return fill_terms(plan, [[lp for lp, _ in row] for row in rows])

    # ---- memory (docs/rl.md) --------------------------------------------------------------------------
    def release_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        """Free the device memory of `tags` (weights, kv_cache, cuda_graph; none: all), as the HTTP route does:
        {"success", "message", "released", "resident_bytes"}; refused while requests run."""
        return self._memory("release_memory", tags)

    def resume_memory_occupation(self, tags: Sequence[str] | None = None) -> dict:
        return self._memory("resume_memory", tags)

    def _memory(self, op: str, tags: Sequence[str] | None) -> dict:
        from redraft.protocol.messages import GenerationControlReq

        result = self.core.weights.handle(GenerationControlReq(uuid.uuid4().hex, op, tags=list(tags or [])))[0]
        return {"success": result.success, "message": result.message,
                **{k: v for k, v in result.data.items() if k in ("released", "resident_bytes")}}

    def shutdown(self) -> None:
        self.core.shutdown()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- internals ----------------------------------------------------------------------------------
    def _encode(self, prompt: Any, input_ids: Any, messages: Any) -> tuple[bool, list[list[int]]]:
        """(one request?, the token ids of each request) from whichever of the three forms was given."""
        if messages is not None:
            single = len(messages) == 0 or isinstance(messages[0], Mapping)
            chats = [messages] if single else list(messages)
            return single, [self.tokenizer.encode_chat(list(chat)) for chat in chats]
        if prompt is not None:
            single = isinstance(prompt, str)
            return single, [self.tokenizer.encode(p) for p in ([prompt] if single else list(prompt))]
        single = len(input_ids) == 0 or isinstance(input_ids[0], int)
        return single, [list(input_ids)] if single else [list(x) for x in input_ids]

    def _run(self, id_lists: list[list[int]], params: list[SamplingParams],
             on_events: Callable[[int, list[dict]], None] | None = None) -> list[OutputStream]:
        core = self.core
        if not core.weights.serving():
            raise RuntimeError("the weights or the KV cache are released: resume_memory_occupation first")
        streams: dict[str, OutputStream] = {}
        try:
            rids = [uuid.uuid4().hex for _ in id_lists]
            core.add_requests(list(zip(rids, id_lists, params)))  # all or nothing, scheduled side by side
            for i, (rid, p) in enumerate(zip(rids, params)):
                streams[rid] = OutputStream(rid, self.tokenizer, p.stop, p.no_stop_trim, p.skip_special_tokens)
                streams[rid].index, streams[rid].denoise = i, p.stream_denoise
            t0 = time.perf_counter()
            pending = set(streams)
            while pending:
                for out in core.step():
                    stream = streams.get(out.rid)
                    if stream is None:
                        continue
                    stream.add(out)
                    if stream.new_events and on_events is not None:
                        on_events(stream.index, stream.new_events)
                    stop = stream.stop_abort()  # a stop string appeared: end it there, before another forward
                    if stop is not None:
                        core.abort(stop.rid, stop.finish, stop.keep_tokens)
                    if stream.finished:
                        pending.discard(out.rid)
            latency = time.perf_counter() - t0
            for s in streams.values():
                s.meta["e2e_latency"] = latency
            return list(streams.values())
        finally:  # an exception must not leave requests (and their pages) behind
            for rid in streams:
                core.abort(rid)
            core.step()  # nothing is left to run: this only reports (and forgets) the aborted requests
