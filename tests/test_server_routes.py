"""The HTTP side in pieces, without an engine process: each route group is a router that an app of its own can
serve (its routes reach the ServerState through a dependency), one error type travels from the engine's refusal
to the HTTP answer, and each route names the engine's fields by its own table."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from redraft.protocol.errors import RequestError, duplicate_request_id
from redraft.protocol.messages import Rejected, ScoreResult
from redraft.protocol.sampling_params import SamplingParams, SamplingParamsError
from redraft.protocol.server_args import ServerArgs
from redraft.server import likelihood_api, native_api, openai_api, rl_api
from redraft.server.common import ServerState
from redraft.server.http_server import create_app, request_error
from redraft.server.param_names import CHAT, COMPLETIONS, SCORE, generate_names


class _Client:
    """What the routes read of an EngineClient, and nothing that reaches an engine."""

    def __init__(self) -> None:
        self.info = {"max_model_len": 128, "vocab_size": 64, "model_path": "/models/tiny"}
        self.on_submit, self.on_message, self.on_down = [], [], []
        self.failed, self.alive, self.hung = False, True, False


def _state(**kwargs) -> ServerState:
    tokenizer = SimpleNamespace(vocab_size=64, eos_token="<eos>", eos_token_ids=frozenset({3, 1}), bos_token=None, pad_token=None, mask_token="<m>",
                                chat_template=None)
    return ServerState(_Client(), tokenizer, "tiny", "/models/tiny", **kwargs)


def _app_with(router, state: ServerState) -> FastAPI:
    app = FastAPI()
    app.state.redraft = state
    app.include_router(router)
    app.add_exception_handler(RequestError, request_error)
    return app


def test_a_router_serves_from_an_app_of_its_own() -> None:
    client = TestClient(_app_with(openai_api.router, _state()))
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["tiny"] and models["data"][0]["max_model_len"] == 128
    missing = client.get("/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"] == {
        "message": "The model `other` does not exist.", "type": "invalid_request_error", "param": "model",
        "code": "model_not_found"}
    info = TestClient(_app_with(likelihood_api.router, _state())).get("/tokenizer_info").json()
    assert info["vocab_size"] == 64 and info["model_max_length"] == 128 and info["eos_token_ids"] == [1, 3]
    assert TestClient(_app_with(native_api.router, _state())).get("/live").status_code == 200


def test_the_app_keeps_every_route_of_its_routers() -> None:
    app = create_app(_state())
    paths = set(app.openapi()["paths"])
    for router in (openai_api.router, likelihood_api.router, native_api.router, rl_api.router):
        assert {r.path_format for r in router.routes} <= paths


def test_one_error_type_from_the_engine_to_the_answer() -> None:
    refused = RequestError("the prompt is empty", param="input_ids")  # as the engine core raises it
    wire = pickle.loads(pickle.dumps(Rejected.of("r1", refused)))  # what the engine process sends
    err = wire.error()  # what the engine client raises
    assert isinstance(err, RequestError) and (err.status, err.code, err.param) == (400, "invalid_request_error",
                                                                                   "input_ids")
    assert err.body() == {"error": {"message": "the prompt is empty", "type": "invalid_request_error",
                                    "param": "input_ids", "code": "invalid_request_error"}}
    full = ScoreResult.failed("t", RequestError("the KV cache is full: try again", status=503, code="cache_full"))
    assert full.error().type == "server_error" and full.error().code == "cache_full"
    copy = pickle.loads(pickle.dumps(RequestError("gone", status=503, code="x", headers={"Retry-After": "2"})))
    assert (copy.status, copy.code, copy.type, copy.headers) == (503, "x", "server_error", {"Retry-After": "2"})
    assert duplicate_request_id("a").message == "request id 'a' is already in flight"
    assert isinstance(refused, ValueError)  # the offline Engine's callers catch bad input as a ValueError


def test_each_route_names_the_engines_fields_its_own_way() -> None:
    engine_refusal = RequestError("too long", code="context_length_exceeded", param="input_ids")
    assert CHAT.engine_error(engine_refusal).param == "messages"
    assert COMPLETIONS.engine_error(engine_refusal).param == "prompt"
    assert SCORE.engine_error(engine_refusal).param == "items"
    assert generate_names("text").engine_error(engine_refusal).param == "text"
    assert generate_names("text").engine_param("min_tokens") == "min_tokens"
    try:
        SamplingParams.from_dict({"max_new_tokens": 0})
    except SamplingParamsError as exc:
        chat, native = CHAT.params_error(exc), generate_names("input_ids").params_error(exc)
    assert chat.param == "max_tokens" and "max_tokens" in chat.message and "max_new_tokens" not in chat.message
    assert native.param == "sampling_params.max_new_tokens" and "max_new_tokens" in native.message


def test_the_limits_default_to_server_args() -> None:
    state = _state()
    assert state.max_body_bytes == ServerArgs().max_body_bytes
    assert state.max_choices == ServerArgs().max_choices_per_request
