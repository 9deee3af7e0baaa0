"""`cli caption`: real photos through a detector and a trained captioner; bad files reported and skipped;
JSON lines / CSV output; pictures; clear messages when no model exists."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from caption_helpers import tiny_detector
from PIL import Image
from typer.testing import CliRunner

from cli import app


@pytest.fixture(scope="module")
def checkpoint(tiny_captioners: Path) -> Path:
    """A tiny SAN trained for eight XE epochs on 128-d oracle features (the tiny detector's feature size): it
    writes a non-empty caption for every photo."""
    return tiny_captioners / "train-b" / "best.pt"


@pytest.fixture(scope="module")
def detector(tmp_path_factory) -> Path:
    """A seeded random tiny bottom-up detector weights file (:func:`caption_helpers.tiny_detector`)."""
    return tiny_detector(tmp_path_factory.mktemp("detector") / "tiny.pth")


@pytest.fixture()
def mixed_folder(tmp_path: Path, shared_data: Path) -> Path:
    folder = tmp_path / "photos"
    folder.mkdir()
    for name in ("000456.jpg", "COCO_train2014_000000150367.jpg", "001763.jpg"):
        shutil.copy(shared_data / "photos" / name, folder / name)
    (folder / "broken.jpg").write_bytes((shared_data / "photos" / "000542.jpg").read_bytes()[:3000])  # truncated JPEG
    (folder / "notes.jpg").write_text("this is not an image")
    Image.fromarray(np.full((40, 60), 128, np.uint8)).save(folder / "gray.png")  # greyscale, tiny
    return folder


def run_caption(*args: str):
    return CliRunner().invoke(app, ["caption", *args, "--set", "caption.min_size=160", "--set", "caption.max_size=256"])


def test_captions_real_photos_and_reports_bad_files(
    checkpoint: Path, detector: Path, mixed_folder: Path, tmp_path: Path
) -> None:
    out = tmp_path / "captions.jsonl"
    res = run_caption(
        str(mixed_folder),
        "--model",
        str(checkpoint),
        "--weights",
        str(detector),
        "--output",
        str(out),
        "--n-best",
        "2",
        "--visualize",
        str(tmp_path / "pics"),
    )
    assert res.exit_code == 0, res.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 6
    good = {Path(r["image"]).name: r for r in rows if "caption" in r}
    bad = {Path(r["image"]).name: r for r in rows if "error" in r}
    assert set(good) == {"000456.jpg", "COCO_train2014_000000150367.jpg", "001763.jpg", "gray.png"}
    assert set(bad) == {"broken.jpg", "notes.jpg"}
    for r in good.values():
        assert isinstance(r["caption"], str) and len(r["nbest"]) == 2
        assert r["nbest"][0]["caption"] == r["caption"] and r["nbest"][0]["score"] >= r["nbest"][1]["score"]
    assert good["COCO_train2014_000000150367.jpg"]["key"] == "150367"  # COCO ids as keys, like `extract`
    pics = sorted(p.name for p in (tmp_path / "pics").glob("*.png"))
    assert len(pics) == 4
    with Image.open(tmp_path / "pics" / pics[0]) as im:
        assert im.width == 520 and im.height > 300
    assert "skipped" in res.stdout


def test_csv_output_and_cache_reuse(checkpoint: Path, detector: Path, shared_data: Path, tmp_path: Path) -> None:
    photos = [str(shared_data / "photos" / "000456.jpg"), str(shared_data / "photos" / "004545.jpg")]
    out = tmp_path / "c.csv"
    cache = tmp_path / "cache"
    first = run_caption(
        *photos, "--model", str(checkpoint), "--weights", str(detector), "--output", str(out), "--cache", str(cache)
    )
    assert first.exit_code == 0, first.output
    rows = list(csv.DictReader(out.open()))
    assert [Path(r["image"]).name for r in rows] == ["000456.jpg", "004545.jpg"] and all(r["caption"] for r in rows)
    from pipeline.store import FeatureStore

    assert sorted(FeatureStore(cache).keys()) == ["000456.jpg", "004545.jpg"]
    again = run_caption(
        *photos,
        "--model",
        str(checkpoint),
        "--weights",
        str(detector),
        "--output",
        str(tmp_path / "d.csv"),
        "--cache",
        str(cache),
    )
    assert again.exit_code == 0
    assert [r["caption"] for r in csv.DictReader((tmp_path / "d.csv").open())] == [r["caption"] for r in rows]


def test_clear_messages_without_a_model_or_with_bad_input(tmp_path: Path, shared_data: Path, checkpoint: Path) -> None:
    photo = str(shared_data / "photos" / "000456.jpg")
    res = run_caption(photo, "--model", str(tmp_path / "runs" / "demo"))
    assert res.exit_code == 2 and "python cli.py demo" in res.stderr and "Traceback" not in res.output
    empty = tmp_path / "empty"
    empty.mkdir()
    res = run_caption(photo, "--model", str(empty))
    assert res.exit_code == 2 and "no trained captioner" in res.stderr
    res = run_caption(photo, "--model", str(checkpoint))  # no detector next to a bare checkpoint
    assert res.exit_code == 2 and "--weights" in res.stderr
    res = run_caption(photo, "--model", str(checkpoint), "--weights", "random", "--output", str(tmp_path / "x.txt"))
    assert res.exit_code == 2 and ".jsonl" in res.stderr
    res = run_caption(str(tmp_path / "nothing_here"), "--model", str(checkpoint), "--weights", "random")
    assert res.exit_code == 2
