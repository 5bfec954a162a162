"""Per-request decoding parameters: presets (S/Q/auto), overrides and validation. Torch-free.

Mode presets from the LLaDA2.1 model card (block 32, temperature 0):
    Q (quality): threshold 0.7, edit_threshold 0.5, max_post_steps 16
    S (speed):   threshold 0.5, edit_threshold 0.0, max_post_steps 16
`auto` picks S for the code and math domains and Q otherwise. Explicit `threshold`, `edit_threshold` and
`max_post_steps` override whatever the mode says.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

PRESETS: dict[str, tuple[float, float, int]] = {
    "Q": (0.7, 0.5, 16),
    "S": (0.5, 0.0, 16),
}
AUTO_SPEED_DOMAINS = frozenset({"code", "math"})
MODES = ("S", "Q", "auto")
INT64_MAX = 2**63 - 1


class SamplingParamsError(ValueError):
    """A sampling parameter is invalid; `param` names it (for the API's error body)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    mode: str | None = None  # "S" | "Q" | "auto"; None: the engine's default mode
    threshold: float | None = None
    edit_threshold: float | None = None
    max_post_steps: int | None = None
    mbe_window: int = 1
    domain: str | None = None
    logprobs: bool = False  # per-token logprobs (of the forward that last saw each block)
    top_logprobs: int = 0  # and the top alternatives at each position, 0..20
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | "SamplingParams" | None) -> "SamplingParams":
        if raw is None:
            return cls()
        if isinstance(raw, SamplingParams):
            return raw
        if not isinstance(raw, dict):
            raise SamplingParamsError(f"sampling_params must be an object, got {type(raw).__name__}")
        names = {f.name for f in fields(cls)} - {"extra"}
        unknown = sorted(set(raw) - names)
        if unknown:
            raise SamplingParamsError(f"unsupported sampling parameter(s): {', '.join(unknown)}", unknown[0])
        values = dict(raw)
        if isinstance(values.get("stop"), str):
            values["stop"] = (values["stop"],)
        for key in ("stop", "stop_token_ids"):
            if values.get(key) is None:
                values.pop(key, None)
            elif not isinstance(values[key], (list, tuple)):
                raise SamplingParamsError(f"{key} must be a list", key)
            else:
                values[key] = tuple(values[key])
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        def fail(msg: str, param: str) -> None:
            raise SamplingParamsError(msg, param)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool)

        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            fail("max_new_tokens must be an integer >= 1", "max_new_tokens")
        if not is_num(self.temperature) or not 0.0 <= self.temperature <= 100.0:
            fail("temperature must be a number in [0, 100]", "temperature")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail("top_p must be in (0, 1]", "top_p")
        # top_k and seed travel to the model runner as int64 tensors: a larger value would crash its step.
        if not is_int(self.top_k) or not -1 <= self.top_k <= INT64_MAX:
            fail("top_k must be an integer in [-1, 2^63) (-1 or 0 disables it)", "top_k")
        if self.seed is not None and (not is_int(self.seed) or not -INT64_MAX - 1 <= self.seed <= INT64_MAX):
            fail("seed must be an integer in [-2^63, 2^63)", "seed")
        if self.mode is not None and self.mode not in MODES:
            fail(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}", "mode")
        for name in ("threshold", "edit_threshold"):
            v = getattr(self, name)
            if v is not None and (not is_num(v) or not 0.0 <= v <= 1.0):
                fail(f"{name} must be a number in [0, 1]", name)
        if self.max_post_steps is not None and (not is_int(self.max_post_steps) or not 0 <= self.max_post_steps <= 1024):
            fail("max_post_steps must be an integer in [0, 1024]", "max_post_steps")
        if not is_int(self.mbe_window) or self.mbe_window < 1:
            fail("mbe_window must be an integer >= 1", "mbe_window")
        if self.mbe_window != 1:
            fail("mbe_window > 1 (multi-block editing) is not implemented yet; use 1", "mbe_window")
        if any(not isinstance(s, str) or not s for s in self.stop):
            fail("stop must hold non-empty strings", "stop")
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            fail("stop_token_ids must hold non-negative integers", "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            fail("ignore_eos must be a boolean", "ignore_eos")
        if not isinstance(self.logprobs, bool):
            fail("logprobs must be a boolean", "logprobs")
        if not is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= 20:
            fail("top_logprobs must be an integer in [0, 20]", "top_logprobs")
        if self.domain is not None and not isinstance(self.domain, str):
            fail("domain must be a string", "domain")

    def effective_mode(self, default_mode: str = "Q") -> str:
        """S or Q after resolving None (-> default) and auto (-> by domain)."""
        mode = self.mode or default_mode
        if mode == "auto":
            return "S" if (self.domain or "").lower() in AUTO_SPEED_DOMAINS else "Q"
        return mode

    def resolved(self, default_mode: str = "Q") -> "ResolvedParams":
        threshold, edit_threshold, max_post_steps = PRESETS[self.effective_mode(default_mode)]
        return ResolvedParams(
            params=self,
            mode=self.effective_mode(default_mode),
            threshold=threshold if self.threshold is None else float(self.threshold),
            edit_threshold=edit_threshold if self.edit_threshold is None else float(self.edit_threshold),
            max_post_steps=max_post_steps if self.max_post_steps is None else self.max_post_steps,
        )

    def with_overrides(self, **changes: Any) -> "SamplingParams":
        return replace(self, **changes)


@dataclass(frozen=True)
class ResolvedParams:
    """The concrete numbers the decoding step uses."""

    params: SamplingParams
    mode: str
    threshold: float
    edit_threshold: float
    max_post_steps: int
