"""Per-request decoding parameters, the mode presets, and the one function that resolves defaults. Torch-free.

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

BLOCK_SIZE = 32  # LLaDA2.1 decodes in blocks of 32 tokens; one KV page holds exactly one block.

PRESETS: dict[str, tuple[float, float, int]] = {
    "Q": (0.7, 0.5, 16),
    "S": (0.5, 0.0, 16),
}
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
INT64_MAX = 2**63 - 1
MAX_DOMAIN_LEN = 64  # as on the OpenAI routes: a label, not a text
GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "lark")  # structured output: the constraint fields

# Level 4: what a request gets when no level names a value. max_new_tokens from here (or from any default
# level) is capped by the context left after the prompt, so a default never makes a request too long.
BUILTIN_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": 1024,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "mode": "Q",
    "mbe_window": 1,
    "decoder": "threshold",  # startup puts "levenshtein" in a level of its own for a checkpoint with DELETE/SPLIT
    "steps": 32,
    "max_steps_per_block": 1000,
}


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; `param` names it (for the API's error body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Defaults:
    """One level of defaults below the request (operator flags, or generation_config.json); None = not set."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    mode: str | None = None
    threshold: float | None = None
    edit_threshold: float | None = None
    max_post_steps: int | None = None
    mbe_window: int | None = None
    decoder: str | None = None
    steps: int | None = None
    max_steps_per_block: int | None = None

    def __post_init__(self) -> None:
        _validate_common(self)

    @classmethod
    def from_generation_config(cls, raw: dict[str, Any]) -> "Defaults":
        """The keys redraft reads from a checkpoint's generation_config.json (`editing_threshold` is the
        diffusers spelling of edit_threshold); anything else there is ignored."""
        values = {k: raw[k] for k in ("max_new_tokens", "temperature", "top_p", "top_k", "threshold",
                                      "edit_threshold", "max_post_steps", "steps", "max_steps_per_block")
                  if raw.get(k) is not None}
        if "edit_threshold" not in values and raw.get("editing_threshold") is not None:
            values["edit_threshold"] = raw["editing_threshold"]
        if values.get("top_k") == 0:
            values["top_k"] = -1  # HF's "off"
        try:
            return cls(**values)
        except SamplingParamsError as exc:
            raise ValueError(f"generation_config.json: {exc}") from exc


@dataclass(frozen=True)
class SamplingParams:
    """What one request asks for (SGLang's sampling_params keys plus the diffusion ones). None = unset."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    mode: str | None = None  # "S" | "Q" | "auto"
    threshold: float | None = None
    edit_threshold: float | None = None
    max_post_steps: int | None = None
    mbe_window: int | None = None
    decoder: str | None = None  # "levenshtein" | "threshold" (LLaDA2.2 checkpoints: docs/llada22.md)
    steps: int | None = None  # Levenshtein step: scheduled transfers per block
    max_steps_per_block: int | None = None  # Levenshtein step: hard cap (the last step is a final round)
    domain: str | None = None
    logprobs: bool = False  # per-token logprobs (of the forward that last saw each block)
    top_logprobs: int = 0  # and the top alternatives at each position, 0..20
    # Logit controls (engine/decoding/logit_controls.py defines them for block diffusion)
    stutter_penalty: float = 0.0  # >= 0: lowers the logit of the token the previous position holds
    frequency_penalty: float = 0.0  # -2..2, per occurrence in the committed output (OpenAI)
    presence_penalty: float = 0.0  # -2..2, once per token present in the committed output (OpenAI)
    repetition_penalty: float = 1.0  # 0.01..100, on tokens of the prompt or the committed output (HF / vLLM)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, -100..100), at most 300 (OpenAI)
    min_tokens: int = 0  # no EOS / stop token before this many output tokens (vLLM)
    # Output text (SGLang's; the HTTP side's detokenizer applies them, the engine never sees them)
    no_stop_trim: bool = False  # keep the matched stop string at the end of the text
    skip_special_tokens: bool = True  # False: special tokens appear in the text
    # Structured output (SGLang's names, plus llguidance's Lark), at most one: the output must match it
    # (engine/decoding/constrained.py). json_schema: the schema as JSON text (an object is accepted and serialised).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None  # GBNF, as SGLang and llama.cpp write it
    lark: str | None = None
    # Watching the decoding (docs/denoise.md): an event per forward on a stream, and the step maps in meta_info
    stream_denoise: bool = False
    return_step_maps: bool = False
    # "placement" (docs/rl.md): the step maps carry each token's log-probability in the forward that placed it,
    # and each edit's in the forward that made it (implies return_step_maps); None: the step maps without them
    logprob_mode: str | None = None

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
        def fail(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        _validate_common(self)
        # seed travels to the model runner as an int64 tensor: a larger value would crash its step.
        if self.seed is not None and (not _is_int(self.seed) or not -INT64_MAX - 1 <= self.seed <= INT64_MAX):
            fail("seed must be an integer in [-2^63, 2^63)", "seed")
        if len(self.stop) > MAX_STOP_STRINGS:
            fail(f"at most {MAX_STOP_STRINGS} stop strings", "stop")
        if any(not isinstance(s, str) or not 1 <= len(s) <= MAX_STOP_LEN for s in self.stop):
            fail(f"stop strings must have 1 to {MAX_STOP_LEN} characters", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            fail(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
        if any(not _is_int(t) or not 0 <= t <= INT64_MAX for t in self.stop_token_ids):
            fail("stop_token_ids must hold token ids (integers >= 0)", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos must be a boolean", "ignore_eos")
        if not isinstance(self.logprobs, bool):
            fail("logprobs must be a boolean", "logprobs")
        for name in ("no_stop_trim", "skip_special_tokens", "stream_denoise", "return_step_maps"):
            if not isinstance(getattr(self, name), bool):
                fail(f"{name} must be a boolean", name)
        if self.logprob_mode not in (None, "placement"):
            fail(f"logprob_mode must be \"placement\" (or absent), got {self.logprob_mode!r}", "logprob_mode")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            fail("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        if self.domain is not None and (not isinstance(self.domain, str) or len(self.domain) > MAX_DOMAIN_LEN):
            fail(f"domain must be a string of at most {MAX_DOMAIN_LEN} characters", "domain")
        if not _is_num(self.stutter_penalty) or not 0.0 <= self.stutter_penalty <= 100.0:
            fail("stutter_penalty must be a number in [0, 100]", "stutter_penalty")
        for name in ("frequency_penalty", "presence_penalty"):
            v = getattr(self, name)
            if not _is_num(v) or not -2.0 <= v <= 2.0:
                fail(f"{name} must be a number in [-2, 2]", name)
        # below 0.01 a seen token's logit is scaled past float range (inf, then NaN): no useful value lives there
        if not _is_num(self.repetition_penalty) or not 0.01 <= self.repetition_penalty <= 100.0:
            fail("repetition_penalty must be a number in [0.01, 100]", "repetition_penalty")
        if not isinstance(self.logit_bias, tuple) or len(self.logit_bias) > MAX_LOGIT_BIAS:
            fail(f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases", "logit_bias")
        for tok, bias in self.logit_bias:
            if not _is_int(tok) or not 0 <= tok <= INT64_MAX or not _is_num(bias) or not -100.0 <= bias <= 100.0:
                fail("logit_bias maps token ids (integers >= 0) to numbers in [-100, 100]", "logit_bias")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= INT64_MAX:
            fail("min_tokens must be an integer >= 0", "min_tokens")
        named = [name for name in GRAMMAR_FIELDS if getattr(self, name) is not None]
        for name in named:
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                fail(f"{name} must be a non-empty string", name)
        if len(named) > 1:
            fail(f"at most one of {', '.join(GRAMMAR_FIELDS)} may be set; got {', '.join(named)}", named[1])

    @property
    def grammar(self) -> tuple[str, str] | None:
        """(field, source) of the request's output constraint, or None."""
        return next(((n, getattr(self, n)) for n in GRAMMAR_FIELDS if getattr(self, n) is not None), None)


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


def _validate_common(p: SamplingParams | Defaults) -> None:
    """Ranges of the fields a request and a defaults level share (None always passes)."""
    def fail(msg: str, param: str) -> None:
        raise SamplingParamsError(msg, param)

    if p.max_new_tokens is not None and (not _is_int(p.max_new_tokens) or p.max_new_tokens < 1):
        fail("max_new_tokens must be an integer >= 1", "max_new_tokens")
    if p.temperature is not None and (not _is_num(p.temperature) or not 0.0 <= p.temperature <= 100.0):
        fail("temperature must be a number in [0, 100]", "temperature")
    if p.top_p is not None and (not _is_num(p.top_p) or not 0.0 < p.top_p <= 1.0):
        fail("top_p must be in (0, 1]", "top_p")
    if p.top_k is not None and (not _is_int(p.top_k) or not -1 <= p.top_k <= INT64_MAX):
        fail("top_k must be an integer in [-1, 2^63) (-1 or 0 disables it)", "top_k")
    if p.mode is not None and p.mode not in MODES:
        fail(f"mode must be one of {', '.join(MODES)}, got {p.mode!r}", "mode")
    for name in ("threshold", "edit_threshold"):
        v = getattr(p, name)
        if v is not None and (not _is_num(v) or not 0.0 <= v <= 1.0):
            fail(f"{name} must be a number in [0, 1]", name)
    if p.max_post_steps is not None and (not _is_int(p.max_post_steps) or not 0 <= p.max_post_steps <= 1024):
        fail("max_post_steps must be an integer in [0, 1024]", "max_post_steps")
    if p.mbe_window is not None and (not _is_int(p.mbe_window) or not 1 <= p.mbe_window <= MAX_MBE_WINDOW):
        fail(f"mbe_window must be an integer in [1, {MAX_MBE_WINDOW}]", "mbe_window")
    if p.decoder is not None and p.decoder not in DECODERS:
        fail(f"decoder must be one of {', '.join(DECODERS)}, got {p.decoder!r}", "decoder")
    for name in ("steps", "max_steps_per_block"):
        v = getattr(p, name)
        if v is not None and (not _is_int(v) or not 1 <= v <= MAX_STEPS):
            fail(f"{name} must be an integer in [1, {MAX_STEPS}]", name)


@dataclass(frozen=True)
class ResolvedParams:
    """Every value the decoding of one request uses, after `resolve`: nothing is left unset."""

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
    decoder: str = "threshold"  # "levenshtein": LLaDA2.2's insert/delete step (engine/decoding/levenshtein.py)
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


def effective_mode(mode: str, domain: str | None) -> str:
    """S or Q: `auto` means S for the code and math domains, Q otherwise."""
    if mode == "auto":
        return "S" if (domain or "").lower() in AUTO_SPEED_DOMAINS else "Q"
    return mode


def _mode_values(chain: Sequence[SamplingParams | Defaults], mode: str) -> dict[str, Any]:
    """threshold, edit_threshold and max_post_steps: each from the highest level of `chain` that names it or a
    mode (a named mode's preset wins over lower levels' values), else `mode`'s preset."""
    decoding = dict(zip(("threshold", "edit_threshold", "max_post_steps"), PRESETS[mode]))
    for name in decoding:
        for level in chain:
            if getattr(level, name) is not None:
                decoding[name] = getattr(level, name)
                break
            if level.mode is not None:
                break
    return decoding


def resolve(params: SamplingParams, levels: Sequence[Defaults] = (), *, prompt_len: int = 0,
            max_model_len: int | None = None) -> ResolvedParams:
    """THE chain of defaults (module docstring): request, then each of `levels` in order, then the built-ins."""
    chain: list[SamplingParams | Defaults] = [params, *levels]

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
    decoding = _mode_values(chain, mode)
    max_new, from_request = first("max_new_tokens")
    if not from_request and max_model_len is not None:
        max_new = max(1, min(max_new, max_model_len - prompt_len))
    top_k = first("top_k")[0]
    return ResolvedParams(
        max_new_tokens=int(max_new),
        temperature=float(first("temperature")[0]),
        top_p=float(first("top_p")[0]),
        top_k=-1 if top_k == 0 else int(top_k),
        seed=params.seed,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        mode=mode,
        threshold=float(decoding["threshold"]),
        edit_threshold=float(decoding["edit_threshold"]),
        max_post_steps=int(decoding["max_post_steps"]),
        mbe_window=int(first("mbe_window")[0]),
        domain=params.domain,
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        stutter_penalty=float(params.stutter_penalty),
        frequency_penalty=float(params.frequency_penalty),
        presence_penalty=float(params.presence_penalty),
        repetition_penalty=float(params.repetition_penalty),
        logit_bias=tuple((t, float(b)) for t, b in params.logit_bias),
        min_tokens=params.min_tokens,
        grammar=params.grammar,
        stream_denoise=params.stream_denoise,
        return_step_maps=params.return_step_maps or params.logprob_mode == "placement",
        placement_logprobs=params.logprob_mode == "placement",
        decoder=decoder,
        steps=int(first("steps")[0]),
        max_steps_per_block=int(first("max_steps_per_block")[0]),
    )
