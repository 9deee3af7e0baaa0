"""`eval-detector --batch-size --num-workers --precision` (and `--device`): a detector trained for a few seconds on
a tiny synthetic world, evaluated on its 16 training images (two image sizes, so batches stack several blobs).

Batching: the scores are equal; the detector's numbers agree with one-by-one runs up to the float rounding of
a batched convolution (CPU: not bitwise for blobs stacked with others, bitwise for a blob alone in its shape group).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from cli import app
from extractors.factory import configure_recipe
from extractors.preprocess import load_rgb, recipe_blob
from extractors.training.evaluate import attribute_probs, evaluate_model
from extractors.training.stage import evaluate_detector, load_detector_config, train_detector
from extractors.weights import load_detector
from pipeline.core.config import load_config
from pipeline.world.generate import generate_world

TINY = Path(__file__).resolve().parent.parent / "configs" / "detector" / "tiny.yaml"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(world folder, weights file, config): 24 iterations of the tiny preset on 16 images of 64-65 px, on the CPU
    (the tolerances below were measured on these weights; CUDA training is not repeatable, see docs/gpu.md)."""
    world = tmp_path_factory.mktemp("world")
    generate_world(
        world,
        load_config(
            "world",
            None,
            ["world.num_images=20", "world.image_size=[64, 65]", "world.max_objects=3", "world.num_workers=1"],
        ).world,
    )
    cfg = load_detector_config(
        TINY,
        [
            f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
            f"data.train_images={world / 'images'}",
            "data.eval_annotations=null",
            "detector_train.max_iter=24",
            "detector_train.steps=[20]",
            "detector_train.device=cpu",
        ],
    )
    stage = tmp_path_factory.mktemp("det")
    outputs, _ = train_detector(stage, cfg)
    return world, stage / outputs["weights"], cfg


@pytest.fixture
def four_cores(monkeypatch):
    """The thread policy sees 4 cores, so that 2 DataLoader workers start on a 2-core machine too."""
    from pipeline.core import threads

    monkeypatch.setattr(threads, "available_cores", lambda: 4)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("BUTD_THREADS", raising=False)


def _evaluate(trained, *overrides: str) -> dict:
    world, weights, cfg = trained
    return evaluate_detector(
        weights,
        world / "annotations" / "instances_train.json",
        world / "images",
        cfg.with_overrides(["eval.device=cpu", *overrides]),
    )


def test_batch_size_and_workers_leave_the_scores_unchanged(trained, four_cores):
    base = _evaluate(trained)  # the defaults: one image per forward, decoded in the main process
    assert base["images"] == 16 and base["objects"] > 16 and "failed_images" not in base
    assert 0.0 < base["recall"] <= 1.0 and 10 <= base["boxes_per_image"] <= 100
    assert _evaluate(trained, "eval.batch_size=3") == base
    assert _evaluate(trained, "eval.num_workers=2") == base
    assert _evaluate(trained, "eval.batch_size=4", "eval.num_workers=2") == base


def test_batched_detection_and_attribute_head_match_one_by_one(trained):
    world, weights, cfg = trained
    model = load_detector(weights)[0].fold_batchnorm()
    _, rule = configure_recipe(model, "butd", cfg.eval, "eval")
    blobs, frames = [], []
    for path in sorted((world / "images").glob("*.jpg"))[:8]:
        blob, frame = recipe_blob(load_rgb(path), rule.recipe)
        blobs.append(torch.from_numpy(blob))
        frames.append(frame)
    assert len({tuple(b.shape) for b in blobs}) < len(blobs)  # some blobs share a backbone pass
    batch = model.detect(blobs, frames, rule)
    boxes = [torch.from_numpy(o.boxes[:5]) * f.im_scale for o, f in zip(batch, frames)]
    probs = attribute_probs(model, blobs, boxes)
    for i in range(len(blobs)):
        (one,) = model.detect(blobs[i : i + 1], frames[i : i + 1], rule)
        assert np.array_equal(one.class_ids, batch[i].class_ids)  # same selection, same classes
        np.testing.assert_allclose(one.boxes, batch[i].boxes, rtol=0, atol=1e-3)  # measured: <= 2e-5 px
        np.testing.assert_allclose(one.features, batch[i].features, rtol=0, atol=1e-4)  # measured: <= 2e-6
        torch.testing.assert_close(
            attribute_probs(model, blobs[i : i + 1], boxes[i : i + 1])[0], probs[i], rtol=0, atol=1e-6
        )


def test_bf16_autocasts_the_network_and_scores_in_range(trained):
    world, weights, cfg = trained
    model = load_detector(weights)[0].fold_batchnorm()
    seen: set[torch.dtype] = set()
    model.backbone.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    _, rule = configure_recipe(model, "butd", cfg.eval, "eval")
    ann = world / "annotations" / "instances_train.json"
    ev = evaluate_model(model, ann, world / "images", *_names(weights), rule=rule, batch_size=3, precision="bf16")
    assert seen == {torch.bfloat16}
    assert ev["images"] == 16 and "failed_images" not in ev and 10 <= ev["boxes_per_image"] <= 100
    assert all(0.0 <= ev[k] <= 1.0 for k in ("recall", "class_accuracy", "attribute_accuracy"))
    seen.clear()
    evaluate_model(model, ann, world / "images", *_names(weights), rule=rule, limit=2, precision="fp32")
    assert seen == {torch.float32}


def _names(weights: Path) -> tuple[list[str], list[str]]:
    info = load_detector(weights)[1]
    return info["classes"], info["attributes"]


def _cli(trained, *extra: str):
    world, weights, _ = trained
    return CliRunner().invoke(
        app,
        [
            "eval-detector",
            str(weights),
            "-a",
            str(world / "annotations" / "instances_train.json"),
            "--images",
            str(world / "images"),
            "--json",
            "-q",
            *extra,
        ],
    )


def test_cli_options_reach_the_evaluation(trained):
    res = _cli(trained, "--device", "cpu", "--batch-size", "3", "--num-workers", "2")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout) == _evaluate(trained)
    res = _cli(trained, "--precision", "bf16", "--batch-size", "4")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["images"] == 16


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch-size", "0"], "--batch-size must be 1 or more, not 0"),
        (["--set", "eval.batch_size=0"], "eval.batch_size must be an integer >= 1, not 0"),
        (["--num-workers", "-1"], "--num-workers must be 0 (load in this process) or more, not -1"),
        (["--set", "eval.num_workers=-1"], "eval.num_workers must be an integer >= 0, not -1"),
        (["--precision", "fp16"], "eval.precision=fp16 cannot apply: the detector has no fp16 path"),
        (["--set", "eval.precision=fp64"], "eval.precision must be one of auto, fp32, tf32, bf16, fp16, not 'fp64'"),
        (["--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_bad_values_are_one_error_line(trained, extra, message):
    res = _cli(trained, *extra)
    lines = res.stderr.strip().splitlines()
    assert res.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], res.stderr
    assert "Traceback" not in res.output


def test_batches_reach_the_detector_and_workers_decode(trained, tmp_path, monkeypatch, four_cores):
    """The options are real: ``batch_size`` images per detect call, decoding in ``workers`` other processes."""
    import os

    import extractors.photos as run

    world, weights, cfg = trained
    model = load_detector(weights)[0].fold_batchnorm()
    sizes: list[int] = []
    detect = model.detect
    monkeypatch.setattr(model, "detect", lambda blobs, *a, **k: sizes.append(len(blobs)) or detect(blobs, *a, **k))
    decode = run.load_rgb

    def load_and_sign(path, *args):  # each decoding process leaves a file named by its pid
        (tmp_path / str(os.getpid())).touch()
        return decode(path, *args)

    monkeypatch.setattr(run, "load_rgb", load_and_sign)
    _, rule = configure_recipe(model, "butd", cfg.eval, "eval")
    evaluate_model(
        model,
        world / "annotations" / "instances_train.json",
        world / "images",
        *_names(weights),
        rule=rule,
        batch_size=3,
        workers=2,
    )
    assert sizes == [3, 3, 3, 3, 3, 1]
    pids = {int(p.name) for p in tmp_path.iterdir()}
    assert len(pids) == 2 and os.getpid() not in pids
