"""Structured output on the OpenAI routes: `response_format`, the `regex` / `ebnf` / `lark` extras and a forced
`tool_choice` become one constraint field of SamplingParams (the engine decodes it: engine/decoding/constrained.py).
A constraint that does not compile is a 400 naming the request field that holds it, before any work. Every
constraint, on every route, is checked by the grammar sandbox (engine/text/grammar_sandbox.py: worker processes, as
native code may crash on a hostile grammar), never compiled in this process."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from redraft.engine.text.grammar import GrammarError, parse_schema, tool_call_lark
from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import SamplingParams
from redraft.server.common import ServerState
from redraft.server.param_names import RouteNames

log = logging.getLogger("redraft.http")

JSON_OBJECT_SCHEMA = {"type": "object"}


async def constraint_of(state: ServerState, body: Any, rid: str = "-") -> dict[str, str]:
    """{SamplingParams field: source} for the body's constraint (empty when it has none); RequestError when the
    body asks for two, or for one that does not compile (logged with the request id `rid`). Off the event loop:
    building it on a thread, the check in the sandbox."""
    found = await asyncio.to_thread(_constraint_source, state, body, rid)
    if not found:
        return {}
    request_field, field, source = found
    try:
        await state.grammar_sandbox.acheck(field, source)
    except GrammarError as exc:
        raise _refused(exc, field, request_field, rid) from exc
    return {field: source}


def _constraint_source(state: ServerState, body: Any, rid: str) -> tuple[str, str, str] | None:
    """(request field, SamplingParams field, source) of the body's constraint, not yet checked."""
    found: list[tuple[str, str, Any]] = []  # (request field, SamplingParams field, source)
    fmt = getattr(body, "response_format", None)
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", "json_schema", JSON_OBJECT_SCHEMA))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise RequestError("response_format json_schema needs json_schema.schema", param="response_format")
        found.append(("response_format", "json_schema", fmt.json_schema.schema_))
    for name in ("regex", "ebnf", "lark"):
        if getattr(body, name, None) is not None:
            found.append((name, name, getattr(body, name)))
    found += vllm_constraints(body)
    tools = getattr(body, "tools", None)
    choice = getattr(body, "tool_choice", None)
    if tools and (choice == "required" or (choice is not None and not isinstance(choice, str))):
        found.append(("tool_choice", "lark", _tool_grammar(state, body, rid)))
    if not found:
        return None
    if len(found) > 1:
        names = ", ".join(f[0] for f in found)
        raise RequestError(f"a request may carry one output constraint; this one has {names}", param=found[1][0])
    request_field, field, source = found[0]
    if field == "json_schema":
        try:
            source = json.dumps(parse_schema(source, request_field))
        except GrammarError as exc:
            raise _refused(exc, field, request_field, rid) from exc
    return request_field, field, source


def vllm_constraints(body: Any) -> list[tuple[str, str, Any]]:
    """vLLM's spellings as (request field, SamplingParams field, source): `structured_outputs` (json, regex,
    choice, grammar, json_object) and the older `guided_json` / `guided_regex` / `guided_choice` /
    `guided_grammar`. A grammar is read as `ebnf` (GBNF, or Lark); a choice list becomes a regex."""
    found: list[tuple[str, str, Any]] = []
    so = getattr(body, "structured_outputs", None)
    spelled = [("guided_json", getattr(body, "guided_json", None), "json_schema"),
               ("guided_regex", getattr(body, "guided_regex", None), "regex"),
               ("guided_choice", getattr(body, "guided_choice", None), "choice"),
               ("guided_grammar", getattr(body, "guided_grammar", None), "ebnf")]
    if so is not None:
        spelled += [("structured_outputs.json", so.json_, "json_schema"),
                    ("structured_outputs.regex", so.regex, "regex"),
                    ("structured_outputs.choice", so.choice, "choice"),
                    ("structured_outputs.grammar", so.grammar, "ebnf"),
                    ("structured_outputs.json_object", JSON_OBJECT_SCHEMA if so.json_object else None, "json_schema")]
        if not any(value is not None for _, value, _ in spelled[-5:]):
            raise RequestError("structured_outputs needs one of json, regex, choice, grammar, json_object",
                               param="structured_outputs")
    for request_field, value, kind in spelled:
        if value is None:
            continue
        if kind == "choice":
            found.append((request_field, "regex", choice_regex(value)))
        else:
            found.append((request_field, kind, value))
    return found


def choice_regex(choices: list[str]) -> str:
    """A regex matching exactly one of `choices`: an alternation of the strings, every character that means
    something in a regex escaped."""
    return "(" + "|".join(_escape(c) for c in choices) + ")"


_REGEX_META = frozenset("\\.+*?()|[]{}^$#&-~")


def _escape(text: str) -> str:
    return "".join(f"\\{c}" if c in _REGEX_META else (c if c.isprintable() else f"\\x{{{ord(c):x}}}")
                   for c in text)


async def check_native_constraint(state: ServerState, params: SamplingParams, names: RouteNames, rid: str) -> None:
    """/generate: the sampling params' constraint through the sandbox, off the event loop; RequestError naming
    the route's field of it (`names`) when it does not pass."""
    if params.grammar is None:
        return
    field, source = params.grammar
    try:
        await state.grammar_sandbox.acheck(field, source)
    except GrammarError as exc:
        raise _refused(exc, field, names.param(field), rid) from exc


def _refused(exc: GrammarError, field: str, request_field: str, rid: str) -> RequestError:
    """The 400 for a constraint that did not pass, logged with the request id and the reason."""
    message = str(exc).replace(f"invalid {field}", f"invalid {request_field}", 1)
    log.warning("request %s: %s refused: %s", rid, request_field, message)
    return RequestError(message, param=request_field)


def _tool_grammar(state: ServerState, body: Any, rid: str) -> str:
    tok = state.tokenizer
    start, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    if start is None or end is None:
        raise RequestError("this model's tokenizer has no <tool_call> tokens: tool_choice 'required' or a named "
                           "function cannot be enforced", param="tool_choice")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    name = None if isinstance(body.tool_choice, str) else body.tool_choice.function.name
    try:
        return tool_call_lark(tools, start, end, name=name, parallel=body.parallel_tool_calls is not False)
    except GrammarError as exc:
        param = exc.param if exc.param.startswith("tools[") else "tool_choice"
        log.warning("request %s: %s refused: %s", rid, param, exc)
        raise RequestError(str(exc), param=param) from exc
