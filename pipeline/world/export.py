"""Writing the world's annotations in the formats users already have.

* ``dataset_coco.json``: Karpathy split file (images with filepath, filename, imgid, cocoid, split,
  sentids and sentences with ``raw``, ``tokens``, ``imgid``, ``sentid``).
* ``captions_<split>.json``: COCO caption annotations, one file per split.
* ``instances_<split>.json``: COCO instances (bbox ``[x, y, w, h]``, area, polygon segmentation) with
  Visual-Genome-style ``attribute_ids`` per object and a top-level ``attributes`` table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.core.fileio import atomic_write_json
from pipeline.world.vocab import (
    COLOUR_NAMES,
    SHAPES,
    attribute_names,
    category_id,
    colour_attribute_id,
    size_attribute_id,
)

SPLITS = ("train", "val", "test")
INFO = {"description": "butd-caption synthetic world", "version": "1.0", "year": 2026, "contributor": "butd-caption"}


def polygon_area(points: Sequence[Sequence[float]]) -> float:
    """Shoelace area of a simple polygon."""
    n = len(points)
    if n < 3:
        return 0.0
    s = 0.0
    for i in range(n):
        x1, y1 = points[i]
        x2, y2 = points[(i + 1) % n]
        s += x1 * y2 - x2 * y1
    return abs(s) / 2.0


def _flat(points: Sequence[Sequence[float]]) -> list[float]:
    return [round(float(v), 2) for p in points for v in p]


def karpathy_json(records: Sequence[dict[str, Any]], image_dir: str) -> dict[str, Any]:
    images = []
    sentid = 0
    for imgid, rec in enumerate(records):
        sentences = []
        for raw, tokens in zip(rec["captions"], rec["tokens"]):
            sentences.append({"tokens": tokens, "raw": raw, "imgid": imgid, "sentid": sentid})
            sentid += 1
        images.append(
            {
                "filepath": image_dir,
                "filename": rec["file_name"],
                "imgid": imgid,
                "split": rec["split"],
                "cocoid": rec["id"],
                "sentids": [s["sentid"] for s in sentences],
                "sentences": sentences,
            }
        )
    return {"dataset": "coco", "images": images}


def _image_entry(rec: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": rec["id"],
        "file_name": rec["file_name"],
        "width": rec["width"],
        "height": rec["height"],
        "license": 0,
        "background": rec["background"],  # extra key (texture name); COCO tools ignore it
    }


def _running_counts(recs: Sequence[dict[str, Any]]) -> list[int]:
    """Number of captions before each record (for file-unique annotation ids)."""
    out, total = [], 0
    for r in recs:
        out.append(total)
        total += len(r["captions"])
    return out


def coco_captions(records: Sequence[dict[str, Any]], split: str) -> dict[str, Any]:
    recs = [r for r in records if r["split"] == split]
    anns = [
        {"id": len_before + k + 1, "image_id": r["id"], "caption": raw}
        for len_before, r in zip(_running_counts(recs), recs)
        for k, raw in enumerate(r["captions"])
    ]
    return {
        "info": INFO,
        "licenses": [{"id": 0, "name": "generated", "url": ""}],
        "type": "captions",
        "images": [_image_entry(r) for r in recs],
        "annotations": anns,
    }


def coco_instances(records: Sequence[dict[str, Any]], split: str) -> dict[str, Any]:
    recs = [r for r in records if r["split"] == split]
    anns = []
    for r in recs:
        for obj in r["objects"]:
            x1, y1, x2, y2 = obj["box"]
            area = polygon_area(obj["polygon"]) - polygon_area(obj["hole"])
            segmentation = [_flat(obj["polygon"])]
            anns.append(
                {
                    "id": len(anns) + 1,
                    "image_id": r["id"],
                    "category_id": category_id(obj["shape"]),
                    "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2), round(y2 - y1, 2)],
                    "area": round(area, 2),
                    "iscrowd": 0,
                    "segmentation": segmentation,
                    "attribute_ids": [colour_attribute_id(obj["colour"]), size_attribute_id(obj["size"])],
                }
            )
    attrs = [
        {"id": i + 1, "name": n, "type": "colour" if n in COLOUR_NAMES else "size"}
        for i, n in enumerate(attribute_names())
    ]
    return {
        "info": INFO,
        "licenses": [{"id": 0, "name": "generated", "url": ""}],
        "images": [_image_entry(r) for r in recs],
        "annotations": anns,
        "categories": [{"id": category_id(s), "name": s, "supercategory": "shape"} for s in SHAPES],
        "attributes": attrs,
    }


def write_annotations(records: Sequence[dict[str, Any]], ann_dir: Path, image_dir: str) -> dict[str, str]:
    """Write every annotation file atomically; returns name -> path relative to ``ann_dir.parent``."""
    out: dict[str, str] = {}
    atomic_write_json(ann_dir / "dataset_coco.json", karpathy_json(records, image_dir), indent=None)
    out["karpathy"] = f"{ann_dir.name}/dataset_coco.json"
    for split in SPLITS:
        atomic_write_json(ann_dir / f"captions_{split}.json", coco_captions(records, split), indent=None)
        atomic_write_json(ann_dir / f"instances_{split}.json", coco_instances(records, split), indent=None)
        out[f"captions_{split}"] = f"{ann_dir.name}/captions_{split}.json"
        out[f"instances_{split}"] = f"{ann_dir.name}/instances_{split}.json"
    return out


__all__ = ["SPLITS", "coco_captions", "coco_instances", "karpathy_json", "polygon_area", "write_annotations"]
