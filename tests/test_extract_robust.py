"""`cli extract` against odd inputs: thin images, a model that raises on one image, non-UTF-8 and markup
file names, missing / dangling / looping / non-file inputs, bad numeric options, a full disk."""

from __future__ import annotations

import errno
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from extract_helpers import TINY_SET, tiny_spec
from PIL import Image
from typer.testing import CliRunner

from cli import app
from pipeline.core.keys import key_from_name
from pipeline.store import FeatureStore

SMALL = ["--set", TINY_SET, "--set", "extract.min_size=200", "--set", "extract.max_size=333", "--workers", "0"]


def _extract(*args: str):
    return CliRunner().invoke(app, ["extract", *args])


def _failures(store: Path) -> dict[str, dict]:
    return {Path(r["path"]).name: r for r in map(json.loads, (store / "failures.jsonl").read_text().splitlines())}


def _photo(path: Path, w: int = 64, h: int = 48, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(path)
    return path


def test_thin_images_are_refused_and_the_batch_survives(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    _photo(d / "a_good.png")
    _photo(d / "b_wide.png", 2000, 2)
    _photo(d / "c_tall.png", 2, 2000)
    _photo(d / "d_good.png", seed=1)
    store = tmp_path / "s"
    res = _extract(str(d), "--weights", "random", "--store", str(store), "--batch-size", "4", *SMALL)
    assert res.exit_code == 0, res.output
    assert sorted(FeatureStore(store).keys()) == ["a_good.png", "d_good.png"]
    fails = _failures(store)
    assert {k: v["reason"] for k, v in fails.items()} == {"b_wide.png": "too_thin", "c_tall.png": "too_thin"}
    assert "2000x2 image resizes to 333x1" in fails["b_wide.png"]["detail"]
    assert "below the 16 px minimum" in fails["c_tall.png"]["detail"]


def test_an_image_on_which_the_model_raises_costs_only_itself(tmp_path, monkeypatch):
    """With the thin-image check off, the real detector raises on the 2000x2 image; the guard reruns the
    batch image by image, lists that image as detector_failed and keeps the others of its batch."""
    import extractors.photos as run

    monkeypatch.setattr(run, "thin_image_reason", lambda *a: None)
    d = tmp_path / "imgs"
    d.mkdir()
    _photo(d / "a.png", 333, 200)
    _photo(d / "b.png", 2000, 2)
    _photo(d / "c.png", 333, 200, seed=2)
    store = tmp_path / "s"
    res = _extract(str(d), "--weights", "random", "--store", str(store), "--batch-size", "3", *SMALL)
    assert res.exit_code == 0, res.output
    assert sorted(FeatureStore(store).keys()) == ["a.png", "c.png"]
    fail = _failures(store)["b.png"]
    assert fail["reason"] == "detector_failed" and "RuntimeError" in fail["detail"]


def test_guarded_detect_on_a_batch_with_a_malformed_blob():
    from extract_helpers import selector_for

    from extractors.factory import random_detector
    from extractors.inputs import ImageItem
    from extractors.photos import Photo, detect_guarded
    from extractors.preprocess import Frame

    model = random_detector(tiny_spec(), 0).eval().fold_batchnorm()
    frame = Frame(200, 266, 200, 266, 1.0)
    good = Photo(0, ImageItem("good", Path("good")), blob=torch.zeros(3, 200, 266), frame=frame, size=(200, 266))
    bad = Photo(1, ImageItem("bad", Path("bad")), blob=torch.zeros(4, 200, 266), frame=frame, size=(200, 266))
    failed = []
    with torch.no_grad():
        out = detect_guarded(
            model,
            [good, bad],
            selector_for(model.spec, boxes="adaptive"),
            "fp32",
            torch.device("cpu"),
            lambda photo, failure: failed.append((photo.item.key, failure.reason)),
        )
    assert [p.item.key for p, _ in out] == ["good"] and out[0][1].boxes.shape[0] >= 1
    assert failed == [("bad", "detector_failed")]


def test_file_list_with_undecodable_and_nul_names(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    _photo(Path(os.path.join(os.fsencode(d), b"caf\xe9.png").decode("utf-8", "surrogateescape")))
    listing = tmp_path / "list.txt"
    listing.write_bytes(b"imgs/caf\xe9.png\nimgs/nul\x00name.png\n")
    store = tmp_path / "s"
    res = _extract("--file-list", str(listing), "--weights", "random", "--store", str(store), *SMALL)
    assert res.exit_code == 0, res.output
    assert FeatureStore(store).keys() == [key_from_name(b"imgs/caf\xe9.png")]
    (fail,) = _failures(store).values()
    assert fail["key"] == "imgs/nul\\u0000name.png" and "NUL" in fail["detail"]


def test_odd_file_names_are_stored_and_resumed(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    (d / "[").mkdir()
    names = [b"caf\xe9.png", b"[bold]x.png", b"[/x].png", b"new\nline.png", b"back\\slash.png"]  # "[/x]": folder "["
    for i, n in enumerate(names):
        _photo(Path(os.path.join(os.fsencode(d), n).decode("utf-8", "surrogateescape")), seed=i)
    store = tmp_path / "s"
    res = _extract(str(d), "--weights", "random", "--store", str(store), "--batch-size", "2", *SMALL)
    assert res.exit_code == 0, res.output
    assert sorted(FeatureStore(store).keys()) == sorted(key_from_name(n) for n in names)
    assert not list(store.glob("*.tmp"))
    res = _extract(str(d), "--weights", "random", "--store", str(store), *SMALL)
    assert res.exit_code == 0 and f"skipped (already in store) {len(names)}" in res.output, res.output
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 0 and f"ok: {len(names)} of {len(names)}" in res.output


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_missing_dangling_looping_and_non_file_inputs_are_reported(tmp_path):
    d = tmp_path / "imgs"
    d.mkdir()
    _photo(d / "good.png")
    (d / "dangling.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (d / "loop1.jpg").symlink_to(d / "loop2.jpg")
    (d / "loop2.jpg").symlink_to(d / "loop1.jpg")
    (d / "folder.jpg").mkdir()
    os.mkfifo(d / "pipe.jpg")
    other = _photo(tmp_path / "other.png", seed=3)
    missing = tmp_path / "missing.jpg"
    store = tmp_path / "s"
    args = [
        str(d),
        str(other),
        str(missing),
        str(tmp_path / "none-*.png"),
        "--weights",
        "random",
        "--store",
        str(store),
        *SMALL,
    ]
    warnings = _Lines()
    logging.getLogger("butd").addHandler(warnings)
    try:
        res = _extract(*args)
    finally:
        logging.getLogger("butd").removeHandler(warnings)
    assert res.exit_code == 0, res.output
    assert sorted(FeatureStore(store).keys()) == ["good.png", "other.png"]
    fails = _failures(store)
    assert {k: v["reason"] for k, v in fails.items()} == {
        "dangling.jpg": "unreadable",
        "loop1.jpg": "unreadable",
        "loop2.jpg": "unreadable",
        "folder.jpg": "not_a_file",
        "pipe.jpg": "not_a_file",
        "missing.jpg": "unreadable",
        "none-*.png": "unreadable",
    }
    assert "dangling symbolic link" in fails["dangling.jpg"]["detail"] and "loop" in fails["loop1.jpg"]["detail"]
    assert "no such file" in fails["missing.jpg"]["detail"] and "matches" in fails["none-*.png"]["detail"]
    for name, rec in fails.items():  # a warning line names each path
        assert sum(line.startswith(f"skipped {rec['path']}: ") for line in warnings.lines) == 1, warnings.lines
    res = _extract(*args, "--strict")
    assert res.exit_code == 1 and "7 images failed" in res.output
    res = _extract(str(missing), str(d / "dangling.jpg"), "--weights", "random", "--store", str(tmp_path / "t"), *SMALL)
    assert res.exit_code == 2 and "missing.jpg" in res.output and "dangling.jpg" in res.output


@pytest.mark.parametrize(
    "opt",
    [
        ["--workers", "-1"],
        ["--batch-size", "0"],
        ["--limit", "-1"],
        ["--set", "extract.commit_every=-5"],
        ["--set", "extract.conf_thresh=1.5"],
        ["--set", "extract.max_pixels=0"],
    ],
)
def test_bad_numbers_are_one_line_exit_2(tmp_path, opt):
    _photo(tmp_path / "a.png")
    res = _extract(str(tmp_path / "a.png"), "--weights", "random", "--store", str(tmp_path / "s"), *SMALL, *opt)
    assert res.exit_code == 2, res.output
    assert "Traceback" not in res.output and "error:" in res.output
    assert not (tmp_path / "s").exists()


def test_disk_full_mid_run_is_one_line_and_keeps_committed_images(tmp_path, monkeypatch):
    import pipeline.store.segment as segment

    d = tmp_path / "imgs"
    d.mkdir()
    for i in range(4):
        _photo(d / f"{i}.png", seed=i)
    real = segment._write_segment_file
    calls = []

    def fills_up(*args, **kw):
        calls.append(1)
        if len(calls) >= 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(*args, **kw)

    monkeypatch.setattr(segment, "_write_segment_file", fills_up)
    store = tmp_path / "s"
    res = _extract(
        str(d),
        "--weights",
        "random",
        "--store",
        str(store),
        "--batch-size",
        "1",
        "--set",
        "extract.commit_every=1",
        *SMALL,
    )
    assert res.exit_code == 1, res.output
    assert "Traceback" not in res.output
    assert "cannot write feature segment" in res.output and "No space left on device" in res.output
    assert "disk full" in res.output
    assert sorted(FeatureStore(store).keys()) == ["0.png", "1.png"]
    monkeypatch.setattr(segment, "_write_segment_file", real)
    res = _extract(str(d), "--weights", "random", "--store", str(store), *SMALL)  # space freed: resumes
    assert res.exit_code == 0 and "skipped (already in store) 2" in res.output
    assert len(FeatureStore(store).keys()) == 4


def test_sigterm_commits_finished_images_and_the_rerun_resumes(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    d = tmp_path / "imgs"
    d.mkdir()
    for i in range(40):
        _photo(d / f"{i:02d}.png", 333, 200, seed=i)
    store = tmp_path / "s"
    repo = Path(__file__).resolve().parent.parent
    cmd = [
        sys.executable,
        str(repo / "cli.py"),
        "extract",
        str(d),
        "--weights",
        "random",
        "--store",
        str(store),
        "--batch-size",
        "1",
        "--set",
        "extract.commit_every=5",
        *SMALL,
    ]
    env = dict(os.environ, BUTD_NO_PROGRESS="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    while time.time() < deadline and not list(store.glob("seg-*.h5")) and proc.poll() is None:
        time.sleep(0.05)  # until the first commit (5 images) is published
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 130, (out, err)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "stopped by SIGTERM" in errors[0] and "Traceback" not in err
    done = len(FeatureStore(store).keys())
    assert 5 <= done < 40 and f"after {done} new images" in errors[0]
    res = _extract(str(d), "--weights", "random", "--store", str(store), *SMALL)
    assert res.exit_code == 0 and f"skipped (already in store) {done}" in res.output, res.output
    assert len(FeatureStore(store).keys()) == 40
