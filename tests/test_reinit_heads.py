"""`train-detector --reinit-heads`: fine-tune a public-layout file (random weights, reduced widths, another label
set) on the synthetic world's 7 classes: new class and attribute heads, backbone / RPN / res5 from the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from detector_helpers import save_layout
from typer.testing import CliRunner

from cli import app
from extractors import EXTRACTORS, available_extractors
from extractors.random_weights import random_detector
from extractors.training.data import load_instances
from extractors.training.export import HEAD_KEYS
from extractors.training.loop import build_detector
from extractors.training.stage import load_detector_config
from extractors.weights import describe, load_detector
from pipeline.core.config import load_config
from pipeline.world.generate import generate_world

TINY = Path(__file__).resolve().parent.parent / "configs" / "detector" / "tiny.yaml"


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    cfg = load_config(
        "world",
        None,
        ["world.num_images=12", "world.image_size=[64, 96]", "world.max_objects=3", "world.num_workers=1"],
    ).world
    generate_world(out, cfg)
    return out


@pytest.fixture(scope="module")
def public_file(tmp_path_factory) -> Path:
    """MILVLG layout, the tiny preset's reduced widths, 30 classes and 20 attributes (not the world's)."""
    available_extractors()
    cfg = load_detector_config(TINY)
    spec = EXTRACTORS.get(str(cfg.model.preset))().with_(
        **{k: tuple(v) if isinstance(v, list) else v for k, v in cfg.model.spec.to_dict().items()},
        num_classes=31,
        num_attributes=21,
    )
    return save_layout(
        random_detector(spec, seed=7).state_dict(), "milvlg", tmp_path_factory.mktemp("pub") / "bua-tiny.pth"
    )


def _cfg(world: Path, public: Path, *extra: str):
    return load_detector_config(
        TINY,
        [
            f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
            f"data.train_images={world / 'images'}",
            f"model.init_weights={public}",
            *extra,
        ],
    )


def test_reinit_keeps_the_trunk_and_makes_new_heads(world, public_file):
    cfg = _cfg(world, public_file, "model.reinit_heads=true")
    data = load_instances(cfg.data.train_annotations, cfg.data.train_images)
    assert data.num_classes == 8  # 7 shapes + background
    det = build_detector(cfg, data)
    assert det.spec.num_classes == 8 and det.spec.num_attributes == data.num_attributes
    assert (
        det.roi_heads.box_predictor.cls_score.out_features == 8
        and det.roi_heads.box_predictor.bbox_pred.out_features == 32
    )
    assert det.roi_heads.box_predictor.cls_embed.num_embeddings == 8
    pub = load_detector(public_file)[0].state_dict()
    kept = [k for k in det.state_dict() if not k.startswith(HEAD_KEYS)]
    assert any(k.startswith("backbone.") for k in kept) and any(k.startswith("proposal_generator.") for k in kept)
    assert (
        any(k.startswith("roi_heads.res5.") for k in kept)
        and "proposal_generator.anchor_generator.cell_anchors.0" in kept
    )
    for k in kept:
        torch.testing.assert_close(det.state_dict()[k], pub[k], rtol=0, atol=0)


def test_without_the_flag_the_label_mismatch_is_one_line(world, public_file, tmp_path):
    res = CliRunner().invoke(
        app,
        [
            "train-detector",
            "-c",
            str(TINY),
            "--world",
            str(world),
            "--out",
            str(tmp_path / "d"),
            "--set",
            f"model.init_weights={public_file}",
        ],
    )
    assert res.exit_code == 2 and "--reinit-heads" in res.output and "31 classes" in res.output


def test_fine_tune_on_the_world_with_reinit_heads(world, public_file, tmp_path):
    out = tmp_path / "run" / "detector"  # --out is the run directory, the stage is RUN/detector
    res = CliRunner().invoke(
        app,
        [
            "train-detector",
            "-c",
            str(TINY),
            "--world",
            str(world),
            "--out",
            str(out.parent),
            "--reinit-heads",
            "--set",
            f"model.init_weights={public_file}",
            "--set",
            "detector_train.max_iter=6",
            "--set",
            "detector_train.steps=[5]",
            "--set",
            "data.eval_annotations=null",
        ],
    )
    assert res.exit_code == 0, res.output
    info = describe(out / "detector.pth")
    assert info["layout"] == "butd" and info["classes"] == 8 and "circle" in info["class_names"]
    trained = load_detector(out / "detector.pth")[0].state_dict()
    pub = load_detector(public_file)[0].state_dict()
    # the trunk started from the file: after 6 small steps it is still close to it (a fresh init would not be)
    for k in ("backbone.stem.conv1.weight", "proposal_generator.rpn_head.conv.weight", "roi_heads.res5.0.conv2.weight"):
        assert (trained[k] - pub[k]).norm() < 0.2 * pub[k].norm(), k
