"""Statistics of a feature store for ``cli info STORE``: counts, boxes, dtype, size on disk, identity."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from pipeline.store.reader import FeatureStore


def _disk_bytes(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _checksum_state(store: "FeatureStore") -> str:
    segs = store._st().segments
    old = sum(1 for s in segs if not s.checksummed)
    if not old:
        return "crc32 per image (checked on every read; `info --verify` checks all)"
    if old == len(segs):
        return "none (written before checksums; damage cannot be detected, `info --verify` checks structure only)"
    return f"crc32 per image in {len(segs) - old} of {len(segs)} segments ({old} written before checksums)"


def store_info(store: "FeatureStore", sample: int = 256) -> dict[str, Any]:
    """Summary of ``store``. Box statistics use every box; feature statistics a sample of ``sample`` images."""
    keys = store.keys()
    counts = np.asarray(store.num_boxes(), dtype=np.int64)
    info: dict[str, Any] = {
        "path": str(store.path),
        "images": len(keys),
        "boxes": int(counts.sum()),
        "segments": len(store._st().segments),
        "commits": store.commit_counter,
        "feature_dtype": store.feature_dtype,
        "feature_dim": store.feature_dim,
        "fields": store.fields,
        "pooled_dim": store.pooled_dim,
        "size_on_disk_bytes": _disk_bytes(store.path),
        "identity": store.identity,
        "checksums": _checksum_state(store),
    }
    if not keys:
        return info
    info["boxes_per_image"] = {"min": int(counts.min()), "mean": float(counts.mean()), "max": int(counts.max())}
    widths, heights, areas = [], [], []
    sizes = store._st().sizes
    for i in range(len(keys)):
        rec = store.get_position(i)
        b = rec["boxes"].astype(np.float64)
        widths.append(b[:, 2] - b[:, 0])
        heights.append(b[:, 3] - b[:, 1])
        areas.append(widths[-1] * heights[-1] / float(sizes[i, 0] * sizes[i, 1]))
    w, h, a = np.concatenate(widths), np.concatenate(heights), np.concatenate(areas)
    info["box_width_px"] = {"min": float(w.min()), "mean": float(w.mean()), "max": float(w.max())}
    info["box_height_px"] = {"min": float(h.min()), "mean": float(h.mean()), "max": float(h.max())}
    info["box_area_fraction"] = {"min": float(a.min()), "mean": float(a.mean()), "max": float(a.max())}
    info["image_size"] = {
        "width": {"min": int(sizes[:, 0].min()), "max": int(sizes[:, 0].max())},
        "height": {"min": int(sizes[:, 1].min()), "max": int(sizes[:, 1].max())},
    }
    rng = np.random.default_rng(0)
    picks = rng.choice(len(keys), size=min(sample, len(keys)), replace=False)
    feats = np.concatenate([store.get_position(int(i))["features"].astype(np.float32) for i in picks])
    info["features_sampled"] = {
        "images": int(len(picks)),
        "min": float(feats.min()),
        "mean": float(feats.mean()),
        "max": float(feats.max()),
        "zero_fraction": float((feats == 0).mean()),
    }
    return info
