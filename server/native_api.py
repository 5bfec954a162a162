"""SGLang's native routes: POST /generate (JSON or SSE, one chunk per committed block), POST /abort_request,
POST /flush_cache, GET /health (pings the engine), GET /live (does not), GET /server_info and /model_info (also
under their older get_ names, in SGLang's shapes), GET /metrics, GET /version.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import uuid
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from redraft.engine.text.output_stream import OutputStream
from redraft.protocol.errors import RequestError
from redraft.protocol.fields import GENERATE_BODY, GENERATE_TOP
from redraft.protocol.sampling_params import FIELDS, SamplingParams, SamplingParamsError
from redraft.server.common import (RETRY_AFTER, ChoiceStream, ServerState, check_choice_count, check_logit_bias_keys,
                                   check_model, check_request_id, check_token_ids, client_rid, engine_error, engine_rid,
                                   error_response, run_all, run_until_disconnect, sse, sse_error, start_streams)
from redraft.server.denoise import denoise_sse
from redraft.server.dials import DIALS, DialError, lift_dials
from redraft.server.engine_client import EngineDead
from redraft.server.likelihood_api import all_prompt_logprobs
from redraft.server.metrics import CONTENT_TYPE_LATEST
from redraft.server.openai_api import aborted_error
from redraft.server.openai_protocol import reject_lone_surrogates, reject_loose_booleans
from redraft.server.param_names import RouteNames, generate_names
from redraft.server.request_fields import carried, pydantic_fields, shaped_fields
from redraft.server.routing import DepthCheckedRoute, State
from redraft.server.structured import check_native_constraint

log = logging.getLogger("redraft.http")
SMG_NO_MODEL = "unknown"  # the `model` smg puts on a /generate that named none
UNSUPPORTED_FLAGS = ("return_hidden_states", "return_entropy", "return_bytes", "background",
                     "return_routed_experts")  # only false
NULL_ONLY = ("image_data", "lora_path")  # what RL clients always send (docs/rl.md): accepted when null


class _GenerateShaped(BaseModel):
    """A /generate body less the request fields it carries at its top level as declared (`GenerateBody` adds
    them: stream_denoise, return_step_maps, logprob_mode)."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | None = None
    stream: bool = False
    rid: str | None = None  # as X-Request-Id: checked below
    # SGLang's logprob fields: output logprobs (return_logprob), the prompt's from logprob_start_len (-1: none),
    # top_logprobs_num alternatives at each position (those two: `GenerateBody`, from the declarations); entries
    # are [logprob, id, text], text None unless asked
    logprob_start_len: int = Field(default=-1, ge=-1)
    return_text_in_logprobs: bool = False  # the third entry of each logprob tuple: the token's text
    # what SGLang clients and sglang-router add (docs/scaling.md): `model` must name the served model; the
    # logging switches are no-ops; the features redraft lacks are accepted only when off
    model: str | None = None
    metadata: dict[str, str] | None = None  # may carry dials (server/dials.py)
    log_metrics: bool = True
    no_logs: bool = False
    return_hidden_states: bool = False
    return_entropy: bool = False
    return_bytes: bool = False
    background: bool = False
    # what AReaL and slime send on every request (docs/rl.md)
    return_routed_experts: bool = False
    image_data: Any = None
    lora_path: Any = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:  # lone surrogates would fail the tokenizer or the reply: a 500
        return reject_loose_booleans(cls, reject_lone_surrogates(data))

    @field_validator("rid")
    @classmethod
    def _plain_rid(cls, rid: str | None) -> str | None:
        return check_request_id(rid, "rid")



# watching the decoding (docs/denoise.md) at the top level as SGLang's return_* flags (or in sampling_params): an
# `event: denoise` per forward on a stream, meta_info.step_maps, placement log-probabilities (docs/rl.md)
GenerateBody = create_model("GenerateBody", __base__=_GenerateShaped, __module__=__name__,
                            **pydantic_fields(GENERATE_TOP), **shaped_fields(GENERATE_BODY))

class AbortBody(BaseModel):
    """SGLang's AbortReq: a request by its id, or every request (`abort_all`)."""

    model_config = ConfigDict(extra="forbid")
    rid: str = ""  # a client's id, or the engine's scoped one: checked below
    abort_all: bool = False
    abort_message: str | None = None  # (SGLang's; the finish reason here is always {"type": "abort"})

    @field_validator("rid")
    @classmethod
    def _plain_rid(cls, rid: str) -> str:
        return check_request_id(rid, "rid", scoped=True) if rid else rid

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:  # lone surrogates would fail the tokenizer or the reply: a 500
        return reject_lone_surrogates(data)


router = APIRouter(route_class=DepthCheckedRoute)


# ---- service routes ---------------------------------------------------------------------------------------
@router.get("/version")
async def version():
    return {"version": package_version("redraft")}


@router.get("/health", response_class=Response, responses={200: {"description": "Healthy (an empty body)"}})
async def health(state: State):
    if state.draining:  # load balancers: stop sending here
        return error_response(RequestError("the server is shutting down", status=503, code="shutting_down"))
    try:
        await state.client.ping(timeout=5.0)
    except (EngineDead, asyncio.TimeoutError):
        return error_response(RequestError("the engine is not responding", status=503, code="engine_unavailable",
                                           headers=RETRY_AFTER))
    return Response(status_code=200)


@router.get("/live", response_class=Response, responses={200: {"description": "Live (an empty body)"}})
async def live(state: State):
    """Liveness: the HTTP process answers and its engine is running or being restarted (no engine round trip;
    /health checks the engine). 503 once the engine could not be restarted (the server is exiting)."""
    if state.client.failed:
        return error_response(RequestError("the engine could not be restarted", status=503, code="engine_failed"))
    if state.client.hung:  # silent past --engine-heartbeat-timeout: killed, its replacement not yet ready
        return error_response(RequestError("the engine stopped answering and is being replaced", status=503,
                                           code="engine_hung", headers=RETRY_AFTER))
    return Response(status_code=200)


@router.get("/server_info")
@router.get("/get_server_info")
async def server_info(state: State):
    stats = {}
    with contextlib.suppress(EngineDead, asyncio.TimeoutError):
        stats = await state.client.ping(timeout=2.0)
    return {**state.client.info, "model_name": state.model_name, "engine_alive": state.client.alive, **stats}


@router.get("/model_info")
@router.get("/get_model_info")
async def model_info(state: State):
    """SGLang's shape (sglang-router reads it when a worker registers)."""
    path = state.client.info.get("model_path") or state.model_path
    config: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError, TypeError):
        config = json.loads((Path(path) / "config.json").read_text())
    return {"model_path": path, "tokenizer_path": path, "served_model_name": state.model_name,
            "is_generation": True, "preferred_sampling_params": None,
            "weight_version": state.client.info.get("weight_version", "default"),
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": config.get("model_type"), "architectures": config.get("architectures"),
            "max_model_len": state.max_model_len}


@router.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus text exposition format"}})
async def metrics(state: State):
    try:
        state.metrics.set_engine_stats(await state.client.ping(timeout=2.0), state.client.info)
    except (EngineDead, asyncio.TimeoutError):
        state.metrics.set_engine_down()
    return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


# ---- admin routes (the admin key, with --api-key: server/middleware.py) ----------------------------------
@router.get("/flush_cache")
@router.post("/flush_cache")  # (slime uses GET, as SGLang allows)
async def flush_cache(state: State):
    try:
        result = await state.client.flush_cache()
    except (EngineDead, asyncio.TimeoutError) as exc:
        raise engine_error(exc) from exc
    if not result.ok:
        raise RequestError(result.message, code="cache_in_use")
    return {"flushed": True}


@router.post("/abort_request")
async def abort_request(body: AbortBody, state: State):
    """The admin ends a request by the id its client sees (`<X-Request-Id>-<choice>`, a /generate rid): every
    in-flight request of that id, under any API key; or by the engine's scoped id (`<scope>/<id>`, in the
    engine's log). Answers as before whether or not one was running (aborting is idempotent). `abort_all`: every
    request in the engine, whoever sent it (each ends with finish_reason abort and what it committed)."""
    if body.abort_all:
        from redraft.server.rl_api import control  # (the training control plane's engine round trip)

        result = await control(state, op="abort_all")
        log.info("admin abort of every request: %s ended", result.data.get("aborted"))
        return {"rid": body.rid, "abort_all": True, "aborted": result.data.get("aborted", 0)}
    if not body.rid:
        raise RequestError("give the rid of the request to abort, or abort_all: true", param="rid")
    targets = {r for r in state.client.in_flight_rids
               if r == body.rid or (state.api_keys and client_rid(r) == body.rid)}
    for rid in targets or {body.rid}:
        await state.client.abort(rid)
    log.info("admin abort of %r: %d request(s) in flight", body.rid, len(targets))
    return {"rid": body.rid}


# ---- /generate --------------------------------------------------------------------------------------------
@router.post("/generate")
async def generate(body: GenerateBody, request: Request, state: State):
    # smg fills in "unknown" when the client named no model: that is no model, not a wrong one
    check_model(state, None if body.model == SMG_NO_MODEL else body.model)
    for flag in UNSUPPORTED_FLAGS:
        if getattr(body, flag):
            raise RequestError(f"{flag} is not supported (only false)", param=flag)
    for name in NULL_ONLY:
        if getattr(body, name) is not None:
            raise RequestError(f"{name} is not supported: this model reads text only (only null)", param=name)
    names = generate_names("text" if body.text is not None else "input_ids")
    n = _choice_count(body)
    prompts = await _native_prompts(state, body, names)
    params = _sampling_params(body, names)
    await check_native_constraint(state, params, names, body.rid or request.state.request_id)
    input_lps = None
    if body.return_logprob and body.logprob_start_len >= 0:  # the prompt's staircase values
        if body.stream:
            raise RequestError("input logprobs (logprob_start_len >= 0) need stream=false", param="stream")
        input_lps = await all_prompt_logprobs(state, request, prompts, body.logprob_start_len,
                                              body.top_logprobs_num, "logprob_start_len")
    if body.stream and len(prompts) * n != 1:
        raise RequestError("stream=true takes a single prompt and n = 1", param="stream")
    # n samples of each prompt (SGLang's order: a prompt's n outputs together), admitted together
    prompts, input_lps = [p for p in prompts for _ in range(n)], [lp for lp in input_lps or [] for _ in range(n)]
    all_params = [params if n == 1 else _nth_sample(params, j) for _ in range(len(prompts) // n) for j in range(n)]
    base_rid = body.rid or uuid.uuid4().hex
    rids = [base_rid] if len(prompts) == 1 else [f"{base_rid}-{i}" for i in range(len(prompts))]
    rids = [engine_rid(request, r) for r in rids]  # scoped by the API key; meta_info.id stays the client's
    count_param = names.prompt if n == 1 else "sampling_params.n"
    streams = await start_streams(state, rids, prompts, all_params, names, count_param=count_param)
    if body.stream:
        return StreamingResponse(_native_sse(streams[0]), media_type="text/event-stream")
    outs = await run_until_disconnect(request, run_all(streams))
    results = _native_results(state, body, outs, prompts, input_lps or None)
    batch = isinstance(body.text, list) or _is_batch_ids(body.input_ids) or n > 1
    return results if batch else results[0]


MAX_N = 16  # as the OpenAI routes


def _choice_count(body: GenerateBody) -> int:
    """sampling_params.n (SGLang's parallel sampling): 1 changes nothing; n > 1 answers a list."""
    n = (body.sampling_params or {}).get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_N:
        raise RequestError(f"sampling_params.n must be an integer in [1, {MAX_N}]", param="sampling_params.n")
    return n


def _nth_sample(params: SamplingParams, j: int) -> SamplingParams:
    """The j-th of n samples: its own seed (the request's + j, wrapped to int64), so seeded samples differ."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j + 2**63) % 2**64 - 2**63)


def _sampling_params(body: GenerateBody, names: RouteNames) -> SamplingParams:
    """sampling_params with the carried dials and SGLang's logprob fields, checked."""
    raw_params = _sglang_aliases(_with_carried_dials(body))
    check_logit_bias_keys(raw_params.get("logit_bias"), "sampling_params.logit_bias")
    if body.return_logprob:
        raw_params.update(logprobs=True, top_logprobs=body.top_logprobs_num)
    for name in carried(GENERATE_TOP):  # given at the top level (a false flag there leaves sampling_params' own)
        if getattr(body, name) != FIELDS[name].default:
            raw_params[name] = getattr(body, name)
    if not body.stream:
        raw_params.pop("stream_denoise", None)  # events need a stream: a plain answer carries none
    try:
        return SamplingParams.from_dict(raw_params)
    except SamplingParamsError as exc:
        raise names.params_error(exc) from exc


def _native_results(state: ServerState, body: GenerateBody, outs: list[OutputStream], prompts: list[list[int]],
                    input_lps: list[list] | None) -> list[dict]:
    """The non-streamed answer of every prompt (a 500 naming the reason when the engine failed one)."""
    failed = next((o for o in outs if _error_finish(o)), None)
    if failed is not None:  # a failure inside the engine ended it: a 500 naming the reason, never a 200
        raise aborted_error(failed)
    results = [_native_payload(o, final=True) for o in outs]
    for res, ids, lps in zip(results, prompts, input_lps or []):
        res["meta_info"]["input_token_logprobs"] = [[e[0] if e else None, t, None] for t, e in zip(ids, lps)]
        res["meta_info"]["input_top_logprobs"] = [[[v, a, None] for a, v in e[1]] if e else None for e in lps]
    if body.return_text_in_logprobs:
        for res in results:
            _token_texts(res["meta_info"], state.tokenizer)
    return results


def _sglang_aliases(raw: dict[str, Any]) -> dict[str, Any]:
    """SGLang's sampling-parameter names that RL clients send: `sampling_seed` is the seed;
    `spaces_between_special_tokens` is accepted (a bool) and changes nothing here (the detokenizer decodes
    special tokens, when kept, without added spaces)."""
    if "sampling_seed" in raw:
        seed = raw.pop("sampling_seed")
        if seed is not None and raw.get("seed") is not None and raw["seed"] != seed:
            raise RequestError("sampling_params.sampling_seed and sampling_params.seed differ: give one",
                               param="sampling_params.sampling_seed")
        if seed is not None:
            raw["seed"] = seed
    if "spaces_between_special_tokens" in raw:
        if not isinstance(raw.pop("spaces_between_special_tokens"), bool):
            raise RequestError("spaces_between_special_tokens must be a boolean",
                               param="sampling_params.spaces_between_special_tokens")
    return raw


def _with_carried_dials(body: GenerateBody) -> dict[str, Any]:
    """sampling_params with the dials that came in `sampling_params.custom_params` or `metadata` (smg keeps
    both; server/dials.py)."""
    raw = dict(body.sampling_params or {})
    raw.pop("n", None)  # read by _choice_count
    custom = raw.pop("custom_params", None)
    if custom is not None and (not isinstance(custom, dict) or set(custom) - set(DIALS)):
        raise RequestError(f"sampling_params.custom_params may hold only redraft's dials ({', '.join(DIALS)})",
                           param="sampling_params.custom_params")
    try:
        return lift_dials(raw, {"sampling_params.custom_params": custom, "metadata": body.metadata},
                          prefix="sampling_params.")
    except DialError as exc:
        raise RequestError(str(exc), param=exc.param) from exc


def _token_texts(meta: dict, tokenizer: Any) -> None:
    """return_text_in_logprobs: fill the third entry of every [logprob, id, text] with the token's text."""
    def fill(entry: list | None) -> None:
        if entry is not None:
            entry[2] = tokenizer.decode([entry[1]], skip_special_tokens=False)

    for key in ("input_token_logprobs", "output_token_logprobs"):
        for entry in meta.get(key) or []:
            fill(entry)
    for key in ("input_top_logprobs", "output_top_logprobs"):
        for row in meta.get(key) or []:
            for entry in row or []:
                fill(entry)


def _is_batch_ids(ids: Any) -> bool:
    return bool(ids) and isinstance(ids[0], list)


async def _native_prompts(state: ServerState, body: GenerateBody, names: RouteNames) -> list[list[int]]:
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("give exactly one of text or input_ids", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        check_choice_count(state, len(texts), names.prompt)  # before tokenizing them
        prompts = [await state.encode(t, "text") for t in texts]
    else:
        prompts = body.input_ids if _is_batch_ids(body.input_ids) else [body.input_ids]  # type: ignore[list-item]
        check_token_ids(state, prompts, names.prompt)  # before the prompt-logprob path reads them
    if not prompts:  # an empty batch; an empty prompt is the engine's to refuse
        raise RequestError("the prompt is empty", param=names.prompt)
    return [list(p) for p in prompts]


def _error_finish(out: OutputStream) -> bool:
    return (out.finish_reason or {}).get("type") == "error"


def _native_payload(out: OutputStream, final: bool = False) -> dict:
    """SGLang's native shape: the text decided so far (all of it at the end), every output id, meta_info."""
    text = out.text if final else out.detok.released
    return {"text": text, "output_ids": list(out.ids), "meta_info": out.meta_info()}


async def _native_sse(stream: ChoiceStream) -> AsyncIterator[str]:
    """One SSE chunk per committed block (cumulative text and ids, as SGLang streams them), then [DONE]; with
    stream_denoise, an `event: denoise` before it for each forward (server/denoise.py)."""
    sent = 0  # output ids the data chunks have carried
    try:
        async for up in stream.updates():
            for event in up.denoise:
                yield denoise_sse(event)
            if up.denoise and up.ids_end == sent and not up.finished:
                continue  # a forward that committed nothing: its event alone
            sent = up.ids_end
            yield sse(_native_payload(stream.out, final=stream.out.finished))
            if stream.out.finished and _error_finish(stream.out):  # its last chunk, then the error
                yield sse_error(aborted_error(stream.out))
                break
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
        yield sse_error(exc)
    finally:
        await stream.close()
    yield "data: [DONE]\n\n"
