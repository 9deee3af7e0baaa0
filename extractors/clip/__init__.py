"""CLIP image encoders as one release: the encoders (:mod:`.model`), their weights files (:mod:`.files`) and the
feature recipes (:mod:`.recipe`). docs/extractor.md and docs/recipes.md describe it."""

from __future__ import annotations

from extractors.clip.files import LAYOUTS, ClipWeightsError, load_clip, read_clip
from extractors.clip.model import PRESETS, ClipVisionConfig, build, infer_config
from extractors.clip.recipe import (
    CLIP_MEAN,
    CLIP_STD,
    RECIPES,
    ClipFeatures,
    ClipRecipe,
    extract,
    extract_batch,
    prepare,
)
from extractors.clip.run import ClipEncoder, claims

__all__ = [
    "CLIP_MEAN",
    "CLIP_STD",
    "ClipEncoder",
    "LAYOUTS",
    "PRESETS",
    "RECIPES",
    "ClipFeatures",
    "ClipRecipe",
    "ClipVisionConfig",
    "ClipWeightsError",
    "build",
    "claims",
    "extract",
    "extract_batch",
    "infer_config",
    "load_clip",
    "prepare",
    "read_clip",
]
