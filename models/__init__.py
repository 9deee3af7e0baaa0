"""Captioners: a registry, one record per captioner and one builder.

Each captioner has a *model card*, ``configs/models/<name>.yaml`` read once by :func:`model_card`: the paper's
hyperparameters (``model:``), its test-time decoding (``decoding:``, over ``configs/decoding.yaml``) and its
training recipe (``schedule:``, stages ``xe`` / ``scst``). ``build_captioner(name, vocab_size, **overrides)``
applies ``overrides`` to the card's ``model:`` section (validated: unknown keys or wrong types fail with a clear
message) and calls the class registered under ``name``. A new model is one module that registers itself with
``@register_captioner("name")``, plus one YAML file (docs/extending.md).

Packages: :mod:`models.captioners` (the captioner contract and one module per captioner, all imported when a
captioner is looked up), :mod:`models.layers` (attention, normalisation, geometry and the other building blocks
the captioners share), :mod:`models.decoding` (model-agnostic greedy, sampling and beam search),
:mod:`models.released` (other projects' released checkpoints converted to the native one) and
:mod:`models.checkpoints` / :mod:`models.loading` (the typed captioner checkpoint and reading a captioner file).
Imports go one way: layers <- captioners <- decoding; checkpoints <- released <- loading.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.captioners.base import Captioner, index_state
from pipeline.core.config import CONFIG_DIR, Config, load_yaml_with_bases, validate_against
from pipeline.core.errors import ConfigError
from pipeline.core.registry import Registry, import_modules_of

CAPTIONERS: Registry = Registry("captioner")

_CARD_FILES: dict[str, Path] = {}  # captioner name -> its model card file, recorded at registration


def register_captioner(name: str, card: str | Path | None = None):
    """Class decorator: register a :class:`Captioner` subclass under ``name``.

    Its model card is ``card`` if given, else ``configs/models/<name>.yaml``, else ``<name>.yaml`` beside the
    module that defines the class (a captioner kept outside this repository).
    """

    def deco(cls):
        cls.name = name
        CAPTIONERS.register(name)(cls)
        _CARD_FILES[name] = _card_file(name, cls, card)
        return cls

    return deco


def _card_file(name: str, cls: type, card: str | Path | None) -> Path:
    if card is not None:
        return Path(card)
    in_repo = CONFIG_DIR / "models" / f"{name}.yaml"
    module_file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    beside = Path(module_file).with_name(f"{name}.yaml") if module_file else None
    return beside if not in_repo.is_file() and beside is not None and beside.is_file() else in_repo


@dataclass(frozen=True)
class ModelCard:
    """A captioner's YAML, read once: ``model`` (constructor hyperparameters of the paper), ``decoding`` (test-time
    decoding: ``configs/decoding.yaml`` with the model's ``decoding:`` keys, validated) and ``schedule`` (the
    training recipe: ``xe`` and ``scst`` mappings, see :mod:`pipeline.training.recipe`)."""

    name: str
    path: Path
    model: Config
    decoding: Config
    schedule: Config


def _section(data: Mapping[str, Any], key: str, path: Path, required: bool = False) -> dict[str, Any]:
    value = data.get(key)
    if value is None and not required:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path} must have a '{key}:' mapping")
    return dict(value)


@functools.lru_cache(maxsize=None)
def model_card(name: str) -> ModelCard:
    """The :class:`ModelCard` of captioner ``name`` (unknown names fail listing the known ones; a missing or
    malformed card names its file)."""
    import_modules_of("models.captioners", skip=("base",))
    CAPTIONERS.get(name)
    path = _CARD_FILES.get(name, CONFIG_DIR / "models" / f"{name}.yaml")
    if not path.is_file():
        raise ConfigError(f"captioner {name}: model card {path} not found (one YAML with model:, decoding:, schedule:)")
    data = load_yaml_with_bases(path)
    defaults = load_yaml_with_bases(CONFIG_DIR / "decoding.yaml")["decoding"]
    decoding = validate_against(defaults, _section(data, "decoding", path), str(path), prefix="decoding.")
    return ModelCard(
        name,
        path,
        Config(_section(data, "model", path, required=True)),
        Config(decoding),
        Config(_section(data, "schedule", path)),
    )


def model_config(name: str, overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """The ``model:`` section of captioner ``name``'s card with ``overrides`` applied."""
    return model_card(name).model.with_overrides(overrides, source=f"model {name}")


def build_captioner(name: str, vocab_size: int, **overrides: Any) -> Captioner:
    """Build captioner ``name`` for a vocabulary of ``vocab_size`` ids with its paper hyperparameters."""
    cfg = model_config(name, overrides)
    cls = CAPTIONERS.get(name)
    return cls(vocab_size=vocab_size, **cfg.to_dict())


def available_captioners() -> list[str]:
    """The registered captioner names, sorted."""
    import_modules_of("models.captioners", skip=("base",))
    return CAPTIONERS.names()


__all__ = [
    "CAPTIONERS",
    "Captioner",
    "ModelCard",
    "available_captioners",
    "build_captioner",
    "index_state",
    "model_card",
    "model_config",
    "register_captioner",
]
