"""Printing a feature store's summary (``cli info STORE``): plain ``name: value`` lines on stdout."""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.core.console import stdout_console
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.keys import key_to_text
from pipeline.store.reader import FeatureStore
from pipeline.store.verify import verify_store


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
    if info["pooled_dim"]:
        lines.append(f"pooled vector: {info['pooled_dim']} values per image (float32)")
    if info["images"]:
        lines += [
            "boxes per image: min {min}, mean {mean:.1f}, max {max}".format(**info["boxes_per_image"]),
            f"box width (px): {_stat(info['box_width_px'])}",
            f"box height (px): {_stat(info['box_height_px'])}",
            f"box area / image area: {_stat(info['box_area_fraction'], '{:.3f}')}",
            "image width: {min}-{max}".format(**info["image_size"]["width"]),
            "image height: {min}-{max}".format(**info["image_size"]["height"]),
            "features ({images} sampled images): {rng}, zeros {z:.1%}".format(
                images=info["features_sampled"]["images"],
                rng=_stat(info["features_sampled"], "{:.3f}"),
                z=info["features_sampled"]["zero_fraction"],
            ),
        ]
    lines.append(f"checksums: {info['checksums']}")
    lines.append(f"extractor identity: {json.dumps(info['identity'], sort_keys=True)}")
    for line in lines:
        con.print(line, highlight=False, markup=False)


def print_verify_report(path: Path) -> bool:
    """``info --verify``: read every row, print one line per damaged segment or image, and a summary line.

    Returns True when nothing is damaged.
    """
    report = verify_store(path)
    con = stdout_console()
    for seg, why in report.bad_segments:
        con.print(f"damaged segment {seg}: {why}", highlight=False, markup=False)
    for seg, key, why in report.bad_images:
        con.print(f"damaged image {key_to_text(key)} in {seg}: {why}", highlight=False, markup=False)
    if report.unchecksummed_segments:
        con.print(
            f"{len(report.unchecksummed_segments)} of {report.segments} segments were written before checksums: "
            "only their structure and finiteness could be checked",
            highlight=False,
            markup=False,
        )
    status = "ok" if report.ok else "DAMAGED"
    con.print(
        f"verify {path}: {status}: {report.checked_images} of {report.images} images read in {report.segments} "
        "segments; "
        f"{len(report.bad_images)} damaged images, {len(report.bad_segments)} damaged segments",
        highlight=False,
        markup=False,
    )
    return report.ok
