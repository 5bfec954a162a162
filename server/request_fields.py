"""The HTTP side of the per-request fields: what the request bodies, the dials, Responses' extras and the routes'
spellings are, read from each field's one declaration (`SamplingParams`, protocol/fields.py).

`pydantic_fields(route)` gives the pydantic fields a route's body model is made with (`pydantic.create_model`):
the field's allowed values as a Literal, its range as ge / gt / le or min / max_length (the route's own bound
where it differs: OpenAI's temperature cap), its help as the OpenAPI description, null for unset (a flag has its
default). `shaped_fields(body)` gives those a body spells its own way, from the same declarations (`stop` as a
string or a list, `logit_bias` as an object, `logprobs` a flag on chat and a count on completions, SGLang's
`top_logprobs_num`). tests/test_request_fields.py checks that every field a route carries is in its model.
"""

from __future__ import annotations

from typing import Any, Iterable, Literal, Mapping

from pydantic import Field

from redraft.protocol.fields import OPENAI, FieldSpec
from redraft.protocol.sampling_params import FIELDS


def pydantic_field(spec: FieldSpec, route: str = "") -> tuple[Any, Any]:
    """(annotation, FieldInfo) of one scalar field in a body of `route` (module docstring)."""
    if spec.kind is bool:
        return bool, Field(default=spec.default, description=spec.help)
    annotation: Any = Literal[spec.choices] if spec.choices is not None else spec.kind  # type: ignore[valid-type]
    bounds = {k: getattr(spec, k) for k in ("ge", "gt", "le", "min_length", "max_length")
              if getattr(spec, k) is not None}
    if route == OPENAI:  # the route's own bounds (None: none there, the engine's check answers)
        bounds = {k: v for k, v in {**bounds, **spec.openai}.items() if v is not None}
    return annotation | None, Field(default=None, description=spec.help, **bounds)


def pydantic_fields(route: str, *, skip: Iterable[str] = (), only: Iterable[str] | None = None,
                    specs: Mapping[str, FieldSpec] = FIELDS) -> dict[str, tuple[Any, Any]]:
    """name -> (annotation, FieldInfo) of the scalar fields `route` carries (or of `only`), less `skip` (those its
    model declares in a shape of its own), in declaration order: `create_model`'s field arguments."""
    names = carried(route, specs) if only is None else tuple(only)
    return {name: pydantic_field(specs[name], route) for name in names
            if name not in set(skip) and specs[name].scalar}


def shaped_fields(body: str, specs: Mapping[str, FieldSpec] = FIELDS) -> dict[str, tuple[Any, Any]]:
    """name -> (annotation, FieldInfo) of the fields `body` (protocol/fields.py BODIES) spells its own way (each
    declared field's `shapes`), under the body's name for each, in declaration order."""
    out = {}
    for name, spec in specs.items():
        if (shape := spec.shapes.get(body)) is not None:
            annotation = shape.annotation if shape.default is not None else shape.annotation | None
            out[shape.name or name] = (annotation, Field(default=shape.default, description=shape.help or spec.help,
                                                         **shape.bounds))
    return out


def carried(route: str, specs: Mapping[str, FieldSpec] = FIELDS) -> tuple[str, ...]:
    """The fields a client may send on `route` (protocol/fields.py ROUTES), in declaration order."""
    return tuple(name for name, spec in specs.items() if route in spec.routes)


def dial_types(specs: Mapping[str, FieldSpec] = FIELDS) -> dict[str, type]:
    """dial -> its value's type (server/dials.py)."""
    return {name: spec.kind for name, spec in specs.items() if spec.dial}


def openai_spellings(specs: Mapping[str, FieldSpec] = FIELDS) -> dict[str, str]:
    """The fields the OpenAI routes spell otherwise: SamplingParams' name -> theirs (max_new_tokens -> max_tokens)."""
    return {name: spec.openai_name for name, spec in specs.items() if spec.openai_name}
