"""The region record: one image's regions as they cross the layers.

A detector (:mod:`extractors`) and an importer (:mod:`pipeline.importers`) produce it; the feature store's
writer takes it (``writer.add(key, record)``, :mod:`pipeline.store.writer`, the one writer of the store's
rows); the captioning engine pads records into a captioner's input. The store's reader hands the same fields
back by name (``store.get(key)["features"]``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

#: the per-region fields a record may carry besides features and boxes (all or none in one store)
OPTIONAL_FIELDS = ("class_ids", "class_scores", "attr_ids", "attr_scores")


@dataclass
class RegionRecord:
    """One image's regions: ``features`` (N, D) float, ``boxes`` (N, 4) float32 x1y1x2y2 in original pixels,
    the image size, optionally 0-based vocabulary ``class_ids``/``attr_ids`` with their probabilities, and
    optionally ``pooled`` (P,): a vector for the whole image (CLIP's attention pool or class token)."""

    features: np.ndarray
    boxes: np.ndarray
    image_w: int
    image_h: int
    class_ids: np.ndarray | None = None
    class_scores: np.ndarray | None = None
    attr_ids: np.ndarray | None = None
    attr_scores: np.ndarray | None = None
    #: one vector per image (not per region): CLIP's pooled vector, stored as the store's ``pooled`` field
    pooled: np.ndarray | None = None

    @classmethod
    def from_mapping(cls, rec: Mapping[str, Any]) -> "RegionRecord":
        """A record from a mapping with these field names (others, e.g. ``key``, are ignored)."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in rec.items() if k in names})

    def optional(self) -> dict[str, np.ndarray]:
        """The optional per-region fields this record carries."""
        return {name: getattr(self, name) for name in OPTIONAL_FIELDS if getattr(self, name) is not None}

    def to_dict(self) -> dict[str, Any]:
        """features, boxes, image_w, image_h and the optional fields it carries (the reader's field names)."""
        return {
            "features": self.features,
            "boxes": self.boxes,
            "image_w": self.image_w,
            "image_h": self.image_h,
            **self.optional(),
        }
