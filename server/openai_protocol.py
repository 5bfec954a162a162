"""OpenAI request bodies (pydantic). Unknown fields are rejected by name; fields we accept only at their
no-op value (echo, suffix, best_of, ...) are rejected by name when set to anything else."""

from __future__ import annotations

import logging
import re
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from redraft.protocol.fields import CHAT, COMPLETIONS, OPENAI
from redraft.protocol.sampling_params import MAX_STOP_LEN, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS
from redraft.server.dials import lift_dials, without_dials
from redraft.server.request_fields import pydantic_fields, shaped_fields

MAX_N = 16

log = logging.getLogger("redraft.http")

# OpenAI fields that mean nothing for this server: accepted and ignored (docs/openai.md), each said once in the log
IGNORED_FIELDS = {
    "service_tier": "one tier here",
    "reasoning_effort": "LLaDA2 does not reason in a separate channel",
    "prompt_cache_key": "the radix cache matches prompts by their tokens",
    "safety_identifier": "nothing is sent on to a moderation service",
    "verbosity": "no model here reads it",
}
_warned: set[str] = set()


def drop_ignored_fields(data: dict[str, Any]) -> dict[str, Any]:
    """`data` without the fields of IGNORED_FIELDS; `store` must be false (nothing is kept here)."""
    if data.get("store") is True:
        raise UnsupportedValue("store", "store=true is not supported: this server keeps no responses")
    out = {k: v for k, v in data.items() if k not in IGNORED_FIELDS and k != "store"}
    for name in IGNORED_FIELDS.keys() & data.keys():
        if name not in _warned:
            _warned.add(name)
            log.warning("the request field %r is accepted and ignored: %s (said once)", name, IGNORED_FIELDS[name])
    return out


def legacy_functions(data: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's deprecated `functions` / `function_call` as `tools` / `tool_choice`."""
    if "functions" not in data and "function_call" not in data:
        return data
    if "tools" in data or "tool_choice" in data:
        raise UnsupportedValue("functions", "send either functions/function_call or tools/tool_choice, not both")
    out = {k: v for k, v in data.items() if k not in ("functions", "function_call")}
    if isinstance(data.get("functions"), list):
        out["tools"] = [{"type": "function", "function": f} for f in data["functions"]]
    call = data.get("function_call")
    if isinstance(call, dict):
        out["tool_choice"] = {"type": "function", "function": call}
    elif call is not None:
        out["tool_choice"] = call
    return out


class UnsupportedValue(ValueError):
    """A field we know but cannot honour at the value given (reported with its name as the param)."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


_SURROGATE = re.compile("[\ud800-\udfff]")


def has_lone_surrogate(value: Any) -> bool:
    """True if any string in a parsed JSON value holds a UTF-16 surrogate. JSON's `\\ud800` escapes decode to
    such code points when unpaired (a valid pair becomes one character); they cannot be encoded as UTF-8, so
    the tokenizer and the response encoder would fail on them (a 500) rather than reject them."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return True
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return False


MAX_TOOL_CALLS_PER_MESSAGE = 128  # as many as `tools` may name (a request's whole body is capped too: routing.py)
MAX_PARTS_PER_MESSAGE = 1024  # content parts of one message
MAX_JSON_DEPTH = 64  # nesting levels of a request body (objects and arrays); real schemas and messages use < 20


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> list[str] | None:
    """The path to the first object or array nested more than `limit` levels deep in a parsed JSON value (the
    body itself is level 1), or None. Iterative, and it stops at the limit, so its cost is bounded by the body."""
    if not isinstance(value, (dict, list)):
        return None
    stack: list[tuple[Any, int, tuple[str, ...]]] = [(value, 1, ())]
    while stack:
        v, depth, path = stack.pop()
        if depth > limit:
            return list(path)
        items = v.items() if isinstance(v, dict) else enumerate(v)
        for k, child in items:
            if isinstance(child, (dict, list)):
                stack.append((child, depth + 1, (*path, str(k))))
    return None


def text_chars(value: Any) -> int:
    """Characters of every string in a JSON-like value, object keys included (iterative: any depth)."""
    total = 0
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def reject_lone_surrogates(data: Any) -> Any:
    if has_lone_surrogate(data):
        raise ValueError("a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not valid Unicode")
    return data


def _is_bool_field(annotation: Any) -> bool:
    """bool, or bool | None."""
    return annotation is bool or (get_origin(annotation) in (Union, UnionType)
                                  and set(get_args(annotation)) == {bool, type(None)})


def reject_loose_booleans(model: type[BaseModel], data: Any) -> Any:
    """A flag is a JSON boolean: pydantic would read 1, "true", "yes" or "on" as true (and so slip past a check
    of `is True`); every bool field of `model` refuses anything but true, false (or null where allowed)."""
    if not isinstance(data, dict):
        return data
    for name, info in model.model_fields.items():
        key = info.alias or name
        value = data.get(key)
        if value is not None and not isinstance(value, bool) and _is_bool_field(info.annotation):
            raise UnsupportedValue(key, f"{key} must be true or false (a JSON boolean), got {str(value)[:32]!r}")
    return data


def merge_extra_body(data: Any) -> Any:
    """`extra_body` sent literally in the JSON (as curl users copy it from SDK examples, where the SDK would have
    merged it) is merged into the request; a field given both ways is an error."""
    if not isinstance(data, dict) or "extra_body" not in data:
        return data
    extra = data["extra_body"]
    if extra is None:
        return {k: v for k, v in data.items() if k != "extra_body"}
    if not isinstance(extra, dict):
        raise ValueError("extra_body must be an object (its fields are merged into the request)")
    clash = sorted(k for k in extra if k in data and k != "extra_body")
    if clash:
        raise ValueError(f"{clash[0]} is given both at the top level and in extra_body")
    return {**{k: v for k, v in data.items() if k != "extra_body"}, **extra}


class Strict(BaseModel):
    """Unknown fields are a 400 naming them; an explicit null means the field is absent (as the spec allows)."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return reject_loose_booleans(cls, {k: v for k, v in data.items() if v is not None})
        return data


class TextPart(Strict):
    type: Literal["text"]
    text: str


class FunctionCall(Strict):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(Strict):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]  # function: the legacy result
    content: str | Annotated[list[TextPart], Field(max_length=MAX_PARTS_PER_MESSAGE)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(default=None, max_length=MAX_TOOL_CALLS_PER_MESSAGE)
    function_call: FunctionCall | None = None  # the legacy call of an assistant turn, as clients replay it
    tool_call_id: str | None = None
    # response-side keys a client appends back with the assistant's message: accepted, not rendered
    refusal: str | None = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, v: Any) -> Any:
        for part in v if isinstance(v, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this model reads text only "
                                 "(send {'type': 'text', 'text': ...} parts or a string)")
        return v

    @model_validator(mode="after")
    def _content_needed(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError(f"the {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Strict):
    type: Literal["function"]
    function: FunctionDef


class ToolChoiceFunction(Strict):
    name: str


class ToolChoiceNamed(Strict):
    type: Literal["function"]
    function: ToolChoiceFunction


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Strict):
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the output always follows the schema, strict or not (docs/structured-output.md)

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs`: exactly one constraint (server/structured.py maps it onto redraft's)."""

    json_: dict[str, Any] | str | bool | None = Field(default=None, alias="json")
    regex: str | None = Field(default=None, min_length=1)
    choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    grammar: str | None = Field(default=None, min_length=1)
    json_object: bool | None = None

    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class _CommonShaped(Strict):
    """Fields shared by chat and completions that are the route's own (structured output's many spellings);
    `_Common` adds the request fields it carries as declared (protocol/sampling_params.py `SamplingParams`,
    server/request_fields.py), `stop` as a string or a list and `logit_bias` as an object among them."""

    model: str | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None
    # structured output beyond response_format (SGLang's extras regex / ebnf / lark are request fields): see
    # docs/structured-output.md; vLLM's spellings are mapped onto the same constraints (server/structured.py)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(default=None, min_length=1)
    guided_choice: list[str] | None = Field(default=None, min_length=1, max_length=1024)
    guided_grammar: str | None = Field(default=None, min_length=1)
    # vLLM's token-level extras (docs/openai.md): ids in the answer, the prompt cut from the left, prompt logprobs
    return_token_ids: bool = False
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # SGLang's fields (its clients and sglang-router send them, mostly at their defaults): docs/scaling.md
    return_hidden_states: bool = False  # only false: hidden states are not returned
    separate_reasoning: bool = True  # no-ops: redraft has no reasoning parser, so there is nothing to separate
    stream_reasoning: bool = True
    include_reasoning: bool = True  # vLLM's spelling of the same no-op

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        data = merge_extra_body(reject_lone_surrogates(data))
        if not isinstance(data, dict):
            return data
        data = drop_ignored_fields({k: v for k, v in data.items() if v is not None})
        if "tools" in cls.model_fields:
            data = legacy_functions(data)
        # dials spelt inside the maps a router keeps (server/dials.py); the template never sees them
        carriers = {k: data.get(k) for k in ("chat_template_kwargs", "metadata") if k in cls.model_fields}
        data = lift_dials(data, carriers)
        if isinstance(data.get("chat_template_kwargs"), dict):
            data["chat_template_kwargs"] = without_dials(data["chat_template_kwargs"])
        return data

    @field_validator("stop", check_fields=False)  # (declared in `_Common`)
    @classmethod
    def _stop_bounds(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings")
        if any(not s or len(s) > MAX_STOP_LEN for s in stops):
            raise ValueError(f"stop strings must have 1 to {MAX_STOP_LEN} characters")
        return stops

    def check_noop_fields(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise UnsupportedValue("stream_options", "stream_options is only allowed with stream=true")
        if self.return_hidden_states:
            raise UnsupportedValue("return_hidden_states", "return_hidden_states is not supported (only false)")

    @property
    def request_domain(self) -> str | None:
        return self.domain or (self.metadata or {}).get("domain")  # type: ignore[attr-defined]


# ... and the request fields the OpenAI routes carry (sampling, logit controls, the diffusion dials, SGLang's
# output-text flags), made from their declarations (server/request_fields.py)
_Common = create_model("_Common", __base__=_CommonShaped, __module__=__name__,
                       __doc__="Fields shared by chat and completions, including the diffusion ones sent through "
                               "`extra_body`.", **pydantic_fields(OPENAI, skip=_CommonShaped.model_fields),
                       **shaped_fields(OPENAI))


class _ChatShaped(_Common):
    """A chat body less what `ChatCompletionRequest` adds from the declarations (logprobs, top_logprobs)."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=1024)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceNamed | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # assistant prefill (SGLang's / vLLM's): the last assistant turn rendered open, continued by the answer
    continue_final_message: bool = False
    add_generation_prompt: bool | None = None  # default true; false renders no opening assistant turn

    def check_noop_fields(self) -> None:
        super().check_noop_fields()
        check_prefill(self.messages, self.continue_final_message, self.add_generation_prompt)
        if self.top_logprobs and not self.logprobs:
            raise UnsupportedValue("top_logprobs", "top_logprobs needs logprobs=true")
        if self.tool_choice is not None and self.tool_choice != "none" and not self.tools:
            raise UnsupportedValue("tool_choice", "tool_choice needs tools")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


ChatCompletionRequest = create_model("ChatCompletionRequest", __base__=_ChatShaped, __module__=__name__,
                                     __doc__=None, **shaped_fields(CHAT))


def check_prefill(messages: list[Any], continue_final: bool, add_generation_prompt: bool | None) -> None:
    """continue_final_message continues the last message, which must be an assistant's text (not calls), and
    excludes add_generation_prompt (as vLLM: both true is a contradiction)."""
    if not continue_final:
        return
    if add_generation_prompt:
        raise UnsupportedValue("continue_final_message", "continue_final_message and add_generation_prompt cannot "
                                                         "both be true")
    last = messages[-1] if messages else None
    role = getattr(last, "role", None) if not isinstance(last, dict) else last.get("role")
    calls = getattr(last, "tool_calls", None) if not isinstance(last, dict) else last.get("tool_calls")
    content = getattr(last, "content", None) if not isinstance(last, dict) else last.get("content")
    if role != "assistant" or calls or content is None:
        raise UnsupportedValue("continue_final_message", "continue_final_message needs the last message to be an "
                                                         "assistant message with text content (no tool calls)")


class _CompletionShaped(_Common):
    """A completions body less what `CompletionRequest` adds from the declarations (logprobs, as a count)."""

    prompt: str | list[str] | list[int] | list[list[int]] = Field(...)
    max_tokens: int | None = Field(default=16, ge=0)  # 0: with echo, score the prompt only
    echo: bool = False
    logprob_start_len: int | None = Field(default=None, ge=0)  # echo: prompt positions before it get no logprob
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_bounds(cls, v: Any) -> Any:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
        return v

    def check_noop_fields(self) -> None:
        super().check_noop_fields()
        if self.max_tokens == 0 and not self.echo:
            raise UnsupportedValue("max_tokens", "max_tokens 0 needs echo=true (scoring the prompt)")
        if self.suffix:
            raise UnsupportedValue("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise UnsupportedValue("best_of", "best_of is not supported (only 1)")


    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


CompletionRequest = create_model("CompletionRequest", __base__=_CompletionShaped, __module__=__name__,
                                 __doc__=None, **shaped_fields(COMPLETIONS))
