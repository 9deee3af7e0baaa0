"""Feature store: random single-image reads from the project's store vs the usual per-image alternatives.

All layouts hold the same synthetic images (10-100 boxes, D=2048 ReLU-like float16 features, float32
boxes), written once before timing:

* ``store``        the project's store (``pipeline.store``: contiguous segments, reads by offset, CRC-checked)
* ``npz``          one uncompressed ``.npz`` per image (``np.savez``)
* ``npz-compressed`` one ``np.savez_compressed`` file per image (MILVLG / ruotianluo-style directories)
* ``h5-groups``    one plain h5py group per image with ``features``/``boxes`` datasets (M2-style)

One timed call reads ``reads`` random images (features and boxes) in a fixed random order; the page cache is
warm (a full untimed pass first, then every repeat is another full pass), and every image read is compared
with the store's (exact). ``python -m bench --only store [--size default|tiny]``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

from bench.harness import Case
from pipeline.core.regions import RegionRecord
from pipeline.store import FeatureStore, open_writer

IDENTITY = {"name": "bench-synthetic", "config": {"boxes": [10, 100]}}


class Source:
    """Deterministic synthetic images built from a small pool (so generation does not dominate timings)."""

    def __init__(self, n: int, dim: int, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.counts = rng.integers(10, 101, n)
        pool = np.maximum(rng.normal(0, 1.5, (8, 100, dim)), 0).astype(np.float32)
        self.pools = {np.dtype(t): pool.astype(t) for t in ("float16", "float32")}
        self.sizes = np.stack([rng.integers(300, 641, n), rng.integers(300, 641, n)], 1)
        self.dim = dim

    def __len__(self) -> int:
        return len(self.counts)

    def image(self, i: int, dtype: np.dtype) -> tuple[str, np.ndarray, np.ndarray, int, int]:
        k = int(self.counts[i])
        w, h = (int(v) for v in self.sizes[i])
        feats = self.pools[np.dtype(dtype)][i % 8, :k]
        boxes = np.tile(np.array([[0, 0, w / 2, h / 2]], np.float32), (k, 1))
        return str(i), feats, boxes, w, h


def drop_cache(path: Path) -> None:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def disk_bytes(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- writers ----------------------------------------------------------------------------------------------
def write_store(path: Path, src: Source, dtype: str, chunk_rows: int = 0, fsync: bool = True) -> None:
    with open_writer(path, IDENTITY, dtype, commit_every=1000, commit_bytes=0, chunk_rows=chunk_rows, fsync=fsync) as w:
        for i in range(len(src)):
            key, f, b, wd, ht = src.image(i, np.dtype(dtype))
            w.add(key, RegionRecord(f, b, wd, ht))


def write_groups(path: Path, src: Source, dtype: str) -> None:
    with h5py.File(path, "w") as fh:
        for i in range(len(src)):
            key, f, b, wd, ht = src.image(i, np.dtype(dtype))
            g = fh.create_group(key)
            g["features"], g["boxes"] = f, b
            g.attrs["size"] = (wd, ht)


def write_npz(path: Path, src: Source, dtype: str, compressed: bool = False) -> None:
    path.mkdir()
    save = np.savez_compressed if compressed else np.savez
    for i in range(len(src)):
        key, f, b, wd, ht = src.image(i, np.dtype(dtype))
        save(path / f"{key}.npz", features=f, boxes=b, size=np.array([wd, ht]))


# -- readers: key -> (features, boxes) -------------------------------------------------------------------
Reader = Callable[[str], tuple[np.ndarray, np.ndarray]]


def reader_store(path: Path) -> tuple[Reader, Callable[[], None]]:
    store = FeatureStore(path)

    def read(key: str) -> tuple[np.ndarray, np.ndarray]:
        rec = store.get(key)
        return rec["features"], rec["boxes"]

    return read, store.close


def reader_groups(path: Path) -> tuple[Reader, Callable[[], None]]:
    fh = h5py.File(path, "r")

    def read(key: str) -> tuple[np.ndarray, np.ndarray]:
        g = fh[key]
        return g["features"][()], g["boxes"][()]

    return read, fh.close


def reader_npz(path: Path) -> tuple[Reader, Callable[[], None]]:
    def read(key: str) -> tuple[np.ndarray, np.ndarray]:
        with np.load(path / f"{key}.npz") as z:
            return z["features"], z["boxes"]

    return read, lambda: None


BASELINES = {
    "npz": (lambda p, s, d: write_npz(p, s, d), reader_npz, ""),
    "npz-compressed": (lambda p, s, d: write_npz(p, s, d, compressed=True), reader_npz, ""),
    "h5-groups": (write_groups, reader_groups, ".h5"),
}
SIZES = {"tiny": {"images": 40, "dim": 64, "reads": 20}, "default": {"images": 1000, "dim": 2048, "reads": 400}}


def differing_reads(ours: list[tuple[np.ndarray, np.ndarray]], theirs: list[tuple[np.ndarray, np.ndarray]]) -> float:
    """How many reads differ (features dtype, shape or values, or boxes); 0 when exact."""
    if len(ours) != len(theirs):
        return float("inf")
    return float(
        sum(
            not (fa.dtype == fb.dtype and np.array_equal(fa, fb) and np.array_equal(ba, bb))
            for (fa, ba), (fb, bb) in zip(ours, theirs)
        )
    )


def cases(size: str = "default", root: Path | None = None) -> tuple[list[Case], Callable[[], None]]:
    """One row per baseline layout, and a cleanup function (closes files, removes the folder unless ``root``
    was given). Files go to ``root`` or a fresh temporary folder."""
    cfg = SIZES[size]
    dtype = "float16"
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-")) if root is None else Path(root)
    workdir.mkdir(parents=True, exist_ok=True)
    src = Source(cfg["images"], cfg["dim"])
    keys = [
        str(i)
        for i in np.random.default_rng(1).choice(cfg["images"], size=min(cfg["reads"], cfg["images"]), replace=False)
    ]
    closers: list[Callable[[], None]] = []
    store_path = workdir / "store"
    shutil.rmtree(store_path, ignore_errors=True)
    write_store(store_path, src, dtype, fsync=False)
    read_store, close = reader_store(store_path)
    closers.append(close)
    out = []
    for name, (write, reader, suffix) in BASELINES.items():
        path = workdir / f"{name}{suffix}"
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        write(path, src, dtype)
        read, close = reader(path)
        closers.append(close)
        mib = disk_bytes(path) / 2**20
        out.append(
            Case(
                "store reads",
                "pipeline.store",
                name,
                f"{len(keys)} random images (D={cfg['dim']}, {dtype})",
                lambda r=read_store: [r(k) for k in keys],
                lambda r=read: [r(k) for k in keys],
                differing_reads,
                0.0,
                note=(
                    f"{name}: {mib:.0f} MiB on disk vs store {disk_bytes(store_path) / 2**20:.0f} MiB; warm page cache"
                ),
            )
        )

    def cleanup() -> None:
        for c in closers:
            c()
        if root is None:
            shutil.rmtree(workdir, ignore_errors=True)

    return out, cleanup


if __name__ == "__main__":
    from bench.__main__ import main

    raise SystemExit(main(["--only", "store"]))
