"""Feature store: round trip, resume, identity/version checks, bad inputs, merge/compact, info CLI."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import h5py
import numpy as np
import pytest
from store_helpers import IDENTITY, add_image, synthetic_image

from pipeline.core.errors import PipelineError, UsageError
from pipeline.store import FeatureStore, compact_store, is_store, merge_stores, open_writer
from pipeline.store.merge import check_exactly_once


def write_store(path: Path, indices, commit_every: int = 7, dtype: str = "float16", **kw) -> None:
    with open_writer(path, IDENTITY, dtype, commit_every=commit_every, **kw) as w:
        for i in indices:
            add_image(w, synthetic_image(i))


def assert_image_equal(rec: dict, want: dict, dtype=np.float16) -> None:
    assert rec["image_w"] == want["image_w"] and rec["image_h"] == want["image_h"]
    assert rec["features"].dtype == dtype
    np.testing.assert_array_equal(rec["features"], want["features"].astype(dtype))
    np.testing.assert_array_equal(rec["boxes"], want["boxes"])
    np.testing.assert_array_equal(rec["class_ids"], want["class_ids"].astype(np.int32))
    np.testing.assert_array_equal(rec["attr_scores"], want["attr_scores"])


@pytest.mark.parametrize(
    "dtype,chunk_rows,compression", [("float16", 0, None), ("float32", 0, None), ("float16", 64, "lzf")]
)
def test_round_trip(tmp_path, dtype, chunk_rows, compression):
    write_store(tmp_path / "s", range(30), dtype=dtype, chunk_rows=chunk_rows, compression=compression)
    store = FeatureStore(tmp_path / "s")
    assert len(store) == 30 and store.keys()[0] == "img00000" and "img00029" in store and "nope" not in store
    assert store.identity == IDENTITY and store.feature_dtype == dtype and store.feature_dim == 64
    assert store.fields == ["attr_ids", "attr_scores", "class_ids", "class_scores"]
    assert len(list((tmp_path / "s").glob("seg-*.h5"))) == 5  # 30 images, commit every 7 -> 4 full + 1 by close
    for i in (0, 6, 7, 29):
        assert_image_equal(store.get(f"img{i:05d}"), synthetic_image(i), np.dtype(dtype))
    with pytest.raises(KeyError, match="not in feature store"):
        store.get("missing")


def test_read_touches_only_the_image_rows(tmp_path):
    """A contiguous segment is read with one pread per field at the image's own byte range."""
    write_store(tmp_path / "s", range(10), commit_every=0)
    store = FeatureStore(tmp_path / "s")
    st = store._st()
    seg = st.segments[0]
    src = seg.sources["features"]
    assert src.byte_offset is not None
    i = 4
    want = synthetic_image(i)["features"].astype(np.float16)
    raw = (tmp_path / "s" / seg.path.name).read_bytes()
    start = src.byte_offset + int(seg.offsets[i]) * src.row_bytes
    np.testing.assert_array_equal(np.frombuffer(raw[start : start + want.nbytes], np.float16).reshape(want.shape), want)


def test_resume_skips_committed_and_drops_uncommitted(tmp_path):
    path = tmp_path / "s"
    w = open_writer(path, IDENTITY, commit_every=0)
    for i in range(5):
        add_image(w, synthetic_image(i))
    w.commit()
    for i in range(5, 8):
        add_image(w, synthetic_image(i))
    w.close()  # 5..7 never committed
    assert len(FeatureStore(path)) == 5
    with open_writer(path, IDENTITY) as w:
        assert w.has("img00004") and not w.has("img00005") and w.num_committed == 5
        for i in range(10):
            rec = synthetic_image(i)
            if not w.has(rec["key"]):
                add_image(w, rec)
    store = FeatureStore(path)
    assert store.keys() == [f"img{i:05d}" for i in range(10)]
    assert_image_equal(store.get("img00006"), synthetic_image(6))


def test_identity_and_dtype_mismatch_are_refused(tmp_path):
    write_store(tmp_path / "s", range(2))
    other = dict(IDENTITY, weights_sha256="f" * 64)
    with pytest.raises(UsageError, match="different extractor .*weights_sha256.*stored .*0000.*given .*ffff"):
        open_writer(tmp_path / "s", other)
    with pytest.raises(UsageError, match="holds float16 features"):
        open_writer(tmp_path / "s", IDENTITY, "float32")
    with pytest.raises(UsageError, match="different extractor"):
        FeatureStore(tmp_path / "s", expect_identity=other)
    assert FeatureStore(tmp_path / "s", expect_identity=IDENTITY).identity == IDENTITY


def test_second_writer_is_locked_out(tmp_path):
    with open_writer(tmp_path / "s", IDENTITY):
        with pytest.raises(UsageError, match="being written by another process"):
            open_writer(tmp_path / "s", IDENTITY)
    open_writer(tmp_path / "s", IDENTITY).close()  # released on close


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda r: r["features"].__setitem__((0, 3), np.nan), "NaN"),
        (lambda r: r["boxes"].__setitem__((1, 2), r["image_w"] + 50), "outside the"),
        (lambda r: r["boxes"].__setitem__((1, 0), -20), "outside the"),
        (lambda r: r.__setitem__("boxes", r["boxes"][:-1]), "boxes must be"),
        (lambda r: r.__setitem__("features", r["features"][:, :10]), "feature dimension 10"),
        (lambda r: r.__setitem__("class_ids", None), "optional fields"),
        (lambda r: r.__setitem__("features", r["features"] * 1e6), "float16 range"),
    ],
)
def test_bad_images_are_rejected_naming_the_key(tmp_path, mutate, message):
    with open_writer(tmp_path / "s", IDENTITY) as w:
        add_image(w, synthetic_image(0))
        rec = synthetic_image(1)
        mutate(rec)
        with pytest.raises(PipelineError, match=message) as err:
            add_image(w, rec)
        assert "img00001" in str(err.value) and "\n" not in str(err.value)
        with pytest.raises(PipelineError, match="duplicate image id"):
            add_image(w, synthetic_image(0))
    assert len(FeatureStore(tmp_path / "s")) == 1


def test_corrupt_and_foreign_files(tmp_path):
    write_store(tmp_path / "s", range(8), commit_every=4)
    seg = sorted((tmp_path / "s").glob("seg-*.h5"))[1]
    data = seg.read_bytes()
    seg.write_bytes(data[: len(data) // 3])  # truncated segment
    with pytest.raises(PipelineError, match=seg.name):
        FeatureStore(tmp_path / "s")
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as fh:
        fh["features"] = np.zeros((3, 4))
    with pytest.raises(PipelineError, match="foreign.h5 is not a butd-caption feature segment"):
        FeatureStore(foreign)
    junk = tmp_path / "junk.h5"
    junk.write_bytes(b"not hdf5 at all" * 10)
    with pytest.raises(PipelineError, match="junk.h5 is not a readable HDF5 file"):
        FeatureStore(junk)
    assert not is_store(junk) and not is_store(foreign) and is_store(tmp_path / "s")


def test_unknown_schema_version(tmp_path):
    write_store(tmp_path / "s", range(2))
    record = tmp_path / "s" / "store.json"
    data = json.loads(record.read_text())
    data["schema_version"] = 99
    record.write_text(json.dumps(data))
    with pytest.raises(PipelineError, match="schema version 99; this butd-caption reads version 1"):
        FeatureStore(tmp_path / "s")
    write_store(tmp_path / "t", range(2))
    seg = next((tmp_path / "t").glob("seg-*.h5"))
    with h5py.File(seg, "r+") as fh:
        fh.attrs["schema_version"] = 7
    with pytest.raises(PipelineError, match="schema version 7"):
        FeatureStore(seg)


def test_pickle_reopens_lazily(tmp_path):
    write_store(tmp_path / "s", range(5))
    store = FeatureStore(tmp_path / "s")
    store.get("img00001")
    clone = pickle.loads(pickle.dumps(store))
    assert clone._state is None  # nothing open until used
    assert_image_equal(clone.get("img00003"), synthetic_image(3))


def test_merge_shards_exactly_once(tmp_path):
    write_store(tmp_path / "a", range(0, 10))
    write_store(tmp_path / "b", range(10, 25))
    n = merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m", expected_keys=[f"img{i:05d}" for i in range(25)])
    merged = FeatureStore(tmp_path / "m")
    assert n == 25 and len(merged) == 25 and len(list((tmp_path / "m").glob("seg-*.h5"))) == 1
    for i in (0, 9, 10, 24):
        assert_image_equal(merged.get(f"img{i:05d}"), synthetic_image(i))
    merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "one.h5")
    single = FeatureStore(tmp_path / "one.h5")
    assert len(single) == 25 and single.identity == IDENTITY
    assert_image_equal(single.get("img00017"), synthetic_image(17))
    write_store(tmp_path / "c", range(8, 12))  # overlaps a and b
    with pytest.raises(PipelineError, match="4 image ids appear in more than one shard"):
        merge_stores([tmp_path / "a", tmp_path / "b", tmp_path / "c"], tmp_path / "m2")
    with pytest.raises(PipelineError, match="1 missing .*img00099"):
        check_exactly_once([FeatureStore(tmp_path / "a")], [f"img{i:05d}" for i in range(10)] + ["img00099"])
    with open_writer(tmp_path / "d", dict(IDENTITY, name="other")) as w:
        add_image(w, synthetic_image(50))
    with pytest.raises(UsageError, match="identities differ"):
        merge_stores([tmp_path / "a", tmp_path / "d"], tmp_path / "m3")
    assert not (tmp_path / "m2").exists() and not (tmp_path / "m3").exists()


def test_compact_in_place(tmp_path):
    write_store(tmp_path / "s", range(20), commit_every=3)
    assert len(list((tmp_path / "s").glob("seg-*.h5"))) == 7
    compact_store(tmp_path / "s")
    assert len(list((tmp_path / "s").glob("seg-*.h5"))) == 1
    store = FeatureStore(tmp_path / "s")
    assert store.keys() == [f"img{i:05d}" for i in range(20)]
    assert_image_equal(store.get("img00013"), synthetic_image(13))
    with open_writer(tmp_path / "s", IDENTITY) as w:  # still appendable
        add_image(w, synthetic_image(20))
    assert len(FeatureStore(tmp_path / "s")) == 21


def test_preload_matches_reads(tmp_path):
    write_store(tmp_path / "s", range(12), commit_every=5)
    store = FeatureStore(tmp_path / "s")
    direct = {k: store.get(k) for k in store.keys()}
    store.preload()
    for k, rec in direct.items():
        np.testing.assert_array_equal(store.get(k)["features"], rec["features"])
        np.testing.assert_array_equal(store.get(k)["attr_ids"], rec["attr_ids"])


def test_info_cli(cli, tmp_path):
    write_store(tmp_path / "s", range(6))
    store = FeatureStore(tmp_path / "s")
    counts = [len(synthetic_image(i)["boxes"]) for i in range(6)]
    info = store.info()
    assert info["images"] == 6 and info["boxes"] == sum(counts)
    assert info["boxes_per_image"] == {"min": min(counts), "mean": pytest.approx(np.mean(counts)), "max": max(counts)}
    proc = cli("info", str(tmp_path / "s"))
    assert proc.returncode == 0, proc.stderr
    assert "images: 6" in proc.stdout and f"boxes: {sum(counts)}" in proc.stdout
    assert "float16" in proc.stdout and "test-extractor" in proc.stdout and "size on disk" in proc.stdout
    bad = tmp_path / "bad.h5"
    bad.write_bytes(b"garbage")
    proc = cli("info", str(bad))
    assert proc.returncode == 2 and "bad.h5" in proc.stderr and "Traceback" not in proc.stderr


def test_info_cli_wrong_version_is_one_line_exit_2(cli, tmp_path):
    write_store(tmp_path / "s", range(2))
    record = tmp_path / "s" / "store.json"
    data = json.loads(record.read_text())
    data["schema_version"] = 2
    record.write_text(json.dumps(data))
    proc = cli("info", str(tmp_path / "s"))
    err = " ".join(proc.stderr.split())
    assert (
        proc.returncode == 2 and "schema version 2; this butd-caption reads version 1" in err and "Traceback" not in err
    )


def test_merge_cli(cli, tmp_path):
    write_store(tmp_path / "shard-0", range(0, 6))
    write_store(tmp_path / "shard-1", range(6, 9))
    ids = tmp_path / "ids.txt"
    ids.write_text("\n".join(f"img{i:05d}" for i in range(9)))
    proc = cli(
        "merge-features",
        str(tmp_path / "shard-0"),
        str(tmp_path / "shard-1"),
        "--store",
        str(tmp_path / "all"),
        "--expect",
        str(ids),
    )
    assert proc.returncode == 0 and "images: 9" in proc.stdout, proc.stderr
    assert FeatureStore(tmp_path / "all").keys() == [f"img{i:05d}" for i in range(9)]
    ids.write_text("\n".join(f"img{i:05d}" for i in range(10)))
    proc = cli(
        "merge-features",
        str(tmp_path / "shard-0"),
        str(tmp_path / "shard-1"),
        "--store",
        str(tmp_path / "all2"),
        "--expect",
        str(ids),
    )
    assert proc.returncode == 2 and "1 missing (e.g. ['img00009'])" in " ".join(proc.stderr.split())


def test_reader_is_a_snapshot_while_a_writer_appends(tmp_path):
    with open_writer(tmp_path / "s", IDENTITY) as w:
        for i in range(3):
            add_image(w, synthetic_image(i))
        w.commit()
        reader = FeatureStore(tmp_path / "s")  # opened while the writer holds the lock
        for i in range(3, 5):
            add_image(w, synthetic_image(i))
        assert len(reader) == 3  # pending images are invisible
        w.commit()
        assert len(reader) == 3 and len(reader.refresh()) == 5
        assert_image_equal(reader.get("img00004"), synthetic_image(4))
