"""Dials carried in the maps a router keeps (server/dials.py): parsed to their types, lifted to where a direct
client puts them, and refused when two routes disagree."""

from __future__ import annotations

import pytest

from redraft.server.dials import DIALS, DialError, lift_dials, parse_dial, without_dials
from redraft.server.openai_protocol import ChatCompletionRequest, CompletionRequest

CHAT = [{"role": "user", "content": "hi"}]


def test_metadata_strings_become_the_dials_types() -> None:
    got = lift_dials({}, {"metadata": {"threshold": "0.9", "mbe_window": "2", "mode": "S", "other": "x"}})
    assert got == {"threshold": 0.9, "mbe_window": 2, "mode": "S"}
    assert isinstance(got["mbe_window"], int) and isinstance(got["threshold"], float)


@pytest.mark.parametrize("name,value", [("threshold", "high"), ("mbe_window", "2.5"), ("mode", 3),
                                        ("edit_threshold", True), ("max_post_steps", 1.5)])
def test_an_unreadable_carried_dial_names_where_it_came_from(name: str, value) -> None:
    with pytest.raises(DialError) as err:
        lift_dials({}, {"metadata": {name: value}})
    assert err.value.param == f"metadata.{name}"


def test_two_routes_must_agree() -> None:
    assert lift_dials({"threshold": 0.5}, {"metadata": {"threshold": "0.50"}}) == {"threshold": 0.5}
    with pytest.raises(DialError, match="threshold = 0.5, chat_template_kwargs.threshold = 0.7"):
        lift_dials({"threshold": 0.5}, {"chat_template_kwargs": {"threshold": 0.7}})
    with pytest.raises(DialError) as err:
        lift_dials({}, {"chat_template_kwargs": {"mode": "S"}, "metadata": {"mode": "Q"}})
    assert err.value.param == "metadata.mode"


def test_the_template_never_sees_a_dial() -> None:
    assert without_dials({"mode": "S", "enable_thinking": False}) == {"enable_thinking": False}
    req = ChatCompletionRequest.model_validate({"messages": CHAT, "chat_template_kwargs": {"mode": "S", "x": 1},
                                                "metadata": {"threshold": "0.9"}})
    assert (req.mode, req.threshold, req.chat_template_kwargs) == ("S", 0.9, {"x": 1})


def test_completions_read_metadata_and_validate_the_lifted_value() -> None:
    req = CompletionRequest.model_validate({"prompt": "hi", "metadata": {"edit_threshold": "0.3", "domain": "math"}})
    assert (req.edit_threshold, req.request_domain) == (0.3, "math")
    with pytest.raises(ValueError, match="threshold"):  # lifted, then held to the same bounds as a direct value
        CompletionRequest.model_validate({"prompt": "hi", "metadata": {"threshold": "7"}})


def test_every_dial_is_a_request_field() -> None:
    fields = set(ChatCompletionRequest.model_fields)
    assert set(DIALS) <= fields and parse_dial("max_post_steps", " 3 ", "x") == 3
