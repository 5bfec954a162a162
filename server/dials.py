"""redraft's per-request dials, and the other places a request may carry them so that they survive a router.

Direct clients send each dial at the top level of the body (what the OpenAI SDK's `extra_body` does) or, on
`/generate`, inside `sampling_params`. SGLang's routers re-serialise a request through their own types and drop
fields they do not know; what they keep (measured: docs/scaling.md) are free-form maps, so a dial may also be
spelt by its own name inside one of them:

    chat_template_kwargs: {"mode": "S"}            chat; kept by sglang-router 0.3 and smg
    metadata: {"threshold": "0.9"}                 chat and completions (kept by both), /generate (smg);
                                                   values are strings there (OpenAI types metadata so)
    sampling_params.custom_params: {"mode": "S"}   /generate (smg)

A dial given by two routes must have one value; two different values are a 400 that names both.
"""

from __future__ import annotations

from typing import Any

from redraft.server.request_fields import dial_types

# dial -> the type its value has (strings from `metadata` are parsed into it): the request fields declared with
# `dial=True` (protocol/sampling_params.py SamplingParams)
DIALS: dict[str, type] = dial_types()
BOOL_WORDS = {"true": True, "false": False, "1": True, "0": False}


class DialError(ValueError):
    """A dial that cannot be read, or one given twice with two values; `param` names where."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def parse_dial(name: str, value: Any, where: str) -> Any:
    """A carried value as the dial's type: '0.9' -> 0.9, '2' -> 2; DialError naming `where` otherwise."""
    kind = DIALS[name]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lower() in BOOL_WORDS:
            return BOOL_WORDS[value.strip().lower()]
        raise DialError(f"{where} must be a boolean, got {value!r}", where)
    if isinstance(value, bool):
        raise DialError(f"{where} must be a {kind.__name__}, got {value!r}", where)
    if kind is str:
        if not isinstance(value, str):
            raise DialError(f"{where} must be a string, got {value!r}", where)
        return value
    if isinstance(value, (int, float)) and (kind is float or isinstance(value, int)):
        return kind(value)
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            pass
    raise DialError(f"{where} must be {'a number' if kind is float else 'an integer'}, got {value!r}", where)


def _same(name: str, a: Any, b: Any) -> bool:
    try:
        return parse_dial(name, a, name) == parse_dial(name, b, name)
    except DialError:
        return a == b


def lift_dials(target: dict[str, Any], carriers: dict[str, dict[str, Any] | None], prefix: str = "") -> dict[str, Any]:
    """`target` with every dial found in a carrier map (carrier path -> the map) set on it, parsed; DialError when
    two routes give one dial two values. `prefix` names `target` in messages (e.g. 'sampling_params.')."""
    out = dict(target)
    origin = {name: f"{prefix}{name}" for name in DIALS if out.get(name) is not None}
    for path, carried in carriers.items():
        if not isinstance(carried, dict):
            continue
        for name in DIALS:
            if carried.get(name) is None:
                continue
            where = f"{path}.{name}"
            value = parse_dial(name, carried[name], where)
            if name in origin:
                if not _same(name, out[name], value):
                    raise DialError(f"{name} is given twice with different values: {origin[name]} = "
                                    f"{out[name]!r}, {where} = {carried[name]!r}", where)
                continue
            out[name], origin[name] = value, where
    return out


def without_dials(carried: dict[str, Any] | None) -> dict[str, Any] | None:
    """A carrier map with the dials taken out (chat_template_kwargs must not hand them to the template)."""
    if carried is None:
        return None
    return {k: v for k, v in carried.items() if k not in DIALS}
