"""Likelihood routes (docs/likelihood.md): `/score` (block ELBO, staircase or exact terms for RL trainers), the
prompt log-probabilities behind `echo` on /v1/completions and SGLang's `input_token_logprobs` on /generate, and
the tokenizer routes lm-evaluation-harness's remote tokenizer reads (`/tokenize`, `/detokenize`,
`/tokenizer_info`, in vLLM's shapes). The HTTP process plans the masked variants (engine/text/likelihood.py,
torch-free); the engine runs them."""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator

from redraft.engine.text.likelihood import (
    MAX_VARIANTS, Plan, elbo_plan, fill_terms, mask_plan, min_variants, staircase_values, staircase_variants,
)
from redraft.engine.text.tokenizer import ChatTemplateError
from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import BLOCK_SIZE
from redraft.server.common import ServerState, check_model, engine_error, run_until_disconnect
from redraft.server.engine_client import EngineDead
from redraft.server.openai_protocol import (UnsupportedValue, check_prefill, reject_lone_surrogates,
                                            reject_loose_booleans, text_chars)
from redraft.server.param_names import PROMPT_LOGPROBS, SCORE
from redraft.server.routing import DepthCheckedRoute, State

MAX_DETOKENIZE_IDS = 2**17  # token ids per /detokenize (a 128k context's worth): a bounded decode, off the loop


async def prompt_logprobs(state: ServerState, ids: list[int], start: int, top_k: int
                          ) -> list[tuple[float, list[tuple[int, float]]] | None]:
    """The staircase value of every position from max(start, 1) (None before), with top_k alternatives."""
    variants = staircase_variants(0, len(ids), max(1, start), BLOCK_SIZE)
    try:
        rows = await state.client.score([ids], variants, top_k) if variants else []
    except (EngineDead, RequestError) as exc:
        raise engine_error(exc, PROMPT_LOGPROBS) from exc
    except asyncio.TimeoutError as exc:
        raise _timed_out() from exc
    return staircase_values(len(ids), variants, rows)


def _timed_out() -> RequestError:
    return RequestError("the likelihood work did not finish in time (the engine is busy): try again or send less",
                        status=503, code="timeout")


def check_prompt_logprobs_budget(prompts: list[list[int]], start: int, param: str) -> None:
    """A 400 naming `param` when the prompt log-probabilities of these prompts need more than MAX_VARIANTS block
    forwards (one per prompt token from max(start, 1)), before any work."""
    need = sum(max(0, len(ids) - max(1, start)) for ids in prompts)
    if need > MAX_VARIANTS:
        raise RequestError(f"the prompt log-probabilities of this request need {need} block forwards (one per "
                           f"prompt token after the start); at most {MAX_VARIANTS} per request: shorten or split the "
                           "prompts", param=param)


async def all_prompt_logprobs(state: ServerState, request: Request, prompts: list[list[int]], start: int,
                              top_k: int | None, param: str) -> list[list]:
    """`prompt_logprobs` of every prompt (rows of None where top_k is None: none asked), checked against the
    per-request budget first, and dropped in the engine if the client leaves meanwhile."""
    if top_k is None:
        return [[None] * len(ids) for ids in prompts]
    check_prompt_logprobs_budget(prompts, start, param)

    async def run() -> list[list]:
        return [await prompt_logprobs(state, ids, start, top_k) for ids in prompts]

    return await run_until_disconnect(request, run())


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        return reject_loose_booleans(cls, reject_lone_surrogates(data))


class ScoreItem(Strict):
    prompt: str | list[int] = Field(min_length=1)
    response: str | list[int] = Field(min_length=1)


class ScoreBody(Strict):
    items: list[ScoreItem] = Field(min_length=1, max_length=256)
    estimator: Literal["elbo", "staircase", "exact"] = "elbo"
    num_timesteps: int = Field(default=8, ge=1, le=256)
    timestep_rule: Literal["stratified", "gauss_legendre"] = "stratified"
    masking: Literal["bernoulli", "count", "complementary"] = "bernoulli"
    seed: int = Field(default=0, ge=0, le=2**63 - 1)
    # for trainers (docs/rl.md): every term's tokens and their log-probabilities; the masks to run, chosen by the
    # client (per item, a list of masks of response positions; replaces estimator's own); and the weights the
    # answer must come from (409 when the server holds another version)
    return_token_logprobs: bool = False
    masks: list[list[list[StrictInt]]] | None = Field(default=None, max_length=256)
    require_weight_version: str | None = None


class TokenizeBody(Strict):
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = Field(default=None, max_length=1024)  # as chat completions
    add_special_tokens: bool = False  # LLaDA2 adds none either way
    add_generation_prompt: bool | None = None  # default true (with messages)
    continue_final_message: bool = False  # assistant prefill, as on chat completions
    model: str | None = None


class DetokenizeBody(BaseModel):
    """Not Strict: its ids need no Unicode scan (a Python loop over up to 8 MB of ids on the event loop)."""

    model_config = ConfigDict(extra="forbid")
    tokens: list[StrictInt]  # true/false or 1.0 are no token ids
    model: str | None = Field(default=None, max_length=256)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:  # the keys and the model name only: ids hold no text
        if isinstance(data, dict):
            reject_lone_surrogates([*data.keys(), data.get("model")])
        return data


router = APIRouter(route_class=DepthCheckedRoute)


@router.post("/score")
async def score(body: ScoreBody, request: Request, state: State):
    """Likelihood terms of (prompt, response) items: per (timestep, block) the sum of the masked tokens'
    log-probabilities and their count, and the weighted estimate (docs/likelihood.md)."""
    seqs, spans = [], []
    for k, item in enumerate(body.items):
        p = item.prompt if isinstance(item.prompt, list) else await state.encode(item.prompt, f"items.{k}.prompt")
        r = item.response if isinstance(item.response, list) else await state.encode(item.response,
                                                                                        f"items.{k}.response")
        if not p or not r:
            raise RequestError("prompt and response must each hold at least one token", param=f"items.{k}")
        seqs.append(list(p) + list(r))
        spans.append((len(p), len(p) + len(r)))
    _check_weight_version(state, body.require_weight_version)
    plan = await _plan(body, spans)
    if len(plan.variants) > MAX_VARIANTS:
        raise RequestError(f"this request needs {len(plan.variants)} block forwards; at most {MAX_VARIANTS}",
                           param="num_timesteps")
    try:  # a job the engine interleaves with decoding; dropped there at once if the client leaves
        rows = await run_until_disconnect(request, state.client.score(seqs, plan.variants)) if plan.variants \
            else []
    except (EngineDead, RequestError) as exc:
        raise engine_error(exc, SCORE) from exc
    except asyncio.TimeoutError as exc:
        raise _timed_out() from exc
    _check_weight_version(state, body.require_weight_version)  # (an update waits for running score jobs)
    lens = [p for p, _ in spans] if body.return_token_logprobs else None
    results = await asyncio.to_thread(fill_terms, plan, [[lp for lp, _ in row] for row in rows], lens)
    return {"object": "score", "model": state.model_name, "estimator": "masks" if body.masks else body.estimator,
            "num_timesteps": body.num_timesteps, "timestep_rule": body.timestep_rule, "masking": body.masking,
            "seed": body.seed, "block_size": BLOCK_SIZE, "weight_version": state.client.info.get("weight_version",
                                                                                              "default"),
            "results": results}


def _check_weight_version(state: ServerState, required: str | None) -> None:
    held = state.client.info.get("weight_version", "default")
    if required is not None and required != held:
        raise RequestError(f"the server holds weight version {held!r}, not {required!r}", status=409,
                           code="weight_version_mismatch", param="require_weight_version")


async def _plan(body: ScoreBody, spans: list[tuple[int, int]]) -> Plan:
    """The variants to run: the client's masks, or the estimator's plan (refused over MAX_VARIANTS)."""
    if body.masks is not None:
        if len(body.masks) != len(body.items):
            raise RequestError(f"masks holds {len(body.masks)} entries for {len(body.items)} items", param="masks")
        try:
            plan = mask_plan(spans, body.masks, BLOCK_SIZE)
        except ValueError as exc:
            raise RequestError(str(exc), param="masks") from exc
    else:
        low = min_variants(spans, estimator=body.estimator, num_timesteps=body.num_timesteps, block_size=BLOCK_SIZE)
        if low > MAX_VARIANTS:  # before planning: a maximal plan takes seconds of CPU
            raise RequestError(f"this request needs at least {low} block forwards; at most {MAX_VARIANTS}",
                               param="num_timesteps")
        try:  # off the event loop: planning the largest allowed request takes seconds
            plan = await asyncio.to_thread(elbo_plan, spans, estimator=body.estimator,
                                           num_timesteps=body.num_timesteps, timestep_rule=body.timestep_rule,
                                           masking=body.masking, seed=body.seed, block_size=BLOCK_SIZE)
        except ValueError as exc:
            raise RequestError(str(exc), param="estimator") from exc
    return plan


@router.post("/tokenize")
async def tokenize(body: TokenizeBody, state: State):
    check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give exactly one of prompt or messages", param="prompt")
    if body.prompt is not None:
        tokens = await state.encode(body.prompt, "prompt")
    else:  # every string counts (tool call arguments, names, ...): all of it is rendered and tokenized
        state.check_text_length(text_chars(body.messages), "messages")
        try:
            check_prefill(body.messages, body.continue_final_message, body.add_generation_prompt)
        except UnsupportedValue as exc:
            raise RequestError(str(exc), param=exc.param) from exc
        try:  # off the loop, as for chat completions
            tokens = await asyncio.to_thread(state.tokenizer.encode_chat, body.messages,
                                             add_generation_prompt=body.add_generation_prompt is not False
                                             and not body.continue_final_message,
                                             continue_final_message=body.continue_final_message)
        except ChatTemplateError as exc:
            raise RequestError(str(exc), param="messages") from exc
    return {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeBody, state: State):
    check_model(state, body.model)
    if len(body.tokens) > MAX_DETOKENIZE_IDS:
        raise RequestError(f"tokens holds {len(body.tokens)} ids; at most {MAX_DETOKENIZE_IDS} per request",
                           param="tokens")
    vocab = state.vocab_size
    if not all(0 <= t < vocab for t in body.tokens):
        raise RequestError(f"token ids must be in [0, {vocab})", param="tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, skip_special_tokens=False)
    return {"prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(state: State):
    tok = state.tokenizer
    # eos_token_ids: every id that ends an output (generation_config.json's list too); the playground reads it
    return {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": tok.eos_token,
            "eos_token_ids": sorted(tok.eos_token_ids), "bos_token": tok.bos_token,
            "pad_token": tok.pad_token, "mask_token": tok.mask_token, "chat_template": tok.chat_template,
            "model_max_length": state.max_model_len, "vocab_size": tok.vocab_size}
