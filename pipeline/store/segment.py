"""Writing and indexing one immutable HDF5 segment (the flat layout described in :mod:`pipeline.store.format`).

Segments are written once, into a ``*.tmp`` file that is closed and fsynced before it is renamed, so a
published segment is always complete. Because a segment is never appended to, its row arrays are stored
*contiguous* by default: the reader can then fetch one image's rows with a single ``pread`` at the byte
offset HDF5 reports for the dataset (no HDF5 call per read, no chunk cache, nothing else read). A chunked
layout (rows per chunk, optional ``lzf``/``gzip`` compression for archival copies) is available too; the
reader then goes through h5py for that dataset.

**Checksums.** Every segment written by this version carries ``row_crc32`` (n,) uint32: for each image the
CRC-32 (zlib) of its rows' bytes, field after field in the order ``features``, ``boxes``, then the optional
fields, then (only in a segment with the per-image ``pooled`` dataset) the bytes of its pooled vector; and the
attribute ``index_crc32``, the CRC-32 of the keys, offsets and image sizes. Readers check an image's CRC each
time they read its rows and the index CRC when they open the segment, so flipped bytes are refused with one
line naming the segment (and the image) instead of surfacing as NaNs. Segments written before checksums
existed have neither and are still read (``info`` says so).

**Keys** are stored as their exact bytes (:func:`pipeline.core.keys.key_to_bytes`), so a file name that is not
valid UTF-8 round-trips losslessly; valid UTF-8 keys are stored as their plain UTF-8 bytes.
"""

from __future__ import annotations

import json
import os
import re
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pipeline.core.errors import PipelineError, annotate_os_error, exception_line
from pipeline.core.fileio import create_new_file
from pipeline.core.keys import check_key, display_key, key_from_bytes, key_to_bytes
from pipeline.store.format import (
    BOX_DTYPE,
    FEATURE_DTYPES,
    FORMAT,
    MAX_POOLED_DIM,
    OPTIONAL_FIELDS,
    POOLED,
    POOLED_DTYPE,
    SCHEMA_VERSION,
)


def field_dtype(name: str, feature_dtype: str) -> np.dtype:
    if name == "features":
        return FEATURE_DTYPES[feature_dtype]
    if name == "boxes":
        return BOX_DTYPE
    return OPTIONAL_FIELDS[name]


def field_width(name: str, feature_dim: int) -> int | None:
    return feature_dim if name == "features" else 4 if name == "boxes" else None


def row_fields_of(fields: Sequence[str]) -> list[str]:
    """The row datasets of a segment in checksum order: features, boxes, then the optional fields present."""
    return ["features", "boxes"] + [f for f in fields if f in OPTIONAL_FIELDS]


def row_checksums(
    rows: dict[str, np.ndarray], offsets: np.ndarray, order: Sequence[str], pooled: np.ndarray | None = None
) -> np.ndarray:
    """CRC-32 per image of its rows' bytes, chained over the fields in ``order`` (arrays in the stored dtype),
    then over the image's row of ``pooled`` ((n, P) float32) when given.

    ``offsets`` (n + 1,) are row offsets relative to the arrays' first row.
    """
    arrays = [np.ascontiguousarray(rows[name]) for name in order]
    out = np.zeros(len(offsets) - 1, dtype="<u4")
    for i in range(len(out)):
        a, b = int(offsets[i]), int(offsets[i + 1])
        crc = 0
        for arr in arrays:
            crc = zlib.crc32(arr[a:b].tobytes(), crc)
        if pooled is not None:
            crc = zlib.crc32(np.ascontiguousarray(pooled[i], dtype=POOLED_DTYPE).tobytes(), crc)
        out[i] = crc
    return out


def index_checksum(keys: Sequence[str], offsets: np.ndarray, sizes: np.ndarray) -> int:
    """CRC-32 of a segment's index: each key's bytes (NUL-terminated), then offsets (<i8) and sizes (<i4)."""
    crc = 0
    for k in keys:
        crc = zlib.crc32(key_to_bytes(k) + b"\0", crc)
    crc = zlib.crc32(np.ascontiguousarray(offsets, dtype="<i8").tobytes(), crc)
    return zlib.crc32(np.ascontiguousarray(sizes, dtype="<i4").tobytes(), crc)


@dataclass
class Block:
    """A run of consecutive images for :func:`write_segment`: row arrays are concatenated over images."""

    keys: list[str]
    counts: np.ndarray  # (n,) rows per image
    sizes: np.ndarray  # (n, 2) width, height
    rows: dict[str, np.ndarray]  # field -> (rows, ...) array
    pooled: np.ndarray | None = None  # (n, P) one vector per image, for a segment with pooled_dim P


@dataclass(frozen=True)
class SegmentPlan:
    """What :func:`write_segment` announces a segment holds (images, rows, identity, feature type and width, the
    stored fields) and how its row datasets are laid out (``chunk_rows``, ``compression``)."""

    num_images: int
    num_rows: int
    identity: dict[str, Any]
    feature_dtype: str
    feature_dim: int
    fields: Sequence[str]
    chunk_rows: int
    compression: str | None
    pooled_dim: int = 0


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_segment(
    path: Path,
    blocks: Iterable[Block],
    *,
    num_images: int,
    num_rows: int,
    identity: dict[str, Any],
    feature_dtype: str,
    feature_dim: int,
    fields: Sequence[str],
    chunk_rows: int = 0,
    compression: str | None = None,
    fsync: bool = True,
    pooled_dim: int = 0,
) -> None:
    """Write a complete segment file at ``path`` (normally a ``*.tmp`` name), then close and fsync it.

    ``path`` must not exist: it is created exclusively first (:func:`pipeline.core.fileio.create_new_file`), so
    whatever is there (a link planted at the temporary name) is refused, untouched.

    ``blocks`` must together hold exactly ``num_images`` images and ``num_rows`` rows. ``chunk_rows`` 0 means
    contiguous datasets (fastest reads); otherwise datasets are chunked by ``chunk_rows`` rows. ``pooled_dim``
    P > 0 adds the per-image dataset ``pooled`` (n, P) float32: every block then carries ``pooled``.
    """
    plan = SegmentPlan(
        num_images, num_rows, identity, feature_dtype, feature_dim, fields, chunk_rows, compression, pooled_dim
    )
    create_new_file(path, "feature segment")  # HDF5 then opens a new file of ours by name, never a planted link
    try:
        _write_segment_file(h5py, path, blocks, plan)
        if fsync:
            _fsync_file(path)
    except (OSError, RuntimeError) as exc:
        path.unlink(missing_ok=True)
        os_error = exc if isinstance(exc, OSError) else _hdf5_os_error(exc)
        if os_error is None:
            raise
        raise annotate_os_error(os_error, "write feature segment", path) from None
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _hdf5_os_error(exc: RuntimeError) -> OSError | None:
    """The OS error inside an HDF5 failure that h5py reports as ``RuntimeError`` (some builds raise it when a
    close flushes to a full disk: "file write failed: ... errno = 28, error message = 'No space left on device'")."""
    found = re.search(r"errno = (\d+)", str(exc))
    if not found:
        return None
    code = int(found.group(1))
    return OSError(code, os.strerror(code))


def _write_segment_file(h5py: Any, path: Path, blocks: Iterable[Block], plan: SegmentPlan) -> None:
    row_fields = row_fields_of(plan.fields)
    with h5py.File(path, "w", locking=False) as fh:
        fh.attrs["format"] = FORMAT
        fh.attrs["schema_version"] = SCHEMA_VERSION
        fh.attrs["identity"] = json.dumps(plan.identity, sort_keys=True)
        fh.attrs["feature_dtype"] = plan.feature_dtype
        fh.attrs["feature_dim"] = plan.feature_dim
        fh.attrs["fields"] = json.dumps(list(plan.fields))
        fh.attrs["num_images"] = plan.num_images
        fh.attrs["num_rows"] = plan.num_rows
        fh.attrs["complete"] = False
        fh.attrs["checksum"] = "crc32"
        dsets = {}
        for name in row_fields:
            width = field_width(name, plan.feature_dim)
            shape = (plan.num_rows,) if width is None else (plan.num_rows, width)
            kwargs: dict[str, Any] = {}
            if plan.chunk_rows and plan.num_rows:
                kwargs["chunks"] = (min(plan.chunk_rows, plan.num_rows),) + shape[1:]
                if plan.compression:
                    kwargs["compression"] = plan.compression
            dsets[name] = fh.create_dataset(name, shape=shape, dtype=field_dtype(name, plan.feature_dtype), **kwargs)
        pooled_ds = (
            _create_pooled(fh, plan.num_images, plan.pooled_dim, plan.chunk_rows, plan.compression)
            if plan.pooled_dim
            else None
        )
        keys_ds = fh.create_dataset("keys", shape=(plan.num_images,), dtype=h5py.string_dtype("utf-8"))
        offsets = np.zeros(plan.num_images + 1, dtype="<i8")
        sizes = np.zeros((plan.num_images, 2), dtype="<i4")
        crcs = np.zeros(plan.num_images, dtype="<u4")
        all_keys: list[str] = []
        img = row = 0
        for block in blocks:
            n = len(block.keys)
            r = int(block.counts.sum())
            if img + n > plan.num_images or row + r > plan.num_rows:
                raise PipelineError(f"segment {path}: more data than announced")
            stored: dict[str, np.ndarray] = {}
            for name in row_fields:
                arr = block.rows[name]
                if len(arr) != r:
                    raise PipelineError(f"segment {path}: field {name} has {len(arr)} rows, expected {r}")
                with np.errstate(over="ignore", invalid="ignore"):
                    stored[name] = np.ascontiguousarray(arr, dtype=field_dtype(name, plan.feature_dtype))
                if r:
                    dsets[name][row : row + r] = stored[name]
            if n:
                for k in block.keys:
                    check_key(k, f"segment {path}")
                keys_ds[img : img + n] = [key_to_bytes(k) for k in block.keys]
                all_keys.extend(block.keys)
                local = np.concatenate([[0], np.cumsum(block.counts)]).astype(np.int64)
                offsets[img + 1 : img + n + 1] = row + local[1:]
                sizes[img : img + n] = block.sizes
                pooled = _block_pooled(path, block, n, plan.pooled_dim)
                if pooled_ds is not None:
                    pooled_ds[img : img + n] = pooled
                crcs[img : img + n] = row_checksums(stored, local, row_fields, pooled)
            img += n
            row += r
        if img != plan.num_images or row != plan.num_rows:
            raise PipelineError(
                f"segment {path}: wrote {img} images / {row} rows, announced {plan.num_images} / {plan.num_rows}"
            )
        fh.create_dataset("offsets", data=offsets)
        fh.create_dataset("image_size", data=sizes)
        fh.create_dataset("row_crc32", data=crcs)
        fh.attrs["index_crc32"] = index_checksum(all_keys, offsets, sizes)
        fh.attrs["complete"] = True


def _create_pooled(fh: Any, num_images: int, pooled_dim: int, chunk_rows: int, compression: str | None) -> Any:
    """The per-image dataset ``pooled`` (n, P) float32 and the segment attribute ``pooled_dim``."""
    if not 0 < pooled_dim <= MAX_POOLED_DIM:
        raise PipelineError(f"a pooled vector of {pooled_dim} values (1..{MAX_POOLED_DIM} are stored)")
    fh.attrs["pooled_dim"] = pooled_dim
    kwargs: dict[str, Any] = {}
    if chunk_rows and num_images:
        kwargs["chunks"] = (min(chunk_rows, num_images), pooled_dim)
        if compression:
            kwargs["compression"] = compression
    return fh.create_dataset(POOLED, shape=(num_images, pooled_dim), dtype=POOLED_DTYPE, **kwargs)


def _block_pooled(path: Path, block: Block, n: int, pooled_dim: int) -> np.ndarray | None:
    """A block's pooled vectors as stored ((n, P) float32), None for a segment without them; a block that does
    not match the segment is refused."""
    if not pooled_dim:
        if block.pooled is not None:
            raise PipelineError(f"segment {path}: a block carries pooled vectors, the segment has none")
        return None
    if block.pooled is None or np.shape(block.pooled) != (n, pooled_dim):
        got = None if block.pooled is None else np.shape(block.pooled)
        raise PipelineError(f"segment {path}: pooled vectors {got}, expected ({n}, {pooled_dim})")
    return np.ascontiguousarray(block.pooled, dtype=POOLED_DTYPE)


@dataclass
class RowSource:
    """Where a row field lives: a byte offset for contiguous data (read with pread), else via h5py."""

    name: str
    dtype: np.dtype
    width: int | None
    byte_offset: int | None  # None -> read through h5py

    @property
    def row_bytes(self) -> int:
        return self.dtype.itemsize * (self.width or 1)


@dataclass
class SegmentIndex:
    """The small, fully-read part of a segment: keys, offsets, sizes and where each row field lives."""

    path: Path
    identity: dict[str, Any]
    feature_dtype: str
    feature_dim: int
    fields: list[str]
    keys: list[str]
    offsets: np.ndarray
    sizes: np.ndarray
    sources: dict[str, RowSource]
    crc: np.ndarray | None = None  # row_crc32 per image; None for segments written before checksums
    pooled: RowSource | None = None  # the per-image ``pooled`` dataset (rows are images); None: the segment has none

    @property
    def checksummed(self) -> bool:
        return self.crc is not None

    @property
    def pooled_dim(self) -> int:
        return int(self.pooled.width or 0) if self.pooled is not None else 0

    def check_rows(self, i: int, rows: dict[str, np.ndarray], pooled: np.ndarray | None = None) -> None:
        """Refuse image ``i`` if the CRC of its ``rows`` (every row field) and, in a segment with pooled vectors,
        its ``pooled`` vector (P,) differs from the stored one."""
        if self.crc is None:
            return
        vectors = None if pooled is None else np.asarray(pooled).reshape(1, -1)
        got = row_checksums(rows, np.array([0, len(rows["features"])]), list(self.sources), vectors)[0]
        if int(got) != int(self.crc[i]):
            raise PipelineError(
                f"{self.path}: stored rows of image {display_key(self.keys[i])} are damaged (checksum mismatch); "
                "restore the segment from a backup or re-extract (`info --verify STORE` lists every damaged image)"
            )

    @property
    def num_images(self) -> int:
        return len(self.keys)

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])


def _attr(fh: Any, path: Path, name: str) -> Any:
    if name not in fh.attrs:
        raise PipelineError(f"{path} is not a butd-caption feature segment (attribute '{name}' missing)")
    value = fh.attrs[name]
    return value.decode() if isinstance(value, bytes) else value


def open_hdf5_readonly(path: Path) -> h5py.File:
    """``path`` opened read-only without file locking; a file HDF5 cannot open is a :class:`PipelineError` naming
    it."""
    try:
        return h5py.File(path, "r", locking=False)
    except OSError as exc:
        raise PipelineError(f"{path} is not a readable HDF5 file ({str(exc).splitlines()[0]})") from None


def read_segment_index(path: Path, expect_images: int | None = None, expect_rows: int | None = None) -> SegmentIndex:
    """Open ``path`` read-only, validate it thoroughly, and read its index; errors name the file."""
    if not path.is_file():
        raise PipelineError(f"feature segment {path} is missing")
    fh = open_hdf5_readonly(path)
    try:
        if _attr(fh, path, "format") != FORMAT:
            raise PipelineError(f"{path} is an HDF5 file but not a butd-caption feature store")
        version = int(_attr(fh, path, "schema_version"))
        if version != SCHEMA_VERSION:
            raise PipelineError(
                f"{path} has schema version {version}; this butd-caption reads version {SCHEMA_VERSION}"
            )
        if not bool(_attr(fh, path, "complete")):
            raise PipelineError(f"{path} is an incomplete segment (its writer was interrupted)")
        identity = json.loads(_attr(fh, path, "identity"))
        feature_dtype = str(_attr(fh, path, "feature_dtype"))
        feature_dim = int(_attr(fh, path, "feature_dim"))
        fields = list(json.loads(_attr(fh, path, "fields")))
        n = int(_attr(fh, path, "num_images"))
        r = int(_attr(fh, path, "num_rows"))
        if feature_dtype not in FEATURE_DTYPES:
            raise PipelineError(f"{path}: unknown feature dtype {feature_dtype!r}")
        if (expect_images is not None and n != expect_images) or (expect_rows is not None and r != expect_rows):
            raise PipelineError(
                f"{path} holds {n} images / {r} rows but the store record says {expect_images} / {expect_rows}"
            )
        for name in ("keys", "offsets", "image_size", "features", "boxes"):
            if name not in fh:
                raise PipelineError(f"{path}: dataset '{name}' is missing")
        keys = [key_from_bytes(k) for k in fh["keys"][()]]
        offsets = np.asarray(fh["offsets"][()], dtype=np.int64)
        sizes = np.asarray(fh["image_size"][()], dtype=np.int32)
        crc = None
        if "index_crc32" in fh.attrs or "row_crc32" in fh:
            if "index_crc32" not in fh.attrs or "row_crc32" not in fh:
                raise PipelineError(f"{path}: checksum records are incomplete (segment damaged)")
            if index_checksum(keys, offsets, sizes) != int(fh.attrs["index_crc32"]):
                raise PipelineError(f"{path}: the segment index (keys, offsets, sizes) is damaged (checksum mismatch)")
            crc = np.asarray(fh["row_crc32"][()], dtype=np.uint32)
            if crc.shape != (n,):
                raise PipelineError(f"{path}: row checksums do not match num_images={n}")
        if len(keys) != n or offsets.shape != (n + 1,) or sizes.shape != (n, 2):
            raise PipelineError(f"{path}: index arrays do not match num_images={n}")
        if offsets[0] != 0 or offsets[-1] != r or np.any(np.diff(offsets) < 0):
            raise PipelineError(f"{path}: offsets are not increasing from 0 to {r}")
        file_size = path.stat().st_size
        sources: dict[str, RowSource] = {}
        for name in row_fields_of(fields):
            if name not in fh:
                raise PipelineError(f"{path}: dataset '{name}' is missing")
            ds = fh[name]
            width = field_width(name, feature_dim)
            want_shape = (r,) if width is None else (r, width)
            want_dtype = field_dtype(name, feature_dtype)
            if ds.shape != want_shape or ds.dtype != want_dtype:
                raise PipelineError(
                    f"{path}: dataset '{name}' is {ds.shape} {ds.dtype}, expected {want_shape} {want_dtype}"
                )
            offset = None
            if ds.chunks is None and ds.compression is None and r:
                offset = ds.id.get_offset()
                if offset is None or offset + r * want_dtype.itemsize * (width or 1) > file_size:
                    raise PipelineError(f"{path}: dataset '{name}' is truncated")
            sources[name] = RowSource(name, want_dtype, width, offset)
        pooled = _pooled_source(fh, path, n, file_size)
    except PipelineError:
        raise
    except (KeyError, ValueError, TypeError, OSError, RuntimeError) as exc:
        raise PipelineError(f"{path}: corrupt feature segment ({exception_line(exc)})") from None
    finally:
        fh.close()
    return SegmentIndex(path, identity, feature_dtype, feature_dim, fields, keys, offsets, sizes, sources, crc, pooled)


def _pooled_source(fh: Any, path: Path, n: int, file_size: int) -> RowSource | None:
    """Where the segment's per-image ``pooled`` dataset lives (None when it has none), its shape and size checked
    against the ``pooled_dim`` attribute before anything is read."""
    if "pooled_dim" not in fh.attrs:
        if POOLED in fh:
            raise PipelineError(f"{path}: dataset '{POOLED}' without the attribute 'pooled_dim' (segment damaged)")
        return None
    dim = fh.attrs["pooled_dim"]
    if not isinstance(dim, (int, np.integer)) or not 0 < int(dim) <= MAX_POOLED_DIM:
        raise PipelineError(f"{path}: attribute 'pooled_dim' {dim!r} is not an integer in 1..{MAX_POOLED_DIM}")
    dim = int(dim)
    if POOLED not in fh:
        raise PipelineError(f"{path}: dataset '{POOLED}' is missing")
    ds = fh[POOLED]
    if not isinstance(ds, h5py.Dataset) or ds.shape != (n, dim) or ds.dtype != POOLED_DTYPE:
        shape, dtype = getattr(ds, "shape", None), getattr(ds, "dtype", None)
        raise PipelineError(
            f"{path}: dataset '{POOLED}' is {shape} {dtype}, expected {(n, dim)} {POOLED_DTYPE} (pooled_dim {dim})"
        )
    offset = None
    if ds.chunks is None and ds.compression is None and n:
        offset = ds.id.get_offset()
        if offset is None or offset + n * dim * POOLED_DTYPE.itemsize > file_size:
            raise PipelineError(f"{path}: dataset '{POOLED}' is truncated")
    return RowSource(POOLED, POOLED_DTYPE, dim, offset)
