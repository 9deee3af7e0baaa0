"""Oracle region features for the synthetic world: a legitimate test fixture and an upper-bound baseline.

The demo detector (extractors/) is too slow for unit tests, so training tests read features that a
*perfect* detector would give: for every image, the regions are the ground-truth object boxes of
``annotations/instances_{split}.json`` and each region's feature is

    one-hot(shape)  (7)  ⊕  one-hot(colour) (8)  ⊕  one-hot(size) (2)
    ⊕  normalised box (x1/W, y1/H, x2/W, y2/H, sqrt(area/(W H)))  (5)  ⊕  N(0, noise^2) padding (``extra_dims``)

with small deterministic Gaussian noise (seeded by ``seed`` and the image id) added to every component.
``box_features=False`` leaves the five box components out: then a region's feature says *what* the object is
but not *where* (like a pooled RoI feature), and only the boxes passed beside the features (the geometry input
of G-SAN) tell where it is: the setting of the relations comparison (``configs/demo_relations.yaml``).
The store's identity says ``{"name": "oracle", ...}`` so these features can never be mistaken for a
detector's. Captions of the world talk about exactly these attributes, counts and positions, so a model
trained on oracle features shows what the captioner can learn when detection is perfect (an upper bound
of what the bottom-up detector gives).
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json
from pipeline.core.regions import RegionRecord
from pipeline.store import open_writer
from pipeline.world.vocab import COLOUR_NAMES, SHAPES, SIZE_NAMES

log = get_logger("world.oracle")

SPLITS = ("train", "val", "test")
BOX_DIMS = 5


def oracle_dim(extra_dims: int = 0, box_features: bool = True) -> int:
    """Feature size of :func:`oracle_region_features`."""
    return len(SHAPES) + len(COLOUR_NAMES) + len(SIZE_NAMES) + (BOX_DIMS if box_features else 0) + extra_dims


def oracle_region_features(
    annotations: list[dict[str, Any]],
    width: int,
    height: int,
    rng: np.random.Generator,
    noise: float = 0.05,
    extra_dims: int = 0,
    box_features: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """``(features (N, D), boxes (N, 4) x1 y1 x2 y2)`` for one image's COCO instance annotations."""
    nc, nk, ns = len(SHAPES), len(COLOUR_NAMES), len(SIZE_NAMES)
    feats = np.zeros((len(annotations), oracle_dim(extra_dims, box_features)), dtype=np.float32)
    boxes = np.zeros((len(annotations), 4), dtype=np.float32)
    for r, ann in enumerate(annotations):
        x, y, w, h = (float(v) for v in ann["bbox"])
        boxes[r] = (x, y, x + w, y + h)
        feats[r, int(ann["category_id"]) - 1] = 1.0
        colour_id, size_id = sorted(int(a) for a in ann["attribute_ids"])
        feats[r, nc + colour_id - 1] = 1.0
        feats[r, nc + nk + (size_id - nk - 1)] = 1.0
        o = nc + nk + ns
        if box_features:
            feats[r, o : o + BOX_DIMS] = (
                x / width,
                y / height,
                (x + w) / width,
                (y + h) / height,
                np.sqrt(w * h / (width * height)),
            )
    feats += rng.normal(0.0, noise, feats.shape).astype(np.float32)
    return feats, boxes


def write_oracle_store(
    world_dir: str | Path,
    store_dir: str | Path,
    noise: float = 0.05,
    extra_dims: int = 0,
    seed: int = 0,
    box_features: bool = True,
    key: str = "id",
) -> dict[str, Any]:
    """Write oracle features of every image of a generated world into a feature store (keys: the image ids, or
    with ``key="file_name"`` the file names, as the detector's stores of the demo).

    Resumable like any store: images already committed are skipped. Returns a small summary.
    """
    world_dir = Path(world_dir)
    identity = {
        "name": "oracle",
        "source": "synthetic-world ground truth",
        "noise": float(noise),
        "extra_dims": int(extra_dims),
        "seed": int(seed),
    }
    if not box_features:
        identity["box_features"] = False  # only when off, so stores written before the switch keep their identity
    written = 0
    with open_writer(store_dir, identity, feature_dtype="float32", commit_every=500) as writer:
        for split in SPLITS:
            path = world_dir / "annotations" / f"instances_{split}.json"
            if not path.is_file():
                raise UsageError(f"{path} not found: generate the world first (python cli.py demo --generate-only)")
            data = read_json(path, what="COCO instances file")
            per_image: dict[int, list[dict[str, Any]]] = defaultdict(list)
            for ann in data.get("annotations", []):
                per_image[int(ann["image_id"])].append(ann)
            for img in data.get("images", []):
                name = str(img[key])
                if writer.has(name) or not per_image[int(img["id"])]:
                    continue
                rng = np.random.default_rng((int(seed), int(img["id"])))
                feats, boxes = oracle_region_features(
                    per_image[int(img["id"])],
                    int(img["width"]),
                    int(img["height"]),
                    rng,
                    noise,
                    extra_dims,
                    box_features,
                )
                writer.add(name, RegionRecord(feats, boxes, int(img["width"]), int(img["height"])))
                written += 1
        writer.commit()
        total = writer.num_committed
    log.info("oracle features: %d images written, %d in %s", written, total, store_dir)
    return {"images": total, "written": written, "feature_dim": oracle_dim(extra_dims, box_features)}
