"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models.

A request with n choices becomes n engine requests (rids `<id>-<i>`). Streams send one chunk per committed
block per choice. The diffusion figures of a request (forwards, tokens per forward, edits, mode) travel in an
extra top-level `diffusion` object (and in the usage chunk of a stream), which OpenAI clients ignore.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from redraft.engine.text.output_stream import OutputStream
from redraft.engine.text.tokenizer import ChatTemplateError
from redraft.protocol.errors import RequestError
from redraft.protocol.fields import OPENAI
from redraft.protocol.sampling_params import FIELDS, GRAMMAR_FIELDS, SamplingParams, SamplingParamsError
from redraft.server.denoise import chat_event_chunk, completion_event_chunk, step_maps
from redraft.server.likelihood_api import all_prompt_logprobs
from redraft.server.common import (ChoiceStream, ServerState, check_choice_count, check_logit_bias_keys,
                                   check_model, check_token_ids, engine_rid, merge_updates, run_all,
                                   run_until_disconnect, sse, sse_error, start_streams)
from redraft.server.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue, text_chars
from redraft.server.param_names import CHAT, COMPLETIONS, RouteNames
from redraft.server.request_fields import carried
from redraft.server.routing import DepthCheckedRoute, State
from redraft.server.structured import constraint_of
from redraft.server.token_extras import prompt_logprobs_entries, stop_fields, truncate_prompt

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FINISH = {"stop": "stop", "length": "length"}  # OpenAI's values; an aborted request ends with an error instead


def aborted(out: OutputStream) -> bool:
    """Ended by the server (an admin's /abort_request, or a failure inside the engine that ended this request
    alone: an error finish), not by the model or the length."""
    return (out.finish_reason or {}).get("type") in ("abort", "error")


def aborted_error(finish: OutputStream | dict | None = None) -> RequestError:
    """The error of an aborted request; of an error finish (an output or its finish reason), a 500 naming the
    engine's reason."""
    reason = (finish.finish_reason if isinstance(finish, OutputStream) else finish) or {}
    if reason.get("type") == "error":
        return RequestError(f"the request failed in the engine: {reason.get('message') or 'unknown error'}",
                            status=500, code="internal_error")
    return RequestError("the request was aborted by the server", status=503, code="request_aborted")


def first_aborted(outs: list) -> OutputStream | None:
    """The first output ended by an error finish, else by an abort, else None."""
    ended = [o for o in outs if o is not None and aborted(o)]
    return next((o for o in ended if o.finish_reason.get("type") == "error"), ended[0] if ended else None)


RESERVED_TEMPLATE_KWARGS = frozenset({"self", "template", "messages", "tools", "add_generation_prompt",
                                      "continue_final_message"})


# ---- parameters ---------------------------------------------------------------------------------------

# The request fields the OpenAI bodies carry as declared (server/request_fields.py), handed on as sent; the rest are
# the route's: seeds per choice, the domain also from metadata, denoise events only on a stream, the constraint
# from any of its spellings (server/structured.py).
_AS_SENT = tuple(name for name in carried(OPENAI) if FIELDS[name].scalar
                 and name not in ("seed", "domain", "stream_denoise", *GRAMMAR_FIELDS))


def sampling_params(req: ChatCompletionRequest | CompletionRequest, names: RouteNames, *, logprobs: bool,
                    top_logprobs: int, choice: int, constraint: dict[str, str] | None = None) -> SamplingParams:
    """The request's own values; whatever it leaves unset the engine resolves (sampling_params.resolve).
    `constraint`: its structured-output field (server/structured.py constraint_of); `names`: the route's
    names of the fields a refusal names."""
    raw: dict[str, Any] = {name: getattr(req, name) for name in _AS_SENT if getattr(req, name) is not None}
    raw.update({
        "max_new_tokens": req.requested_max_tokens,
        # n sampled choices must differ; wrapped so that seed 2^63 - 1 plus a choice index stays an int64
        "seed": None if req.seed is None else (req.seed + choice + 2**63) % 2**64 - 2**63,
        "stop": tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "domain": req.request_domain,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        "logit_bias": req.logit_bias,
        "stream_denoise": req.stream_denoise and req.stream,
        **(constraint or {}),
    })
    try:
        return SamplingParams.from_dict(raw)
    except SamplingParamsError as exc:
        raise names.params_error(exc) from exc


def validate(req: ChatCompletionRequest | CompletionRequest) -> None:
    try:
        req.check_noop_fields()
    except UnsupportedValue as exc:
        raise RequestError(str(exc), param=exc.param) from exc
    check_logit_bias_keys(req.logit_bias, "logit_bias")


# A non-streamed answer is built whole in memory: its logprob entries (one per output token, plus one per
# alternative) are bounded, about 70 bytes of JSON each (2^17 entries: ~9 MB). A stream sends them as they come.
MAX_LOGPROB_ENTRIES = 2**17


def check_response_size(state: ServerState, outputs: int, max_tokens: int | None, prompt_tokens: int,
                        per_token: int, fields: str) -> None:
    """Refuse a non-streamed request whose logprobs could exceed MAX_LOGPROB_ENTRIES: outputs x max_tokens (the
    context left after the prompt when unset) x per_token (1 + top alternatives)."""
    tokens = max_tokens if max_tokens is not None else max(0, state.max_model_len - prompt_tokens)
    entries = outputs * tokens * per_token
    if entries > MAX_LOGPROB_ENTRIES:
        raise RequestError(f"this non-streamed request could return {entries} logprob entries ({fields}); at most "
                           f"{MAX_LOGPROB_ENTRIES}: lower one of them or use stream=true",
                           param=fields.split(" x ")[0], code="response_too_large")


def finish_reason(out: OutputStream, tool_calls: list | None = None) -> str:
    if tool_calls:
        return "tool_calls"
    return openai_finish(out.finish_reason)


def openai_finish(finish: dict | None) -> str:
    """OpenAI's finish_reason of the engine's (or the stop string's) finish."""
    return FINISH.get((finish or {}).get("type", "stop"), "stop")


def forced_tool_call(body: ChatCompletionRequest) -> bool:
    """tool_choice `required` or a named function: the grammar writes nothing but calls."""
    return bool(body.tools) and body.tool_choice is not None and body.tool_choice not in ("none", "auto")


def split_tool_output(state: ServerState, out: OutputStream, forced: bool) -> tuple[str | None, list[dict] | None]:
    """(content, tool_calls) of an output read for tool calls. A forced call writes only call envelopes: its
    content is never the envelope's text (None beside calls; "" when max_tokens cut the first call short)."""
    content, calls = parse_tool_calls(state, out)
    if calls:
        return (None if forced else content), calls
    return ("" if forced else out.text), None


def parse_tool_calls(state: ServerState, out: OutputStream) -> tuple[str | None, list[dict] | None]:
    """Split `<tool_call>{json}</tool_call>` blocks out of the output. Returns (content, tool_calls)."""
    ids = [t for t in out.ids if t not in state.tokenizer.eos_token_ids]
    raw = state.tokenizer.decode(ids, skip_special_tokens=False)
    calls = []
    for body in TOOL_CALL_RE.findall(raw):
        try:
            obj = json.loads(body)
            name, args = obj["name"], obj.get("arguments", {})
        except (ValueError, KeyError, TypeError):
            continue  # not a well-formed call: leave it in the content
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": str(name), "arguments": args if isinstance(args, str) else json.dumps(args)},
        })
    if not calls:
        return None, None
    content = TOOL_CALL_RE.sub("", raw)
    for tok in ("<|role_end|>", state.tokenizer.eos_token or ""):
        content = content.replace(tok, "") if tok else content
    return (content.strip() or None), calls


def diffusion_stats(outs: list[OutputStream]) -> dict:
    forwards = sum(o.meta.get("steps", 0) for o in outs)
    tokens = sum(len(o.ids) for o in outs)
    stats = {
        "forwards": forwards,
        "tokens_per_forward": round(tokens / forwards, 4) if forwards else 0.0,
        "edits": sum(o.meta.get("edits", 0) for o in outs),
        "mode": outs[0].meta.get("mode") if outs else None,
        "first_forward": [o.meta.get("first_forward") for o in outs],  # the engine forward each choice began at
        **({"step_maps": maps} if (maps := step_maps(outs)) is not None else {}),
    }
    if any(o.meta.get("decoder") == "levenshtein" for o in outs):  # LLaDA2.2's structural edits (docs/llada22.md)
        stats.update(deletions=sum(o.meta.get("deletions", 0) for o in outs),
                     insertions=sum(o.meta.get("insertions", 0) for o in outs))
    return stats


def continuous_usage(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """vLLM's stream_options.continuous_usage_stats: usage on every chunk, only where include_usage asks for
    usage at all."""
    options = body.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def running_usage(prompt_tokens: int, completion_tokens: int) -> dict:
    """The usage a chunk carries under stream_options.continuous_usage_stats (vLLM's): its choice so far."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def usage(outs: list[OutputStream], prompt_tokens: int) -> dict:
    completion = sum(len(o.ids) for o in outs)
    cached = max((o.meta.get("cached_tokens", 0) for o in outs), default=0)
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


# ---- logprobs in OpenAI's two shapes ---------------------------------------------------------------------

def _token_entry(state: ServerState, token: int, logprob: float) -> dict:
    raw = state.tokenizer.token_bytes(token)
    return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}


def _logprob_rows(out: OutputStream, start: int, end: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """(token, logprob, top alternatives [(token, logprob), ...]) of output positions [start, end)."""
    lps = out.logprobs or []
    tops = out.top_logprobs or [[] for _ in lps]
    return list(zip(out.ids[start:end], lps[start:end], tops[start:end]))


def chat_logprobs(state: ServerState, out: OutputStream, start: int, end: int) -> dict | None:
    if out.logprobs is None:
        return None
    content = []
    for tok, lp, alts in _logprob_rows(out, start, end):
        entry = _token_entry(state, tok, lp)
        entry["top_logprobs"] = [_token_entry(state, t, v) for t, v in alts]
        content.append(entry)
    return {"content": content}


def completion_logprobs(state: ServerState, out: OutputStream, start: int, end: int, text_offset: int) -> dict | None:
    if out.logprobs is None:
        return None
    tokens, lps, top, offsets = [], [], [], []
    pos = text_offset
    for tok, lp, alts in _logprob_rows(out, start, end):
        text = _token_entry(state, tok, lp)["token"]
        tokens.append(text)
        lps.append(lp)
        top.append(_top_dict(state, alts, text, lp))
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


def _top_dict(state: ServerState, alts: list[tuple[int, float]], text: str, logprob: float) -> dict[str, float]:
    """The legacy top_logprobs entry of one position: its alternatives by text, best first (when two tokens
    decode to the same text, e.g. "\ufffd", the better is kept), and the token itself always (as OpenAI and vLLM
    do: with logprobs 0 it is the only entry)."""
    alt: dict[str, float] = {}
    for t, v in alts:
        alt.setdefault(_token_entry(state, t, v)["token"], v)
    alt.setdefault(text, logprob)
    return alt


# ---- routes -------------------------------------------------------------------------------------------

@dataclass
class ChatStart:
    """A chat request started in the engine: its accepted streams, the prompt's ids, whether tool calls are read
    from the output, and vLLM's prompt_logprobs when asked (else None)."""

    streams: list[ChoiceStream]
    prompt_ids: list[int]
    tools: bool
    prompt_logprobs: list | None = None


async def start_chat(state: ServerState, body: ChatCompletionRequest, request: Request) -> ChatStart:
    """Check a chat request, render its template, and start its n choices in the engine. The chat route and the
    Responses route (server/responses_api.py) both start here."""
    check_model(state, body.model)
    validate(body)
    rid = request.state.request_id
    messages = [_template_message(m) for m in body.messages]
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" else None
    template_kwargs = body.chat_template_kwargs or {}
    reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:  # would collide with apply_chat_template's own arguments (a TypeError, i.e. a 500)
        raise RequestError(f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")
    state.check_text_length(text_chars(messages) + text_chars(tools), "messages")
    try:  # message text is tokenized as plain text: only the template's markup makes special tokens; off the loop
        ids = await asyncio.to_thread(state.tokenizer.encode_chat, messages, tools=tools,
                                      add_generation_prompt=body.add_generation_prompt is not False
                                      and not body.continue_final_message,
                                      continue_final_message=body.continue_final_message, **template_kwargs)
    except ChatTemplateError as exc:
        raise RequestError(f"the chat template could not render these messages: {exc}", param="messages") from exc
    ids = truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
    top = body.top_logprobs or 0
    if body.logprobs and not body.stream:
        check_response_size(state, body.n, body.requested_max_tokens, len(ids), top + 1,
                            "n x max_tokens x (top_logprobs + 1)")
    constraint = await constraint_of(state, body, rid)  # checked off the loop
    params = [sampling_params(body, CHAT, logprobs=body.logprobs, top_logprobs=top, choice=i, constraint=constraint)
              for i in range(body.n)]
    prompt_lps = None
    if body.prompt_logprobs is not None:  # staircase values of the prompt, before generating (as echo)
        rows = (await all_prompt_logprobs(state, request, [ids], 1, body.prompt_logprobs, "prompt_logprobs"))[0]
        prompt_lps = prompt_logprobs_entries(state.tokenizer, ids, rows)
    rids = [engine_rid(request, f"{rid}-{i}") for i in range(body.n)]
    streams = await start_streams(state, rids, [ids] * body.n, params, CHAT)
    return ChatStart(streams, ids, tools is not None, prompt_lps)


router = APIRouter(route_class=DepthCheckedRoute)


def model_card(state: ServerState, name: str) -> dict:
    """One model's object, the same in the list and on its own (vLLM's fields: root, parent, max_model_len)."""
    return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "redraft",
            "root": state.model_path, "parent": None, "max_model_len": state.max_model_len}


@router.get("/v1/models")
async def list_models(state: State):
    return {"object": "list", "data": [model_card(state, name) for name in state.model_names[:1]]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, state: State):
    check_model(state, model)
    return model_card(state, model)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request, state: State):
    start = await start_chat(state, body, request)
    chat = ChatFormatter(state, f"chatcmpl-{request.state.request_id}", body, start)
    if body.stream:
        return StreamingResponse(chat.stream(start.streams), media_type="text/event-stream")
    return chat.response(await run_until_disconnect(request, run_all(start.streams)))


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request, state: State):
    check_model(state, body.model)
    validate(body)
    rid = request.state.request_id
    constraint = await constraint_of(state, body, rid)  # checked off the loop
    prompts = [truncate_prompt(ids, body.truncate_prompt_tokens, state.max_model_len)
               for ids in await _completion_prompts(state, body.prompt)]
    top = body.logprobs or 0
    all_prompts = [ids for ids in prompts for _ in range(body.n)]
    check_choice_count(state, len(all_prompts), "n")  # before any work, echo included
    if body.logprobs is not None and not body.stream:
        check_response_size(state, len(all_prompts), body.max_tokens, min(map(len, prompts)), top + 1,
                            "n x prompts x max_tokens x (logprobs + 1)")
    fmt = CompletionFormatter(state, f"cmpl-{rid}", body, prompts)
    if body.echo:  # the prompt's own log-probabilities (staircase values), computed before generating
        start = 1 if body.logprob_start_len is None else body.logprob_start_len
        fmt.echo = await all_prompt_logprobs(state, request, prompts, start, body.logprobs, "prompt")
        fmt.echo_texts = [p if isinstance(p, str) and body.truncate_prompt_tokens is None  # else: what is left
                          else state.tokenizer.decode(ids, skip_special_tokens=False)
                          for p, ids in zip(_prompt_list(body.prompt), prompts)]
        if body.max_tokens == 0:
            if body.stream:
                return StreamingResponse(fmt.echo_only_stream(), media_type="text/event-stream")
            return fmt.response([None] * len(all_prompts))
    if body.prompt_logprobs is not None:  # vLLM's field: staircase values as with echo, in vLLM's shape
        rows = await all_prompt_logprobs(state, request, prompts, 1, body.prompt_logprobs, "prompt_logprobs")
        fmt.prompt_logprobs = [prompt_logprobs_entries(state.tokenizer, ids, r) for ids, r in zip(prompts, rows)]
    params = [sampling_params(body, COMPLETIONS, logprobs=body.logprobs is not None, top_logprobs=top, choice=i,
                              constraint=constraint) for _ in prompts for i in range(body.n)]
    rids = [engine_rid(request, f"{rid}-{i}") for i in range(len(all_prompts))]
    streams = await start_streams(state, rids, all_prompts, params, COMPLETIONS)
    if body.stream:
        return StreamingResponse(fmt.stream(streams), media_type="text/event-stream")
    return fmt.response(await run_until_disconnect(request, run_all(streams)))


TEMPLATE_ROLES = {"developer": "system", "function": "tool"}  # a legacy function result is a tool result


def _template_message(m) -> dict:
    """What the chat template reads of a message (response-side keys a client sent back are left out)."""
    msg: dict[str, Any] = {"role": TEMPLATE_ROLES.get(m.role, m.role), "content": m.text()}
    calls = list(m.tool_calls or ()) + ([SimpleNamespace(id=None, function=m.function_call)] if m.function_call
                                        else [])
    if calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _json_or_raw(c.function.arguments)}}
            for c in calls
        ]
    if m.tool_call_id:
        msg["tool_call_id"] = m.tool_call_id
    if m.name:
        msg["name"] = m.name
    return msg


def _json_or_raw(args: str | dict) -> Any:
    if isinstance(args, dict):
        return args
    try:
        return json.loads(args)
    except (ValueError, RecursionError):  # not JSON, or nested beyond the parser: passed on as text
        return args


def _prompt_list(prompt: Any) -> list[Any]:
    """The prompts of a completions request, one entry each (a string or a list of token ids)."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [prompt]
    return list(prompt)


async def _completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    """Token ids of each prompt (text is tokenized here, off the event loop; ids are checked by the engine at
    admission)."""
    if isinstance(prompt, str):
        return [await state.encode(prompt, "prompt")]
    if prompt and isinstance(prompt[0], str):
        return [await state.encode(p, "prompt") for p in prompt]
    ids = [list(prompt)] if prompt and isinstance(prompt[0], int) else [list(p) for p in prompt]
    check_token_ids(state, ids, "prompt")
    return ids


class ChatFormatter:
    def __init__(self, state: ServerState, cid: str, body: ChatCompletionRequest, start: ChatStart):
        self.state, self.id, self.body, self.start = state, cid, body, start
        self.prompt_tokens, self.tools = len(start.prompt_ids), start.tools
        self.created = int(time.time())
        self.model = body.model or state.model_names[0]

    def _envelope(self, obj: str, **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, **extra}

    def _message(self, out: OutputStream) -> tuple[dict, str]:
        content, calls = split_tool_output(self.state, out, forced_tool_call(self.body)) if self.tools \
            else (out.text, None)
        # reasoning_content: null, as SGLang and vLLM answer (no reasoning channel here); clients read it directly
        if calls:
            return {"role": "assistant", "content": content, "reasoning_content": None, "tool_calls": calls}, \
                "tool_calls"
        return {"role": "assistant", "content": content, "reasoning_content": None}, finish_reason(out)

    def _stop(self, finish: dict | None) -> dict:
        return stop_fields(finish, self.state.tokenizer.eos_token_ids, self.body.stop_token_ids)

    def response(self, outs: list[OutputStream]) -> dict:
        if first_aborted(outs) is not None:
            raise aborted_error(first_aborted(outs))
        choices = []
        ids = self.body.return_token_ids
        for i, out in enumerate(outs):
            message, reason = self._message(out)
            lp = chat_logprobs(self.state, out, 0, len(out.ids)) if self.body.logprobs else None
            choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": reason,
                            **self._stop(out.finish_reason), "token_ids": list(out.ids) if ids else None})
        return self._envelope("chat.completion", choices=choices, usage=usage(outs, self.prompt_tokens),
                              prompt_token_ids=list(self.start.prompt_ids) if ids else None,
                              prompt_logprobs=self.start.prompt_logprobs, diffusion=diffusion_stats(outs))

    def _chunk(self, index: int, delta: dict, reason: str | None = None, logprobs: dict | None = None,
               tokens: int = 0, **fields: Any) -> str:
        """One choice's chunk; `tokens`: that choice's output tokens so far (continuous_usage_stats); `fields`:
        more of the choice's (matched_stop, token_ids)."""
        delta = {**delta, "reasoning_content": None}  # as SGLang and vLLM send it: clients read it directly
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason, **fields}
        extra = {"usage": running_usage(self.prompt_tokens, tokens) if self._continuous_usage else None} \
            if self._include_usage or self._continuous_usage else {}
        return sse(self._envelope("chat.completion.chunk", choices=[choice], **extra))

    def _ids(self, c: ChoiceStream, end: int) -> dict:
        """return_token_ids: the output ids this chunk adds (vLLM's token_ids)."""
        if not self.body.return_token_ids:
            return {}
        start, c.sent_ids = c.sent_ids, end
        return {"token_ids": list(c.out.ids[start:end])}

    @property
    def _continuous_usage(self) -> bool:
        return continuous_usage(self.body)

    @property
    def _include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    async def stream(self, streams: list[ChoiceStream]) -> AsyncIterator[str]:
        try:
            first = {"prompt_token_ids": list(self.start.prompt_ids)} if self.body.return_token_ids else {}
            if self.start.prompt_logprobs is not None:
                first["prompt_logprobs"] = self.start.prompt_logprobs
            for c in streams:
                yield self._chunk(c.index, {"role": "assistant", "content": ""}, **first)
            async for c, up in merge_updates(streams):
                if isinstance(up, Exception):
                    yield sse_error(up)
                    break
                for event in up.denoise:  # stream_denoise: the forwards first, then what they committed
                    yield sse(chat_event_chunk(self._envelope("chat.completion.chunk"), event))
                if up.aborted:  # cut by the server or failed in the engine: a valid finish, then the error
                    yield self._chunk(c.index, {"content": up.text} if up.text else {}, "stop", tokens=up.ids_end)
                    yield sse_error(aborted_error(up.finish_reason))
                    break
                if self.tools:  # tool calls are parsed once the output is whole (it is, once finished)
                    if up.finished:
                        message, reason = self._message(c.out)
                        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [dict(tc, index=j) for j, tc in enumerate(delta["tool_calls"])]
                        yield self._chunk(c.index, delta, reason, self._lp(c, up.ids_end), tokens=up.ids_end,
                                          **self._stop(up.finish_reason), **self._ids(c, up.ids_end))
                    continue
                lp = self._lp(c, up.ids_end)
                if up.text or lp:
                    yield self._chunk(c.index, {"content": up.text}, None, lp, tokens=up.ids_end,
                                      **self._ids(c, up.ids_end))
                if up.finished:
                    yield self._chunk(c.index, {}, openai_finish(up.finish_reason), tokens=up.ids_end,
                                      **self._stop(up.finish_reason), **self._ids(c, up.ids_end))
            else:
                if self._include_usage:
                    outs = [c.out for c in streams]
                    yield sse(self._envelope("chat.completion.chunk", choices=[],
                                             usage=usage(outs, self.prompt_tokens), diffusion=diffusion_stats(outs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
            yield sse_error(exc)
        yield "data: [DONE]\n\n"

    def _lp(self, c: ChoiceStream, end: int) -> dict | None:
        """The logprobs of the tokens this choice has not sent yet, up to output position `end`."""
        if not self.body.logprobs:
            return None
        lp = chat_logprobs(self.state, c.out, c.sent_tokens, end)
        c.sent_tokens = end
        return lp if lp and lp["content"] else None


class CompletionFormatter:
    def __init__(self, state: ServerState, cid: str, body: CompletionRequest, prompts: list[list[int]]):
        self.state, self.id, self.body, self.prompts = state, cid, body, prompts
        self.created = int(time.time())
        self.model = body.model or state.model_names[0]
        # echo: per prompt, its staircase log-probabilities (None where not computed) and its text
        self.echo: list[list] | None = None
        self.echo_texts: list[str] = []
        self.prompt_logprobs: list[list] | None = None  # vLLM's prompt_logprobs per prompt, when asked

    def _echo_logprobs(self, p: int) -> tuple[dict, int]:
        """The prompt part of an echoed choice's logprobs (OpenAI's legacy shape), and its text length."""
        tokens, lps, tops, offsets, pos = [], [], [], [], 0
        for tok, entry in zip(self.prompts[p], self.echo[p]):
            text = _token_entry(self.state, tok, 0.0)["token"]
            tokens.append(text)
            offsets.append(pos)
            pos += len(text)
            if entry is None:
                lps.append(None)
                tops.append(None)
            else:
                lps.append(entry[0])
                tops.append(_top_dict(self.state, entry[1], text, entry[0]))
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, pos

    def _envelope(self, **extra: Any) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, **extra}

    def _prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def response(self, outs: list[OutputStream | None]) -> dict:
        """`outs` None: echo with max_tokens 0 (the prompt alone, no generation)."""
        done = [o for o in outs if o is not None]
        if first_aborted(done) is not None:
            raise aborted_error(first_aborted(done))
        choices = []
        n = self.body.n
        for i, out in enumerate(outs):
            text, lp = (out.text if out else ""), None
            if self.body.logprobs is not None:
                lp = completion_logprobs(self.state, out, 0, len(out.ids), 0) if out else \
                    {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if self.echo is not None:
                p = i // n
                prompt_text = self.echo_texts[p]
                if lp is not None:
                    echoed, length = self._echo_logprobs(p)  # the prompt's entries first, then the completion's
                    lp = {"tokens": echoed["tokens"] + lp["tokens"],
                          "token_logprobs": echoed["token_logprobs"] + lp["token_logprobs"],
                          "top_logprobs": echoed["top_logprobs"] + lp["top_logprobs"],
                          "text_offset": echoed["text_offset"] + [length + o for o in lp["text_offset"]]}
                text = prompt_text + text
            reason = finish_reason(out) if out else "length"
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": reason,
                            **self._stop(out.finish_reason if out else None), **self._token_fields(i, out)})
        u = usage(done, self._prompt_tokens())
        return self._envelope(choices=choices, usage=u, diffusion=diffusion_stats(done))

    def _stop(self, finish: dict | None) -> dict:
        return stop_fields(finish, self.state.tokenizer.eos_token_ids, self.body.stop_token_ids)

    def _token_fields(self, i: int, out: OutputStream | None) -> dict:
        """vLLM's per-choice prompt_token_ids, token_ids (null unless return_token_ids) and prompt_logprobs."""
        p, ids = i // self.body.n, self.body.return_token_ids
        return {"prompt_token_ids": list(self.prompts[p]) if ids else None,
                "token_ids": (list(out.ids) if out else []) if ids else None,
                "prompt_logprobs": self.prompt_logprobs[p] if self.prompt_logprobs is not None else None}

    @property
    def _prompt_chunks(self) -> bool:
        """A stream opens each choice with a chunk about its prompt: its echo, its ids, its prompt_logprobs."""
        b = self.body
        return self.echo is not None or b.return_token_ids or self.prompt_logprobs is not None

    def _echo_chunk(self, i: int, reason: str | None = None) -> str:
        """A choice's first chunk in a stream: the prompt's text and its logprobs when echoed, its ids
        (return_token_ids) and prompt_logprobs when asked."""
        p = i // self.body.n
        echo = self.echo is not None
        lp = self._echo_logprobs(p)[0] if echo and self.body.logprobs is not None else None
        extra: dict[str, Any] = {"prompt_token_ids": list(self.prompts[p])} if self.body.return_token_ids else {}
        if self.prompt_logprobs is not None:
            extra["prompt_logprobs"] = self.prompt_logprobs[p]
        return sse(self._envelope(choices=[{"index": i, "text": self.echo_texts[p] if echo else "", "logprobs": lp,
                                            "finish_reason": reason, **extra}]))

    async def echo_only_stream(self) -> AsyncIterator[str]:
        """echo, stream and max_tokens 0: each choice's prompt, finished by length; then usage when asked."""
        count = len(self.prompts) * self.body.n
        for i in range(count):
            yield self._echo_chunk(i, "length")
        if self.body.stream_options and self.body.stream_options.include_usage:
            yield sse(self._envelope(choices=[], usage=usage([], self._prompt_tokens())))
        yield "data: [DONE]\n\n"

    async def stream(self, streams: list[ChoiceStream]) -> AsyncIterator[str]:
        options = self.body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous = continuous_usage(self.body)
        try:
            for c in streams if self._prompt_chunks else ():
                yield self._echo_chunk(c.index)
            async for c, up in merge_updates(streams):
                if isinstance(up, Exception):
                    yield sse_error(up)
                    break
                for event in up.denoise:  # stream_denoise: the forwards first, then what they committed
                    yield sse(completion_event_chunk(self._envelope(), event))
                # usage on every chunk (continuous_usage_stats: this choice's tokens so far), else null or absent
                extra = {"usage": running_usage(self._prompt_tokens(), up.ids_end) if continuous else None} \
                    if include_usage or continuous else {}
                if up.aborted:  # cut by the server or failed in the engine: a valid finish, then the error
                    yield sse(self._envelope(choices=[{"index": c.index, "text": up.text, "logprobs": None,
                                                       "finish_reason": "stop"}], **extra))
                    yield sse_error(aborted_error(up.finish_reason))
                    break
                lp = None
                if self.body.logprobs is not None:
                    lp = completion_logprobs(self.state, c.out, c.sent_tokens, up.ids_end, 0)
                    c.sent_tokens = up.ids_end
                reason = openai_finish(up.finish_reason) if up.finished else None
                if up.text or reason or (lp and lp["tokens"]):
                    fields = self._stop(up.finish_reason) if reason else {}
                    if self.body.return_token_ids:
                        fields["token_ids"] = list(c.out.ids[c.sent_ids:up.ids_end])
                        c.sent_ids = up.ids_end
                    yield sse(self._envelope(choices=[{"index": c.index, "text": up.text, "logprobs": lp,
                                                       "finish_reason": reason, **fields}], **extra))
            else:
                if include_usage:
                    outs = [c.out for c in streams]
                    yield sse(self._envelope(choices=[], usage=usage(outs, self._prompt_tokens()),
                                             diffusion=diffusion_stats(outs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            yield sse_error(exc)
        yield "data: [DONE]\n\n"
