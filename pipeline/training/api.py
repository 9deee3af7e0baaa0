"""Python entry points of training and evaluation (used by ``cli train``, ``cli evaluate --model`` and the demo).

* :func:`train_captioner` runs the ``train-<model>`` stage in a run directory (skipped when done with the
  same config, resumed when interrupted) and returns its :class:`~pipeline.core.stages.StageResult`.
* :func:`evaluate_checkpoint` decodes a split with a checkpoint's decoding settings, scores it with the COCO
  metrics and writes ``predictions_<split>.json`` (COCO results format) and ``metrics_<split>.json``.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.stages import StageResult, read_manifest, run_stage

log = get_logger("train")


def resolve_paths(run_dir: str | Path, cfg: Config) -> Config:
    """Fill ``train.store`` / ``train.data`` from the run directory's ``features/store`` and ``data`` when null."""
    run_dir = Path(run_dir)
    section = cfg.train if "train" in cfg else cfg
    sets = {}
    if section.store is None:
        sets["store"] = str(run_dir / "features" / "store")
    if section.data is None:
        sets["data"] = str(run_dir / "data")
    for key, path in sets.items():
        if not Path(path).exists():
            raise UsageError(f"train.{key} is not set and {path} does not exist; pass --set train.{key}=PATH")
    return section.with_overrides(sets) if sets else section


def train_captioner(
    run_dir: str | Path, cfg: Config, force: bool = False, stage_name: str | None = None
) -> StageResult:
    """Train ``cfg.train.model`` (or a bare ``train`` section) into ``run_dir/train-<model>`` (or ``run_dir/<stage_name>``).

    Works under ``torchrun`` too: rank 0 keeps the stage manifest, every rank trains.
    Returns the stage result: ``outputs`` = {last, best, xe, log} (paths relative to ``result.directory``),
    ``summary`` = {model, stages, best {metric, value, stage, epoch}, global_steps, history}.
    """
    from pipeline.core import distributed
    from pipeline.core.training.determinism import deterministic_mode
    from pipeline.training.engine import Trainer

    section = resolve_paths(
        run_dir, cfg
    )  # torch's threads: the one policy (--threads / BUTD_THREADS, pipeline.core.threads)
    ctx = distributed.setup(str(section.device), "train.device")
    name = stage_name or f"train-{section.model}"

    def work(stage_dir: Path, scfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        with deterministic_mode(bool(scfg.deterministic), "train.deterministic"):  # before the model touches cuBLAS
            summary = Trainer(stage_dir, scfg, ctx).run()
        outputs = {"last": "last.pt", "best": "best.pt", "log": "log.jsonl"}
        if "xe" in scfg.stages:
            outputs["xe"] = "xe.pt"
        return outputs, summary

    try:
        if ctx.main:
            result = run_stage(run_dir, name, section, work, force=force)
            distributed.barrier(ctx)
            return result
        stage_dir = Path(run_dir) / name
        manifest = read_manifest(stage_dir)
        if manifest is not None and manifest["config_digest"] == section.digest() and not force:
            distributed.barrier(ctx)
            return StageResult(name, stage_dir, dict(manifest["outputs"]), 0.0, True, dict(manifest.get("summary", {})))
        outputs, summary = work(stage_dir, section)
        distributed.barrier(ctx)
        return StageResult(name, stage_dir, outputs, 0.0, False, summary)
    finally:
        distributed.teardown(ctx)


def _decoding_source(dataset: Any, dev: Any, num_workers: int) -> Any:
    """The batches ``evaluate --model`` decodes: the split preloaded (RAM, or the CUDA device) with 0 workers,
    else read from the store per batch in ``num_workers`` DataLoader processes."""
    from pipeline.training.batches import BatchSource

    if num_workers < 0:
        raise UsageError(f"evaluate.num_workers must be >= 0, not {num_workers}")
    preload = "none" if num_workers > 0 else "memory" if dev.type == "cpu" else "cuda"
    return BatchSource(dataset, preload, dev, num_workers)


def evaluate_checkpoint(
    checkpoint: str | Path,
    store: str | Path,
    data: str | Path,
    split: str = "test",
    out_dir: str | Path | None = None,
    eval_section: Any = None,
    decoding: dict[str, Any] | None = None,
    device: str = "auto",
    batch_size: int = 50,
    fast_only: bool = False,
    precision: str = "tf32",
    companion: str | Path | None = None,
    num_workers: int = 0,
) -> dict[str, Any]:
    """Decode ``split`` with the checkpoint's model and decoding settings and score it.

    Args:
        checkpoint: a ``best.pt`` / ``last.pt`` / ``xe.pt`` written by training.
        store, data: the feature store and the prepared captions folder (its vocabulary must match).
        out_dir: where ``predictions_<split>.json`` and ``metrics_<split>.json`` go (default: next to the checkpoint).
        eval_section: the ``evaluate:`` config section (metrics, tokenizer, Java); default configs/evaluate.yaml.
        decoding: the command's ``decoding:`` section over the checkpoint's (e.g. ``{"beam_size": 1}``;
            :func:`models.decoding.captions.layered_decoding`).
        fast_only: only the fast CIDEr-D (no Java), e.g. for tests.
        precision: decoding precision, :mod:`pipeline.core.precision` (default ``tf32``, as ``caption``'s; ``auto``:
            bf16 on a CUDA device with native bf16, else fp32, and fp32 for a released model), resolved as ``caption``
            resolves it (:func:`models.decoding.captions.decoding_for`).
        companion: a released model's vocabulary file (M2 ``vocab.pkl``, AoANet ``infos_*.pkl``) when
            ``checkpoint`` is a released weights file (``models.released``); such a model decodes with its own
            vocabulary and its captions are scored as text against the split's references.
        num_workers: 0 reads the split's features into memory first (onto a CUDA device); N > 0 reads each
            decoding batch from the store in N DataLoader processes (the store opens lazily in each), which
            bounds memory by the batches in flight. The captions do not depend on it.

    Returns ``{"metrics": {...}, "num_images", "skipped", "notes", "predictions": path, "metrics_file": path}``.
    """
    from models.decoding.captions import decoding_for
    from models.decoding import check_max_len
    from pipeline.caption_data.prepared import PreparedCaptions
    from pipeline.core.config import load_config
    from pipeline.data import CaptionDataset
    from pipeline.core.fileio import atomic_write_json
    from pipeline.metrics.coco import EvalOptions
    from pipeline.store import FeatureStore
    from models.loading import load_captioner
    from pipeline.core.distributed import DistContext, resolve_device
    from pipeline.core.vocab import Vocab
    from pipeline.training.validation import decode_split, score_split

    checkpoint = Path(checkpoint)
    prepared = PreparedCaptions.load(data)
    dev = resolve_device(device)
    model, ckpt = load_captioner(checkpoint, dev, prepared.vocab, companion=companion)
    vocab = Vocab(ckpt.vocab) if ckpt.release else prepared.vocab
    section = eval_section if eval_section is not None else load_config("evaluate", None, []).evaluate
    features = FeatureStore(store)
    want = getattr(model, "feat_dim", None)
    if want is not None and features.feature_dim is not None and features.feature_dim != want:
        hint = " (released models need the Caffe bottom-up 2048-d features, see README)" if ckpt.release else ""
        raise UsageError(
            f"{store} holds {features.feature_dim}-d region features, but the captioner {checkpoint} expects {want}-d{hint}"
        )
    dataset = CaptionDataset(features, prepared, split)
    options, resolved = decoding_for(ckpt, decoding, precision, dev, "evaluate.precision")  # as caption decodes it
    check_max_len(options, model, "--max-len")
    source = _decoding_source(dataset, dev, num_workers)
    ctx = DistContext(device=dev)
    preds = decode_split(model, source, vocab, options, ctx, batch_size, resolved, description=f"decoding {split}")
    references = prepared.references()
    scores = score_split(preds, references, full=not fast_only, options=EvalOptions.from_config(section))
    out = Path(out_dir) if out_dir is not None else checkpoint.parent
    cocoid = {img["key"]: img.get("cocoid") for img in prepared.images}
    results = [
        {"image_id": cocoid.get(k) if cocoid.get(k) is not None else k, "caption": c} for k, c in sorted(preds.items())
    ]
    pred_path = atomic_write_json(out / f"predictions_{split}.json", results, indent=None)
    metrics = {k: v for k, v in scores.items() if isinstance(v, float)}
    payload = {
        "checkpoint": str(checkpoint),
        "model": ckpt.model_name,
        "split": split,
        "num_images": len(preds),
        "decoding": asdict(options),
        "metrics": metrics,
        "skipped": scores.get("skipped", {}),
        "notes": scores.get("notes", []),
        "tokenizer": scores.get("tokenizer", "words"),
    }
    metrics_path = atomic_write_json(out / f"metrics_{split}.json", payload)
    return {**payload, "predictions": str(pred_path), "metrics_file": str(metrics_path)}
