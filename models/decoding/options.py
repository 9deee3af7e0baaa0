"""Decoding settings (:class:`DecodeOptions`, defaults in ``configs/decoding.yaml``) and the decoded record
(:class:`Generated`); the rules each setting selects are described in :mod:`models.decoding`."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import torch

from models import model_card
from models.captioners.base import Captioner
from pipeline.core.config import CONFIG_DIR, Config, defaults_from, load_yaml_with_bases
from pipeline.core.errors import ConfigError

METHODS = ("beam", "greedy", "sample")
PENALTIES = ("wu", "avg")
STOP_RULES = ("exact", "first_k", "official_m2", "official_aoanet")


@dataclass(frozen=True)
@defaults_from(CONFIG_DIR / "decoding.yaml", "decoding")
class DecodeOptions:
    """Decoding settings; the defaults (one per field, each key's meaning beside it) and the schema of every layer
    are ``configs/decoding.yaml``'s ``decoding:`` section (:func:`~pipeline.core.config.defaults_from`)."""

    method: str
    beam_size: int
    max_len: int
    n_best: int
    length_penalty: float
    length_penalty_kind: str
    block_trigrams: bool
    suppress_unk: bool
    temperature: float
    top_k: int
    top_p: float
    collapse_repeats: bool  # post-processing of the final words (applied by the caller)
    stop_rule: str

    def __post_init__(self) -> None:
        problems = []
        if self.method not in METHODS:
            problems.append(f"method must be one of {METHODS}, got {self.method!r}")
        if self.length_penalty_kind not in PENALTIES:
            problems.append(f"length_penalty_kind must be one of {PENALTIES}, got {self.length_penalty_kind!r}")
        if self.beam_size < 1 or self.max_len < 1 or self.n_best < 1:
            problems.append("beam_size, max_len and n_best must be >= 1")
        if self.method == "beam" and self.n_best > self.beam_size:
            problems.append(f"n_best ({self.n_best}) cannot exceed beam_size ({self.beam_size})")
        if self.method == "greedy" and self.n_best != 1:
            problems.append("greedy decoding returns one caption per image (n_best must be 1)")
        if self.stop_rule not in STOP_RULES:
            problems.append(f"stop_rule must be one of {STOP_RULES}, got {self.stop_rule!r}")
        elif self.stop_rule == "official_m2" and (self.length_penalty != 0 or self.block_trigrams):
            problems.append("stop_rule official_m2 has no length penalty and no trigram blocking (M2's beam search)")
        elif self.stop_rule == "official_aoanet" and self.block_trigrams:
            problems.append("stop_rule official_aoanet has no trigram blocking (AoANet's beam search)")
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            problems.append("need temperature > 0, 0 < top_p <= 1 and top_k >= 0")
        odd = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))
        ]
        if odd:
            problems.insert(0, f"{', '.join(odd)}: every number must be finite")
        if problems:
            raise ConfigError("decoding: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "DecodeOptions":
        """Build from a (validated) ``decoding:`` mapping; unknown keys are a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"decoding: unknown option(s) {unknown} (known: {sorted(known)})")
        return cls(**dict(data))


def check_max_len(options: DecodeOptions, model: Captioner, where: str = "max_len") -> None:
    """Refuse, before any decoding, a ``max_len`` past the model's position table
    (:meth:`Captioner.max_caption_len`)."""
    limit = model.max_caption_len()
    if limit is not None and options.max_len > limit:
        raise ConfigError(
            f"{where} {options.max_len} is longer than the {limit} positions this {model.name or 'captioner'} model's "
            f"position table holds: give {limit} or less"
        )


def decoding_config(model_name: str | None = None, overrides: Mapping[str, Any] | list[str] | None = None) -> Config:
    """The ``decoding:`` section of captioner ``model_name``'s card (:func:`models.model_card`) over
    ``configs/decoding.yaml``; only the defaults without a name."""
    if model_name is None:
        data = load_yaml_with_bases(CONFIG_DIR / "decoding.yaml")["decoding"]
    else:
        data = model_card(model_name).decoding.to_dict()
    return Config(data).with_overrides(overrides, source="decoding")


def decoding_options(
    model_name: str | None = None, overrides: Mapping[str, Any] | list[str] | None = None
) -> DecodeOptions:
    """:class:`DecodeOptions` for ``model_name`` (its paper's test-time setting) with ``overrides``."""
    return DecodeOptions.from_mapping(decoding_config(model_name, overrides).to_dict())


@dataclass
class Generated:
    """Decoded captions of ``B`` images, ``n`` per image, ``T <= max_len`` steps.

    ``tokens`` ``(B, n, T)`` without BOS, ``<eos>`` included, ``<pad>`` after it; ``lengths`` ``(B, n)``
    generated tokens including ``<eos>``; ``logprob`` ``(B, n)`` summed log-probability; ``scores``
    ``(B, n)`` the ranking score (length-penalised for beam search, else ``logprob``), best first for beam
    search; ``token_logprobs`` ``(B, n, T)`` per token (0 after the end; greedy and sampling only).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    logprob: torch.Tensor
    scores: torch.Tensor
    token_logprobs: torch.Tensor | None = None
