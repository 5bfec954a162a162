"""Grammars for structured output: a request's constraint (JSON schema, regex, EBNF/GBNF or Lark) compiled into a
matcher that the constrained decoding step drives (engine/constrained.py). Torch-free: the HTTP process uses it
to refuse a bad grammar with a 400 naming the field, the engine to decode.

The backend is llguidance. `GrammarMatcher` is the whole interface the decoding step uses (validate, consume,
roll back, forced tokens, the allowed-token bitmask); xgrammar's matcher offers the same operations and could
sit behind it. Matchers run on fuel limits, never on time, so a decision never depends on how busy the host is.
"""

from __future__ import annotations

import json
import string
from collections import OrderedDict
from typing import Any, Protocol

import llguidance

from redraft.protocol.sampling_params import GRAMMAR_FIELDS

MAX_GRAMMAR_CHARS = 256 * 1024  # a grammar longer than this is refused before it is compiled
# JSON without optional whitespace: `{"a":1,"b":[2,3]}`. A schema may ask otherwise through its "x-guidance" key.
PUNCTUATION = frozenset(string.punctuation)
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


class GrammarError(ValueError):
    """A constraint that cannot be compiled; `param` names the field that holds it."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


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
        if self._m.is_error():  # only a caller bug gets here: every token consumed was validated first
            raise RuntimeError(f"grammar matcher error: {self._m.get_error()}")

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
        return self._m.compute_ff_tokens()

    def allowed_bitmask(self) -> bytes:
        return self._m.compute_bitmask()

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
        constrained step closes a grammar with when the model wants to stop (engine/constrained.py)."""
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
        """From a redraft Tokenizer (engine/tokenizer.py)."""
        return cls(tokenizer.backend.to_str(), vocab_size, tokenizer.eos_token_id)

    def compile(self, field: str, source: Any) -> str:
        """The llguidance grammar for one constraint field; GrammarError (naming `field`) when it is invalid.
        Valid ones are remembered (LRU): the HTTP process validates every constrained request with this."""
        key = _cache_key(field, source)
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

    def matcher(self, field: str, source: Any) -> LLGuidanceMatcher:
        """A fresh matcher for one request's constraint (compiled once per distinct constraint, LRU)."""
        key = _cache_key(field, source)
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


def _cache_key(field: str, source: Any) -> tuple[str, str]:
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


def parse_schema(source: Any, field: str = "json_schema") -> dict[str, Any]:
    """A JSON schema given as an object or as its JSON text."""
    if isinstance(source, str):
        if len(source) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"{field} is longer than {MAX_GRAMMAR_CHARS} characters", field)
        try:
            source = json.loads(source)
        except ValueError as exc:
            raise GrammarError(f"{field} is not valid JSON: {exc}", field) from exc
    if isinstance(source, bool):  # `true` is the schema every value satisfies
        source = {} if source else {"not": {}}
    if not isinstance(source, dict):
        raise GrammarError(f"{field} must be a JSON schema object", field)
    return source


# LLaDA2's tool-call format, as its chat template writes an assistant's calls (engine/templates/llada2_chat.jinja):
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
    options = [{
        "type": "object",
        "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    } for f in functions]
    schema = dict(options[0] if len(options) == 1 else {"anyOf": options}, **{"x-guidance": TEMPLATE_JSON})
    repeat = "+" if parallel and name is None else ""
    return f"start: call{repeat}\ncall: <[{start_id}]> %json {json.dumps(schema)} <[{end_id}]>\n"
