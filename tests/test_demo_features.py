"""The demo's feature switch: ``--features region,grid`` (config pieces) and ``--features clip`` (a small quick run:
untrained CLIP grid features through ``cli extract``'s stage, one captioner trained and evaluated on them)."""

from __future__ import annotations

import json
import re

import pytest
from typer.testing import CliRunner

from cli import app
from extractors.recipes import recipe_from_config
from pipeline.core.config import load_config
from pipeline.core.errors import UsageError
from pipeline.demo import clip_cells, clip_encoder_config, demo_feature_kinds, grid_extract_section
from pipeline.store import FeatureStore


def test_grid_section_and_kinds():
    cfg = load_config("demo", None, ["demo.grid=5"])
    assert demo_feature_kinds(cfg) == ["region"] and demo_feature_kinds(cfg, ["region", "grid"]) == ["region", "grid"]
    for bad in (["grid", "grid"], ["regions"], []):
        with pytest.raises(UsageError, match="demo features"):
            demo_feature_kinds(cfg, bad)
    r = recipe_from_config(grid_extract_section(cfg), "butd", "caffe")
    assert (r.name, r.selector, r.grid, r.min_size, r.pixel_mean) == ("grid-feats", "grid", 5, None, None)
    assert recipe_from_config(cfg.extract, "butd", "caffe").name == "caffe"


def test_cli_refuses_an_unknown_feature_kind(tmp_path):
    res = CliRunner().invoke(
        app, ["demo", "--out", str(tmp_path / "d"), "--features", "region,pixels", "--num-images", "20"]
    )
    assert res.exit_code == 2 and "demo features" in res.output


def test_clip_section_and_kind():
    cfg = load_config("demo", None, [])
    assert demo_feature_kinds(cfg, ["clip", "region"]) == ["clip", "region"]
    enc, seed = clip_encoder_config(cfg)
    assert (enc.kind, enc.stride, enc.grid_dim, seed, clip_cells(enc)) == ("vit", 64, 128, 0, 49)
    with pytest.raises(UsageError, match="demo.clip"):
        clip_encoder_config(load_config("demo", None, ["demo.clip.width=100"]))


def test_demo_trains_on_clip_features(tmp_path):
    """``demo --quick --features clip``: the random encoder written once, its grid in a store named clip, and the
    table's ``san+clip`` row with its figures (a smaller world and one XE epoch keep it short)."""
    out = tmp_path / "d"
    args = ["demo", "--quick", "--out", str(out), "--features", "clip", "--models", "san", "--num-images", "40"]
    sets = ["train.stages=[xe]", "train.xe={epochs: 1, batch_size: 16, lr: 0.002, warmup_iters: 0}"]
    sets += ["demo.fast_metrics_only=true", "demo.pictures=0"]
    res = CliRunner().invoke(app, [*args, *[a for s in sets for a in ("--set", s)]])
    assert res.exit_code == 0, res.output
    store = FeatureStore(out / "features-clip" / "store")
    assert store.identity["name"] == "clip-ViT-w128-d2-p64" and len(store) == 40 and store.feature_dim == 128
    assert store.identity["config"]["recipe"]["name"] == "clip-vil"
    assert store.get(store.keys()[0])["boxes"].shape == (49, 4)
    assert (out / "clip-encoder" / "clip-random.pt").is_file() and not (out / "detector").exists()
    row = next(line for line in res.output.splitlines() if line.strip().startswith("san+clip"))
    cider = row.split("│")[4].strip()  # model, Bleu_4, METEOR, ROUGE_L, CIDEr
    assert re.fullmatch(r"\d+\.\d{3}", cider), row
    assert json.loads((out / "summary.json").read_text())["metrics"]["san+clip"]["CIDEr"] == pytest.approx(
        float(cider), abs=5e-4
    )
