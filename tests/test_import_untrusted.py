"""import-features on malformed values: every one is a bad row named by its line or key, the store's shape comes
from the first good row, the rows before a bad one are kept, and the store verifies and equals a clean import."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import h5py
import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from pipeline.core.errors import PipelineError
from pipeline.importers import import_features
from pipeline.store import FeatureStore
from pipeline.store.verify import verify_store

IDS = range(1, 21)


def write_sizes(path: Path, overrides: dict[int, tuple[int, int]] | None = None) -> Path:
    sizes = {i: (640, 480) for i in IDS} | (overrides or {})
    path.write_text(json.dumps({"images": [{"id": i, "width": w, "height": h} for i, (w, h) in sizes.items()]}))
    return path


def run(*args: str):
    res = CliRunner().invoke(app, list(args))
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    return res


def import_cli(fmt: str, src: Path, store: Path, sizes: Path | None, *extra: str):
    args = ["import-features", "--format", fmt, str(src), "--store", str(store), "--dtype", "float32", *extra]
    return run(*args, *(["--sizes", str(sizes)] if sizes else []))


def bad_lines(output: str) -> list[str]:
    return [line.strip() for line in output.splitlines() if line.strip().startswith("bad:")]


def error_line(res) -> str:
    lines = [line for line in res.output.splitlines() if line.startswith("error:")]
    assert res.exit_code == 2 and len(lines) == 1, res.output[-2000:]
    return lines[0]


def assert_same_store(got: Path, want: Path) -> None:
    """The two stores hold the same images with the same arrays, image sizes and feature dimension."""
    a, b = FeatureStore(got), FeatureStore(want)
    assert a.keys() == b.keys() and a.feature_dim == b.feature_dim
    for key in a.keys():
        ra, rb = a.get(key), b.get(key)
        assert sorted(ra) == sorted(rb)
        for name, value in ra.items():
            np.testing.assert_array_equal(value, rb[name], err_msg=f"{key}:{name}")
    rep = verify_store(got)
    assert rep.ok and rep.images == len(a.keys()), rep
    assert run("info", "--verify", str(got)).exit_code == 0


# -- vinvl-tsv ---------------------------------------------------------------------------------------------


def b64(a) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype="<f4").tobytes()).decode()


def released_row(key: int, k: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    xy = rng.random((k, 2)) * 200
    boxes = np.concatenate([xy, xy + 20], 1)
    pos = np.stack(
        [
            boxes[:, 0] / 640,
            boxes[:, 1] / 480,
            boxes[:, 2] / 640,
            boxes[:, 3] / 480,
            np.full(k, 20 / 640),
            np.full(k, 20 / 480),
        ],
        1,
    )
    return f"{key}\t{k}\t{b64(np.concatenate([rng.random((k, 2048)), pos], 1))}\n"


def prediction_row(key: int, objects: list | str) -> str:
    body = objects if isinstance(objects, str) else json.dumps({"objects": objects})
    return f"{key}\t{body}\n"


VINVL_BAD = {
    "zero-width": prediction_row(1, [{"rect": [1, 2, 30, 40], "conf": 0.5, "feature": ""}] * 3),
    "deep": prediction_row(2, '{"objects": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    "400-digit": prediction_row(3, '{"objects": [{"rect": [' + "9" * 400 + ', 2, 30, 40], "feature": "AAAAAA=="}]}'),
}


def test_vinvl_bad_values_are_bad_rows_and_the_first_good_row_sets_the_shape(tmp_path):
    sizes = write_sizes(tmp_path / "sizes.json")
    good = [released_row(7, 5, 0), released_row(12, 9, 1)]
    src = tmp_path / "bad.tsv"
    src.write_text(VINVL_BAD["zero-width"] + good[0] + VINVL_BAD["deep"] + VINVL_BAD["400-digit"] + good[1])
    res = import_cli("vinvl-tsv", src, tmp_path / "s", sizes, "--skip-bad")
    assert res.exit_code == 0, res.output
    bad = bad_lines(res.output)
    assert len(bad) == 3 and "imported: 2" in res.output, res.output
    for line, lineno in zip(bad, (1, 3, 4)):
        assert re.search(rf"bad\.tsv:{lineno}\b", line), line
    assert "nested deeper than" in bad[1] and "digits" in bad[2]
    assert FeatureStore(tmp_path / "s").feature_dim == 2054
    clean = tmp_path / "clean.tsv"
    clean.write_text("".join(good))
    assert import_cli("vinvl-tsv", clean, tmp_path / "c", sizes).exit_code == 0
    assert_same_store(tmp_path / "s", tmp_path / "c")
    again = import_cli("vinvl-tsv", clean, tmp_path / "s", sizes)  # resuming with the clean rows adds nothing
    assert again.exit_code == 0 and "already in store: 2" in again.output
    assert_same_store(tmp_path / "s", tmp_path / "c")


@pytest.mark.parametrize("case", list(VINVL_BAD))
def test_vinvl_bad_value_stops_the_import_keeping_the_rows_before(tmp_path, case):
    sizes = write_sizes(tmp_path / "sizes.json")
    src = tmp_path / "one.tsv"
    src.write_text(released_row(7, 5, 0) + VINVL_BAD[case])
    res = import_cli("vinvl-tsv", src, tmp_path / "s", sizes)
    assert "one.tsv:2" in error_line(res)
    assert FeatureStore(tmp_path / "s").keys() == ["7"] and verify_store(tmp_path / "s").ok


def test_json_brackets_inside_strings_do_not_count_as_depth(tmp_path):
    sizes = write_sizes(tmp_path / "sizes.json")
    feats = np.random.default_rng(4).random((2, 2048), dtype=np.float32)
    objects = [{"rect": [1, 2, 30, 40.5], "class": "[" * 5000 + "{", "conf": 0.25, "feature": b64(f)} for f in feats]
    (tmp_path / "pred.tsv").write_text(prediction_row(9, objects))
    res = import_cli("vinvl-tsv", tmp_path / "pred.tsv", tmp_path / "s", sizes)
    assert res.exit_code == 0 and "imported: 1" in res.output, res.output
    np.testing.assert_array_equal(FeatureStore(tmp_path / "s").get("9")["features"], feats)


# -- grid-hdf5 ---------------------------------------------------------------------------------------------


def write_grids(path: Path, good: dict[str, np.ndarray], bad: bool) -> None:
    with h5py.File(path, "w") as fh:
        for key, arr in good.items():
            fh[f"{key}_grids"] = arr
        if not bad:
            return
        fh["1_grids"] = np.zeros((49, 0), np.float32)  # zero width, and the first key in file order
        fh["2_grids"] = np.array([b"not a number"] * 49)
        fh["3_grids"] = np.zeros((49, 4), dtype=[("a", "<f4"), ("b", "<i4")])
        fh.create_group("4_grids")
        fh["5_grids"] = h5py.SoftLink("/7_grids")
        fh["6_grids"] = h5py.ExternalLink(str(path.with_name("other.h5")), "/data")
        fh["8_grids"] = np.zeros(49, np.float32)
        fh["9_grids"] = np.zeros((0, 2048), np.float32)
        fh.create_dataset("11_grids", (49, 8), dtype=h5py.vlen_dtype(np.float32))
        fh.create_dataset("12_grids", (1 << 15, 1 << 14), dtype="f4", chunks=(64, 64))  # 2 GiB, never written


def test_grid_hdf5_bad_datasets_are_bad_rows_named_by_key(tmp_path):
    sizes = write_sizes(tmp_path / "sizes.json")
    with h5py.File(tmp_path / "other.h5", "w") as fh:
        fh["data"] = np.ones((49, 2048), np.float32)
    rng = np.random.default_rng(5)
    good = {"7": rng.random((49, 2048), dtype=np.float32), "10": rng.random((49, 2048), dtype=np.float32)}
    write_grids(tmp_path / "grids.hdf5", good, bad=True)
    res = import_cli("grid-hdf5", tmp_path / "grids.hdf5", tmp_path / "s", sizes, "--skip-bad")
    assert res.exit_code == 0, res.output
    bad = bad_lines(res.output)
    named = sorted(int(re.search(r"grids\.hdf5:(\d+)_grids", line).group(1)) for line in bad)
    assert named == [1, 2, 3, 4, 5, 6, 8, 9, 11, 12], res.output
    text = "\n".join(bad)
    for what in ("soft link", "external link", "a group", "not a numeric", "more than"):
        assert what in text, text
    write_grids(tmp_path / "clean.hdf5", good, bad=False)
    assert import_cli("grid-hdf5", tmp_path / "clean.hdf5", tmp_path / "c", sizes).exit_code == 0
    assert_same_store(tmp_path / "s", tmp_path / "c")
    assert FeatureStore(tmp_path / "s").feature_dim == 2048
    res = import_cli("grid-hdf5", tmp_path / "grids.hdf5", tmp_path / "t", sizes)  # without --skip-bad: key 1 stops it
    assert "grids.hdf5:1_grids" in error_line(res)


# -- m2-hdf5 -----------------------------------------------------------------------------------------------


def test_m2_hdf5_bad_datasets_are_bad_rows_named_by_key(tmp_path):
    sizes = write_sizes(tmp_path / "sizes.json")
    rng = np.random.default_rng(6)
    boxes = np.tile(np.array([[1, 2, 50, 60]], np.float32), (6, 1))
    good = {k: rng.random((6, 2048), dtype=np.float32) for k in ("5", "7")}

    def write(path: Path, bad: bool) -> None:
        with h5py.File(path, "w") as fh:
            for key, feats in good.items():
                fh[f"{key}_features"], fh[f"{key}_boxes"] = feats, boxes
            if not bad:
                return
            fh["1_features"], fh["1_boxes"] = np.zeros((6, 0), np.float32), boxes
            fh["2_features"], fh["2_boxes"] = np.array([b"x"] * 6), boxes
            fh["3_features"], fh["3_boxes"] = good["5"], h5py.SoftLink("/5_boxes")
            fh["4_features"], fh["4_boxes"] = good["5"], boxes
            fh["4_cls_prob"] = np.zeros((6, 3), dtype=[("p", "<f4")])
            fh["6_features"] = good["5"]
            fh.create_group("6_boxes")

    write(tmp_path / "bad.hdf5", True)
    res = import_cli("m2-hdf5", tmp_path / "bad.hdf5", tmp_path / "s", sizes, "--skip-bad")
    assert res.exit_code == 0, res.output
    named = sorted(int(re.search(r"bad\.hdf5:(\d+)\b", line).group(1)) for line in bad_lines(res.output))
    assert named == [1, 2, 3, 4, 6], res.output
    write(tmp_path / "clean.hdf5", False)
    assert import_cli("m2-hdf5", tmp_path / "clean.hdf5", tmp_path / "c", sizes).exit_code == 0
    assert_same_store(tmp_path / "s", tmp_path / "c")


# -- cocobu ------------------------------------------------------------------------------------------------


def test_cocobu_bad_arrays_are_bad_rows_named_by_file(tmp_path):
    sizes = write_sizes(tmp_path / "sizes.json")
    rng = np.random.default_rng(7)
    boxes = np.tile(np.array([[1, 2, 50, 60]], np.float32), (4, 1))
    good = {k: rng.random((4, 2048), dtype=np.float32) for k in ("4", "6")}

    def write(root: Path, bad: bool) -> Path:
        att, box = root / "cocobu_att", root / "cocobu_box"
        att.mkdir(parents=True)
        box.mkdir()
        feats = dict(good)
        if bad:
            feats |= {
                "1": np.zeros((4, 0), np.float32),
                "2": np.array([["a"] * 8] * 4),
                "3": np.zeros((4, 8), dtype=[("a", "<f4")]),
                "5": good["4"],
            }
        for key, arr in feats.items():
            np.savez(att / f"{key}.npz", feat=arr)
            np.save(box / f"{key}.npy", np.array([["x"] * 4] * 4) if key == "5" else boxes)
        return att

    res = import_cli("cocobu", write(tmp_path / "bad", True), tmp_path / "s", sizes, "--skip-bad")
    assert res.exit_code == 0, res.output
    named = sorted(int(re.search(r"cocobu_(?:att|box)/(\d)\.np[yz]", line).group(1)) for line in bad_lines(res.output))
    assert named == [1, 2, 3, 5], res.output
    assert import_cli("cocobu", write(tmp_path / "clean", False), tmp_path / "c", sizes).exit_code == 0
    assert_same_store(tmp_path / "s", tmp_path / "c")


def test_npy_header_is_checked_before_its_data_is_read(tmp_path):
    """A header claiming 16 TB (a file of a few hundred bytes) is a bad row, not an allocation."""
    import io
    import zipfile

    sizes = write_sizes(tmp_path / "sizes.json")
    att, box = tmp_path / "cocobu_att", tmp_path / "cocobu_box"
    att.mkdir()
    box.mkdir()
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12, 4)})
    with zipfile.ZipFile(att / "1.npz", "w") as zf:
        zf.writestr("feat.npy", header.getvalue())
    np.save(box / "1.npy", np.zeros((4, 4), np.float32))
    np.savez(att / "2.npz", feat=np.ones((3, 16), np.float32))
    (box / "2.npy").write_bytes(header.getvalue())
    res = import_cli("cocobu", att, tmp_path / "s", sizes, "--skip-bad")
    bad = bad_lines(res.output)
    assert res.exit_code == 0 and len(bad) == 2, res.output
    assert "1.npz" in bad[0] and "2.npy" in bad[1] and all("more than" in line for line in bad), bad


def test_an_over_long_tsv_row_is_a_bad_row_and_the_next_row_is_read(shared_data, tmp_path, monkeypatch):
    import pipeline.importers.tsv as tsv

    monkeypatch.setattr(tsv, "MAX_ROW_BYTES", 1 << 20)  # the real bound is 64 MiB; a 400 KB row fits either
    good = (shared_data / "butd/caffe_trainval36_150367.tsv").read_bytes()
    src = tmp_path / "long.tsv"
    src.write_bytes(good.replace(b"150367\t", b"150368\t", 1) + b"9\t" * (3 << 19) + b"\r\n" + good)
    report = import_features("butd-tsv", [src], tmp_path / "s", skip_bad=True)
    assert (report.seen, report.imported, len(report.bad)) == (3, 2, 1)
    assert report.bad[0][0].endswith("long.tsv:2") and "longer than 1048576 bytes" in report.bad[0][1]
    assert sorted(FeatureStore(tmp_path / "s").keys()) == ["150367", "150368"]


# -- butd-tsv and image sizes ------------------------------------------------------------------------------


def test_butd_image_size_out_of_range_is_a_bad_row(shared_data, tmp_path):
    good = (shared_data / "butd/caffe_trainval36_150367.tsv").read_bytes()
    first = good.replace(b"150367\t", b"150368\t", 1)
    huge = good.replace(b"150367\t640\t", b"150369\t3000000000\t", 1)
    digits = good.replace(b"150367\t640\t", b"150370\t" + b"9" * 400 + b"\t", 1)
    src = tmp_path / "sizes.tsv"
    src.write_bytes(first + huge + digits + good)
    res = import_cli("butd-tsv", src, tmp_path / "s", None)
    assert "sizes.tsv:2" in error_line(res)
    assert FeatureStore(tmp_path / "s").keys() == ["150368"] and verify_store(tmp_path / "s").ok
    res = import_cli("butd-tsv", src, tmp_path / "t", None, "--skip-bad")
    assert res.exit_code == 0
    bad = bad_lines(res.output)
    assert len(bad) == 2 and "sizes.tsv:2" in bad[0] and "sizes.tsv:3" in bad[1], res.output
    assert sorted(FeatureStore(tmp_path / "t").keys()) == ["150367", "150368"]


@pytest.mark.parametrize("width", ["3000000000", "1e400", "true", "9" * 5000, "0", "640.5"])
def test_sizes_file_values_are_checked_before_the_import(tmp_path, width):
    sizes = write_sizes(tmp_path / "sizes.json")
    sizes.write_text(sizes.read_text().replace('"id": 12, "width": 640', f'"id": 12, "width": {width}', 1))
    (tmp_path / "feat.tsv").write_text(released_row(7, 5, 0) + released_row(12, 4, 1))
    res = import_cli("vinvl-tsv", tmp_path / "feat.tsv", tmp_path / "s", sizes)
    line = error_line(res)
    assert "sizes.json" in line and ("images[11]" in line or "not valid JSON" in line), line
    assert not (tmp_path / "s").exists()  # refused before the store is created


def test_an_out_of_range_size_given_to_the_api_is_a_bad_row(tmp_path):
    (tmp_path / "feat.tsv").write_text(released_row(7, 5, 0) + released_row(12, 4, 1))
    sizes = {"7": (640, 480), "12": (3_000_000_000, 480)}
    with pytest.raises(PipelineError, match=r"feat\.tsv:2\b.*3000000000x480"):
        import_features("vinvl-tsv", [tmp_path / "feat.tsv"], tmp_path / "s", sizes=sizes)
    assert FeatureStore(tmp_path / "s").keys() == ["7"] and verify_store(tmp_path / "s").ok


def test_a_row_past_the_float16_range_does_not_shape_the_store(tmp_path):
    """The first row is refused by the store itself (1e6 exceeds float16): the next row's width is the store's."""
    from pipeline.importers.tsv import write_tsv

    boxes = np.array([[1, 2, 30, 40]] * 3, np.float32)
    rows = [
        {"key": "1", "image_w": 64, "image_h": 48, "features": np.full((3, 8), 1e6, np.float32), "boxes": boxes},
        {"key": "2", "image_w": 64, "image_h": 48, "features": np.ones((3, 16), np.float32), "boxes": boxes},
    ]
    with (tmp_path / "wide.tsv").open("wb") as fh:
        write_tsv(fh, iter(rows), "butd")
    report = import_features(
        "butd-tsv", [tmp_path / "wide.tsv"], tmp_path / "s", feature_dtype="float16", skip_bad=True
    )
    assert (report.imported, len(report.bad)) == (1, 1) and "float16 range" in report.bad[0][1]
    store = FeatureStore(tmp_path / "s")
    assert store.keys() == ["2"] and store.feature_dim == 16 and verify_store(tmp_path / "s").ok
    np.testing.assert_array_equal(store.get("2")["features"], np.ones((3, 16), np.float16))
