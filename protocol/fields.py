"""The per-request fields, each declared once: `request_field` and `FieldSpec`. Torch-free, pydantic-free.

A field of `SamplingParams` (protocol/sampling_params.py) is declared there with `request_field(...)`: its name,
type and default are the dataclass field's; its range or allowed values, the routes that carry it, the levels of
the defaults chain that may set it, its command-line flag and its help ride in the field's metadata as a
`FieldSpec`. `field_specs` reads them back, completed with the name, type and default. Everything else that
knows a field reads it from there:

    validation                 SamplingParams / Defaults (`refusal`, below)
    the defaults chain         Defaults' fields, BUILTIN_DEFAULTS, PRESETS, generation_config.json's keys,
                               the operator's flags (ServerArgs.request_defaults)
    the HTTP models            server/request_fields.py: the pydantic fields of the chat, completions and
                               /generate bodies (those a body shapes its own way from the field's `shapes`), the
                               dials, the fields Responses carries, OpenAI's spellings
    the command line           `redraft generate`'s request flags (redraft/cli.py), `redraft eval-demo --set`'s
                               parameters (training/evaluate.py SWEEPABLE)
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from types import NoneType, UnionType
from typing import Any, Mapping

INT64_MAX = 2**63 - 1

# Where a client may send a field besides /generate's `sampling_params` (which takes every field):
OPENAI = "openai"  # the body of /v1/chat/completions and /v1/completions (extra_body for the OpenAI SDK)
RESPONSES = "responses"  # /v1/responses' extra_body, handed on to the chat request it becomes
GENERATE_TOP = "generate_top"  # /generate's body itself, as SGLang's return_* flags
ROUTES = (OPENAI, RESPONSES, GENERATE_TOP)
CHAT_AND_RESPONSES = frozenset({OPENAI, RESPONSES})
# The bodies that spell a field their own way (FieldSpec.shapes): OPENAI for the part chat and completions share,
# then each route's own body
CHAT, COMPLETIONS, RESPONSES_BODY, GENERATE_BODY = "chat", "completions", "responses_body", "generate_body"
BODIES = (OPENAI, CHAT, COMPLETIONS, RESPONSES_BODY, GENERATE_BODY)


@dataclass(frozen=True)
class Shape:
    """How one body carries a field in a shape of its own: `stop` as a string or a list, `logit_bias` as an object,
    `logprobs` a flag on chat and a count of alternatives on completions, SGLang's `top_logprobs_num`."""

    annotation: Any  # the body's type (a typing expression; the HTTP side adds `| None` where the default is None)
    default: Any = None
    bounds: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # pydantic Field's ge / le / max_length
    name: str | None = None  # the body's name for it, where it differs
    help: str | None = None  # the body's meaning, where it differs


@dataclass(frozen=True)
class FieldSpec:
    """Everything about one per-request field (module docstring). `name`, `kind` and `default` come from the
    dataclass field; the rest from `request_field`."""

    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple[str, ...] | None = None
    min_length: int | None = None  # of a string
    max_length: int | None = None
    message: str | None = None  # the refusal where the generic one does not fit ({name}, {value} filled in)
    routes: frozenset[str] = frozenset()  # of ROUTES
    openai_name: str | None = None  # what the OpenAI routes call it, where they spell it otherwise
    openai: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # its pydantic Field arguments there,
    # where they differ from the engine's check (OpenAI caps temperature at 2)
    dial: bool = False  # also carried in the maps a router keeps (server/dials.py)
    builtin: Any = None  # the defaults chain's last level (None: not a field of the chain, or no built-in)
    preset: Mapping[str, Any] | None = None  # mode -> its value in that mode's preset
    generation_config: tuple[str, ...] = ()  # the keys generation_config.json may hold it under, first wins
    operator_flag: str | None = None  # the ServerArgs field of the operator's level
    cli: bool = False  # a flag of `redraft generate` (--the-name)
    shapes: Mapping[str, Shape] = dataclasses.field(default_factory=dict)  # body (BODIES) -> its own shape there
    sweep: bool = False  # a parameter `redraft eval-demo --set` may change in every setting (training/evaluate.py)
    name: str = ""
    kind: type = object  # int, float, str, bool; tuple for the fields routes shape themselves
    default: Any = None

    @property
    def chained(self) -> bool:
        """A field the defaults chain resolves (a Defaults level may set it)."""
        return self.builtin is not None or self.preset is not None

    @property
    def scalar(self) -> bool:
        return self.kind in (int, float, str, bool)

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def request_field(help: str, *, default: Any = None, **spec: Any) -> Any:
    """A SamplingParams field with its FieldSpec (the keyword arguments of FieldSpec besides name/kind/default)."""
    return dataclasses.field(default=default, metadata={"spec": FieldSpec(help, **spec)})


def _kind(annotation: Any) -> type:
    """int | None -> int; tuple[...] -> tuple."""
    args = [a for a in typing.get_args(annotation) if a is not NoneType] \
        if typing.get_origin(annotation) in (typing.Union, UnionType) else [annotation]
    base = typing.get_origin(args[0]) or args[0]
    return base if len(args) == 1 else object


def field_specs(cls: type) -> dict[str, FieldSpec]:
    """name -> FieldSpec of every field of the dataclass `cls` declared with request_field, in order."""
    hints = typing.get_type_hints(cls)
    return {f.name: dataclasses.replace(f.metadata["spec"], name=f.name, kind=_kind(hints[f.name]),
                                        default=f.default)
            for f in dataclasses.fields(cls) if "spec" in f.metadata}


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


TYPE_CHECKS = {int: is_int, float: is_num, str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}


def generic_message(spec: FieldSpec) -> str:
    """The refusal of a value outside the field's type or range, from its spec: 'threshold must be a number in
    [0, 1]'. A template: {name} and {value} are filled in by `refusal`."""
    if spec.choices is not None:
        return "{name} must be one of " + ", ".join(spec.choices) + ", got {value!r}"
    if spec.kind is bool:
        return "{name} must be a boolean"
    if spec.kind is str:
        if spec.max_length is not None:
            return "{name} must be a string of at most " + str(spec.max_length) + " characters"
        return "{name} must be a non-empty string" if spec.min_length else "{name} must be a string"
    what = "an integer" if spec.kind is int else "a number"
    if spec.le is None or spec.le >= INT64_MAX:
        return "{name} must be " + f"{what} >= {spec.ge:g}"
    return "{name} must be " + f"{what} in [{spec.ge:g}, {spec.le:g}]"


def refusal(spec: FieldSpec, value: Any) -> str | None:
    """Why `value` is not a valid value of the field (None: it is). An unset field (None where the default is None)
    is always valid."""
    if value is None and spec.default is None:
        return None
    if spec.choices is not None:
        ok = value in spec.choices
    else:
        ok = TYPE_CHECKS[spec.kind](value) and _in_range(spec, value)
    return None if ok else (spec.message or generic_message(spec)).format(name=spec.name, value=value)


def _in_range(spec: FieldSpec, value: Any) -> bool:
    size = len(value) if isinstance(value, str) else value
    low, high = (spec.min_length, spec.max_length) if isinstance(value, str) else (spec.ge, spec.le)
    return ((low is None or size >= low) and (high is None or size <= high)
            and (spec.gt is None or size > spec.gt))
