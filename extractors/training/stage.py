"""Detector training and evaluation as pipeline stages (:func:`pipeline.core.stages.run_stage` compatible).

from pipeline.core.stages import run_stage
from extractors.training.stage import demo_detector_config, train_detector
cfg = demo_detector_config("runs/demo/world")          # configs/detector/demo.yaml on the world's splits
result = run_stage("runs/demo", "detector", cfg, train_detector)
weights = result.directory / result.outputs["weights"]  # a butd file: cli extract --weights <it>
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from extractors.training.evaluate import evaluate_weights, summary_line
from extractors.training.loop import CHECKPOINT, WEIGHTS, train
from pipeline.core.config import CONFIG_DIR, Config, load_config
from pipeline.core.console import get_logger
from pipeline.core.distributed import env_context, resolve_device

log = get_logger("train-detector")

STAGE = "train_detector"
DEMO_PRESET = CONFIG_DIR / "detector" / "demo.yaml"


def load_detector_config(
    config_file: str | Path | None = None, overrides: list[str] | dict[str, Any] | None = None
) -> Config:
    """``configs/train_detector.yaml`` defaults, then a preset file (e.g. ``configs/detector/demo.yaml``), then
    overrides."""
    return load_config(STAGE, config_file, overrides)


def demo_detector_config(
    world_dir: str | Path, overrides: list[str] | dict[str, Any] | None = None, eval_split: str = "test"
) -> Config:
    """The demo preset pointed at a synthetic world written by ``cli demo --generate-only`` / the world stage;
    ``overrides``: ``KEY=VALUE`` strings or a mapping of dotted keys (the demo's ``detector_train:`` section)."""
    world = Path(world_dir)
    paths = [
        f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
        f"data.train_images={world / 'images'}",
        f"data.eval_annotations={world / 'annotations' / f'instances_{eval_split}.json'}",
        f"data.eval_images={world / 'images'}",
    ]
    return load_detector_config(DEMO_PRESET, paths).with_overrides(overrides, source="detector overrides")


def train_detector(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
    """Train (resuming if interrupted), export ``detector.pth``, evaluate on ``data.eval_annotations`` if set.

    Returns ``(outputs, summary)``: outputs ``weights`` / ``checkpoint`` (paths relative to ``stage_dir``);
    summary: iterations, training seconds, images/s, last losses, and the evaluation numbers.
    """
    result = train(stage_dir, cfg)
    summary: dict[str, Any] = {
        "iterations": result.iterations,
        "train_seconds": round(result.seconds, 1),
        "images_per_second": round(result.images_per_second, 2),
        "resumed_from": result.resumed_from,
        "losses": result.losses,
    }
    if result.skipped_images:
        summary["skipped"] = result.skipped_images
    if cfg.data.eval_annotations and env_context().main:
        ev = evaluate_detector(result.weights, cfg.data.eval_annotations, cfg.data.eval_images, cfg)
        log.info("evaluation on %s: %s", Path(str(cfg.data.eval_annotations)).name, summary_line(ev))
        summary["eval"] = ev
    return {"weights": WEIGHTS, "checkpoint": CHECKPOINT}, summary


def evaluate_detector(
    weights: str | Path,
    ann_file: str | Path,
    image_root: str | Path | None = None,
    cfg: Config | None = None,
    device: str | None = None,
) -> dict[str, Any]:
    """Evaluate a ``butd`` weights file on a COCO instances split with the ``eval`` section of ``cfg``: its recipe,
    IoU and attribute group, and how it runs (``device`` (an argument given wins), ``batch_size``, ``precision``,
    ``workers``)."""
    ecfg = (cfg or load_detector_config()).eval
    dev = resolve_device(str(device if device is not None else ecfg.device))
    return evaluate_weights(
        weights,
        ann_file,
        image_root,
        device=dev,
        section=ecfg,
        iou=float(ecfg.iou),
        attribute_group=str(ecfg.attribute_group),
        limit=None if ecfg.limit is None else int(ecfg.limit),
        batch_size=int(ecfg.batch_size),
        workers=int(ecfg.num_workers),
        precision=str(ecfg.precision),
    )
