"""Importing public feature files into a feature store, and exporting a store back to TSV.

Formats (``--format``): ``butd-tsv`` (original bottom-up TSV, trainval_36 or adaptive 10-100),
``obj36-tsv`` (LXMERT), ``cocobu`` (ruotianluo npz/npy directories), ``m2-hdf5`` (M2 coco_detections.hdf5).
Every source is streamed one image at a time; the import is resumable (images already committed to the
store are skipped) and every bad row is either an error naming the file and row/id, or (``skip_bad``)
reported and counted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write, read_json
from pipeline.importers.cocobu import read_cocobu
from pipeline.importers.m2 import read_m2
from pipeline.importers.tsv import decode_butd, decode_obj36, tsv_reader, write_tsv
from pipeline.store import FeatureStore, open_writer, validate_image

log = get_logger("import")

Reader = Callable[..., Iterator[tuple[str, Callable[[], dict[str, Any]]]]]

FORMATS: dict[str, Reader] = {
    "butd-tsv": tsv_reader(decode_butd),
    "obj36-tsv": tsv_reader(decode_obj36),
    "cocobu": read_cocobu,
    "m2-hdf5": read_m2,
}
EXPORT_FORMATS = {"butd-tsv": "butd", "obj36-tsv": "obj36"}
DEFAULT_KEYS = {"butd-tsv": "raw", "obj36-tsv": "coco-id", "cocobu": "raw", "m2-hdf5": "raw"}
NEEDS_SIZES = ("cocobu", "m2-hdf5")
OPTIONAL = ("class_ids", "class_scores", "attr_ids", "attr_scores")


@dataclass
class ImportReport:
    """What an import did: rows seen, images added, skipped as already present, and bad rows."""

    seen: int = 0
    imported: int = 0
    already_present: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        return (f"{self.seen} rows read: {self.imported} imported, {self.already_present} already in the store, "
                f"{len(self.bad)} bad")


def default_identity(fmt: str) -> dict[str, Any]:
    """Identity recorded for imported features when none is given: the public format they came from."""
    return {"name": f"imported:{fmt}", "config": {"format": fmt}}


def read_sizes(path: str | Path) -> dict[str, tuple[int, int]]:
    """Image sizes from a COCO json (``images: [{id, width, height}]``), keyed by ``str(id)``."""
    data = read_json(path, what="image sizes file")
    images = data.get("images")
    if not isinstance(images, list):
        raise UsageError(f"{path}: no 'images' list (expected a COCO captions/instances json)")
    sizes: dict[str, tuple[int, int]] = {}
    for i, img in enumerate(images):
        try:
            sizes[str(img["id"])] = (int(img["width"]), int(img["height"]))
        except (KeyError, TypeError, ValueError):
            raise UsageError(f"{path}: images[{i}] lacks integer id/width/height") from None
    return sizes


def import_features(
    fmt: str,
    sources: list[str | Path],
    store: str | Path,
    *,
    identity: dict[str, Any] | None = None,
    feature_dtype: str = "float16",
    keys: str | None = None,
    sizes: dict[str, tuple[int, int]] | None = None,
    skip_bad: bool = False,
    commit_every: int = 1000,
    limit: int | None = None,
) -> ImportReport:
    """Stream ``sources`` in format ``fmt`` into the store at ``store`` (created or resumed).

    Raises :class:`PipelineError` on the first bad row unless ``skip_bad``; duplicate ids within the
    import are bad rows; ids already committed by an earlier (interrupted) run are skipped.
    """
    if fmt not in FORMATS:
        raise UsageError(f"unknown feature format {fmt!r}; choose one of {', '.join(FORMATS)}")
    keys = keys or DEFAULT_KEYS[fmt]
    if keys not in ("raw", "coco-id"):
        raise UsageError(f"keys must be raw or coco-id, not {keys!r}")
    paths = [Path(s) for s in sources]
    for p in paths:
        if not p.exists():
            raise UsageError(f"input not found: {p}")
    if fmt in NEEDS_SIZES and sizes is None:
        raise UsageError(f"{fmt} files carry no image sizes: pass --sizes COCO_JSON (captions_*.json or instances_*.json)")
    report = ImportReport()
    seen_keys: set[str] = set()
    with open_writer(store, identity or default_identity(fmt), feature_dtype, commit_every=commit_every) as writer, \
            make_progress() as progress:
        task = progress.add_task(f"import {fmt}", total=None)
        for where, decode in FORMATS[fmt](paths, keys=keys, sizes=sizes):
            if limit is not None and report.seen >= limit:
                break
            report.seen += 1
            progress.advance(task)
            try:
                rec = decode()
                key = rec["key"]
                if key in seen_keys:
                    raise PipelineError(f"{where}: duplicate image id {key}")
                seen_keys.add(key)
                if writer.has(key):
                    report.already_present += 1
                    continue
                extras = {k: rec[k] for k in OPTIONAL if k in rec}
                validate_image(key, rec["features"], rec["boxes"], rec["image_w"], rec["image_h"],
                               {k: v.reshape(-1) for k, v in extras.items()}, None, where)
                writer.add(key, rec["features"], rec["boxes"], rec["image_w"], rec["image_h"], **extras)
                report.imported += 1
            except PipelineError as exc:
                if not skip_bad:
                    writer.commit()  # keep the good images before it: a re-run after the fix resumes after them
                    raise
                report.bad.append((where, str(exc)))
                log.warning("skipped: %s", exc)
    log.info("import into %s: %s", store, report.summary())
    return report


def iter_store_records(store: FeatureStore) -> Iterator[dict[str, Any]]:
    for i in range(len(store)):
        yield store.get_position(i)


def export_tsv(store_path: str | Path, out: str | Path, fmt: str = "butd-tsv") -> int:
    """Write every image of a store as a TSV in ``fmt`` (atomically); returns the row count.

    Features are written as float32: exporting a float32 store reproduces the imported file byte for byte.
    """
    if fmt not in EXPORT_FORMATS:
        raise UsageError(f"cannot export to {fmt!r}; choose one of {', '.join(EXPORT_FORMATS)}")
    store = FeatureStore(store_path)
    if store.feature_dtype != "float32":
        log.warning("store %s holds float16 features: the TSV will hold them widened to float32", store_path)
    count = 0

    def write(fh: Any) -> None:
        nonlocal count
        count = write_tsv(fh, iter_store_records(store), EXPORT_FORMATS[fmt])

    atomic_write(out, write)
    return count
