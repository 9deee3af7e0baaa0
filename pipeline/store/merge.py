"""Merging shards written by parallel writers, and compacting a store into one segment or one file.

Both stream: images are copied in blocks, never the whole store at once. Both are crash-safe: merge builds
the destination in a temporary directory renamed into place at the end; in-place compaction publishes the
new segment through the same ``store.json`` commit as the writer, and only then deletes the old segments.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np

from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import fsync_dir, remove_entry
from pipeline.store.format import identity_text, new_manifest, read_manifest, segment_name, write_manifest
from pipeline.store.reader import FeatureStore, verify_block
from pipeline.store.segment import Block, write_segment
from pipeline.store.writer import open_writer

log = get_logger("store")


def iter_blocks(store: FeatureStore, block_images: int = 256) -> Iterator[Block]:
    """All images of ``store`` in order, as :class:`Block` s of at most ``block_images`` images."""
    st = store._st()
    fields = ["features", "boxes"] + store.fields
    for si, seg in enumerate(st.segments):
        for lo in range(0, seg.num_images, block_images):
            hi = min(lo + block_images, seg.num_images)
            r0, r1 = int(seg.offsets[lo]), int(seg.offsets[hi])
            rows = {f: store._read_rows(st, si, f, r0, r1 - r0) for f in fields}
            pooled = store._read_pooled(st, si, lo, hi - lo)
            verify_block(seg, lo, rows, pooled)  # never copy damaged rows into a new store
            yield Block(
                keys=seg.keys[lo:hi],
                counts=np.diff(seg.offsets[lo : hi + 1]),
                sizes=seg.sizes[lo:hi],
                rows=rows,
                pooled=pooled,
            )


def _check_compatible(stores: Sequence[FeatureStore]) -> None:
    ref = stores[0]
    for s in stores[1:]:
        if s.identity != ref.identity:
            raise UsageError(
                f"cannot merge {s.path} into {ref.path}: extractor identities differ "
                f"({identity_text(s.identity)} vs {identity_text(ref.identity)})"
            )
        if (
            len(s)
            and len(ref)
            and (s.feature_dtype, s.feature_dim, s.fields) != (ref.feature_dtype, ref.feature_dim, ref.fields)
        ):
            raise UsageError(
                f"cannot merge {s.path} into {ref.path}: dtype/dimension/fields differ "
                f"({s.feature_dtype}, {s.feature_dim}, {s.fields} vs {ref.feature_dtype}, {ref.feature_dim}, "
                f"{ref.fields})"
            )
        if len(s) and len(ref) and s.pooled_dim != ref.pooled_dim:
            raise UsageError(
                f"cannot merge {s.path} into {ref.path}: pooled vectors differ ({s.pooled_dim} vs {ref.pooled_dim} "
                "values per image; 0: none)"
            )


def check_exactly_once(stores: Sequence[FeatureStore], expected: Iterable[str] | None = None) -> int:
    """Every image id appears in exactly one shard (and, given ``expected``, exactly the expected ids)."""
    counts: Counter[str] = Counter()
    for s in stores:
        counts.update(s.keys())
    dups = [k for k, c in counts.items() if c > 1]
    if dups:
        raise PipelineError(f"{len(dups)} image ids appear in more than one shard, e.g. {sorted(dups)[:5]}")
    if expected is not None:
        want = set(expected)
        missing = sorted(want - set(counts))
        extra = sorted(set(counts) - want)
        if missing or extra:
            raise PipelineError(
                f"shards do not hold exactly the expected images: {len(missing)} missing (e.g. {missing[:5]}), "
                f"{len(extra)} unexpected (e.g. {extra[:5]})"
            )
    return len(counts)


def _write_one_segment(
    path: Path, stores: Sequence[FeatureStore], chunk_rows: int, compression: str | None
) -> tuple[int, int]:
    ref = next((s for s in stores if len(s)), stores[0])
    n = sum(len(s) for s in stores)
    rows = sum(int(np.sum(s.num_boxes())) for s in stores)

    def blocks() -> Iterator[Block]:
        for s in stores:
            yield from iter_blocks(s)

    write_segment(
        path,
        blocks(),
        num_images=n,
        num_rows=rows,
        identity=ref.identity,
        feature_dtype=ref.feature_dtype,
        feature_dim=int(ref.feature_dim or 0),
        fields=ref.fields,
        chunk_rows=chunk_rows,
        compression=compression,
        pooled_dim=ref.pooled_dim,
    )
    return n, rows


def merge_stores(
    sources: Sequence[str | Path],
    dst: str | Path,
    expected_keys: Iterable[str] | None = None,
    chunk_rows: int = 0,
    compression: str | None = None,
) -> int:
    """Merge shard stores into a new store ``dst`` (a directory, or a single ``.h5`` file if it ends so).

    Checks that the shards share the extractor identity, dtype and fields and that every image id appears
    exactly once (and, given ``expected_keys``, that exactly those ids are present). Returns the image count.
    """
    dst = Path(dst)
    if dst.exists():
        raise UsageError(f"merge destination {dst} already exists")
    if not sources:
        raise UsageError("merge needs at least one source store")
    stores = [FeatureStore(p) for p in sources]
    _check_compatible(stores)
    total = check_exactly_once(stores, expected_keys)
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.parent / f".{dst.name}.merge.tmp"
    remove_entry(tmp)  # a killed merge's leftover; a link there is removed, never followed
    try:
        if dst.suffix in (".h5", ".hdf5"):
            _write_one_segment(tmp, stores, chunk_rows, compression)
        else:
            tmp.mkdir()
            n, rows = _write_one_segment(tmp / segment_name(0), stores, chunk_rows, compression)
            ref = stores[0]
            manifest = new_manifest(ref.identity, ref.feature_dtype, ref.feature_dim)
            manifest.update(
                fields=ref.fields,
                commit=1,
                num_images=n,
                num_rows=rows,
                segments=[{"file": segment_name(0), "images": n, "rows": rows}],
            )
            pooled_dim = next((s for s in stores if len(s)), ref).pooled_dim
            if pooled_dim:
                manifest["pooled_dim"] = pooled_dim
            write_manifest(tmp, manifest)
        os.replace(tmp, dst)
        fsync_dir(dst.parent)
    except BaseException:
        remove_entry(tmp)
        raise
    finally:
        for s in stores:
            s.close()
    log.info("merged %d shards (%d images) into %s", len(stores), total, dst)
    return total


def compact_store(path: str | Path, chunk_rows: int = 0, compression: str | None = None) -> int:
    """Rewrite a store directory's segments as one segment, in place and crash-safely. Returns images."""
    path = Path(path)
    manifest = read_manifest(path)
    # holding the writer lock keeps other writers out while we swap segments
    writer = open_writer(path, manifest["identity"], manifest["feature_dtype"])
    try:
        if len(manifest["segments"]) <= 1 and not chunk_rows:
            return manifest["num_images"]
        store = FeatureStore(path)
        seg_no = 1 + max(int(s["file"][4:10]) for s in manifest["segments"])
        name = segment_name(seg_no)
        tmp = path / (name + ".tmp")
        n, rows = _write_one_segment(tmp, [store], chunk_rows, compression)
        store.close()
        os.replace(tmp, path / name)
        fsync_dir(path)
        new = dict(manifest, segments=[{"file": name, "images": n, "rows": rows}], commit=manifest["commit"] + 1)
        write_manifest(path, new)
        for seg in manifest["segments"]:
            (path / seg["file"]).unlink(missing_ok=True)
        return n
    finally:
        writer.close()


__all__ = ["check_exactly_once", "compact_store", "iter_blocks", "merge_stores"]
