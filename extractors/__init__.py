"""Region-feature extractors: a registry of detector presets (the bottom-up Faster R-CNN and its variants).

An extractor module registers a factory with ``@EXTRACTORS.register("name")``; ``cli extract`` picks one by
config (``extract.preset``) or, with ``preset: auto``, from the weights file's layout.
"""

from __future__ import annotations

from pipeline.core.registry import Registry, import_modules_of

EXTRACTORS: Registry = Registry("extractor")


def available_extractors() -> list[str]:
    """Every registered preset (the extractor modules imported first, which loads torchvision; ``cli info
    --releases`` lists them)."""
    import_modules_of(__name__)
    return EXTRACTORS.names()


__all__ = ["EXTRACTORS", "available_extractors"]
