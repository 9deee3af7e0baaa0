"""Feature-store benchmark: write and random-read throughput of our store vs the usual alternatives.

Layouts, all holding the same synthetic images (10-100 boxes, D=2048, ReLU-like features, float32 boxes):

* ``store``           our store (contiguous immutable segments, reads by pread at the dataset offset)
* ``store-nofsync``   the same written with ``fsync=False`` (kill-safe, not power-loss durable)
* ``store-chunked``   our store with rows chunked by 64 (reads through h5py)
* ``h5-groups``       one HDF5 group per image with ``features``/``boxes`` datasets (M2-style)
* ``npz-dir``         one uncompressed ``.npz`` per image (MILVLG / ruotianluo-style directory)

Reads fetch features + boxes of single images in random order; "warm" reads come from the page cache
(after a full pass), "cold" reads after ``posix_fadvise(DONTNEED)`` on every file (best effort: the
kernel may keep pages). Usage::

    python bench/store.py --images 20000 --reads 5000 --dtype float16 float32 --out /tmp/bench-store
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

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
            w.add(key, f, b, wd, ht)


def write_groups(path: Path, src: Source, dtype: str) -> None:
    with h5py.File(path, "w") as fh:
        for i in range(len(src)):
            key, f, b, wd, ht = src.image(i, np.dtype(dtype))
            g = fh.create_group(key)
            g["features"], g["boxes"] = f, b
            g.attrs["size"] = (wd, ht)


def write_npz(path: Path, src: Source, dtype: str) -> None:
    path.mkdir()
    for i in range(len(src)):
        key, f, b, wd, ht = src.image(i, np.dtype(dtype))
        np.savez(path / f"{key}.npz", features=f, boxes=b, size=np.array([wd, ht]))


# -- readers ----------------------------------------------------------------------------------------------
def reader_store(path: Path) -> tuple[Callable[[str], int], Callable[[], None]]:
    store = FeatureStore(path)

    def read(key: str) -> int:
        rec = store.get(key)
        return rec["features"].nbytes + rec["boxes"].nbytes

    return read, store.close


def reader_groups(path: Path) -> tuple[Callable[[str], int], Callable[[], None]]:
    fh = h5py.File(path, "r")

    def read(key: str) -> int:
        g = fh[key]
        f, b = g["features"][()], g["boxes"][()]
        return f.nbytes + b.nbytes

    return read, fh.close


def reader_npz(path: Path) -> tuple[Callable[[str], int], Callable[[], None]]:
    def read(key: str) -> int:
        with np.load(path / f"{key}.npz") as z:
            f, b = z["features"], z["boxes"]
        return f.nbytes + b.nbytes

    return read, lambda: None


LAYOUTS = {
    "store": (lambda p, s, d: write_store(p, s, d), reader_store, ""),
    "store-nofsync": (lambda p, s, d: write_store(p, s, d, fsync=False), reader_store, ""),
    "store-chunked": (lambda p, s, d: write_store(p, s, d, chunk_rows=64), reader_store, ""),
    "h5-groups": (write_groups, reader_groups, ".h5"),
    "npz-dir": (write_npz, reader_npz, ""),
}


def time_reads(read: Callable[[str], int], keys: list[str]) -> tuple[float, float]:
    t0 = time.perf_counter()
    nbytes = sum(read(k) for k in keys)
    dt = time.perf_counter() - t0
    return len(keys) / dt, nbytes / dt / 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--images", type=int, default=20000)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--reads", type=int, default=5000, help="random single-image reads per measurement")
    ap.add_argument("--dtype", nargs="+", default=["float16", "float32"])
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--out", type=Path, default=Path("/tmp/bench-store"))
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()

    src = Source(args.images, args.dim)
    rng = np.random.default_rng(1)
    keys = [str(i) for i in rng.choice(args.images, size=min(args.reads, args.images), replace=False)]
    rows = int(src.counts.sum())
    print(f"# {args.images} images, {rows} boxes (10-100 per image), D={args.dim}, {len(keys)} random reads, {os.cpu_count()} CPUs")
    print(f"{'dtype':8} {'layout':14} {'write img/s':>11} {'write MB/s':>10} {'size MiB':>9} "
          f"{'cold img/s':>10} {'cold MB/s':>9} {'warm img/s':>10} {'warm MB/s':>9}")
    args.out.mkdir(parents=True, exist_ok=True)
    for dtype in args.dtype:
        raw = rows * (args.dim * np.dtype(dtype).itemsize + 16)
        for name in args.layouts:
            write, reader, suffix = LAYOUTS[name]
            path = args.out / f"{name}-{dtype}{suffix}"
            if path.exists():
                shutil.rmtree(path) if path.is_dir() else path.unlink()
            t0 = time.perf_counter()
            write(path, src, dtype)
            os.sync()
            wt = time.perf_counter() - t0
            drop_cache(path)
            read, close = reader(path)
            cold = time_reads(read, keys)
            for k in keys:  # fill the page cache
                read(k)
            warm = time_reads(read, keys)
            close()
            print(f"{dtype:8} {name:14} {len(src) / wt:11.0f} {raw / wt / 2**20:10.0f} {disk_bytes(path) / 2**20:9.0f} "
                  f"{cold[0]:10.0f} {cold[1]:9.0f} {warm[0]:10.0f} {warm[1]:9.0f}", flush=True)
            if not args.keep:
                shutil.rmtree(path) if path.is_dir() else path.unlink()


if __name__ == "__main__":
    main()
