"""Grammars for structured output: a request's constraint (JSON schema, regex, EBNF/GBNF or Lark) compiled into a
matcher that the constrained decoding step drives (engine/decoding/constrained.py). Torch-free: the HTTP process uses it
to refuse a bad grammar with a 400 naming the field, the engine to decode.

The backend is llguidance. `GrammarMatcher` is the whole interface the decoding step uses (validate, consume,
roll back, forced tokens, the allowed-token bitmask); xgrammar's matcher offers the same operations and could
sit behind it. Matchers run on fuel limits, never on time, so a decision never depends on how busy the host is.
"""

from __future__ import annotations

import json
import re
import string
from collections import OrderedDict
from typing import Any, Protocol

import llguidance

from redraft.protocol.sampling_params import GRAMMAR_FIELDS

MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar longer than this is refused before it is compiled
# Bounds checked in Python before any native code sees a constraint (docs/structured-output.md). llguidance
# overflows its native stack on long $ref chains (~3,000) and rule chains (~2,700 Lark, ~6,000 GBNF rules) and
# fails on ~499 optional properties in one object or ~2,000 alternatives in one rule: each limit sits well below
# the failure and well above any schema or grammar written by hand.
MAX_SCHEMA_DEPTH = 64  # objects and arrays nested in a JSON schema's text
MAX_SCHEMA_DEFS = 1000  # entries of $defs / definitions, all together
MAX_REF_DEPTH = 64  # $ref hops in a row (a -> b -> c is 2)
MAX_OBJECT_PROPERTIES = 256  # properties of one object schema
MAX_SCHEMA_PROPERTIES = 2048  # properties in the whole schema
MAX_RULES = 1000  # rules of a Lark or GBNF grammar
MAX_ALTERNATIVES = 1000  # `|` alternatives in one rule
MAX_GROUP_DEPTH = 64  # parentheses nested in a Lark or GBNF grammar
PROBE_FORCED_ROUNDS = 8  # fast-forward rounds a check plays before it reads the first free bitmask
# JSON without optional whitespace: `{"a":1,"b":[2,3]}`. A schema may ask otherwise through its "x-guidance" key.
PUNCTUATION = frozenset(string.punctuation)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` names the field that holds it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class GrammarDeadEnd(RuntimeError):
    """The grammar reached a state from which no output can be completed (its matcher failed, or it allows
    nothing and cannot end). The request must end with an error, never go on unconstrained."""


class GrammarMatcher(Protocol):
    """What the constrained step needs from a grammar backend; token ids are the model's."""

    def count_valid(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, the grammar takes from the current state (nothing is consumed)."""

    def consume(self, tokens: list[int]) -> None:
        """Advance over tokens that count_valid accepted."""

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens."""

    def forced_tokens(self) -> list[int]:
        """Tokens every continuation starts with (fast-forward)."""

    def allowed_bitmask(self) -> bytes:
        """The tokens allowed next: bit t % 32 of little-endian 32-bit word t // 32."""

    def is_accepting(self) -> bool:
        """The consumed text is a complete sentence of the grammar (it may end here)."""

    def is_stopped(self) -> bool:
        """Nothing but the end can follow."""


class LLGuidanceMatcher:
    """GrammarMatcher on llguidance's LLMatcher."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._m = matcher

    def _check(self) -> None:
        # a limit of the matcher (e.g. an Earley row too large for a schema met mid-output) or a caller bug
        if self._m.is_error():
            raise GrammarDeadEnd(f"the grammar matcher failed: {first_line(self._m.get_error())}")

    def count_valid(self, tokens: list[int]) -> int:
        return self._m.validate_tokens(tokens) if tokens else 0

    def consume(self, tokens: list[int]) -> None:
        if tokens:
            self._m.consume_tokens(tokens)
            self._check()

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)
            self._check()

    def forced_tokens(self) -> list[int]:
        forced = self._m.compute_ff_tokens()
        self._check()
        return forced

    def allowed_bitmask(self) -> bytes:
        mask = self._m.compute_bitmask()
        if self._m.is_error() and not self._m.is_accepting():
            return bytes(len(mask))  # nothing is allowed: the caller reports the dead end
        return mask

    def is_accepting(self) -> bool:
        return self._m.is_accepting()

    def is_stopped(self) -> bool:
        return self._m.is_stopped()


class Grammars:
    """Compiles constraints for one tokenizer. `tokenizer_json` is the checkpoint's tokenizer.json (byte-level
    BPE in LLaDA2); `vocab_size` the model's (it may exceed the tokenizer's: ids past it are never allowed)."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_id: int, cache_size: int = 128):
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size, eos_token=eos_id)
        self.vocab_size = vocab_size
        self._closers: tuple[int, ...] | None = None
        # (field, source) -> a compiled matcher that never consumed a token; each request gets a deep copy. Clients
        # send the same schema request after request: compiling it once spares the engine loop a few ms each.
        self._compiled: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._validated: OrderedDict[tuple[str, str], str] = OrderedDict()  # (field, source) -> grammar: compile()
        self.cache_size = cache_size
        self.cache_hits = self.cache_misses = 0

    @property
    def closers(self) -> tuple[int, ...]:
        """Tokens that are one ASCII punctuation character (`}`, `]`, `"`, ...), in byte order: what the
        constrained step closes a grammar with when the model wants to stop (engine/decoding/constrained.py)."""
        if self._closers is None:
            found: dict[bytes, int] = {}
            for t in range(self.vocab_size):
                if self.tokenizer.is_special_token(t):
                    continue
                raw = self.tokenizer.decode_bytes([t])
                if len(raw) == 1 and chr(raw[0]) in PUNCTUATION and raw not in found:
                    found[raw] = t
            self._closers = tuple(found[k] for k in sorted(found))
        return self._closers

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int) -> "Grammars":
        """From a redraft Tokenizer (engine/text/tokenizer.py)."""
        return cls(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_id)

    def compile(self, field: str, source: Any) -> str:
        """The llguidance grammar for one constraint field; GrammarError (naming `field`) when it is invalid.
        Valid ones are remembered (LRU): the HTTP process validates every constrained request with this."""
        key = cache_key(field, source)
        grammar = self._validated.get(key)
        if grammar is not None:
            self._validated.move_to_end(key)
            return grammar
        grammar = to_llguidance(field, source)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(f"invalid {field}: {error.strip()}", field)
        self._validated[key] = grammar
        if len(self._validated) > self.cache_size:
            self._validated.popitem(last=False)
        return grammar

    def check(self, field: str, source: Any, bounds: bool = True) -> None:
        """Everything the decoding step does at a constraint's start, so that an error shows here and not in
        the engine loop: compile, build the matcher, play the forced tokens, read the first bitmask.
        GrammarError (naming `field`) when it fails, or when the grammar can never accept (no output
        satisfies it). Run it where a native crash costs nothing (engine/text/grammar_sandbox.py). `bounds`: False
        skips the cheap bounds (tests reach the native code with it)."""
        if bounds:
            check_bounds(field, source)
        m = llguidance.LLMatcher(self.tokenizer, self.compile(field, source), log_level=0)
        _raise_matcher_error(m, field)
        for _ in range(PROBE_FORCED_ROUNDS):
            forced = m.compute_ff_tokens()
            _raise_matcher_error(m, field)
            if not forced:
                break
            m.consume_tokens(forced)
            _raise_matcher_error(m, field)
        mask = m.compute_bitmask()
        eos = self.tokenizer.eos_token
        others = any(mask[i] & ~(1 << eos % 8 if i == eos // 8 else 0) & 0xFF for i in range(len(mask)))
        error = first_line(m.get_error()) if m.is_error() else ""
        if error and not error.startswith("NoExtension"):  # a limit (rows, items), not "nothing can follow"
            _raise_matcher_error(m, field)
        if not others and not m.is_accepting():
            raise GrammarError(f"invalid {field}: no output satisfies this constraint (the grammar can never "
                               "accept; a schema that only refers to itself, such as {\"$ref\": \"#\"}, or a "
                               "$ref cycle that never reaches a value does this)", field)
        _raise_matcher_error(m, field)

    def matcher(self, field: str, source: Any) -> LLGuidanceMatcher:
        """A fresh matcher for one request's constraint (compiled once per distinct constraint, LRU)."""
        key = cache_key(field, source)
        pristine = self._compiled.get(key)
        if pristine is not None:
            self._compiled.move_to_end(key)
            self.cache_hits += 1
            return LLGuidanceMatcher(pristine.deep_copy())
        pristine = llguidance.LLMatcher(self.tokenizer, self.compile(field, source), log_level=0)
        if pristine.is_error():
            raise GrammarError(f"invalid {field}: {pristine.get_error().strip()}", field)
        self.cache_misses += 1
        self._compiled[key] = pristine
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return LLGuidanceMatcher(pristine.deep_copy())


def first_line(text: str) -> str:
    return (text.strip().splitlines() or [""])[0][:500]


def _raise_matcher_error(m: llguidance.LLMatcher, field: str) -> None:
    if m.is_error():
        raise GrammarError(f"invalid {field}: the grammar could not be compiled: {first_line(m.get_error())}", field)


def cache_key(field: str, source: Any) -> tuple[str, str]:
    return field, source if isinstance(source, str) else json.dumps(source, sort_keys=True)


def to_llguidance(field: str, source: Any) -> str:
    """A constraint field's value as an llguidance grammar (not yet validated against a tokenizer)."""
    if field not in GRAMMAR_FIELDS:
        raise GrammarError(f"unknown constraint {field!r}; one of {', '.join(GRAMMAR_FIELDS)}", field)
    if field == "json_schema":
        schema = parse_schema(source, field)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT_JSON)
    if not isinstance(source, str) or not source:
        raise GrammarError(f"{field} must be a non-empty string", field)
    if len(source) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"{field} is longer than {MAX_GRAMMAR_CHARS} characters", field)
    if field == "regex":
        return llguidance.LLMatcher.grammar_from_regex(source)
    try:  # "ebnf": GBNF as SGLang and llama.cpp write it (Lark is accepted too); "lark": llguidance's Lark
        return llguidance.grammar_from("ebnf" if field == "ebnf" else "lark", source)
    except Exception as exc:  # noqa: BLE001 - the GBNF converter is Python code that may raise anything on bad input
        raise GrammarError(f"invalid {field}: {exc}", field) from exc


# ---- bounds checked before native code sees a constraint ---------------------------------------------------
def check_bounds(field: str, source: Any) -> None:
    """GrammarError (naming `field`) when a constraint exceeds a bound llguidance needs (MAX_* above)."""
    if field == "json_schema":
        check_schema_bounds(parse_schema(source, field), field)
    elif field in ("ebnf", "lark") and isinstance(source, str):
        check_grammar_text_bounds(source, field)


def check_schema_bounds(schema: Any, field: str) -> None:
    """Nesting depth, $defs, properties (per object and in all) and the longest $ref chain of a JSON schema.
    Iterative: a schema nested deeper than Python's recursion limit is refused, not a crash."""
    def fail(what: str, limit: int | None = None) -> None:
        raise GrammarError(f"invalid {field}: {what}" + (f"; at most {limit} is allowed" if limit else ""), field)

    total_props = defs = 0
    stack: list[tuple[Any, int]] = [(schema, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            fail(f"the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep")
        if isinstance(node, dict):
            props = node.get("properties")
            if isinstance(props, dict):
                if len(props) > MAX_OBJECT_PROPERTIES:
                    fail(f"an object schema has {len(props)} properties", MAX_OBJECT_PROPERTIES)
                total_props += len(props)
            for key in ("$defs", "definitions"):
                if isinstance(node.get(key), dict):
                    defs += len(node[key])
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, (dict, list)))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, (dict, list)))
    if total_props > MAX_SCHEMA_PROPERTIES:
        fail(f"the schema has {total_props} properties", MAX_SCHEMA_PROPERTIES)
    if defs > MAX_SCHEMA_DEFS:
        fail(f"the schema has {defs} $defs / definitions", MAX_SCHEMA_DEFS)
    if isinstance(schema, dict):
        depth = _ref_depth(_ref_graph(schema))
        if depth > MAX_REF_DEPTH:
            fail(f"the schema's $ref chain is {depth} deep", MAX_REF_DEPTH)


def _refs_in(node: Any, skip_defs: bool = False) -> set[str]:
    """Every $ref string in a schema subtree (the top level's $defs / definitions left out with skip_defs)."""
    found: set[str] = set()
    stack = [(k, v) for k, v in node.items() if not (skip_defs and k in ("$defs", "definitions"))]
    while stack:
        key, value = stack.pop()
        if key == "$ref" and isinstance(value, str):
            found.add(value)
        if isinstance(value, dict):
            stack.extend(value.items())
        elif isinstance(value, list):
            stack.extend(("", v) for v in value)
    return found


_DEF_POINTER = re.compile(r"#/(?:\$defs|definitions)/([^/]*)")


def _ref_target(ref: str) -> str | None:
    """The node a local $ref lands in: a top-level definition's name, or "#" (the root, for any other local
    pointer). None for a remote reference (llguidance refuses those itself)."""
    if not ref.startswith("#"):
        return None
    hit = _DEF_POINTER.match(ref)
    return "$" + hit.group(1).replace("~1", "/").replace("~0", "~") if hit else "#"


def _ref_graph(schema: dict[str, Any]) -> dict[str, set[str]]:
    """node -> the nodes its $refs land in; the nodes are the root ("#") and each top-level definition."""
    graph = {"#": {t for r in _refs_in(schema, skip_defs=True) if (t := _ref_target(r)) is not None}}
    for key in ("$defs", "definitions"):
        for name, sub in (schema.get(key) or {}).items() if isinstance(schema.get(key), dict) else ():
            refs = _refs_in(sub) if isinstance(sub, dict) else set()
            graph.setdefault("$" + name, set()).update(t for r in refs if (t := _ref_target(r)) is not None)
    return graph


def _ref_depth(graph: dict[str, set[str]]) -> int:
    """The longest run of $ref hops, by one depth-first pass (a hop back into the current path, a cycle,
    adds nothing: a recursive schema is fine, a long chain is not)."""
    depth: dict[str, int] = {}
    for root in graph:
        if root in depth:
            continue
        path, stack = {root}, [(root, iter(graph[root]))]
        while stack:
            node, children = stack[-1]
            nxt = next(children, None)
            if nxt is None:
                stack.pop()
                path.discard(node)
                depth[node] = max((1 + depth.get(k, 0) for k in graph[node] if k in graph and k not in path),
                                  default=0)
            elif nxt in graph and nxt not in depth and nxt not in path:
                path.add(nxt)
                stack.append((nxt, iter(graph[nxt])))
    return max(depth.values(), default=0)


_RULE_START = re.compile(r"\s*[?!]?[A-Za-z_][\w.-]*\s*(::=|:)")


def check_grammar_text_bounds(text: str, field: str) -> None:
    """Rules, alternatives per rule and nested parentheses of a Lark or GBNF grammar, counted by a small
    scanner that skips strings, character classes, Lark regexes and comments."""
    rules = alternatives = depth = 0
    for line in text.splitlines():
        if _RULE_START.match(line):
            rules += 1
            alternatives = 0
            if rules > MAX_RULES:
                raise GrammarError(f"invalid {field}: the grammar has more than {MAX_RULES} rules", field)
        i, n = 0, len(line)
        while i < n:
            c = line[i]
            if c == "#" or line.startswith("//", i):
                break  # a comment (GBNF: #, Lark: //)
            if c in "\"'[/" and (c != "/" or field == "lark" or "::=" not in text):
                close = "]" if c == "[" else c
                i += 1
                while i < n and line[i] != close:
                    i += 2 if line[i] == "\\" else 1
            elif c == "|":
                alternatives += 1
                if alternatives >= MAX_ALTERNATIVES:
                    raise GrammarError(f"invalid {field}: a rule has more than {MAX_ALTERNATIVES} alternatives",
                                       field)
            elif c == "(":
                depth += 1
                if depth > MAX_GROUP_DEPTH:
                    raise GrammarError(f"invalid {field}: parentheses are nested more than {MAX_GROUP_DEPTH} deep",
                                       field)
            elif c == ")":
                depth = max(0, depth - 1)
            i += 1


def max_output_tokens(field: str, source: Any) -> int | None:
    """An upper bound on the tokens any output of the constraint takes (its EOS not counted), where one is
    cheap to know: a regex with a finite longest match (Python's parser reads it; the syntaxes agree on what
    this needs). A token holds at least one byte and a character at most four. None: no bound known."""
    if field != "regex" or not isinstance(source, str):
        return None
    try:
        import re._parser as sre_parse  # noqa: PLC0415 - private but stable since 3.11; only a bound is read

        longest = sre_parse.parse(source).getwidth()[1]
    except Exception:  # noqa: BLE001 - a syntax only llguidance reads: no bound
        return None
    return 4 * longest if longest < 2**31 else None


def parse_schema(source: Any, field: str = "json_schema") -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(source, str):
        if len(source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{field} is longer than {MAX_GRAMMAR_CHARS} characters", field)
        try:
            source = json.loads(source)
        except ValueError as exc:
            raise GrammarError(f"{field} is not valid JSON: {exc}", field) from exc
        except RecursionError as exc:  # deeper than Python's parser goes: far past MAX_SCHEMA_DEPTH anyway
            raise GrammarError(f"invalid {field}: the schema is nested more than {MAX_SCHEMA_DEPTH} levels deep",
                               field) from exc
    if isinstance(source, bool):  # `true` is the schema every value satisfies
        source = {} if source else {"not": {}}
    if not isinstance(source, dict):
        raise GrammarError(f"{field} must be a JSON schema object", field)
    return source


# LLaDA2's tool-call format, as its chat template writes an assistant's calls (engine/text/templates/llada2_chat.jinja):
# <tool_call>{"name": "f", "arguments": {...}}</tool_call>, one per call, nothing between them.
TEMPLATE_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def tool_call_lark(tools: list[dict[str, Any]], start_id: int, end_id: int, *, name: str | None = None,
                   parallel: bool = True) -> str:
    """A Lark grammar for tool calls: `name` (tool_choice naming a function) exactly one call of it, else one
    call (or several when `parallel`) of any of `tools` (OpenAI's [{"type": "function", "function": {...}}]).
    Each call's arguments follow its function's `parameters` schema; start_id / end_id: the ids of the
    <tool_call> / </tool_call> special tokens."""
    functions = [t["function"] for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise GrammarError(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    for f in functions:
        check_schema_bounds(f.get("parameters") or {}, f"tools[{[t['function'] for t in tools].index(f)}]"
                                                       ".function.parameters")
    defs: dict[str, Any] = {}
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": _arguments_schema(f, i, defs)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for i, f in enumerate(functions)]
    schema = dict(options[0] if len(options) == 1 else {"anyOf": options}, **{"x-guidance": TEMPLATE_JSON})
    if defs:
        schema["$defs"] = defs
    repeat = "+" if parallel and name is None else ""
    return f"start: call{repeat}\ncall: <[{start_id}]> %json {json.dumps(schema)} <[{end_id}]>\n"


# ---- a function's parameters schema, nested inside the tool-call schema -------------------------------------------
# Keywords whose values are data, not schemas: a "$ref" key inside them is not a pointer.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _arguments_schema(function: dict[str, Any], index: int, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one function's `arguments`. Its local `$ref` pointers ("#", "#/$defs/X", "#/properties/y"
    ...) are relative to its own root, which nesting moves: a schema holding any is placed whole at
    `#/$defs/tool<index>` of the tool-call schema (added to `defs`) with every pointer rewritten to start
    there, self-references included; one without is nested as it is."""
    params = function.get("parameters") or {"type": "object"}
    base = f"#/$defs/tool{index}"
    moved, rewritten = _rebase_refs(params, base)
    if not rewritten:
        return params
    defs[f"tool{index}"] = moved
    return {"$ref": base}


def _rebase_refs(schema: Any, base: str) -> tuple[Any, int]:
    """A copy of `schema` with every local `$ref` ("#..." ) made to start at `base`, and how many there were.
    Iterative (any depth); data keywords (const, enum, default, examples) are copied untouched."""
    count = 0
    root: list[Any] = [None]
    stack: list[tuple[Any, Any, Any]] = [(schema, root, 0)]  # (node, parent container, key in it)
    while stack:
        node, parent, key = stack.pop()
        if isinstance(node, dict):
            copy: dict[str, Any] = {}
            for k, v in node.items():
                if k == "$ref" and isinstance(v, str) and v.startswith("#"):
                    copy[k] = base + v[1:]
                    count += 1
                elif k in _DATA_KEYWORDS or not isinstance(v, (dict, list)):
                    copy[k] = v
                else:
                    copy[k] = None
                    stack.append((v, copy, k))
            parent[key] = copy
        else:  # a list of schemas (anyOf, prefixItems, ...)
            items: list[Any] = [None] * len(node)
            for j, v in enumerate(node):
                if isinstance(v, (dict, list)):
                    stack.append((v, items, j))
                else:
                    items[j] = v
            parent[key] = items
    return root[0], count
