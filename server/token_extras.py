"""The token-level extras SGLang's and vLLM's clients read from a chat or completion answer (docs/openai.md,
"Compatibility"): which stop ended a choice (`matched_stop`, `stop_reason`), the prompt cut from the left
(`truncate_prompt_tokens`), and the prompt's log-probabilities in vLLM's `prompt_logprobs` shape, from the
block-diffusion staircase values (docs/likelihood.md)."""

from __future__ import annotations

from typing import Any

from redraft.protocol.errors import RequestError


def stop_fields(finish: dict | None, eos_ids: frozenset[int], stop_token_ids: list[int] | None) -> dict[str, Any]:
    """SGLang's `matched_stop` (the stop string or token id that ended the choice, an EOS id included; null when
    it did not stop) and vLLM's `stop_reason` (the same, but null for an EOS the request did not name)."""
    finish = finish or {}
    matched = finish.get("matched") if finish.get("type") == "stop" else None
    named_eos = isinstance(matched, int) and matched in eos_ids and matched not in (stop_token_ids or ())
    return {"matched_stop": matched, "stop_reason": None if named_eos else matched}


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens: the last `keep` tokens of the prompt (-1: as many as the context holds)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep == 0:
        raise RequestError("truncate_prompt_tokens 0 would leave no prompt", param="truncate_prompt_tokens")
    return ids[-keep:] if len(ids) > keep else ids


def prompt_logprobs_entries(tokenizer: Any, ids: list[int], rows: list) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt position, null (the first, and any not computed) or
    {token id: {"logprob", "rank", "decoded_token"}} holding the prompt's own token and the top alternatives.
    The values are staircase values; `rank` is the place among the alternatives (1 = best), null for a prompt
    token outside them (the engine reads the top k only, not the token's place in the whole vocabulary)."""
    out: list[dict[str, dict] | None] = []
    for token, row in zip(ids, rows):
        if row is None:
            out.append(None)
            continue
        value, alternatives = row
        entry = {str(t): {"logprob": v, "rank": j + 1, "decoded_token": _text(tokenizer, t)}
                 for j, (t, v) in enumerate(alternatives)}
        entry.setdefault(str(token), {"logprob": value, "rank": None, "decoded_token": _text(tokenizer, token)})
        out.append(entry)
    return out


def _text(tokenizer: Any, token: int) -> str:
    return tokenizer.token_bytes(token).decode("utf-8", errors="replace")
