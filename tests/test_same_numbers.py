"""Same numbers, same captions: `import-features` keeps the source's float32 unless asked (a released-layout M2
captions features imported with the README's command as it captions float32 ones), and `caption --cache`
captions a photo from the same numbers on the first run and on a rerun, whatever the cache's dtype."""

from __future__ import annotations

import json
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch
from caption_helpers import SMALL, small_photos, tiny_detector
from release_helpers import write_m2_checkpoint, write_m2_vocab
from test_photo_path import random_captioner
from typer.testing import CliRunner

from cli import app
from pipeline.store import FeatureStore, open_writer

WORDS = ["a", "man", "dog", "on", "the", "grass", "with", "ball", "red", "sitting"]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def env(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("same_numbers")
    photos = root / "photos"
    small_photos(photos, 6)
    return {
        "root": root,
        "photos": photos,
        "weights": tiny_detector(root / "tiny.pth"),
        "ckpt": random_captioner(root / "san.pt", 128),
    }


def caption(env, *args: str):
    res = CliRunner().invoke(
        app,
        [
            "caption",
            str(env["photos"]),
            "--model",
            str(env["ckpt"]),
            "--weights",
            str(env["weights"]),
            "--n-best",
            "2",
            *SMALL,
            *args,
        ],
    )
    assert res.exit_code == 0, res.output
    return res


def test_caption_cache_twice_gives_identical_output(env, tmp_path):
    """A float16 cache (as `extract` makes them): the first run, which detects, and the rerun, which reads the
    cache, give the same rows, scores included. A new cache (float32): the rows of a run without --cache."""
    from pipeline.captioning.run import build_engine
    from pipeline.core.config import load_config

    cfg = load_config("caption", None, ["caption.min_size=96", "caption.max_size=160"]).caption
    engine, *_ = build_engine(env["ckpt"], str(env["weights"]), cfg)
    with open_writer(tmp_path / "half", engine.store_settings, "float16"):
        pass  # an empty float16 store with the settings of these runs
    for name in ("first", "rerun"):
        caption(env, "--cache", str(tmp_path / "half"), "--output", str(tmp_path / f"{name}.jsonl"))
    assert len(FeatureStore(tmp_path / "half")) == 6 and FeatureStore(tmp_path / "half").feature_dtype == "float16"
    first, rerun = rows(tmp_path / "first.jsonl"), rows(tmp_path / "rerun.jsonl")
    assert len(first) == 6 and all("caption" in r for r in first)
    assert first == rerun
    caption(env, "--output", str(tmp_path / "plain.jsonl"))
    for name in ("new", "new-rerun"):
        caption(env, "--cache", str(tmp_path / "full"), "--output", str(tmp_path / f"{name}.jsonl"))
    assert FeatureStore(tmp_path / "full").feature_dtype == "float32"
    assert rows(tmp_path / "plain.jsonl") == rows(tmp_path / "new.jsonl") == rows(tmp_path / "new-rerun.jsonl")


def test_released_m2_on_features_imported_by_the_readme_command(tmp_path, monkeypatch):
    """README: `import-features --format m2-hdf5 coco_detections.hdf5 --sizes captions_val2014.json --skip-bad
    --store ...`, then `evaluate --model meshed_memory_transformer.pth --vocab vocab.pkl`: the store holds the
    file's float32 numbers exactly and the captions equal those on features imported with --dtype float32."""
    from pipeline.caption_data.prepare import prepare_captions
    from pipeline.core.config import load_config
    from pipeline.core.stages import run_stage
    from pipeline.world.generate import generate_world

    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))
    torch.set_num_threads(1)
    world, run = tmp_path / "world", tmp_path / "run"
    generate_world(world, load_config("world", None, ["world.num_images=40", "world.num_workers=1"]).world)
    cfg = load_config(
        "prepare",
        None,
        [f"prepare.karpathy_json={world / 'annotations/dataset_coco.json'}", "prepare.word_count_threshold=0"],
    )
    run_stage(run, "data", cfg.prepare, prepare_captions)
    sizes = world / "annotations" / "captions_test.json"
    test_ids = [str(im["id"]) for im in json.loads(sizes.read_text())["images"]]
    rng = np.random.default_rng(0)
    src = tmp_path / "coco_detections.hdf5"
    with h5py.File(
        src, "w"
    ) as fh:  # M2's layout: <id>_features (K, D) float32, <id>_boxes (K, 4); train ids lack sizes
        for key in range(1, 41):
            k = int(rng.integers(8, 20))
            fh[f"{key}_features"] = rng.gamma(0.6, 1.2, (k, 64)).astype(
                np.float32
            )  # sparse, non-negative, like ReLU features
            fh[f"{key}_boxes"] = np.tile(np.array([[2, 3, 30, 40]], np.float32), (k, 1))
    models = tmp_path / "m2"
    models.mkdir()
    write_m2_vocab(models / "vocab.pkl", WORDS)
    write_m2_checkpoint(models / "meshed_memory_transformer.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=64)
    captions = {}
    for name, extra in (("readme", []), ("float32", ["--dtype", "float32"])):
        store = tmp_path / f"feats-{name}"
        res = CliRunner().invoke(
            app,
            [
                "import-features",
                "--format",
                "m2-hdf5",
                str(src),
                "--sizes",
                str(sizes),
                "--skip-bad",
                "--store",
                str(store),
                *extra,
            ],
        )
        assert res.exit_code == 0, res.output
        st = FeatureStore(store)
        assert st.feature_dtype == "float32" and sorted(st.keys()) == sorted(test_ids)
        with h5py.File(src, "r") as fh:
            assert all(np.array_equal(st.get(k)["features"], fh[f"{k}_features"][()]) for k in test_ids)
        out = tmp_path / f"eval-{name}"
        res = CliRunner().invoke(
            app,
            [
                "evaluate",
                "--model",
                str(models / "meshed_memory_transformer.pth"),
                "--vocab",
                str(models / "vocab.pkl"),
                "--store",
                str(store),
                "--data",
                str(run / "data"),
                "--split",
                "test",
                "--metrics",
                "bleu",
                "--output",
                str(out / "metrics.json"),
            ],
        )
        assert res.exit_code == 0, res.output
        captions[name] = json.loads((out / "predictions_test.json").read_text())
    assert len(captions["readme"]) == len(test_ids) and captions["readme"] == captions["float32"]
