"""What every route module shares: the server state, errors as HTTP answers, SSE framing, the one way a
request is admitted (`start_streams`: the HTTP status waits until the engine accepted every choice), one
engine request per output stream (`ChoiceStream`), and the way a request is cancelled (and its engine request
aborted) when the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse

from redraft.engine.text.grammar_sandbox import GrammarSandbox
from redraft.engine.text.output_stream import OutputStream
from redraft.engine.text.tokenizer import Tokenizer
from redraft.protocol.errors import RequestError, duplicate_request_id
from redraft.protocol.messages import Accepted, GenerateReq, RequestOutput
from redraft.protocol.sampling_params import SamplingParams
from redraft.protocol.server_args import ServerArgs
from redraft.server.engine_client import EngineClient, EngineDead, EngineHung, EngineStream, ServerDraining, WeightsLost
from redraft.server.metrics import ServerMetrics
from redraft.server.openai_protocol import UnsupportedValue
from redraft.server.param_names import RouteNames

log = logging.getLogger("redraft.http")


def error_response(err: RequestError) -> JSONResponse:
    """The HTTP answer of an error: OpenAI's error body, its status and headers."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


RETRY_AFTER = {"Retry-After": "2"}  # the engine is restarting: try again shortly


class ServerState:
    """What the routes share: the engine client, the tokenizer, metrics and limits."""

    def __init__(self, client: EngineClient, tokenizer: Tokenizer, model_name: str, model_path: str = "",
                 api_keys: tuple[str, ...] = (), max_body_bytes: int = ServerArgs.max_body_bytes,
                 domains: tuple[str, ...] | str | None = None,
                 max_choices: int = ServerArgs.max_choices_per_request, admin_keys: tuple[str, ...] = (),
                 allowed_hosts: tuple[str, ...] = ("*",), max_request_items: int = ServerArgs.max_request_items):
        self.client = client
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.model_path = model_path
        self.api_keys = api_keys
        self.admin_keys = admin_keys
        self.max_body_bytes = max_body_bytes
        self.allowed_hosts = allowed_hosts  # Host header names answered (server/host_check.py)
        self.max_request_items = max_request_items  # JSON objects in one request body (server/routing.py)
        self.max_choices = max_choices  # engine requests one HTTP request may start
        self.draining = False  # shutting down: no new requests; running ones get --shutdown-timeout to finish
        self._max_token_bytes: int | None = None
        self._grammar_sandbox: GrammarSandbox | None = None
        self.metrics = ServerMetrics(model_name, domains)  # domains: the `domain` label's values (else "other")
        self.metrics.attach(client)

    @property
    def grammar_sandbox(self) -> GrammarSandbox:
        """Structured output's checker, to refuse a bad constraint with a 400 (the engine decodes with its own
        compiler); its worker processes start on the first constrained request."""
        if self._grammar_sandbox is None:
            self._grammar_sandbox = GrammarSandbox.for_tokenizer(self.tokenizer, self.vocab_size)
        return self._grammar_sandbox

    def close_grammar_sandbox(self) -> None:
        if self._grammar_sandbox is not None:
            self._grammar_sandbox.close()

    @property
    def max_prompt_chars(self) -> int:
        """No text longer than this fits the context: max_model_len x the most bytes one token stands for (a
        character is at least a byte). Longer text is refused before it is tokenized."""
        if self._max_token_bytes is None:
            self._max_token_bytes = max(len(self.tokenizer.token_bytes(i)) for i in range(self.tokenizer.vocab_size))
        return self.max_model_len * max(1, self._max_token_bytes)

    def check_text_length(self, chars: int, param: str) -> None:
        if chars > self.max_prompt_chars:
            raise RequestError(f"the prompt text has {chars} characters; no text longer than {self.max_prompt_chars} "
                               f"characters fits this model's context of {self.max_model_len} tokens",
                               param=param, code="context_length_exceeded")

    async def encode(self, text: str, param: str) -> list[int]:
        """Tokenize off the event loop, after the length check."""
        self.check_text_length(len(text), param)
        return await asyncio.to_thread(self.tokenizer.encode, text)

    @property
    def model_names(self) -> list[str]:
        """The served name first; the checkpoint path is accepted too."""
        return [self.model_name] + ([self.model_path] if self.model_path and self.model_path != self.model_name else [])

    @property
    def max_model_len(self) -> int:
        return int(self.client.info.get("max_model_len", 0))

    @property
    def vocab_size(self) -> int:
        return int(self.client.info.get("vocab_size", self.tokenizer.vocab_size))


def check_model(state: "ServerState", model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise RequestError(f"The model `{model}` does not exist.", status=404, param="model", code="model_not_found")


def check_choice_count(state: "ServerState", count: int, param: str) -> None:
    """The limit on the engine requests one HTTP request may start (--max-choices-per-request), before any work."""
    if count > state.max_choices:
        raise RequestError(f"this request asks for {count} outputs; the server allows at most {state.max_choices} "
                           "per request (--max-choices-per-request)", param=param)


def engine_error(exc: Exception, names: RouteNames | None = None) -> RequestError:
    """The error to answer for an engine refusal (naming the route's field, by `names`), or 503 for an engine
    that is dead, does not answer in time, or is shutting down."""
    if isinstance(exc, RequestError):
        return names.engine_error(exc) if names is not None else exc
    if isinstance(exc, ServerDraining):
        return RequestError("the server is shutting down", status=503, code="shutting_down", headers=RETRY_AFTER)
    if isinstance(exc, EngineHung):
        return RequestError(str(exc), status=503, code="engine_unavailable", headers=RETRY_AFTER)
    if isinstance(exc, WeightsLost):  # (no Retry-After: it will not come back by itself)
        return RequestError(f"the engine is not serving: {exc}", status=503, code="weights_lost")
    return RequestError("the engine is not available", status=503, code="engine_unavailable", headers=RETRY_AFTER)


def sse_error(exc: Exception) -> str:
    """An error inside a stream whose HTTP status is already sent: one SSE event in the OpenAI error shape."""
    if isinstance(exc, (RequestError, EngineDead)):
        err = engine_error(exc)
    else:
        err = RequestError("internal error while streaming", status=500)
    return sse(err.body())


@dataclass(frozen=True)
class Update:
    """What one engine message changed in a choice, fixed when it was applied: the formatter reads this, never
    the live OutputStream (which a later message may already have finished), so a choice's deltas and its finish
    come from one snapshot and nothing follows the finish."""

    text: str  # the text this message made certain
    ids_end: int  # the choice's output ids (and logprobs) up to here
    finished: bool
    finish_reason: dict[str, Any] | None  # OutputStream.finish_reason at this point (set once finished)
    denoise: tuple[dict[str, Any], ...] = ()  # stream_denoise: this message's forward events (docs/denoise.md)

    @property
    def aborted(self) -> bool:
        """Ended by the server (an admin's /abort_request) or by a failure in the engine that ended this request
        alone (an error finish), not by the model or the length."""
        return self.finished and (self.finish_reason or {}).get("type") in ("abort", "error")


class ChoiceStream:
    """One engine request behind one output (an OpenAI choice, a /generate prompt): accepted first, then one
    update per committed block, assembled by an OutputStream, which owns the stop strings: when one appears
    the engine request is ended there at once. `rid` is the engine's id (scoped by the API key, see
    `engine_rid`); the OutputStream, and so every response, carries the client's own id."""

    def __init__(self, state: "ServerState", engine: EngineStream, params: SamplingParams, index: int):
        self.state, self.rid, self.index, self.params = state, engine.rid, index, params
        self._engine = engine
        rid = engine.rid
        shown = client_rid(rid) if state.api_keys else rid  # without keys no id is scoped
        self.out = OutputStream(shown, state.tokenizer, params.stop, params.no_stop_trim, params.skip_special_tokens)
        self.out.index, self.out.denoise = index, params.stream_denoise
        self.sent_tokens = 0  # output tokens whose logprobs a stream has sent
        self.sent_ids = 0  # output ids a stream has sent (return_token_ids)
        self.accepted: Accepted | None = None

    async def accept(self) -> None:
        first = await self._engine.__anext__()
        assert isinstance(first, Accepted)
        self.accepted = first

    async def updates(self) -> AsyncIterator[Update]:
        """One Update per engine message (its text "" when none), until the request finishes."""
        async for msg in self._engine:
            if not isinstance(msg, RequestOutput):
                continue
            delta = self.out.add(msg)
            stop = self.out.stop_abort()
            if stop is not None:
                await self.state.client.abort(self.rid, stop.finish, stop.keep_tokens)
            yield Update(delta, len(self.out.ids), self.out.finished,
                         self.out.finish_reason if self.out.finished else None, tuple(self.out.new_events))

    async def run(self) -> OutputStream:
        async for _ in self.updates():
            pass
        return self.out

    async def close(self) -> None:
        await self._engine.aclose()


async def start_streams(state: "ServerState", rids: list[str], prompts: list[list[int]],
                        params: list[SamplingParams], names: RouteNames, count_param: str = "n") -> list[ChoiceStream]:
    """Submit every output's engine request and wait until the engine accepted all of them; otherwise end them
    all and raise the RequestError naming the route's fields by `names` (so that no response status is sent
    before admission). `count_param`: the field that sets how many outputs there are."""
    check_choice_count(state, len(prompts), count_param)
    try:  # one message: the engine admits them together, in one iteration, or refuses them all
        engine_streams = await state.client.submit([GenerateReq(rid, list(ids), p)
                                                    for rid, ids, p in zip(rids, prompts, params)])
    except (EngineDead, RequestError) as exc:
        raise engine_error(_client_named(exc, rids, bool(state.api_keys)), names) from exc
    streams = [ChoiceStream(state, e, p, i) for i, (e, p) in enumerate(zip(engine_streams, params))]
    try:
        for s in streams:  # the answers to one message arrive together: no stream waits on another's forward
            await s.accept()
    except BaseException as exc:
        for s in streams:
            await s.close()
        if isinstance(exc, (EngineDead, RequestError)):
            raise engine_error(_client_named(exc, rids, bool(state.api_keys)), names) from exc
        raise
    return streams


def _client_named(exc: Exception, rids: list[str], scoped: bool) -> Exception:
    """A duplicate-id refusal names the engine's id, which is scoped by the API key: name the client's own."""
    if isinstance(exc, RequestError) and exc.code == "duplicate_request_id":
        rid = next((r for r in rids if repr(r) in exc.message), None)
        if rid is not None:
            return duplicate_request_id(client_rid(rid) if scoped else rid)
    return exc


async def run_all(streams: list[ChoiceStream]) -> list[OutputStream]:
    """Run accepted streams to the end (a dead engine becomes its RequestError)."""
    try:
        return list(await asyncio.gather(*[s.run() for s in streams]))
    except EngineDead as exc:
        raise engine_error(exc) from exc
    finally:
        for s in streams:
            await s.close()


async def merge_updates(streams: list[ChoiceStream]) -> AsyncIterator[tuple[ChoiceStream, Update | Exception]]:
    """Interleave the updates of several streams as they come (an engine failure arrives as an Exception)."""
    # bounded: a slow reader holds the pumps back, so its backlog stays in the engine client's queues, where
    # --max-stream-backlog bounds it
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))

    async def pump(s: ChoiceStream) -> None:
        try:
            async for delta in s.updates():
                await queue.put((s, delta))
        except Exception as exc:  # noqa: BLE001 - forwarded to the stream as an error event
            await queue.put((s, exc))
        await queue.put((s, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(streams)
        while remaining:
            s, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield s, item
    finally:
        for t in tasks:
            t.cancel()
        for s in streams:
            await s.close()


async def run_until_disconnect(request: Request, coro) -> Any:
    """Await `coro`, cancelling it (which aborts the engine request) if the client goes away."""
    task = asyncio.ensure_future(coro)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.1)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise RequestError("client closed the request", status=499, code="client_closed")
    finally:
        if not task.done():
            task.cancel()


def sse(payload: Any) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


# ---- request ids, scoped per API key ---------------------------------------------------------------------
# A client names its requests (X-Request-Id, /generate's rid); the engine needs ids unique across all clients.
# With API keys, the engine's id is `<scope>/<client id>`, the scope a short hash of the key: two keys never
# collide, and a duplicate_request_id refusal can only name one's own request. Responses, the X-Request-Id
# echo and meta_info carry the client's id; the admin's /abort_request takes the client's id (every key's
# request of that id is ended) or the scoped one. Without API keys every client is one principal: no scope.
_SCOPE_SEP = "/"


MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(rf"[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")  # X-Request-Id, /generate's rid
_SCOPED_ID = re.compile(rf"(?:[0-9a-f]{{16}}/)?[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}")


def check_request_id(rid: str | None, param: str, scoped: bool = False) -> str | None:
    """A client's request id is 1-128 characters of A-Z a-z 0-9 . _ : - (it reaches logs and other ids);
    `scoped`: the engine's `<scope>/<id>` too. A ValueError naming `param` otherwise."""
    if rid is None or (_SCOPED_ID if scoped else REQUEST_ID).fullmatch(rid):
        return rid
    raise UnsupportedValue(param, f"{param} must be 1-{MAX_REQUEST_ID_CHARS} characters of A-Z a-z 0-9 . _ : - "
                                  "(as X-Request-Id)")


def key_scope(api_key: str) -> str:
    """The scope of one API key: 16 hex digits of its SHA-256 (never the key itself: ids reach the logs)."""
    return hashlib.sha256(api_key.encode()).hexdigest()[:16]


def engine_rid(request: Request, rid: str) -> str:
    """The engine's id of the client's `rid` sent with this request (scoped by its API key, if any)."""
    scope = request.scope.get("state", {}).get("rid_scope")
    return f"{scope}{_SCOPE_SEP}{rid}" if scope else rid


def client_rid(rid: str) -> str:
    """The client's id of an engine id (`engine_rid` undone)."""
    head, sep, tail = rid.partition(_SCOPE_SEP)
    return tail if sep and re.fullmatch("[0-9a-f]{16}", head) else rid


# ---- small checks shared by the routes ---------------------------------------------------------------------
_TOKEN_ID = re.compile("[0-9]{1,10}")


def check_token_ids(state: "ServerState", prompts: list[list[int]], param: str) -> None:
    """Prompts given as token ids: every id inside the vocabulary, checked once before any path reads them (the
    echo and prompt-logprob paths decode them before the engine's own check would refuse them)."""
    vocab = state.vocab_size
    for ids in prompts:
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            shown = bad if abs(bad) < 10**12 else f"{str(bad)[:12]}..."
            raise RequestError(f"token id {shown} is outside the vocabulary [0, {vocab})", param=param)


def check_logit_bias_keys(bias: Any, param: str) -> None:
    """OpenAI's logit_bias keys are token ids written in ASCII digits ("7"), nothing else: int() would also read
    " 7" or Arabic-Indic digits, so a typo could bias a token nobody named."""
    if not isinstance(bias, dict):
        return  # the shape is sampling_params' to refuse
    for key in bias:
        if not isinstance(key, str) or not _TOKEN_ID.fullmatch(key):
            raise RequestError(f"logit_bias key {str(key)[:32]!r} is not a token id (ASCII digits only)", param=param)
