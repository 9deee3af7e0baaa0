"""Helpers for the `caption` tests: a tiny detector weights file, tiny trained captioners, small photos."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from extract_helpers import tiny_spec
from PIL import Image, ImageDraw
from train_helpers import TINY

from extractors.random_weights import random_detector
from extractors.training.export import export_weights
from pipeline.caption_data.prepare import prepare_captions
from pipeline.core.config import load_config
from pipeline.core.stages import run_stage
from pipeline.training.api import train_captioner
from pipeline.world.generate import generate_world
from pipeline.world.oracle_features import oracle_dim, write_oracle_store

REPO = Path(__file__).resolve().parents[1]
CLASSES = ["__background__"] + [f"thing{i}" for i in range(1, 21)]
ATTRIBUTES = ["__no_attribute__"] + [f"colour{i}" for i in range(1, 11)]
SMALL = ["--set", "caption.min_size=96", "--set", "caption.max_size=160", "--set", "caption.batch_size=2"]


def tiny_detector(path: Path, **spec: int) -> Path:
    """A seeded random tiny bottom-up detector written as a ``butd`` weights file (128-d region features);
    ``spec`` overrides fields of the tiny spec (e.g. ``post_nms_topk``, ``pooler_resolution``)."""
    det = random_detector(tiny_spec(min_size=96, max_size=160, **spec), seed=0)
    return export_weights(det, path, (1.0, 1.0, 1.0, 1.0), CLASSES, ATTRIBUTES)


def tiny_run(root: Path, trainings: dict[str, list[str]]) -> Path:
    """A run folder with tiny captioners trained on 128-d oracle features of a 40-image world, one per entry
    (stage ``train-<name>``, extra train overrides), each validated on CIDEr-D."""
    torch.set_num_threads(1)
    world = root / "world"
    generate_world(world, load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    run = root / "run"
    cfg = load_config(
        "prepare",
        None,
        [f"prepare.karpathy_json={world / 'annotations/dataset_coco.json'}", "prepare.word_count_threshold=0"],
    )
    run_stage(run, "data", cfg.prepare, prepare_captions)
    write_oracle_store(world, run / "features" / "store", extra_dims=tiny_spec().feature_dim - oracle_dim())
    for name, extra in trainings.items():
        tcfg = load_config(
            "train",
            None,
            [
                "train.model=san",
                f"train.store={run / 'features/store'}",
                f"train.data={run / 'data'}",
                "train.device=cpu",
                "train.preload=memory",
                "train.stages=[xe]",
                "train.xe={epochs: 1, batch_size: 16, lr: 1.0e-3, warmup_iters: 0}",
                *TINY,
                *extra,
            ],
        )
        train_captioner(run, tcfg, stage_name=f"train-{name}")
    return run


def small_photos(folder: Path, count: int, size: tuple[int, int] = (120, 90), seed: int = 0) -> list[Path]:
    """``count`` small JPEG photos of coloured shapes (deterministic)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(count):
        im = Image.new("RGB", size, tuple(int(v) for v in rng.integers(0, 255, 3)))
        draw = ImageDraw.Draw(im)
        for _ in range(3):
            x, y = int(rng.integers(0, size[0] - 20)), int(rng.integers(0, size[1] - 20))
            draw.ellipse([x, y, x + 18, y + 18], fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        path = folder / f"{i:04d}.jpg"
        im.save(path, quality=85)
        paths.append(path)
    return paths


def cli_env() -> dict[str, str]:
    """The environment of a ``cli.py`` child: this process's, with one thread, no progress bars, 300 columns."""
    return dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BUTD_NO_PROGRESS="1", COLUMNS="300")


def cli_process(*args: str, **kw) -> subprocess.Popen:
    """``cli.py`` in a child process (one thread, no progress bars)."""
    return subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), *args],
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **kw,
    )
