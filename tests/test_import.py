"""Importers: decode the real Caffe rows in shared/data/butd, round-trip TSV exactly, reject bad input."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import h5py
import numpy as np
import pytest

from pipeline.core.errors import PipelineError, UsageError
from pipeline.importers import export_tsv, import_features, read_sizes
from pipeline.importers.tsv import decode_butd, decode_obj36, iter_lines
from pipeline.store import FeatureStore

# shared/data/README.md, obj36 table: id -> (w, h, objects_id range, conf range, feature max, zero fraction)
OBJ36_ROWS = {
    "132417": (500, 333, (72, 601), (0.106, 0.853), 33.47, 0.385),
    "573195": (640, 428, (52, 1325), (0.069, 0.814), 33.79, 0.244),
    "578174": (640, 394, (50, 941), (0.184, 0.831), 26.25, 0.384),
    "494628": (640, 513, (42, 1227), (0.223, 0.782), 24.59, 0.341),
    "207647": (408, 391, (36, 1038), (0.198, 0.854), 35.29, 0.394),
    "84002": (640, 480, (33, 1525), (0.132, 0.914), 27.94, 0.321),
    "306661": (640, 427, (50, 1401), (0.118, 0.883), 34.39, 0.337),
    "387267": (640, 360, (72, 1471), (0.177, 0.950), 29.94, 0.394),
    "131486": (407, 640, (36, 956), (0.213, 0.905), 25.40, 0.365),
    "201446": (640, 438, (106, 1360), (0.122, 0.970), 29.72, 0.244),
}


def test_decode_real_butd_row(shared_data):
    ((where, fields),) = list(iter_lines(shared_data / "butd/caffe_trainval36_150367.tsv"))
    rec = decode_butd(fields, where)
    assert rec["key"] == "150367" and (rec["image_w"], rec["image_h"]) == (640, 480)
    f, b = rec["features"], rec["boxes"]
    assert f.shape == (36, 2048) and f.dtype == np.float32 and b.shape == (36, 4) and b.dtype == np.float32
    np.testing.assert_allclose(b[0], [0, 277.6827, 583.3728, 479.2], atol=1e-4)
    assert b[:, 2].max() == pytest.approx(639.2, abs=1e-4) and b[:, 3].max() == pytest.approx(479.2, abs=1e-4)
    assert np.isfinite(f).all() and f.min() == 0.0 and f.max() == pytest.approx(37.08, abs=0.01)
    assert f.mean() == pytest.approx(0.665, abs=0.001) and (f == 0).mean() == pytest.approx(0.388, abs=0.001)
    assert (
        (b[:, 0] >= 0)
        & (b[:, 0] < b[:, 2])
        & (b[:, 2] <= 640)
        & (b[:, 1] >= 0)
        & (b[:, 1] < b[:, 3])
        & (b[:, 3] <= 480)
    ).all()


def test_decode_real_obj36_rows(shared_data):
    objects = (shared_data / "butd/vg_objects_vocab.txt").read_text().split("\n")
    attrs = (shared_data / "butd/vg_attributes_vocab.txt").read_text().split("\n")
    rows = [decode_obj36(f, w) for w, f in iter_lines(shared_data / "butd/caffe_obj36_train2014.tsv")]
    assert [r["key"] for r in rows] == list(OBJ36_ROWS)
    for r in rows:
        w, h, (id_lo, id_hi), (c_lo, c_hi), fmax, zeros = OBJ36_ROWS[r["key"]]
        assert (r["image_w"], r["image_h"]) == (w, h)
        assert (
            r["features"].shape == (36, 2048)
            and r["class_ids"].dtype == np.int64
            and r["class_scores"].dtype == np.float32
        )
        assert (r["class_ids"].min(), r["class_ids"].max()) == (id_lo, id_hi)
        assert r["class_scores"].min() == pytest.approx(c_lo, abs=6e-4) and r["class_scores"].max() == pytest.approx(
            c_hi, abs=6e-4
        )
        assert 0 <= r["attr_ids"].min() and r["attr_ids"].max() < 400
        f, b = r["features"], r["boxes"]
        assert np.isfinite(f).all() and f.min() >= 0 and f.max() == pytest.approx(fmax, abs=0.006)
        assert (f == 0).mean() == pytest.approx(zeros, abs=0.0006)
        assert (
            (b[:, 0] >= 0)
            & (b[:, 0] < b[:, 2])
            & (b[:, 2] <= w)
            & (b[:, 1] >= 0)
            & (b[:, 1] < b[:, 3])
            & (b[:, 3] <= h)
        ).all()
    first = rows[0]
    assert [objects[i] for i in first["class_ids"][:7]] == ["sky", "tree", "tree", "tree", "field", "pole", "water"]
    assert [attrs[i] for i in first["attr_ids"][:2]] == ["blue", "white"]


@pytest.mark.parametrize(
    "fmt,name,keys",
    [("butd-tsv", "caffe_trainval36_150367.tsv", "raw"), ("obj36-tsv", "caffe_obj36_train2014.tsv", "raw")],
)
def test_tsv_round_trip_is_byte_exact_via_cli(cli, shared_data, tmp_path, fmt, name, keys):
    src = shared_data / "butd" / name
    proc = cli(
        "import-features",
        "--format",
        fmt,
        str(src),
        "--store",
        str(tmp_path / "s"),
        "--dtype",
        "float32",
        "--keys",
        keys,
    )
    assert proc.returncode == 0, proc.stderr
    rows = 1 if fmt == "butd-tsv" else 10
    assert f"imported: {rows}" in proc.stdout and "bad rows: 0" in proc.stdout
    proc = cli("export-features", str(tmp_path / "s"), "--format", fmt, "--output", str(tmp_path / "out.tsv"))
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out.tsv").read_bytes() == src.read_bytes()


def test_float16_import_and_resume(shared_data, tmp_path):
    src = shared_data / "butd/caffe_obj36_train2014.tsv"
    first = import_features("obj36-tsv", [src], tmp_path / "s", limit=4, commit_every=2, feature_dtype="float16")
    assert first.imported == 4
    again = import_features("obj36-tsv", [src], tmp_path / "s", commit_every=3)  # resumes in the store's dtype
    assert (again.already_present, again.imported) == (4, 6)
    store = FeatureStore(tmp_path / "s")
    assert len(store) == 10 and store.feature_dtype == "float16" and "132417" in store
    rows = {r["key"]: r for r in (decode_obj36(f, w) for w, f in iter_lines(src))}
    rec = store.get("387267")
    np.testing.assert_allclose(rec["features"].astype(np.float32), rows["387267"]["features"], rtol=1e-3, atol=1e-3)
    np.testing.assert_array_equal(rec["class_ids"], rows["387267"]["class_ids"])
    assert store.identity["name"] == "imported:obj36-tsv" and store.identity["config"] == {"format": "obj36-tsv"}
    assert store.identity["release"]["recipe"] == "caffe"  # LXMERT's obj36 files: the Caffe model and script


def _corrupt(line: bytes, fn) -> bytes:
    fields = line.rstrip(b"\r\n").split(b"\t")
    fn(fields)
    return b"\t".join(fields) + b"\r\n"


def _set_features(fields, mutate):
    k = int(fields[3])
    f = np.frombuffer(base64.b64decode(fields[5]), np.float32).reshape(k, -1).copy()
    mutate(f)
    fields[5] = base64.b64encode(f.tobytes())


def _set_boxes(fields, mutate):
    b = np.frombuffer(base64.b64decode(fields[4]), np.float32).reshape(-1, 4).copy()
    mutate(b)
    fields[4] = base64.b64encode(b.tobytes())


BAD_ROWS = {
    "truncated": (lambda line: line[: len(line) // 2] + b"\r\n", "column features is not valid base64"),
    "columns": (
        lambda line: b"\t".join(line.split(b"\t")[:4]) + b"\r\n",
        "expected 6 tab-separated columns (BUTD TSV), found 4",
    ),
    "b64-length": (
        lambda line: _corrupt(line, lambda f: f.__setitem__(4, f[4][:-8])),
        "decodes to 570 bytes, expected 576",
    ),
    "nan": (lambda line: _corrupt(line, lambda f: _set_features(f, lambda a: a.__setitem__((3, 5), np.nan))), "NaN"),
    "outside": (
        lambda line: _corrupt(line, lambda f: _set_boxes(f, lambda b: b.__setitem__((2, 2), 700.0))),
        "outside the 640x480 image",
    ),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_rows_fail_with_file_and_row(cli, shared_data, tmp_path, case):
    good = (shared_data / "butd/caffe_trainval36_150367.tsv").read_bytes()
    make, message = BAD_ROWS[case]
    bad_line = make(good)
    other = good.replace(b"150367\t", b"150368\t", 1)
    src = tmp_path / "bad.tsv"
    src.write_bytes(other + bad_line)
    proc = cli("import-features", "--format", "butd-tsv", str(src), "--store", str(tmp_path / "s"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    err = " ".join(proc.stderr.split())
    assert "bad.tsv:2" in err and message in err
    assert len(proc.stderr.strip().splitlines()) <= 3  # one line (rich may wrap long paths)
    assert FeatureStore(tmp_path / "s").keys() == ["150368"]  # the good row before it was committed
    report = import_features("butd-tsv", [src], tmp_path / "t", skip_bad=True)
    assert (report.seen, report.imported, len(report.bad)) == (2, 1, 1) and "bad.tsv:2" in report.bad[0][0]
    assert FeatureStore(tmp_path / "t").keys() == ["150368"]


def test_duplicate_ids_and_skip_report_via_cli(cli, shared_data, tmp_path):
    good = (shared_data / "butd/caffe_trainval36_150367.tsv").read_bytes()
    src = tmp_path / "dup.tsv"
    src.write_bytes(good + good)
    proc = cli("import-features", "--format", "butd-tsv", str(src), "--store", str(tmp_path / "s"))
    assert proc.returncode == 2 and "dup.tsv:2: duplicate image id 150367" in " ".join(proc.stderr.split())
    proc = cli("import-features", "--format", "butd-tsv", str(src), "--store", str(tmp_path / "t"), "--skip-bad")
    assert proc.returncode == 0
    assert "imported: 1" in proc.stdout and "bad rows: 1" in proc.stdout and "duplicate image id 150367" in proc.stdout


def _coco_sizes(path: Path, sizes: dict[str, tuple[int, int]]) -> Path:
    path.write_text(json.dumps({"images": [{"id": int(k), "width": w, "height": h} for k, (w, h) in sizes.items()]}))
    return path


def test_cocobu_directories(tmp_path):
    rng = np.random.default_rng(0)
    att, box = tmp_path / "cocobu_att", tmp_path / "cocobu_box"
    att.mkdir()
    box.mkdir()
    want = {}
    for i, key in enumerate(["9", "25", "30"]):
        k = 10 + i * 7
        feats = np.maximum(rng.normal(size=(k, 2048)), 0).astype(np.float32)
        x1, y1 = rng.uniform(0, 100, k), rng.uniform(0, 100, k)
        boxes = np.stack([x1, y1, x1 + rng.uniform(1, 100, k), y1 + rng.uniform(1, 100, k)], 1).astype(np.float32)
        np.savez_compressed(att / f"{key}.npz", **{("z" if key == "30" else "feat"): feats})
        np.save(box / f"{key}.npy", boxes)
        want[key] = (feats, boxes)
    sizes = _coco_sizes(tmp_path / "captions.json", {"9": (320, 240), "25": (300, 300), "30": (640, 480)})
    with pytest.raises(UsageError, match="--sizes"):
        import_features("cocobu", [att], tmp_path / "s")
    report = import_features("cocobu", [att], tmp_path / "s", sizes=read_sizes(sizes), feature_dtype="float32")
    assert report.imported == 3
    store = FeatureStore(tmp_path / "s")
    for key, (feats, boxes) in want.items():
        rec = store.get(key)
        np.testing.assert_array_equal(rec["features"], feats)
        np.testing.assert_array_equal(rec["boxes"], boxes)
    assert store.image_size("25") == (300, 300)
    (att / "31.npz").write_bytes(b"PK\x03\x04 broken zip")
    _coco_sizes(sizes, {"9": (320, 240), "25": (300, 300), "30": (640, 480), "31": (10, 10)})
    with pytest.raises(PipelineError, match="31.npz: not a readable npz"):
        import_features("cocobu", [att], tmp_path / "s", sizes=read_sizes(sizes), feature_dtype="float32")


def test_m2_hdf5(cli, tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "coco_detections.hdf5"
    want = {}
    with h5py.File(src, "w") as fh:
        for key, k in (("42", 12), ("7", 20)):
            feats = rng.uniform(0, 5, (k, 2048)).astype(np.float32)
            boxes = np.tile(np.array([[1, 2, 50, 60]], np.float32), (k, 1))
            prob = rng.dirichlet(np.ones(1601), size=k).astype(np.float32)
            fh[f"{key}_features"], fh[f"{key}_boxes"], fh[f"{key}_cls_prob"] = feats, boxes, prob
            want[key] = (feats, prob)
    sizes = read_sizes(_coco_sizes(tmp_path / "inst.json", {"42": (100, 100), "7": (64, 80)}))
    import_features("m2-hdf5", [src], tmp_path / "s", sizes=sizes, feature_dtype="float32")
    store = FeatureStore(tmp_path / "s")
    assert store.keys() == ["7", "42"]
    rec = store.get("42")
    np.testing.assert_array_equal(rec["features"], want["42"][0])
    np.testing.assert_array_equal(rec["class_ids"], want["42"][1][:, 1:].argmax(1))
    np.testing.assert_allclose(rec["class_scores"], want["42"][1][:, 1:].max(1))
    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as fh:
        fh["data"] = np.zeros(3)
    proc = cli(
        "import-features",
        "--format",
        "m2-hdf5",
        str(foreign),
        "--store",
        str(tmp_path / "t"),
        "--sizes",
        str(tmp_path / "inst.json"),
    )
    assert proc.returncode == 2 and "foreign.h5 is an HDF5 file but not M2 detections" in " ".join(proc.stderr.split())


def test_export_float16_store_and_identity_mismatch(cli, shared_data, tmp_path):
    src = shared_data / "butd/caffe_trainval36_150367.tsv"
    import_features("butd-tsv", [src], tmp_path / "s", feature_dtype="float16")
    assert export_tsv(tmp_path / "s", tmp_path / "o.tsv") == 1
    ((where, fields),) = list(iter_lines(tmp_path / "o.tsv"))
    rec = decode_butd(fields, where)
    assert rec["features"].dtype == np.float32 and rec["key"] == "150367"
    ident = tmp_path / "ident.json"
    ident.write_text(json.dumps({"name": "butd-caffe", "weights_sha256": "ab" * 32}))
    proc = cli(
        "import-features", "--format", "butd-tsv", str(src), "--store", str(tmp_path / "s"), "--identity", str(ident)
    )
    assert (
        proc.returncode == 2 and "different extractor" in proc.stderr and "butd-caffe" in " ".join(proc.stderr.split())
    )


def test_adaptive_box_counts_round_trip(tmp_path):
    """Adaptive 10-100 box rows (BUTD ``trainval``) written by our encoder import with their own counts."""
    from pipeline.importers.tsv import write_tsv

    rng = np.random.default_rng(3)
    recs = []
    for key, k in (("1", 10), ("2", 100), ("3", 57)):
        x1 = rng.uniform(0, 300, k)
        recs.append(
            {
                "key": key,
                "image_w": 640,
                "image_h": 480,
                "features": rng.uniform(0, 9, (k, 2048)).astype(np.float32),
                "boxes": np.stack([x1, x1 / 2, x1 + 5, x1 / 2 + 9], 1).astype(np.float32),
            }
        )
    src = tmp_path / "karpathy_val_resnet101_faster_rcnn_genome.tsv"
    with src.open("wb") as fh:
        assert write_tsv(fh, iter(recs), "butd") == 3
    import_features("butd-tsv", [src], tmp_path / "s", feature_dtype="float32")
    store = FeatureStore(tmp_path / "s")
    assert [store.num_boxes(k) for k in ("1", "2", "3")] == [10, 100, 57]
    for rec in recs:
        np.testing.assert_array_equal(store.get(rec["key"])["features"], rec["features"])
    export_tsv(tmp_path / "s", tmp_path / "back.tsv")
    assert (tmp_path / "back.tsv").read_bytes() == src.read_bytes()
