"""Captioners: a registry and one builder.

``build_captioner(name, vocab_size, **overrides)`` reads ``configs/models/<name>.yaml`` (the paper's
hyperparameters, key ``model:``), applies ``overrides`` (validated: unknown keys or wrong types fail with a
clear message), and calls the factory registered under ``name``. A new model is one module in this
package that registers itself, plus one YAML file.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pipeline.core.config import CONFIG_DIR, Config, load_yaml_with_bases
from pipeline.core.errors import ConfigError
from pipeline.core.registry import Registry

from models.base import Captioner, index_state

CAPTIONERS: Registry = Registry("captioner")

_LOADED = False


def _import_all() -> None:
    """Import every module of this package once so that their ``register`` decorators run."""
    global _LOADED  # one-time import guard, not configuration
    if _LOADED:
        return
    for info in pkgutil.iter_modules(__path__):
        if info.name not in ("base",):
            importlib.import_module(f"{__name__}.{info.name}")
    _LOADED = True


def register_captioner(name: str):
    """Class decorator: register a :class:`Captioner` subclass under ``name``."""

    def deco(cls):
        cls.name = name
        return CAPTIONERS.register(name)(cls)

    return deco


def model_config(name: str, overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """The resolved ``model:`` section of ``configs/models/<name>.yaml`` with ``overrides`` applied."""
    _import_all()
    CAPTIONERS.get(name)  # unknown names fail here with the list of known ones
    path = CONFIG_DIR / "models" / f"{name}.yaml"
    data = load_yaml_with_bases(path)
    if "model" not in data or not isinstance(data["model"], dict):
        raise ConfigError(f"{path} must have a 'model:' mapping")
    return Config(data["model"]).with_overrides(overrides, source=f"model {name}")


def build_captioner(name: str, vocab_size: int, **overrides: Any) -> Captioner:
    """Build captioner ``name`` for a vocabulary of ``vocab_size`` ids with its paper hyperparameters."""
    cfg = model_config(name, overrides)
    cls = CAPTIONERS.get(name)
    return cls(vocab_size=vocab_size, **cfg.to_dict())


def available_captioners() -> list[str]:
    _import_all()
    return CAPTIONERS.names()


__all__ = ["CAPTIONERS", "Captioner", "available_captioners", "build_captioner", "index_state", "model_config", "register_captioner"]
