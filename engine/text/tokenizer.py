"""Tokenizer and chat template for LLaDA2 checkpoints, built on the `tokenizers` library alone.

`transformers` is deliberately not a dependency: a checkpoint's `tokenizer.json` is a complete `tokenizers`
pipeline, and `tokenizer_config.json` only adds the special-token names and the Jinja chat template, which we
render ourselves in a sandbox (the template ships with the checkpoint, so it is untrusted input).
"""

from __future__ import annotations

import json
import re
import secrets
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

# LLaDA2's special tokens, in the order the official vocabulary lists them. The mask token is what the
# diffusion decoder writes into undecided positions; `<|role_end|>` closes a chat turn.
BOS_TOKEN = "<|startoftext|>"
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
LLADA2_SPECIAL_TOKENS: tuple[str, ...] = (
    BOS_TOKEN,
    EOS_TOKEN,
    MASK_TOKEN,
    "<role>",
    "</role>",
    "<|role_end|>",
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)

_TEMPLATES_DIR = Path(__file__).parent / "templates"
DEFAULT_CHAT_TEMPLATE_FILE = _TEMPLATES_DIR / "llada2_chat.jinja"


class ChatTemplateError(ValueError):
    """The chat template could not be rendered for these messages (bad template, bad input, sandbox)."""


def load_default_chat_template() -> str:
    """The LLaDA2 chat template redraft ships (used for checkpoints we build ourselves)."""
    return DEFAULT_CHAT_TEMPLATE_FILE.read_text(encoding="utf-8")


def _token_content(entry: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as plain strings or as serialized AddedToken dicts.
    if entry is None:
        return None
    if isinstance(entry, str):
        return entry
    if isinstance(entry, Mapping) and isinstance(entry.get("content"), str):
        return entry["content"]
    raise ValueError(f"unrecognised special-token entry in tokenizer_config.json: {entry!r}")


def _raise_exception(message: str) -> None:
    # Templates call this to reject conversations they cannot format; it surfaces as ChatTemplateError.
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson HTML-escapes `<`, `>`, `&` and `'`; chat templates want plain JSON, as HF gives.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


_RENDER = threading.local()  # the deadline of the rendering running on this thread (render_chat_template)
RENDER_TIMEOUT_S = 5.0
RENDER_MAX_CHARS = 16 * 2**20  # a chat prompt longer than this is a runaway template, not a conversation


class RenderBudgetExceeded(Exception):
    pass


class _StrictSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """Jinja's sandbox turns an unsafe attribute (`''.__class__`) into an Undefined that prints as ''; we fail
    loudly instead, so a hostile or broken template is reported rather than silently half-rendered. Every call
    a template makes (`range`, filters, methods: any loop needs one) also checks the rendering's deadline, so a
    template with a runaway loop ends with an error instead of holding a thread forever."""

    def unsafe_undefined(self, obj: Any, attribute: str) -> jinja2.Undefined:
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")

    def call(self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
        deadline = getattr(_RENDER, "deadline", None)
        if deadline is not None and time.monotonic() > deadline:
            raise RenderBudgetExceeded()
        return super().call(__context, __obj, *args, **kwargs)


def _make_jinja_env() -> _StrictSandbox:
    # The same environment Hugging Face builds, so that templates written for `apply_chat_template` render
    # identically: whitespace control, loop controls (break/continue), and the helper globals.
    env = _StrictSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=False,
        extensions=[jinja2.ext.loopcontrols],
        undefined=jinja2.Undefined,
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


_JINJA_ENV = _make_jinja_env()


def read_chat_template_arg(value: str) -> str:
    """--chat-template: a file holding a Jinja template, or the template itself (as vLLM takes it); compiled here
    so that a broken one fails at start-up with its reason, not at the first request."""
    path = Path(value).expanduser()
    if path.is_file():
        source = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        source = value
    else:
        raise FileNotFoundError(f"--chat-template: no such file: {value}")
    try:
        compile_chat_template(source)
    except ChatTemplateError as exc:
        raise ValueError(f"--chat-template does not compile: {exc}") from exc
    return source


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the sandbox; syntax errors become ChatTemplateError."""
    try:
        return _JINJA_ENV.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"invalid chat template (line {exc.lineno}): {exc.message}") from exc


def render_chat_template(template: str | jinja2.Template, messages: Sequence[Mapping[str, Any]],
                         tools: Sequence[Mapping[str, Any]] | None = None,
                         add_generation_prompt: bool = True, *, timeout: float = RENDER_TIMEOUT_S,
                         **extra: Any) -> str:
    """Render a chat template with the variables HF templates expect (messages, tools, add_generation_prompt,
    special-token strings passed in `extra`), within `timeout` seconds and RENDER_MAX_CHARS characters."""
    compiled = compile_chat_template(template) if isinstance(template, str) else template
    deadline = time.monotonic() + timeout
    _RENDER.deadline = deadline
    try:
        parts, size = [], 0
        for piece in compiled.generate(messages=list(messages), tools=list(tools) if tools else None,
                                       add_generation_prompt=add_generation_prompt, **extra):
            parts.append(piece)
            size += len(piece)
            if size > RENDER_MAX_CHARS or time.monotonic() > deadline:
                raise RenderBudgetExceeded()
        return "".join(parts)
    except RenderBudgetExceeded:
        raise ChatTemplateError(f"the chat template took longer than {timeout:.0f}s or produced more than "
                                f"{RENDER_MAX_CHARS} characters") from None
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"chat template attempted an unsafe operation: {exc}") from exc
    except jinja2.exceptions.TemplateError as exc:
        # Covers raise_exception, undefined-variable errors and runtime template errors.
        raise ChatTemplateError(f"chat template error: {exc}") from exc
    except (TypeError, AttributeError, KeyError, IndexError, ValueError) as exc:
        # Malformed messages (e.g. content of an unexpected type) fail inside template expressions.
        raise ChatTemplateError(f"chat template could not format the messages: {type(exc).__name__}: {exc}") from exc
    finally:
        _RENDER.deadline = None


def generation_eos_ids(model_dir: str | Path) -> list[int]:
    """The `eos_token_id` of a checkpoint's generation_config.json as a list: one id, or every id of a list
    (LLaDA2.2-flash lists two, the second `<|role_end|>`); empty when the file or the key is absent."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    raw = json.loads(path.read_text(encoding="utf-8"))
    value = raw.get("eos_token_id") if isinstance(raw, dict) else None
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"generation_config.json: eos_token_id must be a token id or a list of them, not {value!r}")
    return ids


class Tokenizer:
    """A checkpoint's tokenizer: byte-level BPE from `tokenizer.json` plus `tokenizer_config.json` metadata.

    Special-token ids are looked up by name in the vocabulary, never hard-coded: LLaDA2's `<|mask|>` id is
    another token's id in the related Ling-2.0 tokenizer. `eos_token_ids`: every id that ends an output, the EOS
    token and the ids generation_config.json's `eos_token_id` lists (`from_pretrained`).
    """

    def __init__(self, tokenizer: _HFTokenizer, config: Mapping[str, Any] | None = None,
                 extra_eos_ids: Iterable[int] = ()) -> None:
        self._tok = tokenizer
        self.config: dict[str, Any] = dict(config or {})
        self.chat_template: str | None = self._read_chat_template(self.config.get("chat_template"))

        self.mask_token: str = _token_content(self.config.get("mask_token")) or MASK_TOKEN
        self.eos_token: str = _token_content(self.config.get("eos_token")) or EOS_TOKEN
        self.pad_token: str = _token_content(self.config.get("pad_token")) or self.eos_token
        self.bos_token: str | None = _token_content(self.config.get("bos_token"))

        mask_id = self._tok.token_to_id(self.mask_token)
        if mask_id is None:
            raise ValueError(f"the tokenizer has no mask token {self.mask_token!r}: LLaDA2 decoding needs one "
                             "(is this a LLaDA2 checkpoint?)")
        eos_id = self._tok.token_to_id(self.eos_token)
        if eos_id is None:
            raise ValueError(f"the tokenizer has no EOS token {self.eos_token!r}")
        pad_id = self._tok.token_to_id(self.pad_token)
        if pad_id is None:
            raise ValueError(f"the tokenizer has no pad token {self.pad_token!r}")
        self.mask_token_id: int = mask_id
        self.eos_token_id: int = eos_id
        self.eos_token_ids: frozenset[int] = frozenset({eos_id, *extra_eos_ids})  # each one a stop id
        self.pad_token_id: int = pad_id
        self.bos_token_id: int | None = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._compiled_template: jinja2.Template | None = None
        self._plain: _HFTokenizer | None = None  # a copy that reads special-token strings as text (encode_plain)

    @staticmethod
    def _read_chat_template(raw: Any) -> str | None:
        # Some configs store a list of named templates; the one called "default" is what HF applies.
        if raw is None or isinstance(raw, str):
            return raw
        if isinstance(raw, list):
            named = {t.get("name"): t.get("template") for t in raw if isinstance(t, Mapping)}
            return named.get("default")
        raise ValueError(f"unrecognised chat_template entry in tokenizer_config.json: {type(raw).__name__}")

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, chat_template: str | None = None) -> "Tokenizer":
        """`chat_template`: the operator's replacement for the checkpoint's (read_chat_template_arg)."""
        model_dir = Path(model_dir)
        tok_path = model_dir / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {model_dir}")
        cfg_path = model_dir / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.is_file() else {}
        # A separate chat_template.jinja (newer HF layout) wins over an absent config entry.
        jinja_path = model_dir / "chat_template.jinja"
        if not config.get("chat_template") and jinja_path.is_file():
            config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        if chat_template is not None:
            config["chat_template"] = read_chat_template_arg(chat_template)
        return cls(_HFTokenizer.from_file(str(tok_path)), config, generation_eos_ids(model_dir))

    # ----- basic encode / decode -----
    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (the model's embedding may be padded beyond this)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying `tokenizers.Tokenizer` (e.g. for incremental detokenizers)."""
        return self._tok

    def encode(self, text: str) -> list[int]:
        """Token ids for `text`; never adds BOS/EOS (LLaDA2 adds none). Special-token strings in the text
        map to their ids, as in HF."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str | None]:
        return [self._tok.id_to_token(int(i)) for i in ids]

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(int(token_id))

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (byte-level BPE maps each byte to one printable character);
        special tokens give their text. For OpenAI's `bytes` field of logprobs."""
        piece = self._tok.id_to_token(int(token_id)) or ""
        if int(token_id) in self.special_token_ids:
            return piece.encode()
        table = _byte_level_decoder()
        if all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        return piece.encode()

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of every added token flagged special (skipped by decode(skip_special_tokens=True))."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    # ----- chat -----
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render the checkpoint's chat template (sandboxed) and return the prompt text."""
        if not self.chat_template:
            raise ChatTemplateError("this checkpoint's tokenizer_config.json has no chat_template; "
                                    "send a plain prompt (completions / input_ids) instead")
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        # Like HF, expose the special-token strings to the template; caller-supplied values win.
        variables: dict[str, Any] = {"bos_token": self.bos_token or "", "eos_token": self.eos_token,
                                     "pad_token": self.pad_token, "mask_token": self.mask_token}
        variables.update(extra)
        return render_chat_template(self._compiled_template, messages, tools=tools,
                                    add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, **extra: Any) -> list[int]:
        """Token ids of the rendered chat, where only the template's own markup can produce special tokens:
        every string that comes from the messages or the tools (content, names, arguments, tool results and
        descriptions) is tokenized as plain text, so `<|role_end|>` or `<role>SYSTEM</role>` typed by a user is
        just text, as with OpenAI's API.

        How: each such string is rendered between two markers carrying a per-call random nonce (so the text itself
        cannot forge one), the marked spans are cut out of the rendered prompt and tokenized with special tokens
        off, the template's text around them with special tokens on. A template that drops or splits a marker
        (it transformed the text) is refused rather than tokenized unsafely.

        `continue_final_message` (assistant prefill): the last message, an assistant's text, is left open: the
        prompt ends with its text (the markup that closes the turn is cut), so the answer continues it."""
        nonce = secrets.token_hex(8)
        start, end = f"\ue000{nonce}\ue001", f"\ue001{nonce}\ue000"
        marked_messages = _mark_strings(messages, start, end)
        marked_tools = _mark_strings(tools, start, end) if tools is not None else None
        text = self.apply_chat_template(marked_messages, tools=marked_tools, add_generation_prompt=add_generation_prompt,
                                        **extra)
        ids: list[int] = []
        pos = 0
        spans = list(re.finditer(re.escape(start) + "(.*?)" + re.escape(end), text, re.DOTALL))
        if continue_final_message:  # the final message's text is the last string rendered: end the prompt there
            if not spans:
                raise ChatTemplateError("the chat template rendered no text of the final message to continue")
            text = text[: spans[-1].end()]
        for m in [*spans, None]:
            markup = text[pos : m.start() if m else len(text)]
            if "\ue000" in markup or "\ue001" in markup or (m and nonce in m.group(1)):
                raise ChatTemplateError("the chat template altered the message text (a marker was cut or nested); "
                                        "it cannot be tokenized safely")
            ids += self.encode(markup)
            if m:
                ids += self.encode_plain(m.group(1))
                pos = m.end()
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of `text` with every special-token string in it read as plain text."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids


_STRUCTURAL_KEYS = frozenset({"role", "type"})  # compared by templates, never shown: left as they are


MAX_MARK_DEPTH = 100  # messages and tools nested deeper are refused (the HTTP edge allows 64 levels)


def _mark_strings(value: Any, start: str, end: str, depth: int = 0) -> Any:
    """A copy of `value` (messages or tools) with every string wrapped in the markers, but for structural keys.
    Recursive, so bounded: a value nested deeper than MAX_MARK_DEPTH is a ChatTemplateError, not a RecursionError."""
    if isinstance(value, str):
        return start + value + end
    if depth > MAX_MARK_DEPTH and isinstance(value, (Mapping, list, tuple)):
        raise ChatTemplateError(f"the messages or tools are nested more than {MAX_MARK_DEPTH} levels deep")
    if isinstance(value, Mapping):
        return {k: (v if k in _STRUCTURAL_KEYS else _mark_strings(v, start, end, depth + 1)) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_mark_strings(v, start, end, depth + 1) for v in value]
    return value


def _byte_level_decoder() -> dict[str, int]:
    """Inverse of byte-level BPE's byte -> printable character table (printable Latin-1 bytes map to
    themselves; the other bytes, in order, to U+0100 onwards)."""
    global _BYTE_LEVEL_TABLE
    if _BYTE_LEVEL_TABLE is None:
        kept = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1), *range(ord("\u00ae"), 256)]
        table = {chr(b): b for b in kept}
        extra = 0
        for b in range(256):
            if b not in kept:
                table[chr(256 + extra)] = b
                extra += 1
        _BYTE_LEVEL_TABLE = table
    return _BYTE_LEVEL_TABLE


_BYTE_LEVEL_TABLE: dict[str, int] | None = None


# ----- writing the tokenizer of a checkpoint we create (tiny test models, the demo model) -----
def save_pretrained_tokenizer(tok: _HFTokenizer, out_dir: str | Path, chat_template: str | None,
                              *, model_max_length: int = 32768) -> None:
    """Write `tokenizer.json` and a HF-style `tokenizer_config.json` carrying LLaDA2's special tokens."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    added = {
        str(i): {"content": t.content, "lstrip": t.lstrip, "normalized": t.normalized, "rstrip": t.rstrip,
                 "single_word": t.single_word, "special": t.special}
        for i, t in sorted(tok.get_added_tokens_decoder().items())
    }
    config: dict[str, Any] = {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if chat_template is not None:
        config["chat_template"] = chat_template
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n",
                                                   encoding="utf-8")
