"""How each route names the values the engine and SamplingParams name by their own fields.

The engine refuses a request naming the offending field as SamplingParams names it (`max_new_tokens`, `input_ids`
for the prompt); SamplingParams' own checks do the same. A route's client sent those values under its own names
(`max_tokens`, `messages`, `sampling_params.temperature`): the one table per route below turns the internal
name into the route's, so that every refusal names a field of the request the client sent.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

from redraft.protocol.errors import RequestError
from redraft.protocol.sampling_params import SamplingParamsError
from redraft.server.request_fields import openai_spellings


@dataclass(frozen=True)
class RouteNames:
    """One route's names for the engine's fields.

    `engine`: an engine refusal's param -> the route's field (any other name is the route's too).
    `params_prefix`: where the route's body holds SamplingParams' fields (`sampling_params.` on /generate).
    `spelled`: SamplingParams fields the route spells otherwise, in the param and in the message of a
    SamplingParams refusal (OpenAI's `max_tokens`)."""

    engine: Mapping[str, str] = field(default_factory=dict)
    params_prefix: str = ""
    spelled: Mapping[str, str] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The route's field that holds the prompt."""
        return self.engine.get("input_ids", "input_ids")

    def engine_param(self, name: str | None) -> str | None:
        return self.engine.get(name or "", name)

    def param(self, name: str | None) -> str | None:
        """The route's field of a SamplingParams field."""
        return None if name is None else self.params_prefix + self.spelled.get(name, name)

    def engine_error(self, err: RequestError) -> RequestError:
        """An engine refusal naming the route's field."""
        return err.renamed(self.engine_param(err.param))

    def params_error(self, exc: SamplingParamsError) -> RequestError:
        """SamplingParams' refusal of the route's values, in the route's words."""
        message = str(exc)
        for internal, ours in self.spelled.items():
            message = message.replace(internal, ours)
        return RequestError(message, param=self.param(exc.param))


_OPENAI_SPELLED = openai_spellings()  # {"max_new_tokens": "max_tokens"}: each field's declared `openai_name`


def route_names(prompt: str, *, params_prefix: str = "", spelled: Mapping[str, str] | None = None) -> RouteNames:
    """A route whose prompt comes in `prompt`: the engine's refusals of the fields the routes spell their own way
    (each declared `openai_name`: max_new_tokens) name the route's field as its SamplingParams refusals do
    (`max_tokens`, or `sampling_params.max_new_tokens` on /generate)."""
    names = RouteNames(params_prefix=params_prefix, spelled=spelled or {})
    return replace(names, engine={**{name: names.param(name) for name in _OPENAI_SPELLED}, "input_ids": prompt})


CHAT = route_names("messages", spelled=_OPENAI_SPELLED)
COMPLETIONS = route_names("prompt", spelled=_OPENAI_SPELLED)
PROMPT_LOGPROBS = RouteNames(engine={"input_ids": "prompt"})  # echo on completions, input logprobs on /generate
SCORE = RouteNames(engine={"input_ids": "items"})


def generate_names(prompt: str) -> RouteNames:
    """/generate's names; `prompt`: the field its prompt came in (text or input_ids)."""
    return route_names(prompt, params_prefix="sampling_params.")
