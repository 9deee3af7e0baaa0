"""Crash-safe, resumable, append-only writer of a feature store.

Commit protocol (the store stays valid if the process is SIGKILLed at any instant):

1. ``add()`` validates an image and keeps it in memory (nothing on disk changes).
2. ``commit()`` writes all pending images into a new segment ``seg-NNNNNN.h5.tmp``: data first, then the
   index arrays, then the ``complete`` attribute; closes the file and ``fsync``\\ s it.
3. It renames the file to ``seg-NNNNNN.h5`` (atomic) and fsyncs the directory.
4. It atomically replaces ``store.json`` with a record listing the new segment and a commit counter one
   higher (tmp file, fsync, ``os.replace``, fsync dir). **This rename is the commit point.**

A kill before step 4 leaves the previous ``store.json``: readers see exactly the images committed before,
and the next writer deletes the ``*.tmp`` and unlisted ``seg-*.h5`` files it finds. A kill after step 4
loses nothing. HDF5 files are never modified after they are published, so the well-known failure of a
killed HDF5 writer corrupting its whole file cannot touch committed data. One writer at a time is
enforced with an ``flock`` on ``STORE/.lock`` (:mod:`pipeline.core.locks`: released by the kernel if the writer dies,
the holder named to a refused second writer).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError, annotate_os_error
from pipeline.core.fileio import fsync_dir
from pipeline.core.identity import FeatureIdentity
from pipeline.core.keys import display_key
from pipeline.core.locks import WriterLock, acquire_lock
from pipeline.core.regions import RegionRecord
from pipeline.core.stages import MANIFEST as STAGE_MANIFEST
from pipeline.core.stages import RUNNING as STAGE_RUNNING
from pipeline.core.stages import STAGE_LOCK
from pipeline.store.format import (
    FEATURE_DTYPES,
    LOCK,
    MANIFEST,
    MAX_POOLED_DIM,
    OPTIONAL_FIELDS,
    POOLED_DTYPE,
    SEGMENT_GLOB,
    canonical_identity,
    identity_mismatch,
    manifest_pooled_dim,
    new_manifest,
    read_manifest,
    segment_name,
    write_manifest,
)
from pipeline.store.segment import Block, read_segment_index, write_segment
from pipeline.store.validate import _all_finite, _RowBuffer, validate_image

log = get_logger("store")


class FeatureStoreWriter:
    """Appends images to a store; ``commit()`` publishes them durably. Use :func:`open_writer` to make one."""

    def __init__(
        self,
        path: Path,
        manifest: dict[str, Any],
        lock: WriterLock,
        commit_every: int,
        commit_bytes: int,
        chunk_rows: int,
        compression: str | None,
        fsync: bool = True,
    ) -> None:
        self.path = path
        self.fsync = fsync
        self._manifest = manifest
        self._lock: WriterLock | None = lock
        self.commit_every = commit_every
        self.commit_bytes = commit_bytes
        self.chunk_rows = chunk_rows
        self.compression = compression
        self._committed: set[str] = set()
        for seg in manifest["segments"]:
            idx = read_segment_index(path / seg["file"], seg["images"], seg["rows"])
            self._committed.update(idx.keys)
        self._reset_pending()

    def _reset_pending(self) -> None:
        self._pending: list[tuple[str, int, int, int]] = []  # key, rows, width, height
        self._pending_keys: set[str] = set()
        self._pending_bytes = 0
        self._pending_pooled: list[np.ndarray] = []  # one (P,) vector per pending image, in a store with them
        # buffers are kept across commits: re-touching fresh memory for every commit costs more than the copy
        self._buffers: dict[str, _RowBuffer] = getattr(self, "_buffers", {})
        for buf in self._buffers.values():
            buf.rows = 0

    # -- queries -------------------------------------------------------------------------------------------
    @property
    def identity(self) -> dict[str, Any]:
        return dict(self._manifest["identity"])

    @property
    def num_committed(self) -> int:
        return len(self._committed)

    @property
    def pooled_dim(self) -> int | None:
        """P, the length of the pooled vector every image of the store carries (0: none); None until the store has
        taken its first image (that image decides)."""
        return None if self._manifest["fields"] is None else manifest_pooled_dim(self._manifest)

    def has(self, key: str) -> bool:
        """True if ``key`` is committed or pending (added but not yet committed)."""
        return key in self._committed or key in self._pending_keys

    # -- writing -------------------------------------------------------------------------------------------
    def add(self, key: str, record: RegionRecord) -> None:
        """Validate and queue one image's :class:`~pipeline.core.regions.RegionRecord`; it becomes durable at the
        next :meth:`commit` (or auto-commit).

        ``features`` (N, D) any float dtype (cast to the store dtype), ``boxes`` (N, 4) x1 y1 x2 y2 in
        original pixels. Optional per-box fields, and the per-image ``pooled`` vector (P,), must be given for every
        image or for none.
        """
        self._check_open()
        if not isinstance(record, RegionRecord):
            raise TypeError(f"writer.add(key, record) takes a RegionRecord, not {type(record).__name__}")
        if self.has(key):
            raise PipelineError(f"feature store {self.path}: duplicate image id {display_key(key)}")
        feats = np.asarray(record.features)
        boxes, image_w, image_h = record.boxes, record.image_w, record.image_h
        dtype = FEATURE_DTYPES[self._manifest["feature_dtype"]]
        given = {name: np.asarray(val).reshape(-1) for name, val in record.optional().items()}
        fields = self._manifest["fields"]
        if fields is not None and sorted(given) != sorted(fields):
            raise PipelineError(
                f"feature store {self.path}: image {key} has optional fields {sorted(given)}, the store has "
                f"{sorted(fields)}"
            )
        where = f"feature store {self.path}"
        pooled = self._checked_pooled(key, record.pooled, where)
        box_arr = np.asarray(boxes, dtype=np.float32)
        validate_image(
            key,
            feats,
            box_arr,
            int(image_w),
            int(image_h),
            given,
            self._manifest["feature_dim"],
            where,
            check_features=False,
        )
        rows = {"features": feats, "boxes": box_arr, **given}
        for name, arr in rows.items():
            buf = self._buffers.get(name)
            width = arr.shape[1] if arr.ndim == 2 else None
            if buf is None or (buf.rows == 0 and buf.width != width):  # shaped by the first image the store takes
                buf = self._buffers[name] = _RowBuffer(
                    dtype if name == "features" else OPTIONAL_FIELDS.get(name, np.dtype("<f4")), width
                )
            buf.append(arr)  # the one copy, casting to the store dtype
        if not _all_finite(self._buffers["features"].view()[-len(feats) :]):
            for name in rows:
                self._buffers[name].rows -= len(feats)
            if not np.isfinite(feats).all():
                raise PipelineError(f"{where}: image {key}: features contain NaN or infinity")
            raise PipelineError(f"{where}: image {key}: features exceed the {dtype.name} range; use float32")
        if self._manifest["feature_dim"] is None:
            self._manifest["feature_dim"] = int(feats.shape[1])
        if fields is None:
            self._manifest["fields"] = sorted(given)
            if pooled is not None:
                self._manifest["pooled_dim"] = len(pooled)
        self._pending.append((key, len(feats), int(image_w), int(image_h)))
        self._pending_keys.add(key)
        self._pending_bytes += sum(len(feats) * self._buffers[n].data[0].nbytes for n in rows)
        if pooled is not None:
            self._pending_pooled.append(pooled)
            self._pending_bytes += pooled.nbytes
        if (self.commit_every and len(self._pending) >= self.commit_every) or (
            self.commit_bytes and self._pending_bytes >= self.commit_bytes
        ):
            self.commit()

    def _checked_pooled(self, key: str, vector: np.ndarray | None, where: str) -> np.ndarray | None:
        """An image's pooled vector as stored ((P,) float32), None when it has none; refused (one line naming the
        store and the image) if it is not a finite vector or does not match the store (a vector of P values for
        every image, or none for every image)."""
        arr = None
        if vector is not None:
            raw = np.asarray(vector)
            if raw.ndim != 1 or not 0 < raw.shape[0] <= MAX_POOLED_DIM or raw.dtype.kind not in "fiu":
                raise PipelineError(
                    f"{where}: image {key}: pooled must be a numeric vector of 1..{MAX_POOLED_DIM} values, got shape "
                    f"{raw.shape} {raw.dtype}"
                )
            with np.errstate(over="ignore", invalid="ignore"):
                arr = np.ascontiguousarray(raw, dtype=POOLED_DTYPE)
            if not np.isfinite(arr).all():
                raise PipelineError(f"{where}: image {key}: pooled contains NaN or infinity (or exceeds float32)")
        have, got = self.pooled_dim, 0 if arr is None else len(arr)
        if have is not None and got != have:
            raise PipelineError(
                f"{where}: image {key} has {_pooled_text(got)}, the store's images have {_pooled_text(have)} (every "
                "image of a store carries one or none)"
            )
        return arr

    def commit(self) -> int:
        """Durably publish every pending image (one new segment). Returns the number of images committed."""
        self._check_open()
        if not self._pending:
            return 0
        m = self._manifest
        fields = list(m["fields"] or [])
        seg_no = 1 + max((int(s["file"][4:10]) for s in m["segments"]), default=-1)
        name = segment_name(seg_no)
        final = self.path / name
        tmp = self.path / (name + ".tmp")
        counts = np.array([r for _, r, _, _ in self._pending], dtype=np.int64)
        block = Block(
            keys=[k for k, _, _, _ in self._pending],
            counts=counts,
            sizes=np.array([(w, h) for _, _, w, h in self._pending], dtype=np.int32).reshape(-1, 2),
            rows={f: self._buffers[f].view() for f in ["features", "boxes"] + fields},
            pooled=np.stack(self._pending_pooled) if self._pending_pooled else None,
        )
        n, rows = len(self._pending), int(counts.sum())
        try:
            self._publish(tmp, final, name, block, n, rows, fields)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise annotate_os_error(exc, "commit to feature store", self.path)
        log.debug(
            "store %s: commit %d published %d images (%d rows) in %s",
            self.path,
            self._manifest["commit"],
            n,
            rows,
            name,
        )
        return n

    def _publish(self, tmp: Path, final: Path, name: str, block: Block, n: int, rows: int, fields: list[str]) -> None:
        """Write the segment, rename it into place and commit ``store.json`` (the commit point)."""
        m = self._manifest
        write_segment(
            tmp,
            [block],
            num_images=n,
            num_rows=rows,
            identity=m["identity"],
            feature_dtype=m["feature_dtype"],
            feature_dim=m["feature_dim"],
            fields=fields,
            chunk_rows=self.chunk_rows,
            compression=self.compression,
            fsync=self.fsync,
            pooled_dim=manifest_pooled_dim(m),
        )
        os.replace(tmp, final)
        fsync_dir(self.path)
        new = dict(m)
        new["segments"] = list(m["segments"]) + [{"file": name, "images": n, "rows": rows}]
        new["commit"] = m["commit"] + 1
        new["num_images"] = m["num_images"] + n
        new["num_rows"] = m["num_rows"] + rows
        write_manifest(self.path, new)  # the commit point
        self._manifest = new
        self._committed.update(self._pending_keys)
        self._reset_pending()

    def discard_pending(self) -> int:
        """Drop images added since the last commit (nothing on disk changes)."""
        n = len(self._pending)
        self._reset_pending()
        return n

    def close(self) -> None:
        """Release the writer lock. Pending (uncommitted) images are dropped: call :meth:`commit` first."""
        if self._lock is None:
            return
        if self._pending:
            log.warning("store %s: closing with %d uncommitted images (dropped)", self.path, len(self._pending))
            self.discard_pending()
        lock, self._lock = self._lock, None
        lock.release()

    def _check_open(self) -> None:
        if self._lock is None:
            raise PipelineError(f"feature store writer for {self.path} is closed")

    def __enter__(self) -> "FeatureStoreWriter":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None and self._lock is not None:
                self.commit()
            elif exc_type is not None and issubclass(exc_type, KeyboardInterrupt) and self._lock is not None:
                try:  # Ctrl-C: the pending images are complete and validated, keep them
                    n = self.commit()
                    if n:
                        log.warning("store %s: interrupted; committed the %d pending images", self.path, n)
                except (OSError, PipelineError) as err:
                    log.warning("store %s: interrupted; could not commit the pending images (%s)", self.path, err)
        finally:
            self.close()


def _pooled_text(n: int) -> str:
    return f"a pooled vector of {n} values" if n else "no pooled vector"


def _clean_garbage(path: Path, manifest: dict[str, Any]) -> None:
    """Delete leftovers of a killed writer: ``*.tmp`` files and segments not listed in ``store.json``."""
    listed = {s["file"] for s in manifest["segments"]}
    for p in list(path.glob("*.tmp")) + list(path.glob(".*.tmp")):
        p.unlink(missing_ok=True)
    for p in path.glob(SEGMENT_GLOB):
        if p.name not in listed:
            log.info("store %s: removing unpublished segment %s left by an interrupted writer", path, p.name)
            p.unlink(missing_ok=True)


def _check_resumable(
    path: Path, manifest: dict[str, Any], identity: dict[str, Any], feature_dtype: str, match: str
) -> None:
    """Refuse to resume a store written under another identity (``match="identity"``) or, for a cache
    (``match="features"``), with other feature settings; a cache adopts the store's identity and dtype."""
    if match == "features":
        differ = FeatureIdentity.from_dict(manifest["identity"], f"{path / MANIFEST}: identity").settings_diff(identity)
        if differ:
            raise UsageError(
                f"feature store {path} holds features made with other settings: {'; '.join(differ)}; "
                "use another store path"
            )
        return
    if manifest["identity"] != identity:
        raise UsageError(identity_mismatch(str(path), manifest["identity"], identity))
    if manifest["feature_dtype"] != feature_dtype:
        raise UsageError(
            f"feature store {path} holds {manifest['feature_dtype']} features, the writer asked for {feature_dtype}"
        )


def open_writer(
    path: str | Path,
    extractor: FeatureIdentity | dict[str, Any],
    feature_dtype: str = "float16",
    *,
    commit_every: int = 0,
    commit_bytes: int = 256 << 20,
    chunk_rows: int = 0,
    compression: str | None = None,
    fsync: bool = True,
    match: str = "identity",
) -> FeatureStoreWriter:
    """Create a store directory at ``path``, or resume the one there.

    Args:
        path: the store directory (created if missing).
        extractor: identity of what produced the features: a detector's
            :class:`~pipeline.core.identity.FeatureIdentity` (stored as :meth:`FeatureIdentity.to_dict`), or any
            other producer's record with a ``name`` (importers, the oracle, an ``--identity`` file); resuming a store
            written under another identity (or dtype) fails naming both.
        feature_dtype: ``float16`` (default) or ``float32``.
        commit_every: also commit automatically every this many images (0: only by size/explicitly).
        commit_bytes: also commit automatically once pending arrays reach this many bytes (0: never).
        chunk_rows: 0 writes contiguous segments (fastest reads); >0 chunks rows by this many.
        compression: ``None`` (default), ``"lzf"`` or ``"gzip"`` (needs ``chunk_rows``; slower reads).
        fsync: fsync each segment before publishing it (default). ``False`` is faster and still safe against
            a killed process (publication order holds in the page cache), but not against power loss.
        match: ``identity`` (an existing store must have exactly this identity) or ``features`` (it must agree
            on what determines the features, :meth:`FeatureIdentity.settings_diff`; the store
            keeps its own identity and dtype, as a cache does).
    """
    path = Path(path)
    identity = canonical_identity(extractor.to_dict() if isinstance(extractor, FeatureIdentity) else extractor)
    if feature_dtype not in FEATURE_DTYPES:
        raise UsageError(f"feature_dtype must be one of {sorted(FEATURE_DTYPES)}, not {feature_dtype!r}")
    if match not in ("identity", "features"):
        raise UsageError(f"match must be identity or features, not {match!r}")
    if compression not in (None, "lzf", "gzip"):
        raise UsageError(f"compression must be lzf, gzip or none, not {compression!r}")
    if compression and not chunk_rows:
        raise UsageError("compression needs chunk_rows > 0")
    if path.exists() and not path.is_dir():
        raise UsageError(f"{path} is a file; a writer needs a store directory (single-file stores are read-only)")
    # a store may be the folder of its own extraction stage (cli extract): the stage's bookkeeping files may be there
    allowed = {LOCK, STAGE_MANIFEST, STAGE_RUNNING, STAGE_LOCK}
    if path.is_dir() and not (path / MANIFEST).exists() and any(p.name not in allowed for p in path.iterdir()):
        raise UsageError(f"{path} exists, is not empty and is not a feature store; choose another path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise annotate_os_error(exc, "open feature store for writing", path)
    lock = acquire_lock(path / LOCK, f"feature store {path}")
    try:
        if (path / MANIFEST).exists():
            manifest = read_manifest(path)
            _check_resumable(path, manifest, identity, feature_dtype, match)
            _clean_garbage(path, manifest)
            log.info("store %s: resuming, %d images already committed", path, manifest["num_images"])
        else:
            manifest = new_manifest(identity, feature_dtype, None)
            _clean_garbage(path, manifest)
            write_manifest(path, manifest)
        return FeatureStoreWriter(path, manifest, lock, commit_every, commit_bytes, chunk_rows, compression, fsync)
    except BaseException:
        lock.release()
        raise
