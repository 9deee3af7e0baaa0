"""``cli info --verify STORE``: read every row of every segment and report damage by segment and image key.

Segments written with checksums (see :mod:`pipeline.store.segment`) are checked image by image against their
CRC-32; segments written before checksums existed can only be checked for structure and for non-finite
values, and the report says so. Nothing is modified.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.store.format import POOLED, read_manifest
from pipeline.store.segment import SegmentIndex, read_segment_index, row_checksums

BLOCK_IMAGES = 256


@dataclass
class VerifyReport:
    """What ``verify_store`` found: totals, damaged segments (whole) and damaged images (segment, key, why)."""

    path: str
    segments: int = 0
    images: int = 0
    checked_images: int = 0
    unchecksummed_segments: list[str] = field(default_factory=list)
    bad_segments: list[tuple[str, str]] = field(default_factory=list)
    bad_images: list[tuple[str, str, str]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_segments and not self.bad_images


def _segment_list(path: Path) -> list[tuple[Path, int | None, int | None]]:
    if path.is_dir():
        manifest = read_manifest(path)
        return [(path / s["file"], s["images"], s["rows"]) for s in manifest["segments"]]
    return [(path, None, None)]


def _read_block(fh, seg: SegmentIndex, lo: int, hi: int) -> dict[str, np.ndarray]:
    """Rows of images lo..hi-1 by field, and their pooled vectors under ``pooled`` in a segment that has them."""
    r0, r1 = int(seg.offsets[lo]), int(seg.offsets[hi])
    rows = {name: np.asarray(fh[name][r0:r1]) for name in seg.sources}
    if seg.pooled is not None:
        rows[POOLED] = np.asarray(fh[POOLED][lo:hi])
    return rows


def _check_images(fh, seg: SegmentIndex, lo: int, hi: int, report: VerifyReport) -> None:
    """Images lo..hi-1: whole block first; on a read error, image by image so every bad key is named."""
    try:
        blocks = [(lo, hi, _read_block(fh, seg, lo, hi))]
    except (OSError, RuntimeError, ValueError):
        blocks = []
        for i in range(lo, hi):
            try:
                blocks.append((i, i + 1, _read_block(fh, seg, i, i + 1)))
            except (OSError, RuntimeError, ValueError) as exc:
                report.bad_images.append((seg.path.name, seg.keys[i], f"unreadable rows ({type(exc).__name__})"))
    for a, b, rows in blocks:
        local = seg.offsets[a : b + 1] - seg.offsets[a]
        pooled = rows.pop(POOLED, None)
        if seg.crc is not None:
            got = row_checksums(rows, local, list(seg.sources), pooled)
            for j in np.flatnonzero(got != seg.crc[a:b]):
                report.bad_images.append((seg.path.name, seg.keys[a + int(j)], "checksum mismatch"))
        else:
            for j in range(b - a):
                s, e = int(local[j]), int(local[j + 1])
                finite = all(np.isfinite(rows[n][s:e]).all() for n in rows if rows[n].dtype.kind == "f")
                if not finite or (pooled is not None and not np.isfinite(pooled[j]).all()):
                    report.bad_images.append((seg.path.name, seg.keys[a + j], "non-finite values (no checksum)"))
        report.checked_images += b - a


def verify_store(path: str | Path) -> VerifyReport:
    """Read all of ``path`` (a store directory or a single segment file); never raises for damaged data."""
    path = Path(path)
    report = VerifyReport(str(path))
    for seg_path, images, rows in _segment_list(path):
        report.segments += 1
        try:
            seg = read_segment_index(seg_path, images, rows)
        except PipelineError as exc:
            report.bad_segments.append((seg_path.name, str(exc)))
            if images:
                report.images += images
            continue
        report.images += seg.num_images
        if seg.crc is None:
            report.unchecksummed_segments.append(seg_path.name)
        try:
            with h5py.File(seg_path, "r", locking=False) as fh:
                for lo in range(0, seg.num_images, BLOCK_IMAGES):
                    _check_images(fh, seg, lo, min(lo + BLOCK_IMAGES, seg.num_images), report)
        except OSError as exc:
            report.bad_segments.append((seg_path.name, f"{seg_path}: unreadable ({str(exc).splitlines()[0]})"))
    return report
