"""SGLang's training control plane (docs/rl.md), with SGLang's field names and answers, so that RL frameworks
(AReaL's RemoteSGLangEngine, slime's external engines, verl) drive redraft unchanged:

    GET  /get_weight_version              POST /update_weight_version
    POST /update_weights_from_disk        POST /init_weights_update_group
    POST /update_weights_from_distributed POST /destroy_weights_update_group
    POST /begin_weight_update, /end_weight_update (no-ops)
    POST /pause_generation                POST /continue_generation
    GET|POST /release_memory_occupation   GET|POST /resume_memory_occupation
    GET  /health_generate                 GET /get_load, /load, /v1/loads
(/abort_request with abort_all and GET /flush_cache are native_api's.) The engine side of every route is
engine/runtime/weight_update.py; each message is one round trip (protocol/messages.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from redraft.protocol.errors import RequestError
from redraft.protocol.messages import (ControlResult, GenerateReq, GenerationControlReq, RequestOutput,
                                       WeightGroupReq, WeightUpdateReq)
from redraft.protocol.sampling_params import SamplingParams
from redraft.server.common import ServerState, engine_error
from redraft.server.engine_client import EngineDead
from redraft.server.routing import DepthCheckedRoute, State

log = logging.getLogger("redraft.rl")
HEALTH_GENERATE_TIMEOUT_S = 20.0  # SGLang's default
DEFAULT_GROUP = "weight_update_group"

# every route here changes what other clients get: the admin key (server/middleware.py)
RL_ADMIN_PATHS = frozenset({
    "/update_weight_version", "/update_weights_from_disk", "/init_weights_update_group",
    "/update_weights_from_distributed", "/destroy_weights_update_group", "/begin_weight_update",
    "/end_weight_update", "/pause_generation", "/continue_generation", "/release_memory_occupation",
    "/resume_memory_occupation"})

router = APIRouter(route_class=DepthCheckedRoute)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")
    rid: str | list[str] | None = None  # (SGLang's BaseReq field; unused)


# ---- bodies: SGLang's io_struct fields ------------------------------------------------------------------------
class UpdateWeightVersionBody(_Body):
    new_version: StrictStr
    abort_all_requests: bool = True


class UpdateWeightsFromDiskBody(_Body):
    model_path: StrictStr
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None
    flush_cache: bool = True
    # accepted as SGLang does; what they tune does not exist here (no CUDA caching between updates to empty, no
    # asynchronous load, graphs stay valid as weights are copied in place)
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False
    recapture_cuda_graph: bool = False
    token_step: int = 0
    manifest: dict[str, Any] | None = None


class InitWeightsUpdateGroupBody(_Body):
    master_address: StrictStr
    master_port: StrictInt | StrictStr  # AReaL sends a string
    rank_offset: StrictInt = Field(ge=0)
    world_size: StrictInt = Field(ge=2)
    group_name: StrictStr = DEFAULT_GROUP
    backend: Literal["nccl", "gloo"] = "nccl"


class UpdateWeightsFromDistributedBody(_Body):
    names: list[StrictStr]
    dtypes: list[StrictStr]
    shapes: list[list[StrictInt]]
    group_name: StrictStr = DEFAULT_GROUP
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None
    torch_empty_cache: bool = False


class DestroyWeightsUpdateGroupBody(_Body):
    group_name: StrictStr = DEFAULT_GROUP


class PauseGenerationBody(_Body):
    mode: Literal["abort", "retract", "in_place"] = "abort"


class ContinueGenerationBody(_Body):
    torch_empty_cache: bool = True


class MemoryOccupationBody(_Body):
    tags: list[StrictStr] | None = None


class WeightUpdateMarkBody(BaseModel):
    """/begin_weight_update and /end_weight_update: some clients bracket an update with them; nothing to do."""

    model_config = ConfigDict(extra="allow")


# ---- the engine round trip ---------------------------------------------------------------------------------
async def control(state: ServerState, msg: Any = None, **fields: Any) -> ControlResult:
    """Send a control message (or a GenerationControlReq of `fields`) and wait for the engine's answer."""
    if msg is None:
        msg = GenerationControlReq(uuid.uuid4().hex, **fields)
    try:
        result = await state.client.control(msg)
    except (EngineDead, asyncio.TimeoutError) as exc:
        raise engine_error(exc) from exc
    if result.data.get("status") == 500:
        raise RequestError(result.message, status=500, code="internal_error")
    return result


def _answer(result: ControlResult, code: str = "weight_update_failed", param: str | None = None,
            **extra: Any) -> JSONResponse:
    """SGLang's answer: {"success", "message", ...}, 200 or 400; a 400 also carries the refusal in OpenAI's shape
    (`error`, as every refusal of this server: docs/rl.md)."""
    body = {"success": result.success, "message": result.message, **extra}
    if not result.success:
        body["error"] = RequestError(result.message, code=code, param=param).body()["error"]
    return JSONResponse(body, status_code=200 if result.success else 400)


async def _update(state: ServerState, msg: WeightUpdateReq) -> ControlResult:
    result = await control(state, msg)
    if result.success:
        state.client.weights_changed(result.data)
        log.info("weights updated (%s): %s; version %s", msg.source, result.message, result.data.get("weight_version"))
    else:
        log.warning("weight update (%s) refused: %s", msg.source, result.message)
    return result


def _version_note(result: ControlResult, version: str | None) -> str:
    return result.message + (f" Weight version updated to {version}." if result.success and version else "")


# ---- weight versions ---------------------------------------------------------------------------------------
@router.get("/get_weight_version")
async def get_weight_version(state: State):
    return {"weight_version": state.client.info.get("weight_version", "default")}


@router.post("/update_weight_version")
async def update_weight_version(body: UpdateWeightVersionBody, state: State):
    result = await _update(state, WeightUpdateReq(uuid.uuid4().hex, "version", weight_version=body.new_version,
                                                  abort_all_requests=body.abort_all_requests))
    if not result.success:
        return _answer(result)
    return {"success": True, "message": f"Weight version updated to {body.new_version}",
            "new_version": body.new_version}


# ---- updates -----------------------------------------------------------------------------------------------
@router.post("/update_weights_from_disk")
async def update_weights_from_disk(body: UpdateWeightsFromDiskBody, state: State):
    msg = WeightUpdateReq(uuid.uuid4().hex, "disk", model_path=body.model_path, load_format=body.load_format,
                          abort_all_requests=body.abort_all_requests, weight_version=body.weight_version,
                          flush_cache=body.flush_cache)
    result = await _update(state, msg)
    result.message = _version_note(result, body.weight_version)
    return _answer(result, num_paused_requests=result.data.get("num_paused_requests", 0))


@router.post("/init_weights_update_group")
async def init_weights_update_group(body: InitWeightsUpdateGroupBody, state: State):
    try:
        port = int(body.master_port)
    except ValueError:
        raise RequestError(f"master_port {body.master_port!r} is not a port number", param="master_port") from None
    if not 0 < port < 65536:
        raise RequestError(f"master_port {port} is outside 1..65535", param="master_port")
    tp = int(state.client.info.get("tp_size", 1))
    if body.rank_offset + tp > body.world_size:
        raise RequestError(f"rank_offset {body.rank_offset} + this server's {tp} rank(s) exceed world_size "
                           f"{body.world_size}", param="rank_offset")
    msg = WeightGroupReq(uuid.uuid4().hex, "init", body.group_name, body.master_address, port, body.rank_offset,
                         body.world_size, body.backend)
    return _answer(await control(state, msg))


@router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(body: UpdateWeightsFromDistributedBody, state: State):
    msg = WeightUpdateReq(uuid.uuid4().hex, "distributed", load_format=body.load_format, names=body.names,
                          dtypes=body.dtypes, shapes=body.shapes, group_name=body.group_name,
                          abort_all_requests=body.abort_all_requests, weight_version=body.weight_version,
                          flush_cache=body.flush_cache)
    result = await _update(state, msg)
    result.message = _version_note(result, body.weight_version)
    return _answer(result)


@router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(body: DestroyWeightsUpdateGroupBody, state: State):
    return _answer(await control(state, WeightGroupReq(uuid.uuid4().hex, "destroy", body.group_name)))


@router.post("/begin_weight_update")
@router.post("/end_weight_update")
async def weight_update_mark(state: State, body: WeightUpdateMarkBody | None = None):
    return {"success": True, "message": "accepted (nothing to do: an update waits for running requests itself)"}


# ---- generation --------------------------------------------------------------------------------------------
@router.post("/pause_generation")
async def pause_generation(state: State, body: PauseGenerationBody | None = None):
    """AReaL posts no body at all: mode abort."""
    result = await control(state, op="pause", mode=(body or PauseGenerationBody()).mode)
    if not result.success:
        raise RequestError(result.message, param="mode")
    return {"message": "Generation paused successfully.", "status": "ok"}


@router.post("/continue_generation")
async def continue_generation(state: State, body: ContinueGenerationBody | None = None):
    await control(state, op="continue")
    return {"message": "Generation continued successfully.", "status": "ok"}


@router.get("/release_memory_occupation")
@router.post("/release_memory_occupation")
async def release_memory_occupation(state: State, body: MemoryOccupationBody | None = None):
    return await _memory(state, "release_memory", body)


@router.get("/resume_memory_occupation")
@router.post("/resume_memory_occupation")
async def resume_memory_occupation(state: State, body: MemoryOccupationBody | None = None):
    return await _memory(state, "resume_memory", body)


async def _memory(state: ServerState, op: str, body: MemoryOccupationBody | None) -> Response:
    """{"success", "message"} as SGLang's newer servers answer (its older ones answer null; the clients read
    neither), with what stays resident per tag; a 400 while requests run, or for an unknown tag."""
    result = await control(state, op=op, tags=body.tags if body else None)
    if result.success:
        log.info("%s: %s", op, result.message)
        return _answer(result, released=result.data["released"], resident_bytes=result.data["resident_bytes"])
    log.warning("%s refused: %s", op, result.message)
    param = result.data.get("param")
    return _answer(result, code="invalid_tags" if param else "server_busy", param=param)


# ---- health and load -----------------------------------------------------------------------------------------
@router.get("/health_generate", response_class=Response,  # empty bodies both ways (server/openapi_doc.py)
            responses={200: {"description": "One token generated (an empty body)"},
                       503: {"description": "No answer in time, or draining (an empty body)"}})
async def health_generate(state: State):
    """One tiny generation (one token, greedy) through the whole engine: 200 once it finishes, else 503."""
    if state.draining:
        return Response(status_code=503)
    rid = f"HEALTH_CHECK_{uuid.uuid4().hex}"
    token = state.tokenizer.eos_token_id
    try:
        streams = await state.client.submit([GenerateReq(rid, [token], SamplingParams(max_new_tokens=1,
                                                                                        temperature=0.0))])
    except (EngineDead, RequestError):
        return Response(status_code=503)
    try:
        async with asyncio.timeout(HEALTH_GENERATE_TIMEOUT_S):
            async for msg in streams[0]:
                if isinstance(msg, RequestOutput) and msg.finished:
                    return Response(status_code=200)
    except (EngineDead, RequestError, TimeoutError):
        pass
    finally:
        await streams[0].aclose()
    log.error("health_generate: no answer within %.0fs", HEALTH_GENERATE_TIMEOUT_S)
    return Response(status_code=503)


async def _load(state: ServerState) -> dict[str, Any]:
    stats: dict[str, Any] = {}
    with contextlib.suppress(EngineDead, asyncio.TimeoutError):
        stats = await state.client.ping(timeout=2.0)
    return stats


@router.get("/get_load")
@router.get("/load")
async def get_load(state: State):
    """SGLang's /get_load: one entry per data-parallel rank (here one)."""
    s = await _load(state)
    return [{"dp_rank": 0, "num_reqs": s.get("num_running_reqs", 0) + s.get("num_queue_reqs", 0),
             "num_waiting_reqs": s.get("num_queue_reqs", 0), "num_tokens": s.get("num_used_tokens", 0)}]


@router.get("/v1/loads")
async def v1_loads(state: State):
    s = await _load(state)
    running, waiting = s.get("num_running_reqs", 0), s.get("num_queue_reqs", 0)
    return {"timestamp": time.time(), "dp_rank_count": 1, "loads": [{
        "dp_rank": 0, "num_running_reqs": running, "num_waiting_reqs": waiting, "num_total_reqs": running + waiting,
        "num_used_tokens": s.get("num_used_tokens", 0), "max_total_num_tokens": s.get("max_total_tokens", 0),
        "token_usage": s.get("token_usage", 0.0), "cache_hit_rate": s.get("cache_hit_rate", 0.0),
        "engine_alive": bool(s)}]}
