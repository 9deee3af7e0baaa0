"""The static HTML gallery (`caption --gallery DIR`) opened in a real headless browser (Debian's chromium):
every caption is on the rendered page, the script ran (photo count, word filter), the screenshot is not blank,
and the page needs no network."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from caption_helpers import SMALL, small_photos, tiny_detector
from PIL import Image
from typer.testing import CliRunner

from cli import app

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def gallery(tmp_path_factory, tiny_captioner: Path) -> Path:
    root = tmp_path_factory.mktemp("gallery")
    run = tiny_captioner
    photos = root / "photos"
    small_photos(photos, 5, size=(240, 180))
    (photos / "0004.jpg").rename(photos / "a<b>&c.jpg")  # HTML in a file name
    (photos / "broken.jpg").write_bytes(b"not an image")
    res = CliRunner().invoke(
        app,
        [
            "caption",
            str(photos),
            "--model",
            str(run),
            "--weights",
            str(tiny_detector(root / "tiny.pth")),
            "--gallery",
            str(root / "g"),
            "--n-best",
            "2",
            *SMALL,
        ],
        env={"COLUMNS": "200"},
    )
    assert res.exit_code == 0, res.output
    return root / "g"


def records(gallery: Path) -> list[dict]:
    return [json.loads(line) for line in (gallery / "records.jsonl").read_text(encoding="utf-8").splitlines()]


def chromium(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    cmd = [
        str(CHROMIUM),
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--hide-scrollbars",
        f"--user-data-dir={cwd / 'profile'}",
        *args,
    ]
    return subprocess.run(cmd, cwd=cwd, capture_output=True, timeout=120)


def test_gallery_files_and_no_network(gallery: Path) -> None:
    rows = records(gallery)
    assert len(rows) == 6 and sum("error" in r for r in rows) == 1
    page = (gallery / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", page)  # nothing fetched from a network
    for r in rows:
        if "error" in r:
            continue
        assert (gallery / r["thumb"]).is_file() and (gallery / r["picture"]).is_file()
        assert len(r["nbest"]) == 2 and 1 <= len(r["regions"]) <= 5
        assert f'href="{r["picture"]}"' in page
    assert "a&lt;b&gt;&amp;c.jpg" in page and "a<b>&c.jpg" not in page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (Debian: apt-get install chromium)")
def test_gallery_renders_in_headless_chromium(gallery: Path, tmp_path: Path) -> None:
    rows = [r for r in records(gallery) if "error" not in r]
    url = (gallery / "index.html").resolve().as_uri()
    dom = chromium("--dump-dom", url, cwd=tmp_path)
    assert dom.returncode == 0, dom.stderr.decode()[-2000:]
    text = dom.stdout.decode("utf-8")
    for r in rows:  # every caption (and its n-best) is on the rendered page
        assert f'<p class="caption">{r["caption"]} ' in text, r["caption"]
        for hyp, _ in r["nbest"]:
            assert hyp in text
    assert re.search(r'<span id="count">6 of 6 photos</span>', text), "the page script did not run"
    word = next(w for w in rows[0]["caption"].split() if w) if rows[0]["caption"] else "thing"
    filtered = chromium("--dump-dom", f"{url}?q=zzznotaword", cwd=tmp_path).stdout.decode("utf-8")
    assert '<span id="count">0 of 6 photos</span>' in filtered
    some = chromium("--dump-dom", f"{url}?q={word}", cwd=tmp_path).stdout.decode("utf-8")
    shown = int(re.search(r'<span id="count">(\d+) of 6 photos</span>', some).group(1))
    assert (
        1
        <= shown
        == sum(
            f" {word}"
            in " " + " ".join([r["caption"]] + [c for c, _ in r["nbest"]] + [g["label"] for g in r["regions"]]).lower()
            for r in records(gallery)
            if "error" not in r
        )
    )
    shot = tmp_path / "shot.png"
    res = chromium(f"--screenshot={shot}", "--window-size=1000,800", url, cwd=tmp_path)
    assert res.returncode == 0 and shot.is_file(), res.stderr.decode()[-2000:]
    pixels = np.asarray(Image.open(shot).convert("RGB"), dtype=np.float32)
    assert pixels.shape[:2] == (800, 1000)
    assert (
        pixels.std() > 20 and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 500
    )  # photos and text, not a blank page
