"""Random-access reader of a feature store (a store directory or one segment file).

The reader holds only the store path until first use, and (re)opens everything lazily in the process that
uses it: it pickles to its path, so it works in DataLoader workers under ``fork``, ``forkserver`` and
``spawn`` alike, and a reader inherited across ``fork`` reopens its files in the child.

Reading one image touches only that image's rows: for contiguous segments each row field is one
``os.pread`` at the dataset's byte offset (HDF5 reports it once, when the index is read); chunked or
compressed segments are read through h5py. Each image's rows are checked against the CRC-32 its segment
recorded (see :mod:`pipeline.store.segment`): damaged data is refused with one line naming the segment and
the image, never returned. A store whose images carry a pooled vector (CLIP's; ``pooled_dim`` P > 0) returns it
as ``get(key)["pooled"]``, (P,) float32, checked with the image's rows.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import read_json
from pipeline.store.format import (
    MANIFEST,
    POOLED,
    canonical_identity,
    identity_mismatch,
    manifest_pooled_dim,
    read_manifest,
)
from pipeline.store.segment import SegmentIndex, read_segment_index, row_checksums
from pipeline.store.stats import store_info


class _State:
    """Per-process state: the merged index and open file handles (never pickled)."""

    def __init__(self, segments: list[SegmentIndex], manifest: dict[str, Any]) -> None:
        self.pid = os.getpid()
        self.segments = segments
        self.manifest = manifest
        keys: list[str] = []
        seg_of, start, count, sizes = [], [], [], []
        for si, seg in enumerate(segments):
            keys.extend(seg.keys)
            seg_of.append(np.full(seg.num_images, si, dtype=np.int32))
            start.append(seg.offsets[:-1])
            count.append(np.diff(seg.offsets))
            sizes.append(seg.sizes)
        self.keys = keys
        self.index = {k: i for i, k in enumerate(keys)}
        if len(self.index) != len(keys):
            dup = next(k for k in keys if keys.count(k) > 1)
            raise PipelineError(f"feature store {manifest['path']} holds image id {dup!r} more than once")
        self.seg_of = np.concatenate(seg_of) if seg_of else np.zeros(0, np.int32)
        self.start = np.concatenate(start) if start else np.zeros(0, np.int64)
        self.count = np.concatenate(count) if count else np.zeros(0, np.int64)
        self.sizes = np.concatenate(sizes) if sizes else np.zeros((0, 2), np.int32)
        self.first = np.concatenate([[0], np.cumsum([seg.num_images for seg in segments])]).astype(np.int64)
        self.fds: OrderedDict[int, int] = OrderedDict()
        self.h5: OrderedDict[int, Any] = OrderedDict()
        self.memory: dict[str, np.ndarray] | None = None
        self.mem_start: np.ndarray | None = None
        self.mem_pooled: np.ndarray | None = None  # (images, P) after preload, for a store with pooled vectors

    def close(self) -> None:
        for fd in self.fds.values():
            try:
                os.close(fd)
            except OSError:
                pass
        for fh in self.h5.values():
            try:
                fh.close()
            except Exception:
                pass
        self.fds.clear()
        self.h5.clear()


class FeatureStore:
    """Read-only view of a feature store.

    Args:
        path: a store directory (``store.json`` + segments) or a single segment file.
        expect_identity: if given, the store's extractor identity must equal it (else a one-line error).
        max_open: most segment files kept open at once per process (LRU).
    """

    def __init__(self, path: str | Path, expect_identity: dict[str, Any] | None = None, max_open: int = 64) -> None:
        self.path = Path(path)
        self.expect_identity = canonical_identity(expect_identity) if expect_identity is not None else None
        self.max_open = max_open
        self._state: _State | None = None
        if not self.path.exists():
            raise UsageError(f"feature store not found: {self.path}")
        self._open()  # validate eagerly so errors surface where the store is named; dropped on pickling

    # -- lifecycle -----------------------------------------------------------------------------------------
    def _open(self) -> _State:
        if self.path.is_dir():
            manifest = read_manifest(self.path)
            segments = [read_segment_index(self.path / s["file"], s["images"], s["rows"]) for s in manifest["segments"]]
            for seg in segments:
                if seg.identity != manifest["identity"] or seg.feature_dtype != manifest["feature_dtype"]:
                    raise PipelineError(f"{seg.path}: identity or dtype differs from {self.path / MANIFEST}")
                if seg.pooled_dim != manifest_pooled_dim(manifest):
                    raise PipelineError(
                        f"{seg.path}: pooled vectors of {seg.pooled_dim} values, {self.path / MANIFEST} records "
                        f"pooled_dim {manifest_pooled_dim(manifest)} (0: none)"
                    )
        else:
            seg = read_segment_index(self.path)
            segments = [seg]
            manifest = {
                "identity": seg.identity,
                "feature_dtype": seg.feature_dtype,
                "feature_dim": seg.feature_dim,
                "fields": seg.fields,
                "commit": 1,
                "num_images": seg.num_images,
                "num_rows": seg.num_rows,
                "segments": [{"file": self.path.name, "images": seg.num_images, "rows": seg.num_rows}],
            }
            if seg.pooled_dim:
                manifest["pooled_dim"] = seg.pooled_dim
        manifest = dict(manifest, path=str(self.path))
        if self.expect_identity is not None and manifest["identity"] != self.expect_identity:
            raise UsageError(identity_mismatch(str(self.path), manifest["identity"], self.expect_identity))
        self._state = _State(segments, manifest)
        return self._state

    def _st(self) -> _State:
        st = self._state
        if st is None or st.pid != os.getpid():
            if st is not None:
                # inherited across fork: the raw descriptors are this process's copies, close them; the
                # HDF5 handles are left alone (closing a forked HDF5 state is what h5py warns against)
                for fd in st.fds.values():
                    try:
                        os.close(fd)
                    except OSError:
                        pass
                st.fds.clear()
                st.h5.clear()
            st = self._open()
        return st

    def refresh(self) -> "FeatureStore":
        """Re-read the commit record: a reader is a snapshot of the commits made before it opened."""
        self.close()
        self._open()
        return self

    def close(self) -> None:
        if self._state is not None and self._state.pid == os.getpid():
            self._state.close()
        self._state = None

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "expect_identity": self.expect_identity, "max_open": self.max_open}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.path = state["path"]
        self.expect_identity = state["expect_identity"]
        self.max_open = state["max_open"]
        self._state = None  # opened lazily in the process that reads

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __enter__(self) -> "FeatureStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- metadata ------------------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._st().keys)

    def keys(self) -> list[str]:
        return list(self._st().keys)

    def __contains__(self, key: object) -> bool:
        return key in self._st().index

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    @property
    def identity(self) -> dict[str, Any]:
        return dict(self._st().manifest["identity"])

    @property
    def feature_dtype(self) -> str:
        return str(self._st().manifest["feature_dtype"])

    @property
    def feature_dim(self) -> int | None:
        dim = self._st().manifest["feature_dim"]
        return int(dim) if dim is not None else None

    @property
    def fields(self) -> list[str]:
        return list(self._st().manifest.get("fields") or [])

    @property
    def pooled_dim(self) -> int:
        """P, the length of each image's pooled vector (``get(key)["pooled"]``); 0 when the store holds none."""
        return manifest_pooled_dim(self._st().manifest)

    @property
    def commit_counter(self) -> int:
        return int(self._st().manifest["commit"])

    def num_boxes(self, key: str | None = None) -> np.ndarray | int:
        """Boxes of one image, or (no key) an array of boxes per image in :meth:`keys` order."""
        st = self._st()
        if key is None:
            return st.count.copy()
        return int(st.count[self._position(key)])

    def image_size(self, key: str) -> tuple[int, int]:
        w, h = self._st().sizes[self._position(key)]
        return int(w), int(h)

    def info(self, sample: int = 256) -> dict[str, Any]:
        """Counts, box statistics, dtype, size on disk and identity (see :mod:`pipeline.store.stats`)."""
        return store_info(self, sample=sample)

    # -- reading -------------------------------------------------------------------------------------------
    def _position(self, key: str) -> int:
        try:
            return self._st().index[key]
        except KeyError:
            raise KeyError(f"image {key!r} is not in feature store {self.path}") from None

    def _fd(self, st: _State, si: int) -> int:
        fd = st.fds.get(si)
        if fd is None:
            if len(st.fds) >= self.max_open:
                _, old = st.fds.popitem(last=False)
                os.close(old)
            fd = os.open(st.segments[si].path, os.O_RDONLY)
            st.fds[si] = fd
        else:
            st.fds.move_to_end(si)
        return fd

    def _h5(self, st: _State, si: int) -> Any:
        fh = st.h5.get(si)
        if fh is None:
            if len(st.h5) >= self.max_open:
                _, old = st.h5.popitem(last=False)
                old.close()
            fh = h5py.File(st.segments[si].path, "r", locking=False)
            st.h5[si] = fh
        else:
            st.h5.move_to_end(si)
        return fh

    def _read_rows(self, st: _State, si: int, name: str, start: int, count: int) -> np.ndarray:
        seg = st.segments[si]
        src = seg.sources[name]
        shape = (count,) if src.width is None else (count, src.width)
        if src.byte_offset is not None:
            nbytes = count * src.row_bytes
            buf = os.pread(self._fd(st, si), nbytes, src.byte_offset + start * src.row_bytes)
            if len(buf) != nbytes:
                raise PipelineError(f"{seg.path}: short read of '{name}' (file truncated?)")
            return np.frombuffer(buf, dtype=src.dtype).reshape(shape)
        try:
            return np.asarray(self._h5(st, si)[name][start : start + count])
        except (OSError, RuntimeError, ValueError, KeyError) as exc:  # a damaged chunk (compressed or chunked data)
            raise PipelineError(
                f"{seg.path}: cannot read '{name}' rows {start}..{start + count} "
                f"(damaged segment: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None

    def _read_pooled(self, st: _State, si: int, first: int, count: int) -> np.ndarray | None:
        """Pooled vectors (count, P) of the segment's images ``first..first + count``; None when it has none."""
        seg = st.segments[si]
        src = seg.pooled
        if src is None:
            return None
        if src.byte_offset is not None:
            nbytes = count * src.row_bytes
            buf = os.pread(self._fd(st, si), nbytes, src.byte_offset + first * src.row_bytes)
            if len(buf) != nbytes:
                raise PipelineError(f"{seg.path}: short read of '{POOLED}' (file truncated?)")
            return np.frombuffer(buf, dtype=src.dtype).reshape(count, int(src.width or 0))
        try:
            return np.asarray(self._h5(st, si)[POOLED][first : first + count])
        except (OSError, RuntimeError, ValueError, KeyError) as exc:
            raise PipelineError(
                f"{seg.path}: cannot read '{POOLED}' of images {first}..{first + count} "
                f"(damaged segment: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None

    def get_position(self, i: int) -> dict[str, Any]:
        """The image at position ``i`` of :meth:`keys`."""
        st = self._st()
        si, start, count = int(st.seg_of[i]), int(st.start[i]), int(st.count[i])
        w, h = st.sizes[i]
        out: dict[str, Any] = {"key": st.keys[i], "image_w": int(w), "image_h": int(h)}
        if st.memory is not None:
            s = int(st.mem_start[i])  # type: ignore[index]
            for name, arr in st.memory.items():
                out[name] = arr[s : s + count]
            if st.mem_pooled is not None:
                out[POOLED] = st.mem_pooled[i]
            return out
        seg = st.segments[si]
        rows = {name: self._read_rows(st, si, name, start, count) for name in seg.sources}
        pooled = self._read_pooled(st, si, i - int(st.first[si]), 1)
        seg.check_rows(i - int(st.first[si]), rows, None if pooled is None else pooled[0])
        out.update(rows)
        if pooled is not None:
            out[POOLED] = pooled[0]
        return out

    def get(self, key: str) -> dict[str, Any]:
        """One image: ``features`` (N, D) store dtype, ``boxes`` (N, 4) float32, ``image_w``, ``image_h``,
        the optional fields the store has (``class_ids``, ``class_scores``, ``attr_ids``, ``attr_scores``), and
        ``pooled`` (P,) float32 when the store holds a pooled vector per image (:attr:`pooled_dim`).
        Arrays are read-only views; copy before modifying. A missing key raises ``KeyError`` naming the store."""
        return self.get_position(self._position(key))

    def __getitem__(self, key: str) -> dict[str, Any]:
        return self.get(key)

    def preload(self) -> "FeatureStore":
        """Read every row of every field into memory once (per process); later reads are slices of it."""
        st = self._st()
        total = int(st.count.sum())
        memory: dict[str, np.ndarray] = {}
        for name, src in st.segments[0].sources.items() if st.segments else []:
            memory[name] = np.empty((total,) if src.width is None else (total, src.width), dtype=src.dtype)
        dim = self.pooled_dim
        pooled = np.empty((len(st.keys), dim), dtype=np.float32) if dim else None
        row = 0
        for si, seg in enumerate(st.segments):
            for name in memory:
                memory[name][row : row + seg.num_rows] = self._read_rows(st, si, name, 0, seg.num_rows)
            seg_rows = {name: memory[name][row : row + seg.num_rows] for name in memory}
            seg_pooled = None
            if pooled is not None:
                seg_pooled = pooled[int(st.first[si]) : int(st.first[si]) + seg.num_images]
                seg_pooled[:] = self._read_pooled(st, si, 0, seg.num_images)
            verify_block(seg, 0, seg_rows, seg_pooled)
            row += seg.num_rows
        st.memory = memory
        st.mem_pooled = pooled
        st.mem_start = np.concatenate([[0], np.cumsum(st.count)[:-1]]).astype(np.int64)
        return self


def verify_block(seg: SegmentIndex, lo: int, rows: dict[str, np.ndarray], pooled: np.ndarray | None = None) -> None:
    """Check images ``lo..`` of ``seg`` whose rows (from row ``offsets[lo]`` on) are ``rows`` (and, in a segment
    with pooled vectors, whose vectors are ``pooled`` from image ``lo`` on); refuse damage."""
    if seg.crc is None or not rows:
        return

    n = len(next(iter(rows.values())))
    hi = int(np.searchsorted(seg.offsets, seg.offsets[lo] + n, side="right")) - 1
    if pooled is not None:
        hi = min(hi, lo + len(pooled))
    elif seg.pooled is not None:
        raise PipelineError(f"{seg.path}: the pooled vectors of images {lo}.. were not read with their rows")
    local = seg.offsets[lo : hi + 1] - seg.offsets[lo]
    got = row_checksums(rows, local, list(seg.sources), pooled)
    bad = np.flatnonzero(got != seg.crc[lo:hi])
    if len(bad):
        j = int(bad[0])
        seg.check_rows(
            lo + j,
            {k: v[local[j] : local[j + 1]] for k, v in rows.items()},
            None if pooled is None else pooled[j],
        )


def load_identity_file(path: str | Path) -> dict[str, Any]:
    """Read an extractor identity from a JSON file (for ``--identity`` options)."""
    return canonical_identity(read_json(path, what="extractor identity"), source=str(path))
