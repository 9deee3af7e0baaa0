"""VinVL / Oscar feature TSVs (2054-d rows with the 6-d position; scene_graph_benchmark prediction rows) and
RSTNet / DLCT grid HDF5 (``%d_grids``): import, export, round trip, and bad rows named."""

from __future__ import annotations

import base64
import json

import h5py
import numpy as np
from typer.testing import CliRunner

from cli import app
from pipeline.core.regions import RegionRecord
from pipeline.store import FeatureStore, open_writer

SIZES = {"images": [{"id": 7, "width": 640, "height": 480}, {"id": 12, "width": 500, "height": 333}]}


def _b64(a):
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def _released_row(key, feats, boxes, w, h):
    """The released row, written here from MMF ``_norm_box`` (features ‖ x1/W, y1/H, x2/W, y2/H, w/W, h/H)."""
    pos = np.stack(
        [
            boxes[:, 0] / w,
            boxes[:, 1] / h,
            boxes[:, 2] / w,
            boxes[:, 3] / h,
            (boxes[:, 2] - boxes[:, 0]) / w,
            (boxes[:, 3] - boxes[:, 1]) / h,
        ],
        1,
    )
    return f"{key}\t{len(feats)}\t{_b64(np.concatenate([feats, pos], 1))}\n"


def _rand(k, seed):
    rng = np.random.default_rng(seed)
    feats = rng.random((k, 2048), dtype=np.float32)
    xy = rng.random((k, 2)) * 200
    boxes = np.concatenate([xy, xy + 20 + rng.random((k, 2)) * 100], 1).astype(np.float32)
    return feats, boxes


def test_vinvl_tsv_import_export_round_trip(tmp_path):
    (tmp_path / "sizes.json").write_text(json.dumps(SIZES))
    f7, b7 = _rand(12, 0)
    f12, b12 = _rand(30, 1)
    pred = {
        "objects": [
            {"rect": b12[i].tolist(), "bbox_id": i, "class": "dog", "conf": 0.5, "feature": _b64(f12[i])}
            for i in range(30)
        ],
        "relations": None,
    }
    (tmp_path / "feat.tsv").write_text(_released_row(7, f7, b7, 640, 480))
    (tmp_path / "pred.tsv").write_text(f"12\t{json.dumps(pred)}\n")
    for name in ("feat", "pred"):
        res = CliRunner().invoke(
            app,
            [
                "import-features",
                "--format",
                "vinvl-tsv",
                str(tmp_path / f"{name}.tsv"),
                "--store",
                str(tmp_path / name),
                "--sizes",
                str(tmp_path / "sizes.json"),
                "--dtype",
                "float32",
            ],
        )
        assert res.exit_code == 0, res.output
    st = FeatureStore(tmp_path / "feat")
    a, b = st.get("7"), FeatureStore(tmp_path / "pred").get("12")
    assert a["features"].shape == (12, 2054) and b["features"].shape == (30, 2048)
    np.testing.assert_allclose(a["boxes"], b7, rtol=0, atol=1e-3)  # boxes back from the position x size
    np.testing.assert_array_equal(a["features"][:, :2048], f7)
    np.testing.assert_array_equal(b["boxes"], b12)
    assert st.identity["release"]["recipe"] == "vinvl"
    for name in ("feat", "pred"):
        res = CliRunner().invoke(
            app,
            [
                "export-features",
                str(tmp_path / name),
                "--format",
                "vinvl-tsv",
                "--output",
                str(tmp_path / f"{name}.out"),
            ],
        )
        assert res.exit_code == 0, res.output
    rows = dict(
        line.split("\t", 1) for n in ("feat", "pred") for line in (tmp_path / f"{n}.out").read_text().splitlines()
    )
    assert rows["7"] == _released_row(7, f7, b7, 640, 480).split("\t", 1)[1].rstrip(
        "\n"
    )  # 2054-d rows written as they are
    k, blob = rows["12"].split("\t")
    got = np.frombuffer(base64.b64decode(blob), "<f4").reshape(int(k), 2054)
    np.testing.assert_allclose(
        got,
        np.frombuffer(base64.b64decode(_released_row(12, f12, b12, 500, 333).split("\t")[2]), "<f4").reshape(30, 2054),
        rtol=1e-6,
    )  # position appended to 2048-d features
    (tmp_path / "bad.tsv").write_text(f"7\t3\t{_b64(np.zeros(2048 * 3))}\n")
    res = CliRunner().invoke(
        app,
        [
            "import-features",
            "--format",
            "vinvl-tsv",
            str(tmp_path / "bad.tsv"),
            "--store",
            str(tmp_path / "b"),
            "--sizes",
            str(tmp_path / "sizes.json"),
        ],
    )
    assert res.exit_code != 0 and "bad.tsv:1" in res.output and "carry no box position" in res.output


def test_grid_hdf5_import(tmp_path):
    (tmp_path / "sizes.json").write_text(json.dumps(SIZES))
    grids = np.random.default_rng(2).random((49, 2048), dtype=np.float32)
    with h5py.File(tmp_path / "X101_grid_feats_coco_trainval.hdf5", "w") as fh:
        fh["7_grids"] = grids
        fh["12_grids"] = grids[:48]
    res = CliRunner().invoke(
        app,
        [
            "import-features",
            "--format",
            "grid-hdf5",
            str(tmp_path / "X101_grid_feats_coco_trainval.hdf5"),
            "--store",
            str(tmp_path / "s"),
            "--sizes",
            str(tmp_path / "sizes.json"),
            "--dtype",
            "float32",
            "--skip-bad",
        ],
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(tmp_path / "s")
    assert len(st) == 1 and "not a square grid" in res.output
    g = st.get("7")
    np.testing.assert_array_equal(g["features"], grids)
    assert np.allclose(g["boxes"][0], [0, 0, 640 / 7, 480 / 7]) and np.allclose(
        g["boxes"][48], [6 * 640 / 7, 6 * 480 / 7, 640, 480]
    )


def test_export_appends_the_position_to_extracted_features(tmp_path):
    feats, boxes = _rand(10, 3)
    with open_writer(tmp_path / "s", {"name": "t"}, feature_dtype="float32") as w:
        w.add("5", RegionRecord(feats, boxes, 640, 480))
        w.commit()
    res = CliRunner().invoke(
        app, ["export-features", str(tmp_path / "s"), "--format", "vinvl-tsv", "--output", str(tmp_path / "o.tsv")]
    )
    assert res.exit_code == 0, res.output
    assert (tmp_path / "o.tsv").read_text() == _released_row(5, feats, boxes, 640, 480)
