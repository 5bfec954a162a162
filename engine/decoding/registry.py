"""The decoding rules by name: a request's `decoder` (protocol/sampling_params.py `DECODERS`) -> its class.

Adding a rule: write its file (a `Decoder` subclass, engine/decoding/decoder.py), list it here and its name in
`DECODERS`, and add its naive twin to tests/ (tests/naive_llada2.py, tests/naive_llada22.py are the existing ones).
"""

from __future__ import annotations

from redraft.engine.decoding.decoder import Decoder
from redraft.engine.decoding.levenshtein import LevenshteinDecoder
from redraft.engine.decoding.threshold import ThresholdDecoder
from redraft.engine.model.config import ModelConfig

DECODER_CLASSES: dict[str, type[Decoder]] = {cls.name: cls for cls in (ThresholdDecoder, LevenshteinDecoder)}


def decoder_class(name: str) -> type[Decoder]:
    return DECODER_CLASSES[name]


def implied_decoder(cfg: ModelConfig) -> str | None:
    """The rule a checkpoint makes the default of requests that name none (None: the built-in default)."""
    return next((name for name, cls in DECODER_CLASSES.items() if cls.implied_by(cfg)), None)
