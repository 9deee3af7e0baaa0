"""Region-feature extractors: a registry of detector presets (the bottom-up Faster R-CNN and its variants).

An extractor module registers a factory with ``@EXTRACTORS.register("name")``; ``cli extract`` picks one by
config (``extract.preset``) or, with ``preset: auto``, from the weights file's layout.
"""

from __future__ import annotations

import importlib
import pkgutil

from pipeline.core.registry import Registry

EXTRACTORS: Registry = Registry("extractor")

_LOADED = False


def _import_all() -> None:
    global _LOADED  # one-time import guard, not configuration
    if _LOADED:
        return
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    _LOADED = True


def available_extractors() -> list[str]:
    """Every registered preset (the extractor modules imported first, which loads torchvision; ``cli info
    --releases`` lists them)."""
    _import_all()
    return EXTRACTORS.names()


__all__ = ["EXTRACTORS", "available_extractors"]
