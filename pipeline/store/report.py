"""Printing a feature store's summary (``cli info STORE``): plain ``name: value`` lines on stdout."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.console import stdout_console
from pipeline.core.errors import PipelineError, UsageError


def _human_bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.1f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return f"{n} B"


def _stat(d: dict, fmt: str = "{:.1f}") -> str:
    return f"min {fmt.format(d['min'])}, mean {fmt.format(d['mean'])}, max {fmt.format(d['max'])}"


def print_store_info(path: Path) -> None:
    """Open ``path`` as a store and print counts, box statistics, dtype, size and identity.

    A file that is not a readable store is a user error here (exit 2) with a message naming it.
    """
    from pipeline.store.reader import FeatureStore

    try:
        store = FeatureStore(path)
        info = store.info()
    except UsageError:
        raise
    except PipelineError as exc:
        raise UsageError(str(exc)) from None
    con = stdout_console()
    lines = [
        f"feature store: {info['path']}",
        f"images: {info['images']}",
        f"boxes: {info['boxes']}",
        f"segments: {info['segments']}",
        f"commits: {info['commits']}",
        f"feature dtype: {info['feature_dtype']}",
        f"feature dim: {info['feature_dim']}",
        f"fields: {', '.join(['features', 'boxes'] + info['fields'])}",
        f"size on disk: {_human_bytes(info['size_on_disk_bytes'])} ({info['size_on_disk_bytes']} bytes)",
    ]
    if info["images"]:
        lines += [
            "boxes per image: min {min}, mean {mean:.1f}, max {max}".format(**info["boxes_per_image"]),
            f"box width (px): {_stat(info['box_width_px'])}",
            f"box height (px): {_stat(info['box_height_px'])}",
            f"box area / image area: {_stat(info['box_area_fraction'], '{:.3f}')}",
            "image width: {min}-{max}".format(**info["image_size"]["width"]),
            "image height: {min}-{max}".format(**info["image_size"]["height"]),
            "features ({images} sampled images): {rng}, zeros {z:.1%}".format(
                images=info["features_sampled"]["images"], rng=_stat(info["features_sampled"], "{:.3f}"),
                z=info["features_sampled"]["zero_fraction"],
            ),
        ]
    lines.append(f"extractor identity: {json.dumps(info['identity'], sort_keys=True)}")
    for line in lines:
        con.print(line, highlight=False, markup=False)
