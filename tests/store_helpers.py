"""Deterministic synthetic images for store tests (shared by the tests and the kill-test writer process)."""

from __future__ import annotations

import numpy as np

from pipeline.core.regions import RegionRecord

IDENTITY = {"name": "test-extractor", "weights_sha256": "0" * 64, "config": {"boxes": [10, 30]}}


def synthetic_image(i: int, dim: int = 64) -> dict:
    """Image ``i``: 10-30 boxes inside a 100..300 x 80..240 image, ReLU-like features, class/attr fields."""
    rng = np.random.default_rng(1000 + i)
    n = int(rng.integers(10, 31))
    w, h = int(rng.integers(100, 301)), int(rng.integers(80, 241))
    x1 = rng.uniform(0, w / 2, n)
    y1 = rng.uniform(0, h / 2, n)
    boxes = np.stack([x1, y1, x1 + rng.uniform(1, w / 2, n), y1 + rng.uniform(1, h / 2, n)], 1).astype(np.float32)
    feats = np.maximum(rng.normal(0, 2, (n, dim)), 0).astype(np.float32)
    return {
        "key": f"img{i:05d}",
        "features": feats,
        "boxes": boxes,
        "image_w": w,
        "image_h": h,
        "class_ids": rng.integers(0, 1600, n),
        "class_scores": rng.uniform(0, 1, n).astype(np.float32),
        "attr_ids": rng.integers(0, 400, n),
        "attr_scores": rng.uniform(0, 1, n).astype(np.float32),
    }


def add_image(writer, rec: dict) -> None:
    writer.add(rec["key"], RegionRecord.from_mapping(rec))
