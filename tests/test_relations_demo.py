"""The relations comparison (configs/demo_relations.yaml): its world states one true relation per caption
between two singly named objects, its oracle regions carry no position, and comparison mode trains several
seeds per captioner and reports their mean and spread."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest
from test_world import check_caption
from typer.testing import CliRunner

from cli import app
from pipeline.core.config import load_config
from pipeline.store import FeatureStore
from pipeline.world.generate import generate_world
from pipeline.world.grounding import grounding_scores, judge_caption, load_scenes
from pipeline.world.oracle_features import oracle_dim, write_oracle_store

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "demo_relations.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("relworld")
    cfg = load_config("demo", CONFIG, ["world.num_images=60", "world.num_workers=1", "world.seed=5"]).world
    generate_world(out, cfg)
    return out


def test_relation_captions_name_two_objects_and_state_a_true_relation(world: Path) -> None:
    karpathy = json.loads((world / "annotations" / "dataset_coco.json").read_text())
    scenes = {
        **load_scenes(world / "annotations" / "instances_train.json"),
        **load_scenes(world / "annotations" / "instances_val.json"),
        **load_scenes(world / "annotations" / "instances_test.json"),
    }
    vocab = {
        "shapes": {o.shape for s in scenes.values() for o in s.objects},
        "colours": {o.colour for s in scenes.values() for o in s.objects},
        "sizes": {"small", "large"},
    }
    with_relation = 0
    for im in karpathy["images"]:
        scene = scenes[im["cocoid"]]
        assert len(scene.objects) == 2
        rec = {
            "objects": [
                {"shape": o.shape, "colour": o.colour, "size": o.size, "box": list(o.box)} for o in scene.objects
            ],
            "width": scene.width,
            "height": scene.height,
            "background": None,
        }
        kinds = set()
        for s in im["sentences"]:
            verdict = judge_caption(s["raw"], scene, vocab)
            kinds.add(check_caption(s["raw"], s["tokens"], {**rec, "background": _background(world, im["cocoid"])}))
            if verdict["relation"] is not None:
                assert verdict["relation"] is True and verdict["phrases"] == [True, True], s["raw"]
        assert kinds == {"relation"} or "relation" not in kinds  # all five state a relation, or none can
        with_relation += kinds == {"relation"}
    assert with_relation >= 0.8 * len(karpathy["images"])
    refs = [{"image_id": im["cocoid"], "caption": s["raw"]} for im in karpathy["images"] for s in im["sentences"]]
    scores = grounding_scores(refs, scenes)
    assert (
        scores["relation_accuracy"] == 1.0 and 0.25 <= scores["relation_chance"] < 0.5
    )  # one or two of four words hold


def _background(world: Path, image_id: int) -> str:
    for split in ("train", "val", "test"):
        for im in json.loads((world / "annotations" / f"instances_{split}.json").read_text())["images"]:
            if im["id"] == image_id:
                return im["background"]
    raise AssertionError(image_id)


def test_oracle_regions_without_box_features_carry_no_position(world: Path, tmp_path: Path) -> None:
    with_box = write_oracle_store(world, tmp_path / "a", noise=0.0)
    without = write_oracle_store(world, tmp_path / "b", noise=0.0, box_features=False, key="file_name")
    assert with_box["feature_dim"] == oracle_dim() == oracle_dim(box_features=False) + 5 == without["feature_dim"] + 5
    with FeatureStore(tmp_path / "a") as sa, FeatureStore(tmp_path / "b") as sb:
        assert sb.identity["box_features"] is False and "box_features" not in sa.identity
        assert sorted(sb.keys()) == sorted(
            f"world_{int(k):06d}.jpg" for k in sa.keys()
        )  # keyed by file name, as the demo's stores
        key = sorted(sa.keys())[0]
        other = f"world_{int(key):06d}.jpg"
        a, b = np.asarray(sa.get(key)["features"]), np.asarray(sb.get(other)["features"])
        np.testing.assert_array_equal(
            np.asarray(sa.get(key)["boxes"]), np.asarray(sb.get(other)["boxes"])
        )  # the geometry input stays
    # the same one-hot content, and without the box columns the rows are identical for objects of the same kind
    np.testing.assert_allclose(a[:, : b.shape[1]], b)
    assert set(np.unique(b)) <= {0.0, 1.0}


def test_comparison_trains_every_seed_and_reports_mean_and_spread(tmp_path: Path) -> None:
    out = tmp_path / "rel"
    args = [
        "demo",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--models",
        "san,ngsan-signed",
        "--seeds",
        "2",
        "--quiet",
        "--set",
        "world.num_images=40",
        "--set",
        "world.num_workers=1",
        "--set",
        "demo.fast_metrics_only=true",
        "--set",
        "train.xe={epochs: 1, batch_size: 16, lr: 0.002, warmup_iters: 0}",
        "--set",
        "train.model_overrides={d_model: 32, num_heads: 4, d_ff: 64, num_layers: 1}",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["metrics"]) == ["san+oracle", "ngsan-signed+oracle"]
    assert not (out / "detector").exists() and not any(out.glob("pictures-*"))
    for name in ("san+oracle", "ngsan-signed+oracle"):
        runs = summary["runs"][name]
        assert [r["seed"] for r in runs] == [1234, 1235]
        assert (
            (out / f"train-{name}").is_dir()
            and (out / f"train-{name}-seed1235").is_dir()
            and (out / f"eval-{name}-seed1235").is_dir()
        )
        cider = [r["metrics"]["CIDEr"] for r in runs]
        assert summary["metrics"][name]["CIDEr"] == pytest.approx(statistics.fmean(cider))
        assert summary["spread"][name]["CIDEr"] == pytest.approx(statistics.stdev(cider))
        rel = [r["grounding"]["relation_accuracy"] for r in runs]
        if all(v is not None for v in rel):
            assert summary["grounding"][name]["relation_accuracy"] == pytest.approx(statistics.fmean(rel))
    assert "mean ± sd over 2 seeds" in res.output and "guess" in res.output
    again = CliRunner().invoke(app, args)  # every stage, every seed, is skipped on a second run
    assert again.exit_code == 0, again.output
    assert json.loads((out / "summary.json").read_text())["runs"] == summary["runs"]


def test_the_default_world_keeps_its_stage_config_and_the_relations_world_records_its_style() -> None:
    from pipeline.world.generate import world_stage_config

    default = world_stage_config(load_config("demo").world)
    assert "captions" not in default  # worlds generated before world.captions existed keep their digest
    relations = world_stage_config(load_config("demo", CONFIG).world)
    assert (
        relations.captions == "relations"
        and relations.digest()
        != world_stage_config(load_config("demo", CONFIG, ["world.captions=mixed"]).world).digest()
    )


def test_stage_seconds_are_the_same_number_whether_the_stage_ran_or_was_skipped(tmp_path: Path) -> None:
    """A timing of 1.34951 s is 1.3 rounded once but 1.4 through the manifest's 1.350: both paths read the
    manifest, so a rerun's summary.json equals the first run's."""
    from dataclasses import replace

    from pipeline.core.config import Config
    from pipeline.core.stages import run_stage
    from pipeline.demo import _stage_seconds

    ran = run_stage(tmp_path, "s", Config({"a": 1}), lambda d, c: {"x": 1})
    manifest = json.loads((ran.directory / "manifest.json").read_text())
    manifest["seconds"] = 1.35
    (ran.directory / "manifest.json").write_text(json.dumps(manifest))
    assert _stage_seconds(replace(ran, seconds=1.34951)) == _stage_seconds(replace(ran, skipped=True)) == round(1.35, 1)


def test_a_variant_with_its_own_oracle_keys_trains_on_its_own_store_and_the_table_names_the_checkpoint(
    tmp_path: Path,
) -> None:
    out = tmp_path / "rel"
    args = [
        "demo",
        "--config",
        str(CONFIG),
        "--out",
        str(out),
        "--models",
        "san,san-box",
        "--seeds",
        "1",
        "--quiet",
        "--set",
        "world.num_images=40",
        "--set",
        "world.num_workers=1",
        "--set",
        "demo.fast_metrics_only=true",
        "--set",
        "train.xe.epochs=1",
        "--set",
        "train.model_overrides={d_model: 32, num_heads: 4, d_ff: 64, num_layers: 1}",
    ]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    assert list(summary["metrics"]) == ["san+oracle", "san-box+oracle"]
    assert summary["checkpoint"] == "last epoch (train.validation.split: null)"
    assert "checkpoint evaluated: last epoch" in res.output
    plain = json.loads((out / "features-oracle" / "manifest.json").read_text())
    boxed = json.loads((out / "features-oracle-san-box" / "manifest.json").read_text())
    assert boxed["summary"]["feature_dim"] == plain["summary"]["feature_dim"] + 5 == oracle_dim()
    with (
        FeatureStore(out / "features-oracle" / "store") as sa,
        FeatureStore(out / "features-oracle-san-box" / "store") as sb,
    ):
        key = sorted(sa.keys())[0]
        a, b = np.asarray(sa.get(key)["features"]), np.asarray(sb.get(key)["features"])
        assert a.shape[1] + 5 == b.shape[1]
    train_cfgs = {
        name: json.loads((out / f"train-{name}" / "manifest.json").read_text())["config"]
        for name in ("san+oracle", "san-box+oracle")
    }
    assert train_cfgs["san+oracle"]["store"] != train_cfgs["san-box+oracle"]["store"]
    assert "oracle" not in train_cfgs["san-box+oracle"]  # a demo key, not a train key
    for cfg in train_cfgs.values():  # the relations recipe: no dropout, a constant lr, the last epoch's weights
        assert cfg["model_overrides"]["dropout"] == cfg["model_overrides"]["embed_dropout"] == 0.0
        assert cfg["xe"]["lr_schedule"] == "constant" and cfg["validation"]["split"] is None


def test_a_variant_oracle_key_outside_the_oracle_section_is_one_clear_error(tmp_path: Path) -> None:
    res = CliRunner().invoke(
        app,
        [
            "demo",
            "--config",
            str(CONFIG),
            "--out",
            str(tmp_path / "x"),
            "--models",
            "san-box",
            "--set",
            "demo.variants.san-box.oracle={box_feature: true}",
        ],
    )
    assert res.exit_code != 0 and "demo.variants.san-box.oracle" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "x" / "world").exists()
