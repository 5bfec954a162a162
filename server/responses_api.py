"""`POST /v1/responses`: OpenAI's Responses API, the stateless subset vLLM and SGLang serve.

A Responses request is read as the chat request it amounts to (`to_chat`: instructions as a system message,
input items as messages, function tools, `text.format` as `response_format`, max_output_tokens as max_tokens,
redraft's dials as on chat), run through the chat path (template, structured output, engine), and written back
in the Responses shapes: one `message` output item with an `output_text` part, and one `function_call` item per
tool call. Streaming sends the Responses event sequence (response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta ..., *.done,
response.completed with usage; with the `stream_denoise` dial, a `response.diffusion.event` per forward and
commit). Nothing is stored: `store: true`, `previous_response_id` and `background` are
400s that say so.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any, AsyncIterator, Literal

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from pydantic import Field, create_model, model_validator

from redraft.engine.text.output_stream import OutputStream
from redraft.protocol.errors import RequestError
from redraft.protocol.fields import OPENAI, RESPONSES, RESPONSES_BODY
from redraft.server.common import ChoiceStream, ServerState, merge_updates, run_all, run_until_disconnect
from redraft.server.openai_api import (ChatStart, aborted, aborted_error, chat_logprobs, diffusion_stats,
                                       forced_tool_call, split_tool_output, start_chat)
from redraft.server.openai_protocol import (ChatCompletionRequest, Strict, UnsupportedValue,
                                            drop_ignored_fields, merge_extra_body, reject_lone_surrogates,
                                            reject_loose_booleans)
from redraft.server.request_fields import carried, pydantic_fields, shaped_fields
from redraft.server.routing import DepthCheckedRoute, State

# Responses fields that change nothing here (besides the chat ones in openai_protocol.IGNORED_FIELDS)
IGNORED = ("user", "metadata", "reasoning", "truncation", "prompt_cache_key", "max_tool_calls")
OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for the answer's logprobs
# chat fields a Responses request may carry through extra_body, as vLLM allows
# (the request fields declared with the `responses` route: protocol/sampling_params.py SamplingParams)
CHAT_EXTRAS = (*carried(RESPONSES), "chat_template_kwargs")
TEXT_TYPES = ("input_text", "output_text", "text")
# the stream event of one forward (or commit) under the `stream_denoise` dial (docs/denoise.md): a type of its
# own, which SDKs pass through as an untyped event, so text deltas are unchanged for a client that ignores it
DENOISE_EVENT = "response.diffusion.event"


class _ResponsesShaped(Strict):
    """A Responses body less the request fields it carries as declared (`ResponsesRequest` adds them)."""

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    tools: list[dict[str, Any]] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    include: list[str] | None = Field(default=None, max_length=16)  # OUTPUT_LOGPROBS; others name nothing here
    extras: dict[str, Any] = Field(default_factory=dict)  # CHAT_EXTRAS and IGNORED, gathered by the validator

    @model_validator(mode="before")
    @classmethod
    def _gather(cls, data: Any) -> Any:
        data = merge_extra_body(reject_lone_surrogates(data))
        if not isinstance(data, dict):
            return data
        reject_loose_booleans(cls, data)  # before `store` is read (and dropped): "true" or 1 is no boolean
        if data.get("store") is True:
            raise UnsupportedValue("store", "store=true is not supported: this server keeps no responses "
                                            "(send store=false, or leave it out)")
        if data.get("previous_response_id") is not None:
            raise UnsupportedValue("previous_response_id", "previous_response_id is not supported: nothing is "
                                                           "stored here; send the whole conversation as input")
        if data.get("background"):
            raise UnsupportedValue("background", "background responses are not supported")
        data = drop_ignored_fields({k: v for k, v in data.items() if v is not None and k != "store"})
        extras = {k: data.pop(k) for k in list(data) if k in CHAT_EXTRAS}
        for k in IGNORED:
            data.pop(k, None)
        return {**data, "extras": extras}



# temperature and top_p at the top level, as OpenAI's Responses has them (with the OpenAI routes' bounds), and
# top_logprobs (alternatives per token)
ResponsesRequest = create_model("ResponsesRequest", __base__=_ResponsesShaped, __module__=__name__,
                                **pydantic_fields(OPENAI, only=("temperature", "top_p")),
                                **shaped_fields(RESPONSES_BODY))

# ---- the request as a chat request -----------------------------------------------------------------------------
def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where} must be a string or a list of content parts", param=where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_TYPES:
            raise RequestError(f"content parts of type {kind!r} are not supported: this model reads text only",
                               param=f"{where}.{j}")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        return messages + [{"role": "user", "content": body.input}]
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            role = item.get("role")
            if role not in ("system", "developer", "user", "assistant"):
                raise RequestError(f"{where}.role must be system, developer, user or assistant", param=f"{where}.role")
            messages.append({"role": role, "content": _text_of(item.get("content", ""), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")}}
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") and not last.get("content"):
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output", "")
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"),
                             "content": output if isinstance(output, str) else json.dumps(output)})
        elif kind == "reasoning":
            continue  # a reasoning item from another model's answer: nothing here reads it
        else:
            raise RequestError(f"input items of type {kind!r} are not supported (message, function_call, "
                               "function_call_output)", param=f"{where}.type")
    return messages


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if body.tools is None:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise RequestError(f"tools of type {tool.get('type')!r} are not supported: only function tools",
                               param=f"tools.{i}.type")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not choice.get("name"):
            raise RequestError("tool_choice must be none, auto, required or {'type': 'function', 'name': ...}",
                               param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def _response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise RequestError("text.format must be an object such as {\"type\": \"json_object\"}", param="text.format")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict", "description")
                                                       if fmt.get(k) is not None}}
    raise RequestError(f"text.format type {fmt.get('type')!r} is not supported (text, json_object, json_schema)",
                       param="text.format")


def to_chat(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request this Responses request amounts to; RequestError naming the Responses field otherwise."""
    chat = {"model": body.model, "messages": _messages(body), "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": _tools(body),
            "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text), "stream": body.stream, **body.extras}
    if OUTPUT_LOGPROBS in (body.include or ()):  # the answer's logprobs, with top_logprobs alternatives each
        chat.update(logprobs=True, top_logprobs=body.top_logprobs or 0)
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in chat.items() if v is not None})
    except ValueError as exc:  # pydantic's ValidationError: name the first field it names
        errors = getattr(exc, "errors", lambda: [])()
        first = errors[0] if errors else {}
        loc = ".".join(str(x) for x in first.get("loc", ()))
        message = first.get("msg", str(exc)).removeprefix("Value error, ") + (f" ({loc})" if loc else "")
        raise RequestError(message, param=loc or None) from exc


# ---- the answer ------------------------------------------------------------------------------------------------
class ResponsesFormatter:
    def __init__(self, state: ServerState, rid: str, body: ResponsesRequest, chat: ChatCompletionRequest,
                 start: ChatStart):
        self.state, self.body, self.chat = state, body, chat
        self.prompt_tokens, self.tools = len(start.prompt_ids), start.tools
        self.id, self.msg_id = f"resp_{rid}", f"msg_{rid}"
        self.created = int(time.time())
        self.seq = 0

    def _shell(self, status: str, output: list[dict], out: OutputStream | None = None) -> dict:
        """The response object (what response.created carries with status in_progress, and the final one)."""
        incomplete = out is not None and (out.finish_reason or {}).get("type") == "length"
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete else status,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "error": None, "model": self.chat.model or self.state.model_names[0], "output": output,
            "instructions": self.body.instructions, "max_output_tokens": self.body.max_output_tokens,
            "temperature": self.body.temperature, "top_p": self.body.top_p,
            "tools": self.body.tools or [], "tool_choice": self.body.tool_choice or "auto",
            "parallel_tool_calls": self.body.parallel_tool_calls is not False,
            "text": self.body.text or {"format": {"type": "text"}}, "store": False, "previous_response_id": None,
            "metadata": {}, "usage": self._usage(out) if out is not None else None,
            **({"diffusion": diffusion_stats([out])} if out is not None else {}),
        }

    def _usage(self, out: OutputStream) -> dict:
        return {"input_tokens": self.prompt_tokens, "output_tokens": len(out.ids),
                "total_tokens": self.prompt_tokens + len(out.ids),
                "input_tokens_details": {"cached_tokens": out.meta.get("cached_tokens", 0)},
                "output_tokens_details": {"reasoning_tokens": 0}}

    def _items(self, out: OutputStream) -> list[dict]:
        content, calls = split_tool_output(self.state, out, forced_tool_call(self.chat)) if self.tools \
            else (out.text, None)
        items = []
        if content or not calls:
            items.append(self._message(content or "", logprobs=self._logprobs(out, 0, len(out.ids))))
        for call in calls or ():
            items.append({"type": "function_call", "id": f"fc_{call['id']}", "call_id": call["id"],
                          "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                          "status": "completed"})
        return items

    def _message(self, text: str, status: str = "completed", logprobs: list | None = None) -> dict:
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant",
                "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}

    def _logprobs(self, out: OutputStream, start: int, end: int) -> list:
        """The output_text logprobs of output tokens [start, end) (include message.output_text.logprobs), in
        the chat shape: token, logprob, bytes, top_logprobs; [] when not asked."""
        if not self.chat.logprobs:
            return []
        return (chat_logprobs(self.state, out, start, end) or {"content": []})["content"]

    def response(self, out: OutputStream) -> dict:
        if aborted(out):
            raise aborted_error(out)
        return self._shell("completed", self._items(out), out)

    # ---- streaming ----
    def _event(self, kind: str, **fields: Any) -> str:
        self.seq += 1
        data = {"type": kind, "sequence_number": self.seq - 1, **fields}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    def _item_events(self, index: int, item: dict, text_deltas: bool) -> list[str]:
        """The events of one whole output item (added, its content or arguments, done)."""
        if item["type"] == "function_call":
            args = item["arguments"]
            return [self._event("response.output_item.added", output_index=index,
                                item={**item, "arguments": "", "status": "in_progress"}),
                    self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                delta=args),
                    self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=args),
                    self._event("response.output_item.done", output_index=index, item=item)]
        text, logprobs = item["content"][0]["text"], item["content"][0]["logprobs"]
        events = self._open_message(index)
        if text_deltas and text:
            events.append(self._delta(index, text, logprobs))
        return events + self._close_message(index, text, logprobs)

    def _open_message(self, index: int) -> list[str]:
        return [self._event("response.output_item.added", output_index=index, item=self._message("", "in_progress")
                            | {"content": []}),
                self._event("response.content_part.added", item_id=self.msg_id, output_index=index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]

    def _delta(self, index: int, text: str, logprobs: list | None = None) -> str:
        return self._event("response.output_text.delta", item_id=self.msg_id, output_index=index, content_index=0,
                           delta=text, logprobs=logprobs or [])

    def _close_message(self, index: int, text: str, logprobs: list | None = None) -> list[str]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}
        return [self._event("response.output_text.done", item_id=self.msg_id, output_index=index, content_index=0,
                            text=text, logprobs=logprobs or []),
                self._event("response.content_part.done", item_id=self.msg_id, output_index=index, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=index,
                            item=self._message(text, logprobs=logprobs))]

    async def stream(self, stream: ChoiceStream) -> AsyncIterator[str]:
        yield self._event("response.created", response=self._shell("in_progress", []))
        yield self._event("response.in_progress", response=self._shell("in_progress", []))
        opened, text, sent = False, "", 0  # sent: output tokens whose logprobs a delta carried
        try:
            async for _, up in merge_updates([stream]):
                if isinstance(up, Exception):
                    raise up
                for event in up.denoise:  # stream_denoise: the forwards first, then what they committed
                    yield self._event(DENOISE_EVENT, output_index=0, diffusion=event)
                if up.aborted:
                    raise aborted_error(up.finish_reason)
                if self.tools:  # tool calls are read from the whole output: sent once it is finished
                    continue
                if up.text:
                    if not opened:
                        for ev in self._open_message(0):
                            yield ev
                        opened = True
                    text += up.text
                    yield self._delta(0, up.text, self._logprobs(stream.out, sent, up.ids_end))
                    sent = up.ids_end
            out = stream.out
            if self.tools:
                items = self._items(out)
                for i, item in enumerate(items):
                    for ev in self._item_events(i, item, text_deltas=True):
                        yield ev
            else:
                if not opened:
                    for ev in self._open_message(0):
                        yield ev
                logprobs = self._logprobs(out, 0, len(out.ids))
                for ev in self._close_message(0, text, logprobs):
                    yield ev
                items = [self._message(text, logprobs=logprobs)]
            final = self._shell("completed", items, out)
            yield self._event(f"response.{'incomplete' if final['status'] == 'incomplete' else 'completed'}",
                              response=final)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is gone: a failed response, then the error event
            err = exc if isinstance(exc, RequestError) else RequestError(f"{type(exc).__name__}: {exc}", status=500)
            failed = self._shell("failed", [])
            failed["error"] = {"code": err.code or "server_error", "message": err.message}
            yield self._event("response.failed", response=failed)
            yield self._event("error", code=err.code, message=err.message, param=err.param)


router = APIRouter(route_class=DepthCheckedRoute)


@router.post("/v1/responses")
async def responses(body: ResponsesRequest, request: Request, state: State):
    chat = to_chat(body)
    start = await start_chat(state, chat, request)
    fmt = ResponsesFormatter(state, request.state.request_id, body, chat, start)
    if body.stream:
        return StreamingResponse(fmt.stream(start.streams[0]), media_type="text/event-stream")
    return fmt.response((await run_until_disconnect(request, run_all(start.streams)))[0])
