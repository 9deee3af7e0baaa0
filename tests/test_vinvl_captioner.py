"""Captioners on the new features through the CLI: VinVL-layout regions and grid cells extracted from the
synthetic world's photos (random narrow VinVL weights), then ``train`` one epoch, ``evaluate`` and ``caption``;
the feature size comes from the store (no code or config names it)."""

from __future__ import annotations

import json

import pytest
import torch
from detector_helpers import save_vinvl
from test_vinvl import narrow_spec
from train_helpers import TINY
from typer.testing import CliRunner

from cli import app
from extractors.random_weights import random_detector
from pipeline.caption_data.prepare import prepare_captions
from pipeline.core.config import load_config
from pipeline.core.stages import run_stage
from pipeline.store import FeatureStore
from pipeline.world.generate import generate_world

SCALE = [
    "--set",
    "extract.recipes.vinvl.min_size=128",
    "--set",
    "extract.recipes.vinvl.max_size=200",
    "--set",
    "extract.recipes.grid-feats.min_size=128",
    "--set",
    "extract.recipes.grid-feats.max_size=200",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("vinvlcap")
    generate_world(root / "world", load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    cfg = load_config(
        "prepare",
        None,
        [
            f"prepare.karpathy_json={root / 'world/annotations/dataset_coco.json'}",
            "prepare.word_count_threshold=0",
            "prepare.key=filename",
        ],
    )
    run_stage(root / "run", "data", cfg.prepare, prepare_captions)
    weights = save_vinvl(random_detector(narrow_spec(), seed=3), root / "vinvl_vg_x152c4.pth")
    return root, weights


def _ok(res):
    assert res.exit_code == 0, res.output
    return res


@pytest.mark.parametrize("kind", ["regions", "grid"])
def test_train_evaluate_caption_on_vinvl_features(world, kind):
    root, weights = world
    store = root / f"store-{kind}"
    extra = ["--boxes", "grid", "--set", "extract.recipes.grid-feats.grid=4"] if kind == "grid" else []
    _ok(
        CliRunner().invoke(
            app,
            [
                "extract",
                "--device",
                "cpu",
                str(root / "world/images"),
                "--weights",
                str(weights),
                "--store",
                str(store),
                "--workers",
                "0",
                *SCALE,
                *extra,
            ],
        )
    )
    st = FeatureStore(store)
    assert st.feature_dim == 128 and len(st) == 40
    first = st.get(st.keys()[0])
    assert (first["boxes"].shape[0] == 16) if kind == "grid" else (10 <= first["boxes"].shape[0] <= 100)
    out = root / f"run-{kind}"
    sets = [
        "train.model=san",
        f"train.store={store}",
        f"train.data={root / 'run/data'}",
        "train.device=cpu",
        "train.preload=memory",
        "train.stages=[xe]",
        "train.xe={epochs: 1, batch_size: 16, lr: 1.0e-3, warmup_iters: 0}",
        *TINY,
    ]
    _ok(CliRunner().invoke(app, ["train", "--out", str(out), *[a for s in sets for a in ("--set", s)]]))
    ckpt = out / "train-san" / "best.pt"
    assert ckpt.is_file()
    res = _ok(
        CliRunner().invoke(
            app,
            [
                "evaluate",
                "--model",
                str(ckpt),
                "--store",
                str(store),
                "--data",
                str(root / "run/data"),
                "--set",
                "evaluate.metrics=[cider]",
                "--output",
                str(root / f"metrics-{kind}.json"),
            ],
        )
    )
    metrics = json.loads((root / f"metrics-{kind}.json").read_text())
    assert "CIDEr" in json.dumps(metrics), res.output
    photos = sorted((root / "world/images").iterdir())[:3]
    cap = [
        "caption",
        "--device",
        "cpu",
        *map(str, photos),
        "--model",
        str(ckpt),
        "--weights",
        str(weights),
        "--output",
        str(root / f"caps-{kind}.json"),
        "--set",
        "caption.min_size=128",
        "--set",
        "caption.max_size=200",
    ]
    if kind == "grid":
        cap += ["--set", "caption.boxes=grid"]  # every cell of the map (the recipe table of configs/extract.yaml)
    _ok(CliRunner().invoke(app, cap))
    caps = json.loads((root / f"caps-{kind}.json").read_text())
    # one epoch on random detector features: a caption may be empty (EOS first), but every photo gets a decoded result
    assert len(caps) == 3 and all(isinstance(c.get("caption"), str) and c["score"] < 0 for c in caps)
