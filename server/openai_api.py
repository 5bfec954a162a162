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
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from redraft.engine.sampling_params import SamplingParams, SamplingParamsError
from redraft.engine.tokenizer import ChatTemplateError
from redraft.scheduler.messages import Accepted, RequestOutput
from redraft.server.detokenizer import IncrementalDetokenizer
from redraft.server.engine_client import EngineDead, EngineRejected
from redraft.server.common import APIError, ServerState, engine_error, run_until_disconnect, sse
from redraft.server.openai_protocol import ChatCompletionRequest, CompletionRequest, UnsupportedValue

TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
RESERVED_TEMPLATE_KWARGS = frozenset({"self", "template", "messages", "tools", "add_generation_prompt"})


@dataclass
class OpenAISettings:
    default_max_tokens: int = 1024  # chat, when the request names none (capped by the context)
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # from generation_config.json


# ---- parameters ---------------------------------------------------------------------------------------

def sampling_params(state: ServerState, settings: OpenAISettings, req: ChatCompletionRequest | CompletionRequest,
                    prompt_len: int, *, logprobs: bool, top_logprobs: int, choice: int) -> SamplingParams:
    """Request fields first, then the checkpoint's generation_config.json, then the server's flags."""
    gen = settings.generation_defaults
    limit = state.max_model_len
    max_tokens = req.requested_max_tokens
    if max_tokens is None:
        max_tokens = min(int(gen.get("max_new_tokens", settings.default_max_tokens)), max(limit - prompt_len, 1))
    if prompt_len + max_tokens > limit:
        raise APIError(
            400,
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the completion). "
            "Please reduce the length of the messages or completion.",
            param="max_tokens", code="context_length_exceeded",
        )
    no_mode = req.mode is None
    raw: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": req.temperature if req.temperature is not None else float(gen.get("temperature", 0.0)),
        "top_p": req.top_p if req.top_p is not None else float(gen.get("top_p", 1.0)),
        "top_k": req.top_k if req.top_k is not None else int(gen.get("top_k", -1) or -1),
        # n sampled choices must differ; wrapped so that seed 2^63 - 1 plus a choice index stays an int64
        "seed": None if req.seed is None else (req.seed + choice + 2**63) % 2**64 - 2**63,
        "stop": tuple(req.stop or ()),
        "stop_token_ids": tuple(req.stop_token_ids or ()),
        "ignore_eos": req.ignore_eos,
        "mode": req.mode,
        "threshold": req.threshold if req.threshold is not None else (gen.get("threshold") if no_mode else None),
        "edit_threshold": req.edit_threshold if req.edit_threshold is not None else (
            gen.get("edit_threshold", gen.get("editing_threshold")) if no_mode else None),
        "max_post_steps": req.max_post_steps if req.max_post_steps is not None else (
            gen.get("max_post_steps") if no_mode else None),
        "mbe_window": req.mbe_window or 1,
        "domain": req.request_domain,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
    }
    try:
        return SamplingParams.from_dict(raw)
    except SamplingParamsError as exc:
        param = {"max_new_tokens": "max_tokens"}.get(exc.param or "", exc.param)
        raise APIError(400, str(exc).replace("max_new_tokens", "max_tokens"), param=param) from exc


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model not in state.model_names:
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")


def validate(req: ChatCompletionRequest | CompletionRequest) -> None:
    try:
        req.check_noop_fields()
    except UnsupportedValue as exc:
        raise APIError(400, str(exc), param=exc.param) from exc


# ---- one choice ---------------------------------------------------------------------------------------

class Choice:
    """One engine request behind one choice: accept, then committed-block updates, then the final one."""

    def __init__(self, state: ServerState, rid: str, ids: list[int], params: SamplingParams, index: int):
        self.state, self.rid, self.index, self.params = state, rid, index, params
        self.stream = state.client.generate(rid, ids, params)
        self.detok = IncrementalDetokenizer(state.tokenizer, params.stop)
        self.last: RequestOutput | None = None
        self.sent_tokens = 0

    async def accept(self) -> None:
        first = await self.stream.__anext__()
        assert isinstance(first, Accepted)

    async def updates(self) -> AsyncIterator[RequestOutput]:
        async for out in self.stream:
            if isinstance(out, RequestOutput):
                self.last = out
                yield out

    async def run(self) -> RequestOutput:
        async for _ in self.updates():
            pass
        assert self.last is not None
        return self.last

    async def close(self) -> None:
        await self.stream.aclose()


async def start_choices(state: ServerState, base: str, prompts: list[list[int]], params: list[SamplingParams]
                        ) -> list[Choice]:
    """Submit every choice and wait until the engine accepted all of them (else abort all, raise)."""
    choices = [Choice(state, f"{base}-{i}", ids, p, i) for i, (ids, p) in enumerate(zip(prompts, params))]
    try:
        for c in choices:
            await c.accept()
    except BaseException as exc:
        for c in choices:
            await c.close()
        if isinstance(exc, (EngineDead, EngineRejected)):
            raise engine_error(exc) from exc
        raise
    return choices


def finish_reason(out: RequestOutput, tool_calls: list | None = None) -> str:
    if tool_calls:
        return "tool_calls"
    kind = (out.finish_reason or {}).get("type", "stop")
    return FINISH.get(kind, "stop")


def parse_tool_calls(state: ServerState, out: RequestOutput) -> tuple[str | None, list[dict] | None]:
    """Split `<tool_call>{json}</tool_call>` blocks out of the output. Returns (content, tool_calls)."""
    ids = [t for t in out.output_ids if t != state.tokenizer.eos_token_id]
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


def diffusion_stats(outs: list[RequestOutput]) -> dict:
    forwards = sum(o.meta.get("steps", 0) for o in outs)
    tokens = sum(o.meta.get("completion_tokens", 0) for o in outs)
    return {
        "forwards": forwards,
        "tokens_per_forward": round(tokens / forwards, 4) if forwards else 0.0,
        "edits": sum(o.meta.get("edits", 0) for o in outs),
        "mode": outs[0].meta.get("mode") if outs else None,
    }


def usage(outs: list[RequestOutput], prompt_tokens: int) -> dict:
    completion = sum(o.meta.get("completion_tokens", len(o.output_ids)) for o in outs)
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


def chat_logprobs(state: ServerState, meta: dict, start: int, end: int) -> dict | None:
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in pairs]
    content = []
    for (lp, tok), alts in zip(pairs[start:end], tops[start:end]):
        entry = _token_entry(state, tok, lp)
        entry["top_logprobs"] = [_token_entry(state, t, v) for v, t in alts]
        content.append(entry)
    return {"content": content}


def completion_logprobs(state: ServerState, meta: dict, start: int, end: int, text_offset: int) -> dict | None:
    pairs = meta.get("output_token_logprobs")
    if pairs is None:
        return None
    tops = meta.get("output_top_logprobs") or [[] for _ in pairs]
    tokens, lps, top, offsets = [], [], [], []
    pos = text_offset
    for (lp, tok), alts in zip(pairs[start:end], tops[start:end]):
        text = _token_entry(state, tok, lp)["token"]
        tokens.append(text)
        lps.append(lp)
        alt: dict[str, float] = {}
        for v, t in alts:  # best first: when two tokens decode to the same text (e.g. "\ufffd"), keep the better
            alt.setdefault(_token_entry(state, t, v)["token"], v)
        top.append(alt)
        offsets.append(pos)
        pos += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top, "text_offset": offsets}


# ---- routes -------------------------------------------------------------------------------------------

def register_openai_routes(app: FastAPI, state: ServerState, settings: OpenAISettings) -> None:
    @app.get("/v1/models")
    async def list_models():
        now = int(time.time())
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": now, "owned_by": "redraft", "root": state.model_path,
             "max_model_len": state.max_model_len}
            for name in state.model_names[:1]
        ]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        check_model(state, model)
        return {"id": model, "object": "model", "created": int(time.time()), "owned_by": "redraft",
                "max_model_len": state.max_model_len}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(state, body.model)
        validate(body)
        rid = request.state.request_id
        messages = [_template_message(m) for m in body.messages]
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and body.tool_choice != "none" else None
        template_kwargs = body.chat_template_kwargs or {}
        reserved = sorted(set(template_kwargs) & RESERVED_TEMPLATE_KWARGS)
        if reserved:  # would collide with apply_chat_template's own arguments (a TypeError, i.e. a 500)
            raise APIError(400, f"chat_template_kwargs may not set {reserved[0]!r}", param="chat_template_kwargs")
        try:
            prompt = state.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                         **template_kwargs)
        except ChatTemplateError as exc:
            raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc
        ids = state.tokenizer.encode(prompt)
        top = body.top_logprobs or 0
        params = [sampling_params(state, settings, body, len(ids), logprobs=body.logprobs, top_logprobs=top, choice=i)
                  for i in range(body.n)]
        chat = ChatFormatter(state, f"chatcmpl-{rid}", body, len(ids), tools is not None)
        if body.stream:
            choices = await start_choices(state, rid, [ids] * body.n, params)
            return StreamingResponse(chat.stream(choices), media_type="text/event-stream")
        outs = await run_until_disconnect(request, _run_all(state, rid, [ids] * body.n, params))
        return chat.response(outs)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        check_model(state, body.model)
        validate(body)
        rid = request.state.request_id
        prompts = _completion_prompts(state, body.prompt)
        top = body.logprobs or 0
        params, all_prompts = [], []
        for p_index, ids in enumerate(prompts):
            for i in range(body.n):
                params.append(sampling_params(state, settings, body, len(ids), logprobs=body.logprobs is not None,
                                              top_logprobs=top, choice=i))
                all_prompts.append(ids)
        fmt = CompletionFormatter(state, f"cmpl-{rid}", body, prompts)
        if body.stream:
            choices = await start_choices(state, rid, all_prompts, params)
            return StreamingResponse(fmt.stream(choices), media_type="text/event-stream")
        outs = await run_until_disconnect(request, _run_all(state, rid, all_prompts, params))
        return fmt.response(outs)


def _template_message(m) -> dict:
    msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    if m.tool_calls:
        msg["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _json_or_raw(c.function.arguments)}}
            for c in m.tool_calls
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
    except ValueError:
        return args


def _completion_prompts(state: ServerState, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        prompts = [state.tokenizer.encode(prompt)]
    elif prompt and isinstance(prompt[0], str):
        prompts = [state.tokenizer.encode(p) for p in prompt]
    elif prompt and isinstance(prompt[0], int):
        prompts = [list(prompt)]
    else:
        prompts = [list(p) for p in prompt]
    if any(len(p) == 0 for p in prompts):
        raise APIError(400, "the prompt is empty", param="prompt")
    vocab = state.vocab_size
    for p in prompts:
        if any(t < 0 or t >= vocab for t in p):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    return prompts


async def _run_all(state: ServerState, rid: str, prompts: list[list[int]], params: list[SamplingParams]
                   ) -> list[RequestOutput]:
    choices = await start_choices(state, rid, prompts, params)
    try:
        return list(await asyncio.gather(*[c.run() for c in choices]))
    except (EngineDead, EngineRejected) as exc:
        raise engine_error(exc) from exc
    finally:
        for c in choices:
            await c.close()


async def _merge(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput | Exception]]:
    """Interleave the updates of several choices as they come."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(c: Choice) -> None:
        try:
            async for out in c.updates():
                await queue.put((c, out))
        except Exception as exc:  # noqa: BLE001 - forwarded to the stream as an error event
            await queue.put((c, exc))
        await queue.put((c, None))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    try:
        remaining = len(choices)
        while remaining:
            c, item = await queue.get()
            if item is None:
                remaining -= 1
            else:
                yield c, item
    finally:
        for t in tasks:
            t.cancel()
        for c in choices:
            await c.close()


def _error_event(exc: Exception) -> str:
    err = engine_error(exc) if isinstance(exc, (EngineDead, EngineRejected)) else APIError(
        500, "internal error while streaming", "server_error")
    return sse({"error": {"message": err.message, "type": err.type, "param": None, "code": err.code}})


class ChatFormatter:
    def __init__(self, state: ServerState, cid: str, body: ChatCompletionRequest, prompt_tokens: int, tools: bool):
        self.state, self.id, self.body, self.prompt_tokens, self.tools = state, cid, body, prompt_tokens, tools
        self.created = int(time.time())
        self.model = body.model or state.model_names[0]

    def _envelope(self, obj: str, **extra: Any) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "system_fingerprint": None, **extra}

    def _message(self, out: RequestOutput, detok: IncrementalDetokenizer) -> tuple[dict, str]:
        content, calls = parse_tool_calls(self.state, out) if self.tools else (None, None)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
        return {"role": "assistant", "content": detok.text(out.output_ids, True)}, finish_reason(out)

    def response(self, outs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outs):
            detok = IncrementalDetokenizer(self.state.tokenizer, self.body.stop or ())
            message, reason = self._message(out, detok)
            choices.append({"index": i, "message": message, "logprobs": chat_logprobs(
                self.state, out.meta, 0, len(out.output_ids)) if self.body.logprobs else None, "finish_reason": reason})
        return self._envelope("chat.completion", choices=choices, usage=usage(outs, self.prompt_tokens),
                              diffusion=diffusion_stats(outs))

    def _chunk(self, index: int, delta: dict, reason: str | None = None, logprobs: dict | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        extra = {"usage": None} if self._include_usage else {}
        return sse(self._envelope("chat.completion.chunk", choices=[choice], **extra))

    @property
    def _include_usage(self) -> bool:
        return bool(self.body.stream_options and self.body.stream_options.include_usage)

    async def stream(self, choices: list[Choice]) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        try:
            for c in choices:
                yield self._chunk(c.index, {"role": "assistant", "content": ""})
            async for c, item in _merge(choices):
                if isinstance(item, Exception):
                    yield _error_event(item)
                    break
                out = item
                if self.tools:  # tool calls are parsed once the output is whole
                    if out.finished:
                        message, reason = self._message(out, c.detok)
                        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
                        if "tool_calls" in delta:
                            delta["tool_calls"] = [dict(tc, index=j) for j, tc in enumerate(delta["tool_calls"])]
                        yield self._chunk(c.index, delta, reason, self._lp(out, c, len(out.output_ids)))
                        finals[c.index] = out
                    continue
                text = c.detok.delta(out.output_ids, out.finished)
                lp = self._lp(out, c, len(out.output_ids))
                if text or lp:
                    yield self._chunk(c.index, {"content": text}, None, lp)
                if out.finished:
                    yield self._chunk(c.index, {}, finish_reason(out))
                    finals[c.index] = out
            else:
                if self._include_usage:
                    outs = [finals[i] for i in sorted(finals)]
                    yield sse(self._envelope("chat.completion.chunk", choices=[],
                                             usage=usage(outs, self.prompt_tokens), diffusion=diffusion_stats(outs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
            yield _error_event(exc)
        yield "data: [DONE]\n\n"

    def _lp(self, out: RequestOutput, c: Choice, end: int) -> dict | None:
        if not self.body.logprobs:
            return None
        lp = chat_logprobs(self.state, out.meta, c.sent_tokens, end)
        c.sent_tokens = end
        return lp if lp and lp["content"] else None


class CompletionFormatter:
    def __init__(self, state: ServerState, cid: str, body: CompletionRequest, prompts: list[list[int]]):
        self.state, self.id, self.body, self.prompts = state, cid, body, prompts
        self.created = int(time.time())
        self.model = body.model or state.model_names[0]

    def _envelope(self, **extra: Any) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "system_fingerprint": None, **extra}

    def _prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def response(self, outs: list[RequestOutput]) -> dict:
        choices = []
        for i, out in enumerate(outs):
            text = IncrementalDetokenizer(self.state.tokenizer, self.body.stop or ()).text(out.output_ids, True)
            lp = completion_logprobs(self.state, out.meta, 0, len(out.output_ids), 0) if self.body.logprobs is not None else None
            choices.append({"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason(out)})
        u = usage(outs, self._prompt_tokens())
        return self._envelope(choices=choices, usage=u, diffusion=diffusion_stats(outs))

    async def stream(self, choices: list[Choice]) -> AsyncIterator[str]:
        finals: dict[int, RequestOutput] = {}
        include_usage = bool(self.body.stream_options and self.body.stream_options.include_usage)
        extra = {"usage": None} if include_usage else {}
        try:
            async for c, item in _merge(choices):
                if isinstance(item, Exception):
                    yield _error_event(item)
                    break
                out = item
                text = c.detok.delta(out.output_ids, out.finished)
                lp = None
                if self.body.logprobs is not None:
                    lp = completion_logprobs(self.state, out.meta, c.sent_tokens, len(out.output_ids), 0)
                    c.sent_tokens = len(out.output_ids)
                reason = finish_reason(out) if out.finished else None
                if text or reason or (lp and lp["tokens"]):
                    yield sse(self._envelope(choices=[{"index": c.index, "text": text, "logprobs": lp,
                                                       "finish_reason": reason}], **extra))
                if out.finished:
                    finals[c.index] = out
            else:
                if include_usage:
                    outs = [finals[i] for i in sorted(finals)]
                    yield sse(self._envelope(choices=[], usage=usage(outs, self._prompt_tokens()),
                                             diffusion=diffusion_stats(outs)))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001
            yield _error_event(exc)
        yield "data: [DONE]\n\n"
