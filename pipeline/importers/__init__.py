"""Importing public feature files into a feature store, and exporting a store back to TSV.

Each format (``--format``) is one :class:`~pipeline.importers.formats.Format` record registered by the module that
reads it: ``butd-tsv`` and ``obj36-tsv`` (:mod:`.tsv`), ``cocobu`` (:mod:`.cocobu`), ``m2-hdf5`` (:mod:`.m2`),
``vinvl-tsv`` and ``grid-hdf5`` (:mod:`.vinvl`), ``clip-vil`` (:mod:`.clipvil`).
Every source is streamed one image at a time; the import is resumable (images already committed to the
store are skipped) and every bad row is either an error naming the file and row/id, or (``skip_bad``)
reported and counted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extractors.releases import get_release, release_names, release_of_format
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write, read_json
from pipeline.core.regions import RegionRecord
from pipeline.importers import clipvil, cocobu, m2, tsv, vinvl  # noqa: F401  (each registers its formats)
from pipeline.importers.formats import FORMATS, Format, export_formats, register_format, require_sizes
from pipeline.importers.untrusted import check_record, check_size
from pipeline.store import FeatureStore, open_writer
from pipeline.store.format import MANIFEST

log = get_logger("import")

UNTRUSTED_ERRORS = (ValueError, TypeError, OverflowError, KeyError, IndexError, RecursionError)
"""What decoding a malformed value can raise past the readers' own checks; such a row is reported as bad."""

__all__ = ["FORMATS", "Format", "ImportReport", "export_tsv", "import_features", "read_sizes", "register_format"]


@dataclass
class ImportReport:
    """What an import did: rows seen, images added, skipped as already present, and bad rows."""

    seen: int = 0
    imported: int = 0
    already_present: int = 0
    bad: list[tuple[str, str]] = field(default_factory=list)

    def summary(self) -> str:
        return (
            f"{self.seen} rows read: {self.imported} imported, {self.already_present} already in the store, "
            f"{len(self.bad)} bad"
        )


def default_identity(fmt: str, release: str | None = None) -> dict[str, Any]:
    """Identity recorded for imported features when none is given: the public format they came from and the
    release (:mod:`extractors.releases`: its test-time recipe and source) that produced them, ``release`` or the
    one whose record claims the format (:attr:`~extractors.releases.Release.import_formats`). A format no release
    claims needs ``release``; an unknown format or release is a one-line :class:`UsageError` naming it."""
    FORMATS.get(fmt)  # an unknown format is a usage error listing the known ones
    found = get_release(release, "--release") if release else release_of_format(fmt)
    if found is None:
        raise UsageError(
            f"no release claims the files of format {fmt!r}: pass --release ({' | '.join(release_names())})"
        )
    return {
        "name": f"imported:{fmt}",
        "config": {"format": fmt},
        "release": {"recipe": found.name, "source": found.source},
    }


def read_sizes(path: str | Path) -> dict[str, tuple[int, int]]:
    """Image sizes from a COCO json (``images: [{id, width, height}]``), keyed by ``str(id)``; every entry is
    checked before any row is imported (integer id, integer width and height in 1..MAX_IMAGE_SIDE)."""
    data = read_json(path, what="image sizes file")
    images = data.get("images")
    if not isinstance(images, list):
        raise UsageError(f"{path}: no 'images' list (expected a COCO captions/instances json)")
    sizes: dict[str, tuple[int, int]] = {}
    for i, img in enumerate(images):
        ident = img.get("id") if isinstance(img, dict) else None
        if not (isinstance(ident, (int, str)) and not isinstance(ident, bool) and str(ident)):
            raise UsageError(f"{path}: images[{i}] lacks an integer id")
        try:
            sizes[str(ident)] = check_size(img.get("width"), img.get("height"), f"{path}: images[{i}] (id {ident})")
        except PipelineError as exc:
            raise UsageError(str(exc)) from None
    return sizes


def import_features(
    fmt: str,
    sources: list[str | Path],
    store: str | Path,
    *,
    identity: dict[str, Any] | None = None,
    release: str | None = None,
    feature_dtype: str | None = None,
    keys: str | None = None,
    sizes: dict[str, tuple[int, int]] | None = None,
    skip_bad: bool = False,
    commit_every: int = 1000,
    limit: int | None = None,
    fc: str | Path | None = None,
) -> ImportReport:
    """Stream ``sources`` in format ``fmt`` into the store at ``store`` (created or resumed).

    ``feature_dtype``: ``float16`` or ``float32``; None keeps the source's numbers (:func:`store_dtype`): the
    public files hold float32, which the releases' own code reads, so their captions need float32. ``fc``: the
    folder of per-image pooled vectors, for a format that takes one (``clip-vil``'s ``*_fc``; :attr:`Format.options`).

    Raises :class:`PipelineError` on the first bad row unless ``skip_bad``; duplicate ids within the
    import are bad rows; ids already committed by an earlier (interrupted) run are skipped.
    """
    spec = FORMATS.get(fmt)  # an unknown name is a usage error listing the known ones
    keys = keys or spec.default_keys
    if keys not in ("raw", "coco-id"):
        raise UsageError(f"keys must be raw or coco-id, not {keys!r}")
    paths = [Path(s) for s in sources]
    for p in paths:
        if not p.exists():
            raise UsageError(f"input not found: {p}")
    if spec.needs_sizes:
        require_sizes(sizes, f"{fmt} files")
    options: dict[str, Any] = {}
    if fc is not None:
        if "fc" not in spec.options:
            takes = ", ".join(name for name in FORMATS.names() if "fc" in FORMATS.get(name).options)
            raise UsageError(f"--fc (a folder of per-image pooled vectors) is for --format {takes}, not {fmt}")
        options["fc"] = Path(fc)
    report = ImportReport()
    seen_keys: set[str] = set()
    if identity is not None and release is not None:
        identity = {**identity, "release": default_identity(fmt, release)["release"]}
    identity = identity or default_identity(fmt, release)
    with ExitStack() as stack, make_progress() as progress:
        writer = None
        task = progress.add_task(f"import {fmt}", total=None)
        for where, decode in spec.reader(paths, keys=keys, sizes=sizes, **options):
            if limit is not None and report.seen >= limit:
                break
            report.seen += 1
            progress.advance(task)
            try:
                rec = decode()
                check_record(rec, where)  # complete before the store sees it: a bad row never opens or shapes it
            except PipelineError as exc:
                rec, bad = None, exc
            except UNTRUSTED_ERRORS as exc:  # a malformed value no reader check names: still a bad row, not a crash
                rec, bad = None, PipelineError(f"{where}: unreadable row ({type(exc).__name__}: {str(exc)[:120]})")
            if writer is None and rec is not None:  # opened at the first good image: it sets the dtype and the width
                writer = stack.enter_context(
                    open_writer(
                        store, identity, store_dtype(store, feature_dtype, rec["features"]), commit_every=commit_every
                    )
                )
            try:
                if rec is None:
                    raise bad
                key = rec["key"]
                if key in seen_keys:
                    raise PipelineError(f"{where}: duplicate image id {key}")
                seen_keys.add(key)
                if writer.has(key):
                    report.already_present += 1
                    continue
                try:
                    writer.add(key, RegionRecord.from_mapping(rec))
                except PipelineError as exc:  # the store's own rules (its feature width, dtype range): name the row
                    raise PipelineError(f"{where}: {exc}") from None
                report.imported += 1
            except PipelineError as exc:
                if not skip_bad:
                    if writer is not None:
                        writer.commit()  # keep the good images before it: a re-run after the fix resumes after them
                    raise
                report.bad.append((where, str(exc)))
                log.warning("skipped: %s", exc)
        if writer is None:  # no image read: the (empty or resumed) store still exists afterwards
            stack.enter_context(
                open_writer(store, identity, store_dtype(store, feature_dtype, None), commit_every=commit_every)
            )
    log.info("import into %s: %s", store, report.summary())
    return report


def store_dtype(store: str | Path, asked: str | None, features: Any) -> str:
    """The feature dtype of an import: ``asked`` when given; else the dtype of a store being resumed; else the
    source's (``float16`` features stay float16, every other dtype becomes float32, the widest the store holds)."""
    if asked is not None:
        return asked
    if (Path(store) / MANIFEST).exists():
        return FeatureStore(store).feature_dtype
    return "float16" if features is not None and str(getattr(features, "dtype", "")) == "float16" else "float32"


def iter_store_records(store: Any) -> Iterator[dict[str, Any]]:
    """Every image record of an open :class:`pipeline.store.FeatureStore`, in store order."""
    for i in range(len(store)):
        yield store.get_position(i)


def export_tsv(store_path: str | Path, out: str | Path, fmt: str = "butd-tsv") -> int:
    """Write every image of a store in ``fmt`` (a format with an exporter; atomically); returns the row count.

    Features are written as float32: exporting a float32 store reproduces the imported file byte for byte.
    """
    spec = FORMATS.get(fmt)
    if spec.exporter is None:
        raise UsageError(f"cannot export to {fmt!r}; choose one of {', '.join(f.name for f in export_formats())}")
    store = FeatureStore(store_path)
    if store.feature_dtype != "float32":
        log.warning("store %s holds float16 features: the TSV will hold them widened to float32", store_path)
    count = 0

    def write(fh: Any) -> None:
        nonlocal count
        count = spec.exporter(fh, iter_store_records(store))

    atomic_write(out, write)
    return count
