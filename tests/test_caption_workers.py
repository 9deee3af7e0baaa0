"""`caption --num-workers`: photos are decoded (and their detector blobs built) in DataLoader worker processes;
captions, scores, regions and the per-image error rows are the same as with the decoding in the main process,
in the input order, with the loader never more than a few batches ahead."""

from __future__ import annotations

import json
import os
import pickle
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from caption_helpers import SMALL, small_photos, tiny_detector
from PIL import Image
from typer.testing import CliRunner

from cli import app
from extractors.inputs import items_from_paths
from extractors.photos import Need, Photo, PhotoDataset, photo_batches
from pipeline.core import threads as thread_policy

#: the decompression-bomb cap of these tests: the 64x48 photos pass, the 200x150 one is "too_large"
MAX_PIXELS = "caption.max_pixels=20000"
#: the error rows each odd input must give, with or without workers (reason: start of the detail)
ERRORS = {
    "broken.jpg": "not_an_image: ",
    "empty.jpg": "empty: zero-byte file",
    "cut.jpg": "decode_error: OSError: Truncated",
    "big.jpg": "too_large: 200x150 = 30000 pixels",
    "gone.jpg": "unreadable: no such file or directory",
}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_captioners: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("workers")
    run = tiny_captioners
    folder = root / "photos"
    good = small_photos(folder, 5, size=(64, 48))
    (folder / "broken.jpg").write_bytes(b"this is not a JPEG file\n" * 20)
    (folder / "empty.jpg").write_bytes(b"")
    data = good[0].read_bytes()
    (folder / "cut.jpg").write_bytes(data[: len(data) // 2])  # a JPEG cut off half-way
    Image.fromarray(np.full((150, 200, 3), 77, np.uint8)).save(folder / "big.jpg")
    return {
        "root": root,
        "ckpt": run / "train-a" / "best.pt",
        "weights": tiny_detector(root / "tiny.pth"),
        "photos": folder,
        "gone": folder / "gone.jpg",
    }


def workers_available(requested: int = 2) -> int:
    """The DataLoader workers the thread policy grants here for ``requested`` (0 on a one-core machine)."""
    return thread_policy.plan(workers=requested).workers


def caption(env: dict[str, Path], *args: str):
    return CliRunner().invoke(
        app,
        [
            "caption",
            str(env["photos"]),
            str(env["gone"]),
            "--model",
            str(env["ckpt"]),
            "--weights",
            str(env["weights"]),
            *SMALL,
            "--set",
            MAX_PIXELS,
            "--quiet",
            *args,
        ],
        env={"COLUMNS": "300"},
    )


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").splitlines()]


def test_cli_results_and_error_rows_equal_with_and_without_workers(env: dict[str, Path], tmp_path: Path) -> None:
    """--num-workers 2 gives the rows of --num-workers 0: the same captions and scores, the same error rows for
    the missing, broken, empty, cut-off and too-large files, in the same order; so do both when the features
    come from the --cache (there the photos are decoded only for their pictures, which are the same files)."""
    cache = tmp_path / "cache"
    runs = {  # (runs with the cache are compared among themselves)
        "main": ["--num-workers", "0", "--cache", str(cache)],
        "workers": ["--num-workers", "2"],
        "main+cache": ["--num-workers", "0", "--cache", str(cache), "--visualize", str(tmp_path / "main+cache")],
        "workers+cache": ["--num-workers", "2", "--cache", str(cache), "--visualize", str(tmp_path / "workers+cache")],
    }
    rows, failures = {}, {}
    for name, args in runs.items():
        out = tmp_path / f"{name}.jsonl"
        res = caption(env, "--output", str(out), *args)
        assert res.exit_code == 0, res.output
        rows[name], failures[name] = read_jsonl(out), read_jsonl(tmp_path / f"{name}.failures.jsonl")
    base = rows["main"]
    assert len(base) == 10 and sum("caption" in r for r in base) == 5
    errors = {r["key"]: r["error"] for r in base if "error" in r}
    assert set(errors) == set(ERRORS) and all(errors[k].startswith(v) for k, v in ERRORS.items()), errors
    assert rows["workers"] == base  # captions, scores, errors, order
    assert rows["workers+cache"] == rows["main+cache"] and [r["key"] for r in rows["main+cache"]] == [
        r["key"] for r in base
    ]
    assert all(f == failures["main"] for f in failures.values()) and len(failures["main"]) == 5
    pictures = {
        name: {p.name: p.read_bytes() for p in (tmp_path / name).glob("*.png")}
        for name in ("main+cache", "workers+cache")
    }
    assert len(pictures["main+cache"]) == 5 and pictures["workers+cache"] == pictures["main+cache"]


def test_engine_regions_and_images_equal_with_and_without_workers(env: dict[str, Path]) -> None:
    """In the engine: the regions (features, boxes, labels) and the kept images are bitwise those of the
    main-process decoding, batch by batch in the input order."""
    from pipeline.captioning.run import build_engine
    from pipeline.core.config import load_config

    cfg = load_config("caption", None, ["caption.min_size=96", "caption.max_size=160", MAX_PIXELS]).caption
    engine, *_ = build_engine(env["ckpt"], str(env["weights"]), cfg)
    items = items_from_paths([str(env["photos"]), str(env["gone"])])
    runs = {n: list(engine.caption_batches(items, 3, keep_images=True, workers=n)) for n in (0, 2)}
    assert [len(b) for b in runs[2]] == [3, 3, 3, 1] == [len(b) for b in runs[0]]
    flat = {n: [r for b in batches for r in b] for n, batches in runs.items()}
    assert [r.key for r in flat[2]] == [it.key for it in items] == [r.key for r in flat[0]]
    for a, b in zip(flat[0], flat[2]):
        assert (a.error, a.caption, a.score, a.nbest, a.tokens) == (b.error, b.caption, b.score, b.nbest, b.tokens)
        assert (a.regions is None) == (b.regions is None) and (a.image is None) == (b.image is None)
        if a.regions is not None:
            assert a.regions.keys() == b.regions.keys()
            assert all(np.array_equal(np.asarray(a.regions[k]), np.asarray(b.regions[k])) for k in a.regions)
            assert np.array_equal(a.image, b.image)
    assert sum(r.regions is not None for r in flat[2]) == 5


class Recording(PhotoDataset):
    """A :class:`PhotoDataset` that notes, for each photo it decodes, the process and the time."""

    def __init__(self, *args, log: Path, delay: float = 0.0, **kw) -> None:
        super().__init__(*args, **kw)
        self.log, self.delay = log, delay

    def __getitem__(self, i: int) -> Photo:
        time.sleep(self.delay)
        out = super().__getitem__(i)
        with open(self.log, "a", encoding="utf-8") as fh:  # one short appended line per photo (atomic)
            fh.write(f"{os.getpid()} {i}\n")
        return out

    def decoded(self) -> list[tuple[int, int]]:
        return (
            [tuple(map(int, line.split())) for line in self.log.read_text().splitlines()] if self.log.exists() else []
        )


def photo_dataset(env: dict[str, Path], log: Path, count: int, **kw) -> Recording:
    from extractors.recipes import Recipe

    photos = small_photos(env["root"] / f"many{count}", count, size=(64, 48))
    items = items_from_paths([str(p) for p in photos])
    return Recording(
        items,
        Recipe("caffe", pixel_mean=(102.98, 115.95, 122.77), min_size=96, max_size=160),
        10**8,
        16,
        [Need.DETECT] * count,
        log=log,
        **kw,
    )


def test_decoding_runs_in_worker_processes_in_order_and_a_few_batches_ahead(
    env: dict[str, Path], tmp_path: Path
) -> None:
    """The photos are decoded in other processes than the caller's (0 workers: in the caller's), delivered in
    the input order, and the loader stays at most prefetch x workers batches ahead of a slow consumer."""
    granted = workers_available(2)
    if granted == 0:
        pytest.skip(
            "the thread policy grants no DataLoader worker here (one core, or explicit threads take the whole budget)"
        )
    ds = photo_dataset(env, tmp_path / "w.log", 20, delay=0.01)
    assert pickle.loads(pickle.dumps(ds)).needs == ds.needs  # spawn-started workers (macOS, Windows) receive a copy
    seen = []
    for n, batch in enumerate(photo_batches(ds, 2, 2, prefetch=2)):
        seen += [d.index for d in batch]
        if n == 0:
            time.sleep(1.0)  # a slow consumer: the workers may fill their prefetch, no more
            ahead = len(ds.decoded())
    assert seen == list(range(20))
    pids = {pid for pid, _ in ds.decoded()}
    assert os.getpid() not in pids and len(pids) == granted
    assert ahead <= 2 * (1 + 2 * granted), f"{ahead} photos decoded while the consumer held the first batch of 2"
    ds0 = photo_dataset(env, tmp_path / "m.log", 4)
    batches = list(photo_batches(ds0, 3, 0))
    assert [[d.index for d in b] for b in batches] == [[0, 1, 2], [3]]
    assert {pid for pid, _ in ds0.decoded()} == {os.getpid()}
    assert all(isinstance(d.blob, torch.Tensor) and d.image is None for b in batches for d in b)
