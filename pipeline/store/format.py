"""On-disk format of the feature store: names, schema version, the commit record (``store.json``).

A store is a directory::

    STORE/
      store.json          the commit record, replaced atomically (write tmp, fsync, rename) at each commit
      seg-000000.h5       immutable HDF5 segments, one per commit; only those listed in store.json count
      seg-000001.h5
      .lock               advisory lock (flock) held by the one writer
      *.tmp               leftovers of a killed writer: ignored by readers, deleted by the next writer

``store.json`` holds the schema version, the extractor identity, the feature dimension and dtype, the
optional per-box fields present, ``pooled_dim`` P when the images carry a pooled vector (absent: none), a commit
counter and the list of segments with their image and row counts.

A segment (``seg-*.h5``) holds the flat layout for the images of one commit (no per-image groups):

==================  ===================  ==========================================================
dataset             shape / dtype        meaning
==================  ===================  ==========================================================
``features``        (R, D) f16 or f32    region features of all images, concatenated by rows
``boxes``           (R, 4) f32           x1, y1, x2, y2 in original-image pixels
``class_ids``       (R,) i32 (optional)  detector class per box (0-based VG object line)
``class_scores``    (R,) f32 (optional)  its confidence
``attr_ids``        (R,) i32 (optional)  attribute per box (0-based VG attribute line)
``attr_scores``     (R,) f32 (optional)  its confidence
``keys``            (n,) utf-8 strings   image ids (COCO id as text, or a relative path), as their exact
                                         bytes (:mod:`pipeline.core.keys`: a non-UTF-8 file name survives)
``offsets``         (n + 1,) i64         image i owns rows offsets[i] : offsets[i + 1]
``image_size``      (n, 2) i32           width, height in pixels
``row_crc32``       (n,) u4              CRC-32 of each image's rows (all row fields), then of its
                                         ``pooled`` row when the store has one; checked on read
``pooled``          (n, P) f32           one vector per image (optional; CLIP's pooled vector: the
                                         attention pool's output or the class token)
==================  ===================  ==========================================================

Segment attributes: ``format``, ``schema_version``, ``identity`` (JSON), ``num_images``, ``num_rows``,
``feature_dim``, ``feature_dtype``, ``fields`` (JSON list), ``pooled_dim`` (only in a segment with ``pooled``),
``checksum`` (``crc32``), ``index_crc32`` (CRC-32 of keys, offsets and sizes) and ``complete`` (set last).
A store either holds a pooled vector for every image or for none (its writers are refused a mix); a store
without one has exactly the files and checksums it would have without this field. The reader returns it as
``store.get(key)["pooled"]`` ((P,) float32, only when the store has it; ``store.pooled_dim`` is P, 0 for none).
Segments written before checksums lack
``row_crc32``/``index_crc32``/``checksum`` and are still read (``info`` says their damage cannot be detected);
``info --verify STORE`` reads every row and lists damaged images by key (:mod:`pipeline.store.verify`).
A segment file is also a valid single-file store on its own (``FeatureStore("seg.h5")``), which is how a compacted store
is shipped as one file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_json, read_json

FORMAT = "butd-caption-feature-store"
SCHEMA_VERSION = 1
MANIFEST = "store.json"
LOCK = ".lock"
SEGMENT_GLOB = "seg-*.h5"

FEATURE_DTYPES = {"float16": np.dtype("<f2"), "float32": np.dtype("<f4")}
BOX_DTYPE = np.dtype("<f4")
OPTIONAL_FIELDS = {
    "class_ids": np.dtype("<i4"),
    "class_scores": np.dtype("<f4"),
    "attr_ids": np.dtype("<i4"),
    "attr_scores": np.dtype("<f4"),
}
ROW_FIELDS = ("features", "boxes") + tuple(OPTIONAL_FIELDS)
POOLED = "pooled"
POOLED_DTYPE = np.dtype("<f4")
MAX_POOLED_DIM = 65536
"""The longest per-image pooled vector a store holds (CLIP's have 512 to 1280 values)."""


def segment_name(index: int) -> str:
    return f"seg-{index:06d}.h5"


def canonical_identity(identity: Any, source: str = "extractor identity") -> dict[str, Any]:
    """Validate an extractor identity (a JSON-serialisable dict with a ``name``) and return a plain copy."""
    if not isinstance(identity, dict) or not identity:
        raise UsageError(
            f"{source} must be a non-empty dict such as {{'name': ..., 'weights_sha256': ..., 'config': ...}}"
        )
    if not isinstance(identity.get("name"), str) or not identity["name"]:
        raise UsageError(f"{source} must have a 'name' string")
    try:
        return json.loads(json.dumps(identity, sort_keys=True))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"{source} is not JSON-serialisable: {exc}") from exc


def identity_text(identity: dict[str, Any]) -> str:
    """A compact one-line rendering of an identity for messages."""
    return json.dumps(identity, sort_keys=True, separators=(",", ":"))


#: the most differing values an identity mismatch names (a detector identity holds a hundred nested fields)
_MISMATCH_SHOWN = 4


def _differing_leaves(stored: Any, given: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """The dotted paths (``config.boxes.conf``) where two identities differ, with both values (``...`` absent)."""
    if isinstance(stored, dict) and isinstance(given, dict):
        out: list[tuple[str, Any, Any]] = []
        for key in sorted(set(stored) | set(given)):
            out += _differing_leaves(stored.get(key, ...), given.get(key, ...), f"{path}{key}.")
        return out
    return [] if stored == given else [(path[:-1], stored, given)]


def _short(value: Any) -> str:
    text = "absent" if value is ... else identity_text(value)
    return text if len(text) <= 80 else text[:77] + "..."


def identity_mismatch(store: str, stored: dict[str, Any], given: dict[str, Any]) -> str:
    """A one-line message naming the stored extractor, the top-level keys that differ and the first differing
    values (dotted paths into the identities, each value cut to a readable length)."""
    leaves = _differing_leaves(stored, given)
    differ = sorted({path.split(".", 1)[0] for path, _, _ in leaves})
    shown = "; ".join(f"{path} stored {_short(a)} vs given {_short(b)}" for path, a, b in leaves[:_MISMATCH_SHOWN])
    more = f" (and {len(leaves) - _MISMATCH_SHOWN} more)" if len(leaves) > _MISMATCH_SHOWN else ""
    return (
        f"feature store {store} was written by a different extractor ({_short(stored.get('name', ...))}; differs "
        f"in {', '.join(differ)}): {shown}{more}; use another store path"
    )


def new_manifest(identity: dict[str, Any], feature_dtype: str, feature_dim: int | None) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "identity": identity,
        "feature_dtype": feature_dtype,
        "feature_dim": feature_dim,
        "fields": None,
        "commit": 0,
        "num_images": 0,
        "num_rows": 0,
        "segments": [],
    }


def read_manifest(store: Path) -> dict[str, Any]:
    """Read and validate ``STORE/store.json``; every problem is a one-line error naming the file."""
    path = store / MANIFEST
    try:
        data = read_json(path, what="feature store record")
    except UsageError:
        raise UsageError(f"{store} is not a feature store (no {MANIFEST})") from None
    if data.get("format") != FORMAT:
        raise PipelineError(f"{path} is not a butd-caption feature store record (format {data.get('format')!r})")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise PipelineError(
            f"feature store {store} has schema version {version!r}; this butd-caption reads version {SCHEMA_VERSION}"
        )
    for key, kind in (("identity", dict), ("segments", list), ("commit", int), ("num_images", int), ("num_rows", int)):
        if not isinstance(data.get(key), kind):
            raise PipelineError(f"{path}: field '{key}' is missing or not a {kind.__name__}")
    if data.get("feature_dtype") not in FEATURE_DTYPES:
        raise PipelineError(f"{path}: unknown feature_dtype {data.get('feature_dtype')!r}")
    for i, seg in enumerate(data["segments"]):
        if not (
            isinstance(seg, dict)
            and isinstance(seg.get("file"), str)
            and isinstance(seg.get("images"), int)
            and isinstance(seg.get("rows"), int)
            and "/" not in seg["file"]
        ):
            raise PipelineError(f"{path}: segment entry {i} is malformed")
    pooled_dim = data.get("pooled_dim", 0)
    if not isinstance(pooled_dim, int) or isinstance(pooled_dim, bool) or not 0 <= pooled_dim <= MAX_POOLED_DIM:
        raise PipelineError(f"{path}: field 'pooled_dim' {pooled_dim!r} is not an integer in 0..{MAX_POOLED_DIM}")
    if sum(s["images"] for s in data["segments"]) != data["num_images"]:
        raise PipelineError(f"{path}: segment image counts do not add up to num_images")
    return data


def manifest_pooled_dim(manifest: dict[str, Any]) -> int:
    """P, the length of the store's per-image pooled vector; 0 when its images carry none."""
    return int(manifest.get("pooled_dim") or 0)


def write_manifest(store: Path, manifest: dict[str, Any]) -> None:
    """The commit point: atomically replace ``store.json`` (tmp file, fsync, rename, fsync dir)."""
    atomic_write_json(store / MANIFEST, manifest, indent=1)


def is_store(path: str | Path) -> bool:
    """True when ``path`` looks like a feature store: a directory with ``store.json`` or one of our HDF5 files."""
    path = Path(path)
    if path.is_dir():
        return (path / MANIFEST).is_file()
    if path.is_file():
        try:
            with h5py.File(path, "r", locking=False) as fh:
                return fh.attrs.get("format") == FORMAT
        except (OSError, ValueError):
            return False
    return False
