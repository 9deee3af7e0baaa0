"""Region-feature extractors: a registry of detector presets (the bottom-up Faster R-CNN and its variants).

An extractor module registers a factory with ``@EXTRACTORS.register("name")``; ``cli extract`` picks one by
config (``extract.preset``) or, with ``preset: auto``, from the weights file's layout.
"""

from __future__ import annotations

import importlib
import pkgutil

from pipeline.core.registry import Registry

EXTRACTORS: Registry = Registry("extractor")

#: the presets this package registers (importing the extractor modules to list them loads torchvision, which
#: ``cli --help`` should not wait for); tests/test_cli_grammar.py keeps it equal to the registry's names
BUILTIN_PRESETS = ("bottom-up-caffe-r101", "bottom-up-d2-r101", "vinvl-x152c4")

#: the releases this package registers (:mod:`extractors.releases`), for the same reason: the help of
#: ``import-features --release``; tests/test_releases.py keeps it equal to the registry's names
BUILTIN_RELEASES = ("caffe", "hf", "airsplay", "vinvl", "grid-feats", "clip-vil")

_LOADED = False


def _import_all() -> None:
    global _LOADED  # one-time import guard, not configuration
    if _LOADED:
        return
    for info in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{info.name}")
    _LOADED = True


def available_extractors() -> list[str]:
    _import_all()
    return EXTRACTORS.names()


__all__ = ["BUILTIN_PRESETS", "BUILTIN_RELEASES", "EXTRACTORS", "available_extractors"]
