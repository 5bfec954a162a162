"""Per-request decoding parameters, the mode presets, and the one function that resolves defaults. Torch-free.

Every per-request field is declared once, on `SamplingParams` (`request_field`, protocol/fields.py): type,
default, range, routes, dials, the levels below that may set it, CLI flag and help. `FIELDS` reads them back for
the validation here, the chain (`Defaults`, `BUILTIN_DEFAULTS`, `PRESETS`), the HTTP side
(server/request_fields.py) and the command line.

A request names what it wants; anything it leaves unset (None) is decided by `resolve`, walking one chain:

    1. the request itself                      (SamplingParams)
    2. the operator's explicit flags           (ServerArgs.request_defaults(): only flags given on the command line)
    3. the checkpoint's generation_config.json (Defaults.from_generation_config)
    4. the mode preset, then the built-in defaults below

Thresholds follow the mode of the highest level that names either: a level that names `mode` but no
`threshold` uses that mode's preset and hides thresholds set at lower levels (a request asking for S gets
S's thresholds even if generation_config.json sets others). `/generate`, `/v1/*` and the offline `Engine` all
resolve through this function, in the engine, at admission.

Mode presets from the LLaDA2.1 model card (block 32, temperature 0):
    Q (quality): threshold 0.7, edit_threshold 0.5, max_post_steps 16
    S (speed):   threshold 0.5, edit_threshold 0.0, max_post_steps 16
`auto` picks S for the code and math domains and Q otherwise.

LLaDA2.2 checkpoints (docs/llada22.md) add the `decoder` switch: "levenshtein" (the insert/delete step, the
default on a checkpoint whose config.json names delete_token_id and split_token_id) or "threshold" (LLaDA2.1's
step; on a 2.2 checkpoint DELETE and SPLIT are then never proposed), and the Levenshtein step's `steps`
(scheduled transfers) and `max_steps_per_block` (hard cap). A Levenshtein request that names no mode at any
level gets the 2.2 defaults (threshold 0.5, edit_threshold 0.0, max_post_steps 16: S's values, so mode S).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Sequence

from redraft.protocol.fields import (CHAT, CHAT_AND_RESPONSES, COMPLETIONS, GENERATE_BODY, GENERATE_TOP, INT64_MAX,
                                     OPENAI, RESPONSES, RESPONSES_BODY, FieldSpec, Shape, field_specs, is_int, is_num,
                                     refusal, request_field)

BLOCK_SIZE = 32  # LLaDA2.1 decodes in blocks of 32 tokens; one KV page holds exactly one block.

AUTO_SPEED_DOMAINS = frozenset({"code", "math"})
MODES = ("S", "Q", "auto")


@dataclass(frozen=True)
class DecoderTraits:
    """What the host side (scheduler/, resolve) must know of a decoding rule, torch-free. The rule's class
    (engine/decoding/registry.py) declares the same through its `Decoder.reports`; tests/test_architecture.py
    checks that the two agree."""

    # the rule ends a block only by a forward's own verdict (its `ended` report, Request.apply_step) and counts its
    # post-steps itself, so the scheduler's pre-forward check (Request.pre_forward) never ends one of its blocks
    ends_blocks_after_forward: bool = False
    # the mode of a request that names none at any level (None: the built-in default)
    default_mode: str | None = None


# a request's `decoder` -> its rule's traits; the names are exactly the registered rules (engine/decoding/registry.py)
DECODER_TRAITS: dict[str, DecoderTraits] = {
    "threshold": DecoderTraits(),  # LLaDA2.0/2.1's M2T + T2T step
    # LLaDA2.2's insert/delete step: its own defaults are S's thresholds (the spec's 0.5 / 0.0 / 16)
    "levenshtein": DecoderTraits(ends_blocks_after_forward=True, default_mode="S"),
}
DECODERS = tuple(DECODER_TRAITS)
MAX_STEPS = 4096  # `steps` and `max_steps_per_block` above this are refused
MAX_MBE_WINDOW = 8
MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
MAX_STOP_STRINGS = 4  # OpenAI's cap, on every route
MAX_STOP_LEN = 256  # characters per stop string
MAX_STOP_TOKEN_IDS = 64
MAX_DOMAIN_LEN = 64  # as on the OpenAI routes: a label, not a text
MAX_TOP_LOGPROBS = 20  # alternatives per position
MAX_COMPLETION_LOGPROBS = 5  # the legacy completions' `logprobs` count, as OpenAI caps it
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "lark")  # structured output: the constraint fields


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; `param` names it (for the API's error body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for (SGLang's sampling_params keys plus the diffusion ones). None = unset.

    Every per-request field is declared here once (protocol/fields.py): its type, default, range, the routes and
    dials that carry it, the levels of the defaults chain that may set it, its `redraft generate` flag and its
    help. `FIELDS` below reads them back; the validation, the defaults chain, the HTTP models
    (server/request_fields.py), the dials, the param names and the command line all read FIELDS."""

    max_new_tokens: int | None = request_field(
        "output tokens at most (default: the checkpoint's generation_config.json, else 1024)", ge=1,
        openai_name="max_tokens", builtin=1024, generation_config=("max_new_tokens",),
        operator_flag="default_max_tokens", cli=True)
    temperature: float | None = request_field(
        "0 (default): greedy, exact; > 0: sampled", ge=0.0, le=100.0, routes=frozenset({OPENAI}),
        openai={"le": 2.0}, builtin=0.0, generation_config=("temperature",), cli=True)
    top_p: float | None = request_field(
        "nucleus sampling: the smallest set of tokens whose probability reaches top_p", gt=0.0, le=1.0,
        message="top_p must be in (0, 1]", routes=frozenset({OPENAI}), builtin=1.0,
        generation_config=("top_p",))
    top_k: int | None = request_field(
        "sample among the k most likely tokens (-1 or 0: all)", ge=-1, le=INT64_MAX,
        message="top_k must be an integer in [-1, 2^63) (-1 or 0 disables it)", routes=CHAT_AND_RESPONSES,
        openai={"le": None}, builtin=-1, generation_config=("top_k",))  # (past int64: the message above answers)
    seed: int | None = request_field(
        "the request's sampling seed (temperature > 0)", ge=-INT64_MAX - 1, le=INT64_MAX,
        message="seed must be an integer in [-2^63, 2^63)", routes=CHAT_AND_RESPONSES)
    # route-shaped: a string or a list on the OpenAI routes (bounded there by their validator, with the words of
    # _check_containers below)
    stop: tuple[str, ...] = request_field("strings that end the output", default=(), routes=CHAT_AND_RESPONSES,
                                          shapes={OPENAI: Shape(str | list[str])})
    stop_token_ids: tuple[int, ...] = request_field(
        "token ids that end the output", default=(), routes=frozenset({OPENAI}),
        shapes={OPENAI: Shape(list[int], bounds={"max_length": MAX_STOP_TOKEN_IDS})})
    ignore_eos: bool = request_field("go on past EOS, up to max_new_tokens", default=False,
                                     routes=CHAT_AND_RESPONSES)
    mode: str | None = request_field(
        "S: speed (threshold 0.5, edit threshold 0.0), Q: quality (0.7 / 0.5; the default), auto: S for code and "
        "math, else Q", choices=MODES, routes=CHAT_AND_RESPONSES, dial=True, builtin="Q",
        operator_flag="default_mode", cli=True)
    threshold: float | None = request_field(
        "confidence above which a mask is drafted (default: the mode's)", ge=0.0, le=1.0,
        routes=CHAT_AND_RESPONSES, dial=True, preset={"Q": 0.7, "S": 0.5}, generation_config=("threshold",),
        cli=True, sweep=True)
    edit_threshold: float | None = request_field(
        "confidence above which a drafted token is replaced (1.0: editing off; default: the mode's)", ge=0.0,
        le=1.0, routes=CHAT_AND_RESPONSES, dial=True, preset={"Q": 0.5, "S": 0.0},
        generation_config=("edit_threshold", "editing_threshold"), cli=True, sweep=True)  # (diffusers' spelling second)
    max_post_steps: int | None = request_field(
        "editing forwards allowed after a block has no mask left (default: the mode's)", ge=0, le=1024,
        routes=CHAT_AND_RESPONSES, dial=True, preset={"Q": 16, "S": 16}, generation_config=("max_post_steps",),
        cli=True, sweep=True)
    mbe_window: int | None = request_field(
        "multi-block editing: open blocks a forward may still edit (1: the official single-block loop; "
        "docs/mbe.md)", ge=1, le=MAX_MBE_WINDOW, routes=CHAT_AND_RESPONSES, dial=True, builtin=1,
        operator_flag="mbe_window", sweep=True)
    decoder: str | None = request_field(
        "LLaDA2.2: the insert/delete step (default on such a checkpoint) or LLaDA2.1's (docs/llada22.md)",
        choices=DECODERS, routes=CHAT_AND_RESPONSES, dial=True, builtin="threshold", cli=True)
    steps: int | None = request_field(
        "the Levenshtein step's scheduled transfers per block", ge=1, le=MAX_STEPS, routes=CHAT_AND_RESPONSES,
        dial=True, builtin=32, generation_config=("steps",), cli=True)
    max_steps_per_block: int | None = request_field(
        "the Levenshtein step's hard cap of forwards per block (the last one is a final round)", ge=1,
        le=MAX_STEPS, routes=CHAT_AND_RESPONSES, dial=True, builtin=1000,
        generation_config=("max_steps_per_block",), cli=True)
    domain: str | None = request_field(
        "the request's domain (code, math, chat ...): mode auto and the metrics' label read it",
        max_length=MAX_DOMAIN_LEN, routes=CHAT_AND_RESPONSES, dial=True)
    # each route its own spelling: a flag on chat, a count of alternatives on completions, SGLang's on /generate
    # (Responses asks through `include`)
    logprobs: bool = request_field(
        "per-token logprobs (of the forward that last saw each block)", default=False, shapes={
            CHAT: Shape(bool, default=False),
            COMPLETIONS: Shape(int, bounds={"ge": 0, "le": MAX_COMPLETION_LOGPROBS},
                               help="per-token logprobs with this many alternatives at each position"),
            GENERATE_BODY: Shape(bool, default=False, name="return_logprob")})
    top_logprobs: int = request_field(
        "and the top alternatives at each position", default=0, ge=0, le=MAX_TOP_LOGPROBS, shapes={
            CHAT: Shape(int, bounds={"ge": 0, "le": MAX_TOP_LOGPROBS}),
            RESPONSES_BODY: Shape(int, bounds={"ge": 0, "le": MAX_TOP_LOGPROBS}),
            GENERATE_BODY: Shape(int, default=0, bounds={"ge": 0, "le": MAX_TOP_LOGPROBS}, name="top_logprobs_num")})
    # Logit controls (engine/decoding/logit_controls.py defines them for block diffusion)
    stutter_penalty: float = request_field(
        "lowers the logit of the token the previous position holds", default=0.0, ge=0.0, le=100.0,
        routes=CHAT_AND_RESPONSES, dial=True, sweep=True)
    frequency_penalty: float = request_field(
        "per occurrence in the committed output (OpenAI)", default=0.0, ge=-2.0, le=2.0, routes=CHAT_AND_RESPONSES)
    presence_penalty: float = request_field(
        "once per token present in the committed output (OpenAI)", default=0.0, ge=-2.0, le=2.0,
        routes=CHAT_AND_RESPONSES)
    # below 0.01 a seen token's logit is scaled past float range (inf, then NaN): no useful value lives there
    repetition_penalty: float = request_field(
        "on tokens of the prompt or the committed output (HF / vLLM)", default=1.0, ge=0.01, le=100.0,
        routes=CHAT_AND_RESPONSES)
    # route-shaped: a JSON object on the OpenAI routes (token id as a string -> bias)
    logit_bias: tuple[tuple[int, float], ...] = request_field(
        f"(token id, -100..100), at most {MAX_LOGIT_BIAS} (OpenAI)", default=(), routes=frozenset({OPENAI}),
        shapes={OPENAI: Shape(dict[str, float], bounds={"max_length": MAX_LOGIT_BIAS})})
    min_tokens: int = request_field("no EOS / stop token before this many output tokens (vLLM)", default=0, ge=0,
                                    le=INT64_MAX, routes=CHAT_AND_RESPONSES, openai={"le": None})
    # Output text (SGLang's; the HTTP side's detokenizer applies them, the engine never sees them)
    no_stop_trim: bool = request_field("keep the matched stop string at the end of the text", default=False,
                                       routes=frozenset({OPENAI}))
    skip_special_tokens: bool = request_field("false: special tokens appear in the text", default=True,
                                              routes=frozenset({OPENAI}))
    # Structured output (SGLang's names, plus llguidance's Lark), at most one: the output must match it
    # (engine/decoding/constrained.py). json_schema: the schema as JSON text (an object is accepted and serialised;
    # the OpenAI routes take it as response_format).
    json_schema: str | None = request_field("the output follows this JSON schema", min_length=1)
    regex: str | None = request_field("the output matches this regular expression", min_length=1,
                                      routes=frozenset({OPENAI}))
    ebnf: str | None = request_field("the output follows this grammar (GBNF, as SGLang and llama.cpp write it)",
                                     min_length=1, routes=frozenset({OPENAI}))
    lark: str | None = request_field("the output follows this Lark grammar (llguidance)", min_length=1,
                                     routes=frozenset({OPENAI}))
    # Watching the decoding (docs/denoise.md): an event per forward on a stream, and the step maps in meta_info
    stream_denoise: bool = request_field("an event per forward on a stream (docs/denoise.md)", default=False,
                                         routes=frozenset({OPENAI, RESPONSES, GENERATE_TOP}), dial=True)
    return_step_maps: bool = request_field("the step maps in the answer (docs/denoise.md)", default=False,
                                           routes=frozenset({OPENAI, RESPONSES, GENERATE_TOP}), dial=True)
    # "placement" (docs/rl.md): the step maps carry each token's log-probability in the forward that placed it,
    # and each edit's in the forward that made it (implies return_step_maps); None: the step maps without them
    logprob_mode: str | None = request_field(
        "placement: the step maps carry placement log-probabilities (docs/rl.md)", choices=("placement",),
        message='logprob_mode must be "placement" (or absent), got {value!r}', routes=frozenset({GENERATE_TOP}))

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        if raw is None:
            return cls()
        if isinstance(raw, SamplingParams):
            return raw
        if not isinstance(raw, dict):
            raise SamplingParamsError(f"sampling_params must be an object, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise SamplingParamsError(f"unsupported sampling parameter(s): {', '.join(unknown)}", unknown[0])
        values = dict(raw)
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if values.get(key) is None:
                values.pop(key, None)
            elif not isinstance(values[key], (list, tuple)):
                raise SamplingParamsError(f"{key} must be a list", key)
            else:
                values[key] = tuple(values[key])
        if isinstance(values.get("json_schema"), (dict, bool)):
            values["json_schema"] = json.dumps(values["json_schema"])
        if values.get("logit_bias") is not None:
            values["logit_bias"] = _logit_bias_pairs(values["logit_bias"])
        else:
            values.pop("logit_bias", None)
        return cls(**values)

    def __post_init__(self) -> None:
        check_fields(self, FIELDS.values())  # the declared type and range of each field (protocol/fields.py)
        _check_containers(self)

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, source) of the request's output constraint, or None."""
        return next(((n, getattr(self, n)) for n in GRAMMAR_FIELDS if getattr(self, n) is not None), None)


# ---- what the other places read of the declarations above ----------------------------------------------------
FIELDS: dict[str, FieldSpec] = field_specs(SamplingParams)
# the fields of the defaults chain (a Defaults level may set them), and those the mode presets set
CHAINED: tuple[str, ...] = tuple(name for name, spec in FIELDS.items() if spec.chained)
PRESET_FIELDS: tuple[str, ...] = tuple(name for name, spec in FIELDS.items() if spec.preset is not None)
# mode -> its preset's values of PRESET_FIELDS (threshold, edit_threshold, max_post_steps)
PRESETS: dict[str, tuple[Any, ...]] = {mode: tuple(FIELDS[n].preset[mode] for n in PRESET_FIELDS)  # type: ignore[index]
                                       for mode in ("Q", "S")}
# Level 4: what a request gets when no level names a value. max_new_tokens from here (or from any default
# level) is capped by the context left after the prompt, so a default never makes a request too long. (The
# decoder's built-in is "threshold": startup puts "levenshtein" in a level of its own for a checkpoint with
# DELETE/SPLIT.)
BUILTIN_DEFAULTS: dict[str, Any] = {name: spec.builtin for name, spec in FIELDS.items() if spec.builtin is not None}


def check_fields(values: Any, specs: Any) -> None:
    """SamplingParamsError naming the first field of `specs` whose value in `values` is outside its declared type
    or range (the fields routes shape themselves, stop or logit_bias, are `_check_containers`' job)."""
    for spec in specs:
        if spec.scalar and (why := refusal(spec, getattr(values, spec.name))) is not None:
            raise SamplingParamsError(why, spec.name)


def _check_containers(p: SamplingParams) -> None:
    def fail(msg: str, param: str) -> None:
        raise SamplingParamsError(msg, param)

    if len(p.stop) > MAX_STOP_STRINGS:
        fail(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
    if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN for s in p.stop):
        fail(f"stop strings must have 1 to {MAX_STOP_LEN} characters", "stop")
    if len(p.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        fail(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
    if any(not is_int(t) or not 0 <= t <= INT64_MAX for t in p.stop_token_ids):
        fail("stop_token_ids must hold token ids (integers >= 0)", "stop_token_ids")
    if not isinstance(p.logit_bias, tuple) or len(p.logit_bias) > MAX_LOGIT_BIAS:
        fail(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
    for tok, bias in p.logit_bias:
        if not is_int(tok) or not 0 <= tok <= INT64_MAX or not is_num(bias) or not -100.0 <= bias <= 100.0:
            fail("logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]", "logit_bias")
    named = [name for name in GRAMMAR_FIELDS if getattr(p, name) is not None]
    if len(named) > 1:
        fail(f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set; got {', '.join(named)}", named[1])


@dataclass(frozen=True)
class Defaults(SamplingParams):
    """One level of defaults below the request (operator flags, the checkpoint, or generation_config.json): a
    SamplingParams that names only fields of the defaults chain (CHAINED); None = not set."""

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name not in CHAINED and getattr(self, f.name) != f.default:
                raise SamplingParamsError(f"{f.name} is not a field of the defaults chain", f.name)
        check_fields(self, (FIELDS[name] for name in CHAINED))

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any]) -> "Defaults":
        """The keys redraft reads from a checkpoint's generation_config.json (each field's `generation_config`:
        `editing_threshold` is the diffusers spelling of edit_threshold); anything else there is ignored."""
        values = {}
        for name in CHAINED:
            value = next((raw[k] for k in FIELDS[name].generation_config if raw.get(k) is not None), None)
            if value is not None:
                values[name] = value
        if values.get("top_k") == 0:
            values["top_k"] = -1  # HF's "off"
        try:
            return cls(**values)
        except SamplingParamsError as exc:
            raise ValueError(f"generation_config.json: {exc}") from exc


def _logit_bias_pairs(raw: Any) -> tuple[tuple[int, float], ...]:
    """{"123": 5.0} or {123: 5.0} (OpenAI's JSON keys are strings) -> ((123, 5.0),), sorted by token id."""
    if not isinstance(raw, dict):
        raise SamplingParamsError("logit_bias must be an object mapping token ids to biases", "logit_bias")
    pairs = []
    for key, bias in raw.items():
        try:
            tok = int(key) if not isinstance(key, bool) else None
        except (TypeError, ValueError):
            tok = None
        if tok is None or (isinstance(key, str) and not key.strip().lstrip("-").isdigit()):
            raise SamplingParamsError(f"logit_bias key {key!r} is not a token id", "logit_bias")
        pairs.append((tok, bias))
    return tuple(sorted(pairs))


@dataclass(frozen=True)
class ResolvedParams:
    """Every value the decoding of one request uses, after `resolve`: nothing is left unset. (The engine's view of
    the request: the fields it reads, typed as it reads them; their ranges and defaults are SamplingParams'.)"""

    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    mode: str  # "S" or "Q" (auto resolved by domain)
    threshold: float
    edit_threshold: float
    max_post_steps: int
    mbe_window: int
    domain: str | None
    logprobs: bool
    top_logprobs: int
    stutter_penalty: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    grammar: tuple[str, str] | None = None  # (constraint field, source): structured output
    stream_denoise: bool = False  # an event per forward (scheduler/denoise_trace.py)
    return_step_maps: bool = False  # meta_info.step_maps
    placement_logprobs: bool = False  # logprob_mode "placement": the step maps carry placement log-probabilities
    decoder: str = "threshold"  # a name of DECODER_TRAITS (engine/decoding/registry.py: its rule)
    steps: int = 32
    max_steps_per_block: int = 1000

    @property
    def ends_blocks_after_forward(self) -> bool:
        """The decoder's trait (DECODER_TRAITS): its blocks end only by a forward's verdict."""
        return DECODER_TRAITS[self.decoder].ends_blocks_after_forward

    @property
    def wants_logprobs(self) -> bool:
        """Whether each forward computes the window's log-probabilities (for the output's, or the placements')."""
        return self.logprobs or self.top_logprobs > 0 or self.placement_logprobs

    @property
    def has_logit_controls(self) -> bool:
        return bool(self.stutter_penalty or self.frequency_penalty or self.presence_penalty
                    or self.repetition_penalty != 1.0 or self.logit_bias or self.min_tokens)


# the request's own fields the engine reads as they are (no level of the chain sets them)
_FROM_REQUEST = tuple(f.name for f in fields(ResolvedParams) if f.name in FIELDS and f.name not in CHAINED)


def effective_mode(mode: str, domain: str | None) -> str:
    """S or Q: `auto` means S for the code and math domains, Q otherwise."""
    if mode == "auto":
        return "S" if (domain or "").lower() in AUTO_SPEED_DOMAINS else "Q"
    return mode


def _mode_values(chain: Sequence[SamplingParams], mode: str) -> dict[str, Any]:
    """PRESET_FIELDS (threshold, edit_threshold, max_post_steps): each from the highest level of `chain` that
    names it or a mode (a named mode's preset wins over lower levels' values), else `mode`'s preset."""
    decoding = dict(zip(PRESET_FIELDS, PRESETS[mode]))
    for name in decoding:
        for level in chain:
            if getattr(level, name) is not None:
                decoding[name] = getattr(level, name)
                break
            if level.mode is not None:
                break
    return decoding


def _as_declared(name: str, value: Any) -> Any:
    """A number as its field's kind (an int sent for a float field reads as a float)."""
    kind = FIELDS[name].kind
    return kind(value) if value is not None and kind in (int, float) else value


def resolve(params: SamplingParams, levels: Sequence[Defaults] = (), *, prompt_len: int = 0,
            max_model_len: int | None = None) -> ResolvedParams:
    """THE chain of defaults (module docstring): request, then each of `levels` in order, then the built-ins."""
    chain: list[SamplingParams] = [params, *levels]

    def first(name: str) -> tuple[Any, bool]:
        """(value, whether the request itself set it)."""
        for i, level in enumerate(chain):
            value = getattr(level, name)
            if value is not None:
                return value, i == 0
        return BUILTIN_DEFAULTS[name], False

    decoder = first("decoder")[0]
    named_mode = next((level.mode for level in chain if level.mode is not None), None)
    mode = effective_mode(named_mode or DECODER_TRAITS[decoder].default_mode or BUILTIN_DEFAULTS["mode"],
                          params.domain)
    values = {name: getattr(params, name) for name in _FROM_REQUEST}
    values.update({name: first(name)[0] for name in CHAINED if name != "mode" and name not in PRESET_FIELDS})
    values.update(_mode_values(chain, mode))
    values = {name: _as_declared(name, value) for name, value in values.items()}
    max_new, from_request = first("max_new_tokens")
    if not from_request and max_model_len is not None:
        values["max_new_tokens"] = max(1, min(int(max_new), max_model_len - prompt_len))
    if values["top_k"] == 0:
        values["top_k"] = -1
    placement = params.logprob_mode == "placement"
    values.update(mode=mode, logit_bias=tuple((t, float(b)) for t, b in params.logit_bias), grammar=params.grammar,
                  return_step_maps=params.return_step_maps or placement, placement_logprobs=placement)
    return ResolvedParams(**values)
