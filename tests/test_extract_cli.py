"""`cli extract` end to end: robustness corpus, failures manifest, resume after SIGKILL, shards, COCO given
boxes, and the full R-101 on two real photos (random weights)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from detector_helpers import save_layout
from extract_helpers import TINY_SET, read_obj36
from PIL import Image
from typer.testing import CliRunner

from cli import app
from extractors.preprocess import ImageLoadError, load_rgb
from pipeline.store import FeatureStore, merge_stores

REPO = Path(__file__).resolve().parent.parent
SMALL = ["--set", TINY_SET, "--set", "extract.min_size=200", "--set", "extract.max_size=333", "--workers", "0"]


def _extract(*args: str):
    """``cli extract`` pinned to the CPU: resume and shard claims here are bitwise or float32-tight, which CUDA kernels
    (TF32, atomics) do not promise; the GPU path has its own tests under ``-m gpu``."""
    return CliRunner().invoke(app, ["extract", "--device", "cpu", *args])


def _png_header(w: int, h: int) -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00" * 16)) + chunk(b"IEND", b"")
    )


def _corpus(root: Path, photo: Path) -> dict[str, str | None]:
    """Write the corpus; name -> expected failure reason (None = must be extracted)."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    (root / "zero.jpg").write_bytes(b"")
    (root / "text.jpg").write_text("this is not an image\n")
    data = photo.read_bytes()
    (root / "truncated.jpg").write_bytes(data[: len(data) // 2])
    Image.fromarray(rng.integers(0, 255, (60, 80, 3), dtype=np.uint8)).convert("CMYK").save(root / "cmyk.jpg")
    Image.fromarray((rng.integers(0, 65535, (50, 70))).astype(np.uint16)).save(root / "gray16.png")
    rgba = np.zeros((40, 50, 4), np.uint8)
    rgba[:, :25] = [255, 0, 0, 255]
    Image.fromarray(rgba, "RGBA").save(root / "rgba.png")
    Image.fromarray(rng.integers(0, 255, (30, 40, 3), dtype=np.uint8)).convert("P").save(root / "palette.gif")
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 CW on display: stored 80x40 -> shown 40x80
    Image.fromarray(rng.integers(0, 255, (40, 80, 3), dtype=np.uint8)).save(root / "exif.jpg", exif=exif.tobytes())
    Image.fromarray(np.full((1, 1, 3), 200, np.uint8)).save(root / "one.png")
    (root / "bomb.png").write_bytes(_png_header(30000, 30000))
    shutil.copy(photo, root / "good.jpg")
    return {
        "zero.jpg": "empty",
        "text.jpg": "not_an_image",
        "truncated.jpg": "truncated",
        "bomb.png": "too_large",
        "cmyk.jpg": None,
        "gray16.png": None,
        "rgba.png": None,
        "palette.gif": None,
        "exif.jpg": None,
        "one.png": None,
        "good.jpg": None,
    }


def test_loader_normalises_modes(tmp_path, shared_data):
    _corpus(tmp_path / "c", shared_data / "photos" / "000456.jpg")
    rgba = load_rgb(tmp_path / "c" / "rgba.png")
    assert rgba.shape == (40, 50, 3) and rgba[0, 0].tolist() == [255, 0, 0] and rgba[0, -1].tolist() == [255, 255, 255]
    g16 = load_rgb(tmp_path / "c" / "gray16.png")
    assert g16.dtype == np.uint8 and 100 < g16.mean() < 155 and len(np.unique(g16)) > 200  # rescaled, not clipped
    assert load_rgb(tmp_path / "c" / "exif.jpg").shape == (80, 40, 3)
    assert load_rgb(tmp_path / "c" / "cmyk.jpg").shape == (60, 80, 3)
    with pytest.raises(ImageLoadError) as err:
        load_rgb(tmp_path / "c" / "bomb.png")
    assert err.value.reason == "too_large"
    with pytest.raises(ImageLoadError) as err:
        load_rgb(tmp_path / "c" / "good.jpg", max_pixels=1000)
    assert err.value.reason == "too_large"


def test_robustness_corpus_failures_manifest_and_strict(tmp_path, shared_data):
    expected = _corpus(tmp_path / "imgs", shared_data / "photos" / "000456.jpg")
    listing = tmp_path / "list.txt"
    listing.write_text(
        "\n".join([str(tmp_path / "imgs" / n) for n in expected] + [str(tmp_path / "imgs" / "missing.jpg")])
    )
    store = tmp_path / "store"
    res = _extract("--file-list", str(listing), "--weights", "random", "--store", str(store), *SMALL)
    assert res.exit_code == 0, res.output
    fails = {
        Path(r["path"]).name: r["reason"] for r in map(json.loads, (store / "failures.jsonl").read_text().splitlines())
    }
    want_fail = {n: r for n, r in expected.items() if r} | {"missing.jpg": "unreadable"}
    assert len(want_fail) == 5
    assert fails == want_fail
    st = FeatureStore(store)
    good = sorted(f"imgs/{n}" for n, r in expected.items() if r is None)  # keys: paths relative to the list's folder
    assert sorted(st.keys()) == good
    assert st.image_size("imgs/exif.jpg") == (40, 80)  # (w, h) after EXIF rotation
    assert st.image_size("imgs/one.png") == (1, 1) and st.get("imgs/one.png")["boxes"].shape == (
        1,
        4,
    )  # whole-image fallback
    for k in good:
        rec = st.get(k)
        assert (1 if k == "imgs/one.png" else 10) <= rec["features"].shape[0] <= 100 and rec["features"].shape[1] == 128
    assert "failed 5" in res.output and "extracted 7" in res.output
    # re-run: nothing extracted again, failures retried and listed again; --strict turns them into exit 1
    res = _extract("--file-list", str(listing), "--weights", "random", "--store", str(store), "--strict", *SMALL)
    assert res.exit_code == 1 and "skipped (already in store) 7" in res.output and "5 images failed" in res.output
    assert len(FeatureStore(store).keys()) == 7


def test_usage_errors_exit_2(tmp_path, shared_data):
    photos = str(shared_data / "photos")
    assert _extract(photos, "--store", str(tmp_path / "s")).exit_code == 2  # no --weights
    r = _extract(photos, "--weights", "random", "--store", str(tmp_path / "s"), "--boxes", "17")
    assert r.exit_code == 2 and "--boxes" in r.output
    r = _extract(photos, "--weights", "random", "--store", str(tmp_path / "s"), "--boxes", "given")
    assert r.exit_code == 2 and "--coco" in r.output
    r = _extract(photos, "--weights", str(tmp_path / "nope.pth"), "--store", str(tmp_path / "s"))
    assert r.exit_code == 2 and "not found" in r.output
    r = _extract(photos, "--weights", "random", "--store", str(tmp_path / "s"), "--shard", "3/2")
    assert r.exit_code == 2


def _subset(tmp_path: Path, shared_data: Path, n: int) -> Path:
    """``n`` photos, alternating numbered and COCO-named ones."""
    d = tmp_path / "photos"
    d.mkdir()
    numbered = sorted((shared_data / "photos").glob("0*.jpg"))
    coco = sorted((shared_data / "photos").glob("COCO_*.jpg"))
    mixed = [p for pair in zip(numbered, coco) for p in pair] + numbered[len(coco) :] + coco[len(numbered) :]
    for p in mixed[:n]:
        shutil.copy(p, d / p.name)
    return d


def test_killed_extraction_resumes_without_duplicates_or_losses(tmp_path, shared_data):
    photos = _subset(tmp_path, shared_data, 6)
    store = tmp_path / "killed"
    cmd = [
        sys.executable,
        str(REPO / "cli.py"),
        "extract",
        "--device",
        "cpu",
        str(photos),
        "--weights",
        "random",
        "--store",
        str(store),
        *SMALL,
        "--batch-size",
        "1",
        "--set",
        "extract.commit_every=1",
        "-q",
    ]
    env = dict(os.environ, BUTD_NO_PROGRESS="1")
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    committed = 0
    try:
        while time.time() < deadline and proc.poll() is None:
            try:
                committed = json.loads((store / "store.json").read_text())["num_images"]
            except (OSError, ValueError, KeyError):
                committed = 0
            if committed >= 2:
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.05)
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "the extraction finished before it could be killed"
    partial = len(FeatureStore(store).keys())
    assert 2 <= partial < 6
    # the resumed run and the clean one on the CPU as the killed one (a CUDA machine's auto would mix devices)
    res = _extract(str(photos), "--weights", "random", "--store", str(store), *SMALL, "--device", "cpu")
    assert res.exit_code == 0, res.output
    assert f"skipped (already in store) {partial}" in res.output
    clean = tmp_path / "clean"
    assert _extract(str(photos), "--weights", "random", "--store", str(clean), *SMALL, "--device", "cpu").exit_code == 0
    a, b = FeatureStore(store), FeatureStore(clean)
    assert sorted(a.keys()) == sorted(b.keys()) and len(a.keys()) == len(set(a.keys())) == 6
    for k in b.keys():
        np.testing.assert_allclose(
            a.get(k)["features"].astype(np.float32), b.get(k)["features"].astype(np.float32), rtol=2e-3, atol=2e-3
        )
        np.testing.assert_allclose(a.get(k)["boxes"], b.get(k)["boxes"], atol=1e-2)


def test_shards_cover_every_image_exactly_once_and_merge(tmp_path, shared_data):
    photos = _subset(tmp_path, shared_data, 5)
    store = tmp_path / "feats"
    for i in range(2):
        workers = ["--workers", "2"] if i == 0 else []  # decode in DataLoader worker processes for one shard
        res = _extract(str(photos), "--weights", "random", "--store", str(store), "--shard", f"{i}/2", *SMALL, *workers)
        assert res.exit_code == 0, res.output
    shards = sorted(
        p for p in (tmp_path / "feats.shards").iterdir() if p.is_dir()
    )  # beside them: each writer's .lock file
    assert [p.name for p in shards] == ["0-of-2", "1-of-2"]
    assert [len(FeatureStore(p).keys()) for p in shards] == [3, 2]
    res = _extract("--store", str(store), "--merge-shards")
    assert res.exit_code == 0 and "merged 2 shards (5 images)" in res.output, res.output
    assert len(FeatureStore(store).keys()) == 5
    assert merge_stores(shards, tmp_path / "again") == 5
    # COCO ids become keys for COCO file names
    assert sorted(FeatureStore(store).keys()) == ["000456.jpg", "000542.jpg", "001150.jpg", "131486", "84002"]


def test_coco_given_boxes(tmp_path, shared_data):
    ann = {
        "images": [
            {"id": 150367, "file_name": "COCO_train2014_000000150367.jpg", "width": 640, "height": 480},
            {"id": 456, "file_name": "000456.jpg", "width": 500, "height": 375},
        ],
        "annotations": [
            {"id": 1, "image_id": 150367, "bbox": [10, 20, 100, 50], "category_id": 1},
            {"id": 2, "image_id": 150367, "bbox": [300, 200, 340, 280], "category_id": 2},
        ],
    }
    f = tmp_path / "instances.json"
    f.write_text(json.dumps(ann))
    store = tmp_path / "given"
    res = _extract(
        "--coco",
        str(f),
        "--image-root",
        str(shared_data / "photos"),
        "--boxes",
        "given",
        "--weights",
        "random",
        "--store",
        str(store),
        *SMALL,
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(store)
    assert st.keys() == ["150367"]
    np.testing.assert_allclose(st.get("150367")["boxes"], [[10, 20, 110, 70], [300, 200, 640, 480]], atol=1e-3)
    fails = [json.loads(x) for x in (store / "failures.jsonl").read_text().splitlines()]
    assert [(x["key"], x["reason"]) for x in fails] == [("456", "no_boxes")]


@pytest.mark.slow
def test_full_r101_on_two_real_photos_writes_a_valid_store(tmp_path, shared_data):
    """The full-size ResNet-101 preset (random weights) on CPU; reduced scale and proposals keep it quick."""
    rows = {r["img_id"]: r for r in read_obj36(shared_data / "butd" / "caffe_obj36_train2014.tsv")}
    names = ["COCO_train2014_000000132417", "COCO_train2014_000000131486"]
    files = [str(shared_data / "photos" / f"{n}.jpg") for n in names]
    store = tmp_path / "r101"
    res = _extract(
        *files,
        "--weights",
        "random",
        "--store",
        str(store),
        "--preset",
        "bottom-up-caffe-r101",
        "--workers",
        "0",
        "--set",
        "extract.spec={post_nms_topk: 12}",
        "--set",
        "extract.min_size=200",
        "--set",
        "extract.max_size=333",
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(store)
    assert st.feature_dim == 2048 and st.identity["config"]["spec"]["stage_blocks"] == [3, 4, 23]
    for n in names:
        key = str(int(n.split("_")[-1]))
        rec = st.get(key)
        assert st.image_size(key) == (rows[n]["img_w"], rows[n]["img_h"])
        assert 10 <= rec["features"].shape[0] <= 12 and rec["features"].shape[1] == 2048
        assert np.isfinite(rec["features"].astype(np.float32)).all() and (rec["features"] >= 0).all()
        b = rec["boxes"]
        assert (b[:, 2] <= rows[n]["img_w"]).all() and (b[:, 3] <= rows[n]["img_h"]).all() and (b[:, :2] >= 0).all()


@pytest.mark.parametrize("layout,suffix", [("milvlg", ".pth"), ("hf", ".bin")])
def test_extract_with_a_weights_file_records_its_digest(tmp_path, shared_data, layout, suffix):
    from extract_helpers import tiny_spec

    from extractors.random_weights import random_detector
    from extractors.weights import sha256_file

    spec = tiny_spec(flavor="caffe" if layout == "milvlg" else "d2")
    weights = save_layout(random_detector(spec, 3).state_dict(), layout, tmp_path / f"w{suffix}")
    store = tmp_path / "s"
    photos = [
        str(shared_data / "photos" / "000456.jpg"),
        str(shared_data / "photos" / "COCO_train2014_000000207647.jpg"),
    ]
    res = _extract(
        *photos,
        "--weights",
        str(weights),
        "--store",
        str(store),
        "--boxes",
        "36",
        "--workers",
        "0",
        "--set",
        "extract.min_size=200",
        "--set",
        "extract.max_size=333",
    )
    assert res.exit_code == 0, res.output
    st = FeatureStore(store)
    assert st.identity["name"] == f"bottom-up-{layout}" and st.identity["weights_sha256"] == sha256_file(weights)
    assert st.identity["config"]["spec"]["flavor"] == spec.flavor and st.identity["config"]["spec"]["min_size"] == 200
    assert sorted(st.keys()) == ["000456.jpg", "207647"]
    n = [st.get(k)["features"].shape[0] for k in st.keys()]
    assert n == [36, 36] if layout == "milvlg" else all(10 <= x <= 36 for x in n)
    # the same store refuses other weights (identity check) with a one-line usage error
    other = save_layout(random_detector(spec, 4).state_dict(), layout, tmp_path / f"o{suffix}")
    res = _extract(
        *photos,
        "--weights",
        str(other),
        "--store",
        str(store),
        "--boxes",
        "36",
        "--workers",
        "0",
        "--set",
        "extract.min_size=200",
        "--set",
        "extract.max_size=333",
    )
    assert res.exit_code == 2 and "different extractor" in res.output


def test_keys_inputs_and_shard_parsing(tmp_path, monkeypatch):
    from extractors.inputs import image_key, items_from_paths, shard_items
    from pipeline.commands.extract import _parse_shard
    from pipeline.core.errors import UsageError

    assert image_key(Path("/x/COCO_val2014_000000000042.jpg"), None) == "42"
    assert image_key(Path("/x/000000391895.jpg"), None) == "391895"  # COCO 2017 naming
    assert image_key(Path("/r/a/b/000456.jpg"), Path("/r")) == "a/b/000456.jpg"
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    for rel in ("a/b/x.JPG", "a/y.png", ".hidden/z.jpg", "a/notes.txt", "top.webp"):
        (tmp_path / rel).write_bytes(b"?")
    items = items_from_paths([tmp_path])
    assert [i.key for i in items] == ["a/b/x.JPG", "a/y.png", "top.webp"]
    assert [i.key for i in items_from_paths([str(tmp_path / "a" / "*.png")])] == ["y.png"]
    parts = [shard_items(items, i, 2) for i in range(2)]
    assert sorted(i.key for p in parts for i in p) == sorted(i.key for i in items) and len(parts[0]) == 2
    assert _parse_shard("1/4") == (1, 4)
    with pytest.raises(UsageError):
        _parse_shard("4/4")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "2")
    assert _parse_shard(None) == (2, 3)  # torchrun: one shard per rank
