"""Structured output under draft-and-edit decoding (engine/decoding/constrained.py, docs/structured-output.md).

1. Property tests (hypothesis): the frontier sweep driven by adversarial logits on a toy byte-level vocabulary,
   through a block loop written here (the official W = 1 lifecycle, independent of the engine's scheduler).
   For JSON schemas, regexes and tool-call grammars: every output that ends by a stop token is valid (parses and
   validates / full-matches), the invariant holds after every step (no mask behind the frontier, and the text
   behind it is exactly what a fresh matcher accepts), and every forward advances the frontier.
2. The engine on tiny random checkpoints (float64): constrained outputs are valid; a constrained request gives
   the same output alone, in a batch with free and other constrained requests, under preemption and with an
   MBE window; nothing past the frontier is ever streamed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable

import jsonschema
import pytest
from test_engine_exactness import OVERLAP, OVERLAP_ARGS
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import redraft
from redraft.engine.decoding.constrained import Constraint
from tests.threshold_rows import joint_threshold_step
from redraft.engine.text.grammar import GrammarError, Grammars, to_llguidance, tool_call_lark
from redraft.engine.text.tokenizer import Tokenizer
from redraft.protocol.sampling_params import SamplingParams
from redraft.scheduler.request import Request

B = 32
MAX_POST_STEPS = 4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Path:
    return tiny_checkpoint(seed=3)


@pytest.fixture(scope="module")
def tok(ckpt: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(ckpt)


@pytest.fixture(scope="module")
def vocab(ckpt: Path) -> int:
    return json.loads((ckpt / "config.json").read_text())["vocab_size"]


@pytest.fixture(scope="module")
def grammars(tok: Tokenizer, vocab: int) -> Grammars:
    return Grammars.for_tokenizer(tok, vocab)


# ---- what "valid" means, checked without the grammar library ------------------------------------------------------
def json_validator(schema: dict) -> Callable[[str], bool]:
    def check(text: str) -> bool:
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    return check


def regex_validator(pattern: str) -> Callable[[str], bool]:
    return lambda text: re.fullmatch(pattern, text) is not None


CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_validator(tools: list[dict]) -> Callable[[str], bool]:
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}

    def check(text: str) -> bool:
        bodies = CALL_RE.findall(text)
        if not bodies or CALL_RE.sub("", text) != "":
            return False
        for body in bodies:
            try:
                call = json.loads(body)
                jsonschema.validate(call["arguments"], by_name[call["name"]])
            except (ValueError, KeyError, TypeError, jsonschema.ValidationError):
                return False
        return True
    return check


# ---- grammars the properties range over ---------------------------------------------------------------------------
LEAVES = [{"type": "integer"}, {"type": "boolean"}, {"type": "string", "maxLength": 6},
          {"enum": ["red", "green", 7]}, {"type": "integer", "minimum": 0, "maximum": 99},
          {"type": "array", "items": {"type": "integer"}, "maxItems": 3}]


@st.composite
def schemas(draw) -> dict:
    names = draw(st.lists(st.sampled_from(["a", "bb", "name", "x1"]), min_size=1, max_size=3, unique=True))
    props = {n: draw(st.sampled_from(LEAVES)) for n in names}
    if draw(st.booleans()):
        inner = draw(st.sampled_from(LEAVES))
        props["nested"] = {"type": "object", "properties": {"v": inner}, "required": ["v"], "additionalProperties": False}
    return {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}


REGEXES = [r"[0-9]+(, [0-9]+)*", r"(yes|no)", r"[a-z]{2,6}@[a-z]{2,4}\.(com|org)", r"-?[0-9]{1,3}(\.[0-9]{1,2})?",
           r"\([a-z]+\)( \([a-z]+\))*", r"[A-Z][a-z]* [0-9]{4}"]

TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}},
    {"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                         "metric": {"type": "boolean"}}, "required": ["city"]}}},
]


# ---- adversarial logits ---------------------------------------------------------------------------------------------
def adversarial_logits(seed: int, step: int, vocab: int, hot: list[int], scale: float) -> torch.Tensor:
    """[1, B, V]: random, sharpened by `scale`, with a random few of `hot` (EOS, specials, the mask, closers)
    pushed up at random positions: confident proposals the grammar mostly refuses."""
    g = torch.Generator().manual_seed(seed * 1000003 + step)
    logits = torch.randn(1, B, vocab, generator=g, dtype=torch.float64) * scale
    boost = torch.rand(1, B, len(hot), generator=g, dtype=torch.float64) < 0.15
    logits[..., hot] += boost * (scale * 4.0)
    return logits


def masked_argmax(logits: torch.Tensor) -> Callable[[int, bytes], int]:
    def pick(i: int, bitmask: bytes) -> int:
        bits = [(bitmask[t // 8] >> (t % 8)) & 1 if t // 8 < len(bitmask) else 0 for t in range(logits.shape[-1])]
        allowed = torch.tensor(bits, dtype=torch.bool)
        assert allowed.any(), "the sweep asked for an argmax over an empty set"
        row = logits[0, i].masked_fill(~allowed, float("-inf"))
        best = int(row.argmax())
        return best if allowed[best] else int(allowed.nonzero()[0])
    return pick


def drive(c: Constraint, tok: Tokenizer, vocab: int, prompt_len: int, max_new: int, seed: int, scale: float,
          threshold: float, edit_threshold: float, fresh: Callable[[], Any]) -> tuple[list[int], bool]:
    """The official W = 1 block loop around the sweep (max_post_steps 4), checking the invariant after every
    step. Returns the output through the first stop token and whether it ended by one."""
    mask, eos = tok.mask_token_id, tok.eos_token_id
    tokens = [5] * prompt_len  # any prompt: the sweep never reads it
    hot = sorted({eos, mask, *range(min(12, vocab)), *c.closers})
    step = 0
    block = prompt_len // B
    while True:
        start, end = block * B, (block + 1) * B
        tokens = tokens[: max(start, prompt_len)] + [mask] * (end - max(start, prompt_len))
        c.begin_block(tokens, start, end)
        post_steps = 0
        for _ in range(B + MAX_POST_STEPS + 1):  # every forward places at least one token: the block ends
            before = tokens[start:end]
            if mask not in before:  # the official loop's bound on mask-free forwards (max_post_steps)
                post_steps += 1
                if post_steps > MAX_POST_STEPS:
                    break
            logits = adversarial_logits(seed, step, vocab, hot, scale)
            editable = torch.tensor([[start + j >= prompt_len for j in range(B)]])
            res = joint_threshold_step(logits, torch.tensor([before]), editable, torch.tensor([threshold]),
                                       torch.tensor([edit_threshold]), mask)
            probs = torch.softmax(logits[0], -1)
            cand_p, cand_i = probs.topk(8, -1)
            cands = [list(zip(ids, ps)) for ids, ps in zip(cand_i.tolist(), cand_p.tolist())]
            f0, was_done = c.frontier, c.done
            out = c.sweep(start, before, res.tokens[0].tolist(), mask, cands.__getitem__, threshold,
                          masked_argmax(logits))
            tokens[start:end] = out
            step += 1
            # the invariant: no mask behind the frontier, and the text behind it is what a fresh matcher takes
            assert mask not in tokens[prompt_len : c.frontier]
            text = tokens[prompt_len : c.frontier]
            m = fresh()
            assert m.count_valid(text) == len(text), "the frontier is past a token the grammar refuses"
            assert c.consumed == text
            assert was_done or c.done or c.frontier > f0 or mask not in before, "a forward placed nothing"
            if mask not in before and out == before:
                break
        else:
            raise AssertionError("a block did not end")
        if c.done and c.stop_placed:
            return tokens[prompt_len : c.done_at + 1], True
        if end - prompt_len >= max_new:
            return tokens[prompt_len : prompt_len + max_new], False
        block += 1


PROPERTY = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
knobs = dict(seed=st.integers(0, 10**6), scale=st.sampled_from([1.0, 4.0, 12.0]),
             threshold=st.sampled_from([0.0, 0.3, 0.7]), edit_threshold=st.sampled_from([0.0, 0.5, 1.0]),
             prompt_len=st.integers(1, 70), ignore_eos=st.booleans())


def check_property(grammars: Grammars, tok: Tokenizer, vocab: int, field: str, source: str,
                   valid: Callable[[str], bool], seed: int, scale: float, threshold: float, edit_threshold: float,
                   prompt_len: int, ignore_eos: bool, max_new: int = 96) -> None:
    """ignore_eos: no stop token at all (the grammar may complete with nothing to end it: the rest is free)."""
    stops = frozenset() if ignore_eos else frozenset({tok.eos_token_id})
    c = Constraint(grammars.matcher(field, source), prompt_len, stops, tok.eos_token_id, vocab, grammars.closers)
    out, stopped = drive(c, tok, vocab, prompt_len, max_new, seed, scale, threshold, edit_threshold,
                         lambda: grammars.matcher(field, source))
    if stopped:
        assert out[-1] in stops and not stops & set(out[:-1])
        text = tok.decode(out[:-1], skip_special_tokens=False)
        assert valid(text), f"invalid output {text!r} for {field} {source}"


@PROPERTY
@given(schema=schemas(), **knobs)
def test_json_schema_outputs_are_valid(grammars, tok, vocab, schema, seed, scale, threshold, edit_threshold,
                                       prompt_len, ignore_eos) -> None:
    check_property(grammars, tok, vocab, "json_schema", json.dumps(schema), json_validator(schema), seed, scale,
                   threshold, edit_threshold, prompt_len, ignore_eos)


@PROPERTY
@given(pattern=st.sampled_from(REGEXES), **knobs)
def test_regex_outputs_full_match(grammars, tok, vocab, pattern, seed, scale, threshold, edit_threshold,
                                  prompt_len, ignore_eos) -> None:
    check_property(grammars, tok, vocab, "regex", pattern, regex_validator(pattern), seed, scale, threshold,
                   edit_threshold, prompt_len, ignore_eos)


@PROPERTY
@given(name=st.sampled_from([None, "add", "lookup"]), parallel=st.booleans(), **knobs)
def test_tool_call_outputs_parse_and_validate(grammars, tok, vocab, name, parallel, seed, scale, threshold,
                                              edit_threshold, prompt_len, ignore_eos) -> None:
    start, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    lark = tool_call_lark(TOOLS, start, end, name=name, parallel=parallel)
    tools = [t for t in TOOLS if name is None or t["function"]["name"] == name]
    check_property(grammars, tok, vocab, "lark", lark, tool_validator(tools), seed, scale, threshold,
                   edit_threshold, prompt_len, ignore_eos, max_new=128)


def test_properties_reach_the_end(grammars, tok, vocab) -> None:
    """The properties above are not vacuous: with a grammar that must end soon, outputs do end by a stop
    token and pass the independent check (and the closing run is exercised)."""
    ended = 0
    for seed in range(12):
        schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
                  "additionalProperties": False}
        c = Constraint(grammars.matcher("json_schema", json.dumps(schema)), 3, frozenset({tok.eos_token_id}),
                       tok.eos_token_id, vocab, grammars.closers)
        out, stopped = drive(c, tok, vocab, 3, 64, seed, 4.0, 0.3, 0.5,
                             lambda: grammars.matcher("json_schema", json.dumps(schema)))
        if stopped:
            ended += 1
            assert json_validator(schema)(tok.decode(out[:-1], skip_special_tokens=False))
    assert ended >= 6


# ---- the grammar front end ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("field,source", [("json_schema", '{"type": "frob"}'), ("json_schema", "{not json"),
                                          ("json_schema", "[1, 2]"), ("regex", "[a-"), ("ebnf", 'root ::= "a" ('),
                                          ("lark", "start: missing_rule"), ("regex", "")])
def test_invalid_grammars_name_their_field(grammars, field, source) -> None:
    with pytest.raises(GrammarError) as err:
        grammars.compile(field, source)
    assert err.value.param == field


def test_a_repeated_constraint_is_compiled_once_and_its_matchers_are_independent(tok, vocab) -> None:
    """The compile cache hands each request its own copy: one request's progress never leaks into another's,
    a bad grammar is never cached, and the least recently used entry goes first."""
    g = Grammars(tok.backend.to_str(), vocab, tok.eos_token_id, cache_size=2)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    first = g.matcher("json_schema", schema)
    text = tok.encode('{"a":12}')
    first.consume(text[:first.count_valid(text)])
    second = g.matcher("json_schema", json.dumps(schema))  # the same constraint as a string: its own key
    third = g.matcher("json_schema", dict(reversed(list(schema.items()))))  # same dict, other key order: a hit
    assert (g.cache_hits, g.cache_misses) == (1, 2)
    assert first.is_accepting() and not third.is_accepting()
    assert third.count_valid(text) == len(text)  # from the start, untouched by `first`
    with pytest.raises(GrammarError):
        g.matcher("regex", "(")
    assert (g.cache_hits, g.cache_misses) == (1, 2)
    g.matcher("regex", "[0-9]+")  # a third entry: the least recently used (the string schema) goes
    g.matcher("json_schema", json.dumps(schema))
    assert (g.cache_hits, g.cache_misses) == (1, 4)


def test_validation_is_remembered_but_an_invalid_grammar_is_checked_every_time(tok, vocab, monkeypatch) -> None:
    """The HTTP process validates every constrained request: a constraint seen before is not validated again;
    a bad one is refused every time (never remembered)."""
    import llguidance

    calls = []
    real = llguidance.LLMatcher.validate_grammar
    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar",
                        staticmethod(lambda *a, **k: calls.append(a[0]) or real(*a, **k)))
    g = Grammars(tok.backend.to_str(), vocab, tok.eos_token_id)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert g.compile("json_schema", schema) == g.compile("json_schema", dict(schema)) == g.compile("json_schema", schema)
    assert len(calls) == 1
    for _ in range(2):
        with pytest.raises(GrammarError):
            g.compile("regex", "(")
    assert len(calls) == 3


def test_json_is_compact_by_default(grammars, tok) -> None:
    m = grammars.matcher("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}},
                                                    "required": ["a"]}))
    assert m.count_valid(tok.encode('{"a":1}')) == len(tok.encode('{"a":1}'))
    spaced = tok.encode('{"a": 1}')
    assert m.count_valid(spaced) < len(spaced)
    assert to_llguidance("ebnf", 'root ::= "yes" | "no"')  # GBNF converts


def test_tool_grammar_writes_the_template_format(grammars, tok) -> None:
    """What the grammar forces is byte for byte what the chat template renders for the same call."""
    lark = tool_call_lark(TOOLS, tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>"), name="add")
    m = grammars.matcher("lark", lark)
    rendered = tok.apply_chat_template([{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]}])
    call = rendered[rendered.index("<tool_call>") : rendered.index("</tool_call>") + len("</tool_call>")]
    ids = tok.encode(call)
    assert m.count_valid(ids) == len(ids)
    with pytest.raises(GrammarError):
        tool_call_lark(TOOLS, 8, 9, name="nope")


# ---- the engine -----------------------------------------------------------------------------------------------------
ADVERSARIAL = {"mode": "S", "threshold": 0.02, "edit_threshold": 0.02, "max_post_steps": 4}
CONSTRAINTS = [
    ("json_schema", json.dumps({"type": "object", "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}},
                                "required": ["n", "ok"], "additionalProperties": False})),
    ("regex", r"[a-z]{2,5}(-[a-z]{2,5}){0,4}"),
    ("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}, "maxItems": 4})),
]


@pytest.fixture(scope="module", params=["overlap-on", "overlap-off"])
def engine(ckpt: Path, request: pytest.FixtureRequest):
    eng = redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float64", progress=False,
                         **OVERLAP_ARGS[request.param.removeprefix("overlap-")])
    yield eng
    eng.shutdown()


def _params(field: str | None, source: str | None, **extra: Any) -> dict:
    p = dict(ADVERSARIAL, max_new_tokens=80, **extra)
    if field:
        p[field] = source
    return p


def _prompts(tok: Tokenizer, n: int) -> list[list[int]]:
    base = tok.encode("the quick brown fox jumps over the lazy dog " * 3)
    return [base[: 5 + 9 * i] for i in range(n)]


def _valid(field: str, source: str, text: str) -> bool:
    return json_validator(json.loads(source))(text) if field == "json_schema" else regex_validator(source)(text)


def test_engine_outputs_are_valid_and_batch_invariant(engine, tok) -> None:
    prompts = _prompts(tok, 4)
    alone = {}
    for k, (field, source) in enumerate(CONSTRAINTS):
        for j, ids in enumerate(prompts[:2]):
            out = engine.generate(input_ids=ids, sampling_params=_params(field, source))
            alone[(k, j)] = out["output_ids"]
            if out["meta_info"]["finish_reason"]["type"] == "stop":
                assert _valid(field, source, out["text"]), out["text"]
            assert out["meta_info"]["grammar"]["rejected"] > 0, "the logits were not adversarial enough"
    free = engine.generate(input_ids=prompts[2], sampling_params=_params(None, None))["output_ids"]
    # one batch: every constraint twice, free requests in between
    batch_ids, batch_params, keys = [], [], []
    for (k, j) in alone:
        batch_ids += [prompts[j], prompts[2]]
        batch_params += [_params(*CONSTRAINTS[k]), _params(None, None)]
        keys += [(k, j), None]
    outs = engine.generate(input_ids=batch_ids, sampling_params=batch_params)
    for key, out in zip(keys, outs):
        assert out["output_ids"] == (alone[key] if key else free)


@pytest.mark.parametrize("overlap", OVERLAP)
def test_engine_constrained_output_survives_preemption_and_mbe(ckpt: Path, tok, monkeypatch, overlap: str) -> None:
    """A KV cache too small for the batch preempts requests with their frontier inside the active block; an
    MBE window lets later blocks edit earlier ones: neither changes a constrained output (and outputs stay
    valid)."""
    prompts = _prompts(tok, 3)
    field, source = CONSTRAINTS[0]
    with redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float64", progress=False) as roomy:
        plain = roomy.generate(input_ids=prompts, sampling_params=_params(field, source))
        windowed = roomy.generate(input_ids=prompts, sampling_params=_params(field, source, mbe_window=2))
        # a grammar that stays open (no end to the array), and no EOS: every request grows to its last block
        long = _params("json_schema", json.dumps({"type": "array", "items": {"type": "integer"}}), ignore_eos=True)
        want = [o["output_ids"] for o in roomy.generate(input_ids=prompts, sampling_params=long)]
    for out in plain + windowed:
        if out["meta_info"]["finish_reason"]["type"] == "stop":
            assert _valid(field, source, out["text"]), out["text"]
    assert [o["output_ids"] for o in windowed] != [o["output_ids"] for o in plain], "the window changed nothing"
    mid_block = []
    preempt = Request.preempt

    def spy(req: Request) -> None:
        c = req.state.constraint
        if c is not None and not c.done:
            mid_block.append(c.frontier > req.state.active_block * B)
        preempt(req)

    monkeypatch.setattr(Request, "preempt", spy)
    with redraft.Engine(model_path=str(ckpt), device="cpu", dtype="float64", progress=False,
                        max_total_tokens=7 * B, **OVERLAP_ARGS[overlap]) as tight:
        outs = tight.generate(input_ids=prompts, sampling_params=long)
    assert any(mid_block), "no request was preempted with its frontier inside its active block"
    assert [o["output_ids"] for o in outs] == want


def test_nothing_past_the_frontier_is_streamed(engine, tok) -> None:
    """Every output the core reports (committed blocks) lies behind the request's frontier."""
    core = engine.core
    field, source = CONSTRAINTS[1]
    for ids in _prompts(tok, 2):
        rid = f"frontier-{len(ids)}"
        core.add_request(rid, ids, SamplingParams.from_dict(_params(field, source)))
        req = core._requests[rid]
        sent = 0
        while core.has_work():
            for out in core.step():
                sent += len(out.new_ids)
                c = req.state.constraint
                assert c.done or req.prompt_len + sent <= c.frontier


def test_tool_grammar_keeps_each_functions_refs(grammars, tok) -> None:
    """Each function's `$ref`s ("#/$defs/X", a root self-reference "#") point into its own schema once nested
    in the tool-call grammar, for several tools at once; `$ref`-shaped data (a const) is left alone; a schema
    without any is nested as it was."""
    linked = {"$defs": {"Leaf": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}},
              "type": "object", "properties": {"leaf": {"$ref": "#/$defs/Leaf"}, "next": {"$ref": "#"},
                                               "tag": {"const": {"$ref": "#/x"}}},
              "required": ["leaf"], "additionalProperties": False}
    other = {"$defs": {"Leaf": {"type": "string"}}, "type": "object", "properties": {"s": {"$ref": "#/$defs/Leaf"}},
             "required": ["s"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": linked}},
             {"type": "function", "function": {"name": "g", "parameters": other}}, *TOOLS]
    start, end = tok.token_to_id("<tool_call>"), tok.token_to_id("</tool_call>")
    lark = tool_call_lark(tools, start, end)
    assert '"tag": {"const": {"$ref": "#/x"}}' in lark
    assert json.dumps(TOOLS[0]["function"]["parameters"]) in lark  # nested unchanged
    m = grammars.matcher("lark", lark)

    def valid(call: str) -> bool:
        ids = [start, *tok.encode(call), end]
        return grammars.matcher("lark", lark).count_valid(ids) == len(ids)

    assert valid('{"name": "f", "arguments": {"leaf": {"v": 1}, "next": {"leaf": {"v": 2}}, "tag": {"$ref": "#/x"}}}')
    assert valid('{"name": "g", "arguments": {"s": "x"}}')
    assert not valid('{"name": "g", "arguments": {"s": {"v": 1}}}')  # g's Leaf is a string, not f's object
    assert not valid('{"name": "f", "arguments": {"leaf": "x"}}')
    assert m.count_valid([start]) == 1
