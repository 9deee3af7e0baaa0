"""The demo: the whole staged pipeline on the embedded synthetic world, each stage resumable and skipped
when done.

    world -> detector -> features -> data -> train-<model> -> eval-<model> -> pictures-<model>

Every stage runs through :func:`pipeline.core.stages.run_stage` in ``OUT/<stage>/``; a stage's config includes the
config digests of the stages it reads from, so changing an upstream setting redoes what depends on it (and
is refused without ``--force``, like any changed stage). ``--models a,b,c`` trains and evaluates several
captioners on the same features (comparison mode); a name is a registered captioner or a ``demo.variants``
entry (a captioner plus train overrides, e.g. ``ngsan-signed``), so ablations sit in the same table.
``demo.features`` (``--features region,grid``) extracts each kind of feature from the demo detector and trains
every captioner on each: ``grid`` is the res5 map of the whole image pooled to ``demo.grid`` x ``demo.grid``
cells (docs/recipes.md#grid), stages ``features-grid``, ``train-<name>+grid``, ``eval-<name>+grid``, and the
table's rows ``<name>+grid`` sit beside the region rows. The kind ``oracle`` needs no detector: the world's
ground-truth regions (:mod:`pipeline.world.oracle_features`, ``demo.oracle``), stages ``features-oracle``,
``train-<name>+oracle``; the relations comparison (``configs/demo_relations.yaml``) uses it. A variant with an
``oracle:`` mapping (keys of ``demo.oracle``, e.g. ``box_features: true``) trains on its own oracle store, stage
``features-oracle-<name>``.
The kind ``clip`` needs no detector either: CLIP grid features (the CLIP-ViL recipe, 448 x 448) of a seeded random
CLIP encoder of the small architecture ``demo.clip`` (:mod:`extractors.clip.random_weights`; untrained, so the
rows measure the pipeline on CLIP-shaped features, not CLIP), written once as a weights file by the stage
``clip-encoder`` and extracted by ``cli extract``'s stage into ``features-clip``; stages ``train-<name>+clip``.
``demo.seeds`` trains (and evaluates) each captioner with that many training seeds (``train.seed``,
``train.seed + 1``, ...; the first keeps the single-run folder names, the others end in ``-seed<N>``); the
report holds every seed's figures and their mean and sample standard deviation.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import models as model_registry
from extractors.clip.model import ClipVisionConfig
from extractors.clip.random_weights import write_random_clip
from extractors.clip.run import RECIPE_SIZES, arch_name
from extractors.stage import ExtractJob, extract_features
from extractors.training.stage import demo_detector_config, train_detector
from pipeline.caption_data.prepare import prepare_captions
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.captioning.run import caption_photos
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.fileio import atomic_write_text, read_json
from pipeline.core.stages import StageResult, read_manifest, run_stage
from pipeline.training.api import evaluate_checkpoint, train_captioner
from pipeline.world.generate import generate_world, world_stage_config
from pipeline.world.grounding import grounding_scores, load_scenes
from pipeline.world.oracle_features import write_oracle_store

log = get_logger("demo")


@dataclass
class DemoReport:
    """What the demo did: every stage result, in order, plus per-model metrics."""

    out: Path
    stages: list[StageResult] = field(default_factory=list)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)  # per row: mean over seeds
    grounding: dict[str, dict[str, Any]] = field(default_factory=dict)  # per row: mean over seeds
    spread: dict[str, dict[str, float]] = field(
        default_factory=dict
    )  # per row: sample sd over seeds (metrics + grounding)
    runs: dict[str, list[dict[str, Any]]] = field(
        default_factory=dict
    )  # per row: {seed, metrics, grounding, train_seconds}
    detector: dict[str, Any] = field(default_factory=dict)
    pictures: dict[str, list[str]] = field(default_factory=dict)
    checkpoint: str = ""  # which checkpoint each row evaluates (checkpoint_choice)
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "out": str(self.out),
            "seconds": round(self.seconds, 1),
            "stages": [
                {"stage": r.name, "skipped": r.skipped, "seconds": round(r.seconds, 2), "directory": str(r.directory)}
                for r in self.stages
            ],
            "detector": self.detector,
            "metrics": self.metrics,
            "grounding": self.grounding,
            "spread": self.spread,
            "runs": self.runs,
            "pictures": self.pictures,
            "checkpoint": self.checkpoint,
        }


def _with_inputs(cfg: Config | dict[str, Any], **upstream: StageResult) -> Config:
    """A stage config that also records the manifests' digests of the stages it reads from."""
    data = cfg.to_dict() if isinstance(cfg, Config) else dict(cfg)
    data["inputs"] = {name: (read_manifest(r.directory) or {}).get("config_digest", "") for name, r in upstream.items()}
    return Config(data)


def _eval_work(checkpoint: Path, store: Path, data: Path, fast_only: bool, decoding: dict[str, Any]):
    """The test-split evaluation, decoded as the pictures stage decodes: the checkpoint's decoding under the demo's
    ``decoding:`` section (the one layering of docs/architecture.md#decoding)."""

    def work(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        rep = evaluate_checkpoint(
            checkpoint,
            store,
            data,
            split=str(cfg.split),
            out_dir=stage_dir,
            fast_only=fast_only,
            decoding=decoding or None,
        )
        metrics = {k: float(v) for k, v in rep["metrics"].items() if isinstance(v, (int, float))}
        return {"predictions": Path(rep["predictions"]).name, "metrics": Path(rep["metrics_file"]).name}, {
            "metrics": metrics,
            "images": rep.get("num_images"),
            "notes": list(rep.get("notes", [])),
        }

    return work


def _pictures_work(
    world_dir: Path, checkpoint: Path, weights: Path, data: Path, ccfg: Config, decoding: dict[str, Any]
):
    def work(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        prepared = PreparedCaptions.load(data)
        keys = [prepared.images[i]["key"] for i in prepared.split_indices("test")][: int(cfg.count)]
        photos = [str(world_dir / "images" / k) for k in keys]
        caption_photos(
            photos,
            checkpoint,
            str(weights),
            ccfg,
            output=stage_dir / "captions.jsonl",
            visualize=stage_dir / "pictures",
            gallery=stage_dir / "gallery",
            decoding=decoding,
        )
        names = sorted(p.name for p in (stage_dir / "pictures").glob("*.png"))
        rows = [json.loads(line) for line in (stage_dir / "captions.jsonl").read_text(encoding="utf-8").splitlines()]
        return {"captions": "captions.jsonl", "pictures": "pictures", "gallery": "gallery/index.html"}, {
            "captioned": sum("caption" in r for r in rows),
            "pictures": names,
        }

    return work


def _oracle_work(world_dir: Path):
    def work(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        summary = write_oracle_store(
            world_dir,
            stage_dir / "store",
            noise=float(cfg.noise),
            seed=int(cfg.seed),
            box_features=bool(cfg.box_features),
            key="file_name",
        )
        return {"store": "store"}, summary

    return work


def _stage_seconds(result: StageResult) -> float:
    """How long the stage took when it ran, read from its manifest whether this run ran it or skipped it.

    Both paths read the manifest's value (rounded to 3 places there), so a rerun that skips the stage reports
    the very number the first run did: rounding the unrounded timing to 1 place could differ at a boundary."""
    recorded = (read_manifest(result.directory) or {}).get("seconds")
    if recorded is None:
        recorded = 0.0 if result.skipped else round(result.seconds, 3)
    return round(float(recorded), 1)


def mean_and_spread(rows: list[dict[str, Any]]) -> tuple[dict[str, float], dict[str, float]]:
    """Mean and sample standard deviation (0 for one row) of every numeric key the rows share."""
    keys = (
        [
            k
            for k, v in rows[0].items()
            if isinstance(v, (int, float))
            and not isinstance(v, bool)
            and all(isinstance(r.get(k), (int, float)) for r in rows)
        ]
        if rows
        else []
    )
    mean = {k: statistics.fmean(float(r[k]) for r in rows) for k in keys}
    spread = {k: statistics.stdev(float(r[k]) for r in rows) if len(rows) > 1 else 0.0 for k in keys}
    return mean, spread


def _plain(node: Any) -> dict[str, Any]:
    """A config mapping (or None) as a plain dict."""
    if isinstance(node, Config):
        return node.to_dict()
    return dict(node or {})


def _grounding(scenes: dict[int, Any], ev: StageResult) -> dict[str, Any]:
    """Grounding accuracy of the eval stage's test captions against the world's test scenes (recomputed on every
    run from the stage's files: cheap, and it needs no change to a finished stage)."""
    predictions = read_json(ev.directory / ev.outputs["predictions"], "predictions file", expect=list)
    return grounding_scores(predictions, scenes)


def demo_captioners(cfg: Config, names: list[str]) -> dict[str, str]:
    """Map each ``--models`` name to the registered captioner it trains: itself, or its ``demo.variants`` entry's
    ``model``. Unknown names and variants without a registered ``model`` are usage errors."""
    known = model_registry.available_captioners()
    variants = _plain(cfg.demo.variants)
    resolved: dict[str, str] = {}
    for name in names:
        if name in known:
            resolved[name] = name
            continue
        if name not in variants:
            raise UsageError(
                f"unknown captioner '{name}' in --models (captioners: {', '.join(known)}; "
                f"demo.variants: {', '.join(variants) or 'none'})"
            )
        base = variants[name].get("model") if isinstance(variants[name], dict) else None
        if base not in known:
            raise UsageError(
                f"demo.variants.{name}: 'model' must name a registered captioner ({', '.join(known)}), got {base!r}"
            )
        resolved[name] = str(base)
    return resolved


def demo_train_config(cfg: Config, name: str, model: str, store: Path, data: Path) -> Config:
    """The train config of one ``--models`` entry: the demo's train section, ``demo.train_overrides[model]``,
    then (for a variant) the variant's own keys on top. Mappings merge key by key."""
    tcfg = Config({"train": cfg.train.to_dict()}, cfg.open_paths).with_overrides(
        {"train.model": model, "train.store": str(store), "train.data": str(data)}
    )
    layers = [_plain(_plain(cfg.demo.train_overrides).get(model))]
    if name != model:
        layers.append(
            {k: v for k, v in _plain(_plain(cfg.demo.variants).get(name)).items() if k not in VARIANT_DEMO_KEYS}
        )
    for layer in layers:
        for key, value in layer.items():
            tcfg = tcfg.with_overrides({f"train.{key}": value}, source=f"demo overrides of {name}:")
    return tcfg


FEATURE_KINDS = ("region", "grid", "oracle", "clip")
#: the kinds extracted with the demo detector (trained in the stage ``detector``)
DETECTOR_KINDS = ("region", "grid")
CLIP_RECIPE = "clip-vil"
#: keys of a ``demo.variants`` entry that are not train keys: its captioner, and its oracle regions
VARIANT_DEMO_KEYS = ("model", "oracle")
ORACLE_KEYS = ("noise", "seed", "box_features")


def variant_oracle(cfg: Config, name: str) -> dict[str, Any]:
    """The ``demo.oracle`` section of one ``--models`` name: ``demo.oracle`` with the variant's ``oracle`` keys
    on top (e.g. ``san-box: {model: san, oracle: {box_features: true}}``: SAN on regions that carry their box,
    beside SAN on the position-free regions of the same world). Unknown keys are usage errors."""
    base = _plain(cfg.demo.oracle)
    entry = _plain(cfg.demo.variants).get(name)
    own = entry.get("oracle") if isinstance(entry, dict) else None
    if own is None:
        return base
    if not isinstance(own, dict) or set(own) - set(ORACLE_KEYS):
        raise UsageError(f"demo.variants.{name}.oracle: a mapping of {', '.join(ORACLE_KEYS)}, got {own!r}")
    return {**base, **own}


def demo_feature_kinds(cfg: Config, kinds: list[str] | None = None) -> list[str]:
    """The feature kinds of a demo run (``--features`` or ``demo.features``), checked."""
    names = list(kinds if kinds is not None else cfg.demo.features)
    if not names or any(k not in FEATURE_KINDS for k in names) or len(set(names)) != len(names):
        raise UsageError(f"demo features must be distinct names among {', '.join(FEATURE_KINDS)}, got {names}")
    return names


def grid_extract_section(cfg: Config) -> Config:
    """The ``extract:`` section for grid features from the demo detector: ``--boxes grid`` pooled to
    ``demo.grid`` x ``demo.grid``, at the detector's own test scale (the recipe's ``null`` sizes and mean/std)."""
    return cfg.extract.with_overrides(
        {
            "boxes": "grid",
            "recipe": "grid-feats",
            "recipes.grid-feats.grid": int(cfg.demo.grid),
            "recipes.grid-feats.min_size": None,
            "recipes.grid-feats.max_size": None,
            "recipes.grid-feats.pixel_mean": None,
            "recipes.grid-feats.pixel_std": None,
        }
    )


def clip_encoder_config(cfg: Config) -> tuple[ClipVisionConfig, int]:
    """The architecture and seed of the demo's random CLIP encoder (``demo.clip``); one usage error when invalid."""
    section = _plain(cfg.demo.clip)
    seed = section.pop("seed", 0)
    try:
        layers = section.pop("layers")
        enc = ClipVisionConfig(
            layers=tuple(int(n) for n in (layers if isinstance(layers, list) else [layers])), **section
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise UsageError(
            f"demo.clip: not a CLIP encoder (kind, width, layers, resolution, embed_dim, patch): {exc}"
        ) from None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise UsageError(f"demo.clip.seed must be an integer, got {seed!r}")
    return enc, seed


def clip_extract_section(cfg: Config) -> Config:
    """The ``extract:`` section for the demo's CLIP grid: the CLIP-ViL recipe, every cell of the grid."""
    return cfg.extract.with_overrides({"recipe": CLIP_RECIPE, "boxes": None})


def clip_cells(enc: ClipVisionConfig) -> int:
    """Grid cells per image under the demo's CLIP recipe (what each captioner attends over)."""
    return (RECIPE_SIZES[CLIP_RECIPE] // enc.stride) ** 2


def _clip_encoder_work(enc: ClipVisionConfig, seed: int):
    def work(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        write_random_clip(enc, stage_dir / "clip-random.pt", seed)
        return {"weights": "clip-random.pt"}, {
            "architecture": arch_name(enc),
            "seed": seed,
            "cells": clip_cells(enc),
            "dim": enc.grid_dim,
        }

    return work


def checkpoint_choice(tcfg: Config) -> str:
    """Which checkpoint ``best.pt`` holds under a train config: the best one by the validation metric, or (no
    validation split) the last epoch's weights."""
    val = tcfg.train.validation
    if not val.split:
        return "last epoch (train.validation.split: null)"
    return f"best validation {val.metric} on split {val.split}"


def run_demo(
    out: Path,
    cfg: Config,
    models: list[str],
    force: bool = False,
    generate_only: bool = False,
    features: list[str] | None = None,
) -> DemoReport:
    """Run (or resume) the demo into ``out``; returns a :class:`DemoReport`."""
    captioners = demo_captioners(cfg, models)
    for name in captioners:  # the variants' oracle keys checked before any stage runs
        variant_oracle(cfg, name)
    kinds = demo_feature_kinds(cfg, features)
    if int(cfg.demo.seeds) < 1:
        raise UsageError(f"demo.seeds must be >= 1, got {cfg.demo.seeds}")
    detector_overrides = {f"detector_train.{k}": v for k, v in cfg.detector_train.to_dict().items()}
    if any(kind in DETECTOR_KINDS for kind in kinds):  # the detector_train: keys checked before any stage runs
        demo_detector_config(out / "world", overrides=detector_overrides)
    if "clip" in kinds:
        clip_arch, clip_seed = clip_encoder_config(cfg)
    t0 = time.perf_counter()
    report = DemoReport(out=out)
    world = run_stage(out, "world", world_stage_config(cfg.world), generate_world, force=force)
    report.stages.append(world)
    if generate_only:
        report.seconds = time.perf_counter() - t0
        return report

    stores: dict[str, tuple[StageResult, Path]] = {}
    own_oracle: dict[str, tuple[StageResult, Path]] = {}  # variants with their own oracle keys: their own store
    if "oracle" in kinds:
        feats = run_stage(
            out,
            "features-oracle",
            _with_inputs(cfg.demo.oracle, world=world),
            _oracle_work(world.directory),
            force=force,
        )
        report.stages.append(feats)
        stores["oracle"] = (feats, feats.directory / feats.outputs["store"])
        for name in captioners:
            section = variant_oracle(cfg, name)
            if section != _plain(cfg.demo.oracle):
                feats = run_stage(
                    out,
                    f"features-oracle-{name}",
                    _with_inputs(section, world=world),
                    _oracle_work(world.directory),
                    force=force,
                )
                report.stages.append(feats)
                own_oracle[name] = (feats, feats.directory / feats.outputs["store"])
    weights: Path | None = None
    if any(kind in DETECTOR_KINDS for kind in kinds):
        det_cfg = demo_detector_config(world.directory, overrides=detector_overrides)
        detector = run_stage(out, "detector", _with_inputs(det_cfg, world=world), train_detector, force=force)
        report.stages.append(detector)
        report.detector = dict(detector.summary.get("eval", {}))
        weights = detector.directory / detector.outputs["weights"]

    for kind in [k for k in kinds if k in DETECTOR_KINDS]:
        section = cfg.extract if kind == "region" else grid_extract_section(cfg)
        feats = extract_features(
            out,
            "features" if kind == "region" else "features-grid",
            section,
            ExtractJob(str(weights), (str(world.directory / "images"),)),
            config=_with_inputs(section, detector=detector),
            force=force,
        )
        report.stages.append(feats)
        stores[kind] = (feats, feats.directory / feats.outputs["store"])
    if "clip" in kinds:
        encoder = run_stage(
            out,
            "clip-encoder",
            Config({"clip": _plain(cfg.demo.clip), "files": ["clip-random.pt", "open_clip_config.json"]}),
            _clip_encoder_work(clip_arch, clip_seed),
            force=force,
        )
        report.stages.append(encoder)
        section = clip_extract_section(cfg)
        feats = extract_features(
            out,
            "features-clip",
            section,
            ExtractJob(str(encoder.directory / encoder.outputs["weights"]), (str(world.directory / "images"),)),
            config=_with_inputs(section, encoder=encoder, world=world),
            force=force,
        )
        report.stages.append(feats)
        stores["clip"] = (feats, feats.directory / feats.outputs["store"])

    prep_cfg = cfg.prepare.with_overrides(
        {"karpathy_json": str(world.directory / world.outputs["karpathy"]), "key": "filename"}
    )
    data = run_stage(out, "data", _with_inputs(prep_cfg, world=world), prepare_captions, force=force)
    report.stages.append(data)

    test_scenes = load_scenes(world.directory / "annotations" / "instances_test.json")
    seeds = int(cfg.demo.seeds)
    decoding = cfg.decoding.to_dict()  # over each checkpoint's own, for the eval and pictures stages alike
    for kind, name, model in [(k, n, m) for k in kinds for n, m in captioners.items()]:
        features, store = own_oracle[name] if kind == "oracle" and name in own_oracle else stores[kind]
        tcfg = demo_train_config(cfg, name, model, store, data.directory)
        if kind == "grid":
            tcfg = tcfg.with_overrides({"train.max_boxes": int(cfg.demo.grid) ** 2})
        elif kind == "clip":
            tcfg = tcfg.with_overrides({"train.max_boxes": clip_cells(clip_arch)})
        name = name if kind == "region" else f"{name}+{kind}"
        report.checkpoint = report.checkpoint or checkpoint_choice(tcfg)
        runs = []
        for k in range(seeds):
            seed = int(tcfg.train.seed) + k
            suffix = f"-seed{seed}" if k else ""  # the first seed keeps the single-run folder names
            trained = train_captioner(
                out, tcfg.with_overrides({"train.seed": seed}), force=force, stage_name=f"train-{name}{suffix}"
            )
            report.stages.append(trained)
            best = trained.directory / trained.outputs["best"]
            ev = run_stage(
                out,
                f"eval-{name}{suffix}",
                _with_inputs(
                    {
                        "split": "test",
                        "fast_only": bool(cfg.demo.fast_metrics_only),
                        **({"decoding": decoding} if decoding else {}),
                    },
                    train=trained,
                    features=features,
                ),
                _eval_work(best, store, data.directory, bool(cfg.demo.fast_metrics_only), decoding),
                force=force,
            )
            report.stages.append(ev)
            runs.append(
                {
                    "seed": seed,
                    "metrics": dict(ev.summary.get("metrics", {})),
                    "grounding": _grounding(test_scenes, ev),
                    "train_seconds": _stage_seconds(trained),
                }
            )
            if k == 0 and int(cfg.demo.pictures) > 0 and kind == "region":
                pics = run_stage(
                    out,
                    f"pictures-{name}",
                    _with_inputs(
                        {"count": int(cfg.demo.pictures), "caption": cfg.caption.to_dict(), "decoding": decoding},
                        train=trained,
                    ),
                    _pictures_work(world.directory, best, weights, data.directory, cfg.caption, decoding),
                    force=force,
                )
                report.stages.append(pics)
                report.pictures[name] = [str(pics.directory / "pictures" / p) for p in pics.summary.get("pictures", [])]
        report.runs[name] = runs
        report.metrics[name], metric_sd = mean_and_spread([r["metrics"] for r in runs])
        ground_mean, ground_sd = mean_and_spread([r["grounding"] for r in runs])
        report.grounding[name] = (
            {k: ground_mean.get(k) for k in runs[0]["grounding"]} if seeds > 1 else runs[0]["grounding"]
        )
        report.spread[name] = {**metric_sd, **ground_sd}
    report.seconds = time.perf_counter() - t0
    atomic_write_text(out / "summary.json", json.dumps(report.to_json(), indent=1) + "\n")
    return report
