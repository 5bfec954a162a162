"""Each per-request field is declared once (`SamplingParams` with `request_field`, protocol/fields.py) and every
other place reads that declaration: the validation's messages, the defaults chain, the HTTP bodies and their
OpenAPI schema, the dials, Responses' extras, OpenAI's spellings, the operator's flags and `redraft generate`'s
flags. A field added to the declarations appears in all of them."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import re
from pathlib import Path

import pytest
from pydantic import ValidationError, create_model

from redraft.cli import add_request_flags, build_parser
from redraft.protocol.fields import (BODIES, CHAT, COMPLETIONS, GENERATE_BODY, GENERATE_TOP, OPENAI, RESPONSES,
                                     RESPONSES_BODY, FieldSpec, Shape, refusal)
from redraft.protocol.sampling_params import (BUILTIN_DEFAULTS, CHAINED, FIELDS, PRESETS, Defaults, ResolvedParams,
                                              SamplingParams, SamplingParamsError)
from redraft.protocol.server_args import ServerArgs
from redraft.server.dials import DIALS
from redraft.server.native_api import GenerateBody
from redraft.server.openai_protocol import ChatCompletionRequest, CompletionRequest, _CommonShaped
from redraft.server.param_names import CHAT as CHAT_NAMES
from redraft.server.param_names import COMPLETIONS as COMPLETIONS_NAMES
from redraft.server.param_names import generate_names
from redraft.server.request_fields import carried, dial_types, openai_spellings, pydantic_fields, shaped_fields
from redraft.server.responses_api import CHAT_EXTRAS, ResponsesRequest
from redraft.training.evaluate import SWEEPABLE
from redraft.training.evaluate import main as evaluate_main

ROOT = Path(__file__).resolve().parents[1]
BOUND_KEYS = {"ge": "minimum", "gt": "exclusiveMinimum", "le": "maximum", "min_length": "minLength",
              "max_length": "maxLength"}


def schema_of(model, name: str) -> dict:
    """The JSON schema of one field of `model`, its non-null branch merged with the field's own keys."""
    prop = dict(model.model_json_schema()["properties"][name])
    for branch in prop.pop("anyOf", []):
        if branch.get("type") != "null":
            prop.update(branch)
    if "const" in prop:  # a one-value Literal
        prop["enum"] = [prop.pop("const")]
    return prop


def expected_schema(spec: FieldSpec, route: str) -> dict:
    bounds = {k: getattr(spec, k) for k in BOUND_KEYS if getattr(spec, k) is not None}
    if route == OPENAI:
        bounds = {k: v for k, v in {**bounds, **spec.openai}.items() if v is not None}
    want = {BOUND_KEYS[k]: v for k, v in bounds.items()} if spec.kind is not bool else {}
    want["description"] = spec.help
    if spec.choices is not None:
        want["enum"] = list(spec.choices)
    return want


def test_every_field_of_sampling_params_is_declared_with_its_spec() -> None:
    assert list(FIELDS) == [f.name for f in dataclasses.fields(SamplingParams)]
    assert all(spec.help and spec.name == name for name, spec in FIELDS.items())
    assert FIELDS["max_post_steps"].kind is int and FIELDS["threshold"].kind is float
    assert FIELDS["mode"].kind is str and FIELDS["ignore_eos"].kind is bool and FIELDS["stop"].kind is tuple
    # what the engine reads is a declared field, or one resolve derives (grammar, placement_logprobs)
    derived = {"grammar", "placement_logprobs"}
    assert {f.name for f in dataclasses.fields(ResolvedParams)} - derived <= set(FIELDS)


@pytest.mark.parametrize("model", [ChatCompletionRequest, CompletionRequest])
def test_the_openai_bodies_carry_each_declared_field_with_its_range_and_help(model) -> None:
    for name in carried(OPENAI):
        assert name in model.model_fields, name
        spec = FIELDS[name]
        if spec.scalar:
            got = schema_of(model, name)
            assert {k: got.get(k) for k in expected_schema(spec, OPENAI)} == expected_schema(spec, OPENAI), name
    # by hand: the figures the OpenAI routes had before the declarations moved (OpenAI caps temperature at 2)
    assert schema_of(model, "max_post_steps")["maximum"] == 1024 and schema_of(model, "temperature")["maximum"] == 2
    assert schema_of(model, "top_p")["exclusiveMinimum"] == 0 and schema_of(model, "mbe_window")["maximum"] == 8


def test_responses_and_generate_carry_what_the_declarations_say() -> None:
    assert set(carried(RESPONSES)) <= set(CHAT_EXTRAS) and set(CHAT_EXTRAS) - set(carried(RESPONSES)) == \
        {"chat_template_kwargs"}
    for name in ("temperature", "top_p"):
        assert schema_of(ResponsesRequest, name)["maximum"] == expected_schema(FIELDS[name], OPENAI)["maximum"]
    for name in carried(GENERATE_TOP):
        got = schema_of(GenerateBody, name)
        assert {k: got.get(k) for k in expected_schema(FIELDS[name], "")} == expected_schema(FIELDS[name], "")
    assert set(carried(GENERATE_TOP)) == {"stream_denoise", "return_step_maps", "logprob_mode"}


def test_the_dials_and_the_spellings_are_the_declared_ones() -> None:
    assert DIALS == {name: spec.kind for name, spec in FIELDS.items() if spec.dial}
    assert {"mode", "threshold", "edit_threshold", "max_post_steps", "stream_denoise"} <= set(DIALS)
    for dial in DIALS:  # a dial rides every OpenAI-shaped route
        assert {OPENAI, RESPONSES} <= FIELDS[dial].routes, dial
    assert CHAT_NAMES.spelled == COMPLETIONS_NAMES.spelled == {"max_new_tokens": "max_tokens"}


def test_no_route_restates_a_declared_field() -> None:
    """The modules of the routes that carry request fields declare none of the scalar ones they carry as declared:
    no annotated class attribute of that name (they come from `pydantic_fields`). (vLLM's structured_outputs.regex
    is a field of its own object; /score's seed and the RL routes' pause mode are other things of the same name.)"""
    declared = {name for route in (OPENAI, GENERATE_TOP) for name in carried(route) if FIELDS[name].scalar}
    declared |= {shape.name or name for name, spec in FIELDS.items() for shape in spec.shapes.values()}
    restated = []
    for path in [ROOT / "server" / f"{m}.py" for m in ("openai_protocol", "native_api", "responses_api")]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                restated += [f"{path.name}:{node.name}.{stmt.target.id}" for stmt in node.body
                             if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                             and stmt.target.id in declared and node.name != "StructuredOutputs"]
    assert restated == []


def test_the_defaults_chain_reads_the_declarations() -> None:
    assert CHAINED == ("max_new_tokens", "temperature", "top_p", "top_k", "mode", "threshold", "edit_threshold",
                       "max_post_steps", "mbe_window", "decoder", "steps", "max_steps_per_block")
    assert PRESETS == {"Q": (0.7, 0.5, 16), "S": (0.5, 0.0, 16)}  # the LLaDA2.1 model card's
    assert BUILTIN_DEFAULTS["max_new_tokens"] == 1024 and BUILTIN_DEFAULTS["mode"] == "Q"
    with pytest.raises(SamplingParamsError, match="stop is not a field of the defaults chain"):
        Defaults(stop=("x",))
    config = {key: 0.25 for name in CHAINED for key in FIELDS[name].generation_config[:1] if FIELDS[name].kind is float}
    level = Defaults.from_generation_config(config)
    assert level.threshold == level.edit_threshold == level.temperature == level.top_p == 0.25
    assert Defaults.from_generation_config({"editing_threshold": 0.3}).edit_threshold == 0.3
    operator = {spec.operator_flag for spec in FIELDS.values() if spec.operator_flag}
    assert operator == {"default_mode", "default_max_tokens", "mbe_window"}
    assert operator <= {f.name for f in dataclasses.fields(ServerArgs)}
    args = ServerArgs(default_mode="S", default_max_tokens=9, mbe_window=2)
    assert args.request_defaults() == Defaults(mode="S", max_new_tokens=9, mbe_window=2)


def test_generate_has_a_flag_for_each_declared_cli_field() -> None:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {a.dest: a for a in action.choices["generate"]._actions}
    for name, spec in FIELDS.items():
        if spec.cli:
            assert flags[name].option_strings == [spec.flag] and flags[name].help == spec.help, name
            assert flags[name].choices == (list(spec.choices) if spec.choices else None)
    assert flags["max_post_steps"].type is int and flags["threshold"].type is float


@pytest.mark.parametrize("kw, message", [
    ({"max_post_steps": 2000}, "max_post_steps must be an integer in [0, 1024]"),
    ({"threshold": 1.5}, "threshold must be a number in [0, 1]"),
    ({"edit_threshold": -0.1}, "edit_threshold must be a number in [0, 1]"),
    ({"no_stop_trim": 1}, "no_stop_trim must be a boolean"),
    ({"mode": "fast"}, "mode must be one of S, Q, auto, got 'fast'"),
    ({"top_p": 0}, "top_p must be in (0, 1]"),
    ({"max_new_tokens": 0}, "max_new_tokens must be an integer >= 1"),
    ({"repetition_penalty": 0.001}, "repetition_penalty must be a number in [0.01, 100]"),
    ({"domain": "x" * 65}, "domain must be a string of at most 64 characters"),
    ({"lark": ""}, "lark must be a non-empty string"),
])
def test_the_refusals_keep_their_words(kw: dict, message: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kw)
    assert str(err.value) == message and err.value.param == next(iter(kw))


def test_a_field_added_to_the_declarations_appears_everywhere() -> None:
    """A new declared field: the OpenAI body made from the declarations has it with its range and help, the
    dials, Responses' and /generate's top level carry it, `redraft generate` has its flag, and its refusal is made
    from its range."""
    knob = FieldSpec("a knob nobody has yet", ge=0, le=5, routes=frozenset({OPENAI, RESPONSES, GENERATE_TOP}),
                     dial=True, cli=True, name="novel_knob", kind=int)
    specs = {**FIELDS, "novel_knob": knob}
    body = create_model("Body", __base__=_CommonShaped, **pydantic_fields(OPENAI, skip=_CommonShaped.model_fields,
                                                                          specs=specs))
    assert {k: schema_of(body, "novel_knob").get(k) for k in ("minimum", "maximum", "description")} == \
        {"minimum": 0, "maximum": 5, "description": "a knob nobody has yet"}
    assert body(novel_knob=3).novel_knob == 3
    with pytest.raises(ValidationError):
        body(novel_knob=6)
    assert dial_types(specs)["novel_knob"] is int
    assert "novel_knob" in carried(RESPONSES, specs) and "novel_knob" in pydantic_fields(GENERATE_TOP, specs=specs)
    parser = argparse.ArgumentParser()
    add_request_flags(parser, specs)
    assert parser.parse_args(["--novel-knob", "4"]).novel_knob == 4
    assert refusal(knob, 6) == "novel_knob must be an integer in [0, 5]" and refusal(knob, None) is None


def test_the_openai_page_lists_every_field_the_openai_routes_carry() -> None:
    """docs/openai.md's table of fields names each declared field the chat and completions bodies carry."""
    text = (ROOT / "docs" / "openai.md").read_text().split("## Fields")[1].split("\n## ")[0]
    listed = {name for row in text.splitlines() if row.startswith("| `")
              for name in re.findall(r"`([a-z_]+)`", row.split(" | ")[0])}
    assert [name for name in carried(OPENAI) if name not in listed] == []



BODY_MODELS = {OPENAI: (ChatCompletionRequest, CompletionRequest), CHAT: (ChatCompletionRequest,),
               COMPLETIONS: (CompletionRequest,), RESPONSES_BODY: (ResponsesRequest,), GENERATE_BODY: (GenerateBody,)}


def test_each_body_carries_its_own_shape_of_a_field_as_declared() -> None:
    """The fields a body spells its own way come from the declarations' `shapes`: the body's name, its bounds and
    the help; and the shapes the routes had before they moved, by hand."""
    assert set(BODY_MODELS) == set(BODIES)
    for name, spec in FIELDS.items():
        for body, shape in spec.shapes.items():
            for model in BODY_MODELS[body]:
                got = schema_of(model, shape.name or name)
                want = {**{BOUND_KEYS.get(k, k): v for k, v in shape.bounds.items()},
                        "description": shape.help or spec.help}
                if "max_length" in shape.bounds:  # an array's or an object's size
                    want.pop("maxLength")
                    want["maxItems" if got.get("type") == "array" else "maxProperties"] = shape.bounds["max_length"]
                assert {k: got.get(k) for k in want} == want, (model.__name__, name)
    assert schema_of(ChatCompletionRequest, "logprobs")["type"] == "boolean"
    assert {k: schema_of(CompletionRequest, "logprobs")[k] for k in ("type", "minimum", "maximum")} == \
        {"type": "integer", "minimum": 0, "maximum": 5}
    assert schema_of(ResponsesRequest, "top_logprobs")["maximum"] == 20 == schema_of(GenerateBody, "top_logprobs_num")[
        "maximum"] == schema_of(ChatCompletionRequest, "top_logprobs")["maximum"]
    assert GenerateBody.model_fields["return_logprob"].default is False
    assert schema_of(ChatCompletionRequest, "stop_token_ids")["maxItems"] == 64
    assert schema_of(CompletionRequest, "logit_bias")["maxProperties"] == 300
    stop = ChatCompletionRequest.model_json_schema()["properties"]["stop"]["anyOf"]
    assert {b.get("type") for b in stop} == {"string", "array", "null"}
    with pytest.raises(ValidationError, match="at most 4 stop strings"):  # the route's validator still reads it
        CompletionRequest(prompt="x", stop=["a", "b", "c", "d", "e"])
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="x", logprobs=6)


def test_a_shape_added_to_the_declarations_appears_in_its_body() -> None:
    knob = FieldSpec("ids to avoid", shapes={CHAT: Shape(list[int], bounds={"max_length": 3}, name="avoid_ids")},
                     name="avoid", kind=tuple, default=())
    fields = shaped_fields(CHAT, specs={**FIELDS, "avoid": knob})
    body = create_model("Body", __base__=_CommonShaped, **fields)
    assert schema_of(body, "avoid_ids")["maxItems"] == 3 and body(avoid_ids=[1]).avoid_ids == [1]
    with pytest.raises(ValidationError):
        body(avoid_ids=[1, 2, 3, 4])
    assert "avoid_ids" not in shaped_fields(COMPLETIONS, specs={**FIELDS, "avoid": knob})


def test_engine_refusals_name_the_field_a_sampling_params_refusal_would() -> None:
    """Each route names an engine refusal of a field the routes spell their own way (max_new_tokens) as its
    SamplingParams refusal names it: the table is made from the declared `openai_name`s, the same on /generate."""
    assert openai_spellings() == {"max_new_tokens": "max_tokens"}
    for names in (CHAT_NAMES, COMPLETIONS_NAMES, generate_names("text"), generate_names("input_ids")):
        for name in openai_spellings():
            assert names.engine_param(name) == names.param(name)
    assert generate_names("text").engine == {"input_ids": "text",
                                             "max_new_tokens": "sampling_params.max_new_tokens"}
    assert CHAT_NAMES.engine == {"input_ids": "messages", "max_new_tokens": "max_tokens"}


def test_eval_demo_sweeps_the_declared_fields_within_their_range(capsys) -> None:
    assert SWEEPABLE == {name: spec.kind for name, spec in FIELDS.items() if spec.sweep}
    assert SWEEPABLE == {"threshold": float, "edit_threshold": float, "max_post_steps": int, "mbe_window": int,
                         "stutter_penalty": float}  # the list it had by hand
    with pytest.raises(SystemExit):
        evaluate_main(["--model", "/nonexistent", "--set", "threshold=1.5"])
    assert "--set threshold must be a number in [0, 1]" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        evaluate_main(["--model", "/nonexistent", "--set", "steps=4"])
    assert "PARAM one of edit_threshold, max_post_steps, mbe_window, stutter_penalty, threshold" in \
        capsys.readouterr().err


def test_the_engine_reads_a_requests_thresholds_from_its_slot_row_only() -> None:
    """The step and structured output's sweep read the thresholds from the same slot rows (SlotState, filled
    from the request's record): no engine module besides slots.py reads them off the request."""
    readers = [str(path.relative_to(ROOT)) for path in sorted((ROOT / "engine").rglob("*.py"))
               if re.search(r"\bparams\.(edit_)?threshold\b|\bp\.(edit_)?threshold\b", path.read_text())]
    assert readers == ["engine/decoding/slots.py"]
    sweep = (ROOT / "engine" / "runtime" / "grammar_step.py").read_text()
    assert "runner.slots.threshold[" in sweep
