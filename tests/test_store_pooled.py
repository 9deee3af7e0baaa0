"""The store's optional per-image ``pooled`` vector: round trip, checksums, merge/compact, stores without the
field, mixed writers."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import h5py
import numpy as np
import pytest
from store_helpers import IDENTITY, synthetic_image
from typer.testing import CliRunner

from cli import app
from pipeline.captioning.engine import FeatureCache
from pipeline.core.errors import PipelineError
from pipeline.core.identity import FeatureIdentity
from pipeline.core.regions import RegionRecord
from pipeline.store import FeatureStore, compact_store, merge_stores, open_writer
from pipeline.store.format import MANIFEST

P = 24


def pooled_of(i: int) -> np.ndarray:
    return np.random.default_rng(500 + i).normal(0, 1, P).astype(np.float32)


def _record(i: int, pooled: bool = True) -> RegionRecord:
    rec = RegionRecord.from_mapping(synthetic_image(i))
    rec.pooled = pooled_of(i) if pooled else None
    return rec


def _write(path: Path, images: range, pooled: bool = True, **kwargs) -> None:
    with open_writer(path, IDENTITY, "float32", **kwargs) as w:
        for i in images:
            w.add(f"k{i}", _record(i, pooled))


def _check(store: FeatureStore, images: range) -> None:
    assert store.pooled_dim == P
    for i in images:
        rec = store.get(f"k{i}")
        assert rec["pooled"].dtype == np.float32 and rec["pooled"].shape == (P,)
        np.testing.assert_array_equal(rec["pooled"], pooled_of(i))
        np.testing.assert_array_equal(rec["features"], synthetic_image(i)["features"])


def _flip_pooled(seg: Path, image: int, byte: int = 2) -> None:
    with h5py.File(seg, "r") as fh:
        offset = fh["pooled"].id.get_offset() + image * P * 4 + byte
    with open(seg, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0x40]))


@pytest.mark.parametrize("chunk_rows", [0, 7])
def test_pooled_round_trips_and_is_recorded(tmp_path, chunk_rows):
    store = tmp_path / "s"
    _write(store, range(5), commit_every=2, chunk_rows=chunk_rows)
    assert json.loads((store / MANIFEST).read_text())["pooled_dim"] == P
    with h5py.File(store / "seg-000000.h5", "r") as fh:
        assert fh.attrs["pooled_dim"] == P and fh["pooled"].shape == (2, P) and fh["pooled"].dtype == np.float32
    st = FeatureStore(store)
    _check(st, range(5))
    st.preload()
    _check(st, range(5))
    _check(FeatureStore(store / "seg-000001.h5"), range(2, 4))  # a segment is a single-file store
    _write(store, range(5, 7))  # resumed: the store's images keep carrying one
    _check(FeatureStore(store), range(7))
    out = CliRunner().invoke(app, ["info", str(store)]).output
    assert f"pooled vector: {P} values per image" in out


def test_a_damaged_pooled_byte_is_refused_naming_the_image(tmp_path):
    store = tmp_path / "s"
    _write(store, range(6), commit_every=3)
    _flip_pooled(store / "seg-000001.h5", 1)  # k4
    st = FeatureStore(store)
    with pytest.raises(PipelineError, match=r"seg-000001\.h5.*k4.*damaged"):
        st.get("k4")
    _check(st, range(4))
    with pytest.raises(PipelineError, match="k4"):
        FeatureStore(store).preload()
    with pytest.raises(PipelineError, match="k4"):
        merge_stores([store], tmp_path / "copy")
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 1, res.output
    assert "damaged image k4 in seg-000001.h5: checksum mismatch" in res.output and "1 damaged images" in res.output


def test_merge_and_compact_keep_the_pooled_vectors(tmp_path):
    _write(tmp_path / "a", range(0, 3), commit_every=2)
    _write(tmp_path / "b", range(3, 5))
    assert merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m") == 5
    assert json.loads((tmp_path / "m" / MANIFEST).read_text())["pooled_dim"] == P
    _check(FeatureStore(tmp_path / "m"), range(5))
    assert merge_stores([tmp_path / "a", tmp_path / "b"], tmp_path / "m.h5") == 5
    _check(FeatureStore(tmp_path / "m.h5"), range(5))
    assert compact_store(tmp_path / "a") == 3
    assert [p.name for p in (tmp_path / "a").glob("seg-*.h5")] == ["seg-000002.h5"]
    _check(FeatureStore(tmp_path / "a"), range(3))
    res = CliRunner().invoke(app, ["info", "--verify", str(tmp_path / "m")])
    assert res.exit_code == 0 and "ok: 5 of 5 images" in res.output
    _write(tmp_path / "plain", range(5, 7), pooled=False)
    with pytest.raises(PipelineError, match="pooled vectors differ"):
        merge_stores([tmp_path / "a", tmp_path / "plain"], tmp_path / "mixed")


def test_a_store_without_pooled_vectors_is_unchanged(tmp_path):
    """No ``pooled`` dataset, attribute or record field, and the row checksums of features, boxes and fields only."""
    store = tmp_path / "s"
    _write(store, range(3), pooled=False)
    assert "pooled_dim" not in json.loads((store / MANIFEST).read_text())
    with h5py.File(store / "seg-000000.h5", "r") as fh:
        assert "pooled" not in fh and "pooled_dim" not in fh.attrs
        crc = fh["row_crc32"][()]
        offsets = fh["offsets"][()]
        names = ["features", "boxes"] + json.loads(fh.attrs["fields"])
        for i in range(3):
            want = 0
            for name in names:
                want = zlib.crc32(np.ascontiguousarray(fh[name][offsets[i] : offsets[i + 1]]).tobytes(), want)
            assert int(crc[i]) == want
    st = FeatureStore(store)
    assert st.pooled_dim == 0 and "pooled" not in st.get("k1")
    assert "pooled" not in st.preload().get("k1")
    assert "pooled vector" not in CliRunner().invoke(app, ["info", str(store)]).output
    assert merge_stores([store], tmp_path / "m") == 3
    assert "pooled_dim" not in json.loads((tmp_path / "m" / MANIFEST).read_text())


@pytest.mark.parametrize("first", [True, False])
def test_writers_that_mix_with_and_without_pooled_are_refused(tmp_path, first):
    store = tmp_path / "s"
    with open_writer(store, IDENTITY, "float32") as w:
        w.add("k0", _record(0, pooled=first))
        with pytest.raises(PipelineError, match=rf"feature store {store}: image k1 has .*pooled"):
            w.add("k1", _record(1, pooled=not first))
        if first:
            rec = _record(2)
            rec.pooled = rec.pooled[:-1]
            with pytest.raises(PipelineError, match=f"{P - 1} values.*{P} values"):
                w.add("k2", rec)
    with open_writer(store, IDENTITY, "float32") as w:  # the next writer of the store too
        with pytest.raises(PipelineError, match=rf"feature store {store}: image k3 has .*pooled"):
            w.add("k3", _record(3, pooled=not first))
    assert FeatureStore(store).keys() == ["k0"]


@pytest.mark.parametrize(
    "vector, message",
    [
        (np.full(P, np.nan, np.float32), "NaN"),
        (np.zeros((2, P), np.float32), "vector"),
        (np.zeros(0, np.float32), "vector"),
        (np.zeros(70000, np.float32), "65536"),
    ],
)
def test_bad_pooled_vectors_are_refused_naming_the_image(tmp_path, vector, message):
    with open_writer(tmp_path / "s", IDENTITY, "float32") as w:
        rec = _record(0)
        rec.pooled = vector
        with pytest.raises(PipelineError, match=f"k0.*{message}"):
            w.add("k0", rec)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda fh: fh.attrs.__setitem__("pooled_dim", 70000), "pooled_dim"),
        (lambda fh: fh.attrs.__setitem__("pooled_dim", P + 1), "pooled"),
        (lambda fh: fh.attrs.__delitem__("pooled_dim"), "pooled"),
        (lambda fh: fh.__delitem__("pooled"), "pooled"),
    ],
)
def test_bad_pooled_records_in_a_segment_are_one_line_naming_the_file(tmp_path, damage, message):
    store = tmp_path / "s"
    _write(store, range(2))
    with h5py.File(store / "seg-000000.h5", "r+") as fh:
        damage(fh)
    with pytest.raises(PipelineError, match=rf"seg-000000\.h5.*{message}"):
        FeatureStore(store)


def test_store_record_and_segment_must_agree(tmp_path):
    store = tmp_path / "s"
    _write(store, range(2))
    record = json.loads((store / MANIFEST).read_text())
    (store / MANIFEST).write_text(json.dumps({**record, "pooled_dim": P + 1}))
    with pytest.raises(PipelineError, match=rf"seg-000000\.h5.*pooled_dim {P + 1}"):
        FeatureStore(store)
    (store / MANIFEST).write_text(json.dumps({**record, "pooled_dim": -3}))
    with pytest.raises(PipelineError, match=rf"{MANIFEST}.*pooled_dim"):
        FeatureStore(store)


def test_a_caption_cache_of_regions_only_takes_the_cells_of_a_record_with_a_pooled_vector(tmp_path):
    """`caption --cache` on a store without pooled vectors (one extracted before them) keeps working."""
    _write(tmp_path / "old", range(2), pooled=False)
    cache = FeatureCache(tmp_path / "old", FeatureIdentity.from_dict(IDENTITY))
    cache.add("k2", _record(2))
    cache.commit()
    rec = cache.get("k2")
    assert "pooled" not in rec
    np.testing.assert_array_equal(rec["features"], synthetic_image(2)["features"])
    cache.close()
    cache = FeatureCache(tmp_path / "new", FeatureIdentity.from_dict(IDENTITY))  # a new cache keeps the vector
    cache.add("k3", _record(3))
    cache.commit()
    np.testing.assert_array_equal(cache.get("k3")["pooled"], pooled_of(3))
    cache.close()
