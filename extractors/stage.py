"""Feature extraction as a pipeline stage (:func:`pipeline.core.stages.run_stage`), used by ``cli extract`` and
the demo alike.

    from extractors.stage import ExtractJob, extract_features
    job = ExtractJob(weights="bua-caffe-frcn-r101_with_attributes.pth", paths=("photos",))
    result = extract_features("runs/x", "features", load_config("extract").extract, job)
    store = result.directory / result.outputs["store"]      # runs/x/features/store

The stage config is the ``extract:`` section plus the job (weights and inputs), so its manifest says what was
extracted from what. A feature store accumulates: images already in it are skipped, an image that failed is
tried again, and the store refuses another extractor (its identity). So a finished extraction is done again
(a new pass over its inputs, cheap for the images already in the store) when it recorded failures or when the
same store is given other inputs or settings (``reopen=True``, what ``cli extract`` does); the manifest records the
last pass. The demo keeps the strict stage rule (a changed config needs ``--force``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from extractors import available_extractors
from extractors.factory import configure_recipe, load_for_inference, record_settings
from extractors.inputs import items_from_coco, items_from_file_list, items_from_paths, shard_items
from extractors.recipes import BOX_MODES, validate_config
from extractors.releases import release_of_weights
from extractors.run import run_extraction
from extractors.to_host import use_channels_last
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.distributed import local_processes, resolve_device, shared_gpu, visible_gpus
from pipeline.core.environment import launcher_int
from pipeline.core.errors import ConfigError, UsageError
from pipeline.core.keys import key_to_text
from pipeline.core.precision import resolve_precision
from pipeline.core.stages import MANIFEST, RUNNING, StageResult, read_manifest, run_stage
from pipeline.hub import resolve_file
from pipeline.store import open_writer

log = get_logger("extract")

FAILURES = "failures.jsonl"


@dataclass(frozen=True)
class ExtractJob:
    """What one extraction reads and where its store goes (the parts that are not settings of ``extract:``).

    ``paths``: image folders (recursive), files or globs; ``file_list``: a text file with one image per line;
    ``coco``: a COCO annotations file (its images, and with ``boxes: given`` its boxes), ``image_root`` the
    folder of the file-list / COCO images; ``shard`` (i, n) keeps every n-th block of ``shard_block`` images from
    block i (1: every n-th image; torchrun uses the batch size), ``limit`` the first N;
    ``store``: the store's folder inside the stage folder (``"."``: the stage folder is the store); failures are
    listed in ``STAGE/failures.jsonl``.
    """

    weights: str
    paths: tuple[str, ...] = ()
    file_list: str | None = None
    image_root: str | None = None
    coco: str | None = None
    shard: tuple[int, int] | None = None
    limit: int | None = None
    store: str = "store"
    shard_block: int = 1

    def to_config(self) -> dict[str, Any]:
        """The job as plain data for the stage config (absolute paths, so a manifest says which files)."""

        def where(p: str | None) -> str | None:
            return None if p is None else str(Path(p).absolute())

        data = asdict(self)
        data.update(
            paths=[str(Path(p).absolute()) if "*" not in p else p for p in self.paths],
            file_list=where(self.file_list),
            image_root=where(self.image_root),
            coco=where(self.coco),
            shard=list(self.shard) if self.shard else None,
            weights=self.weights if self.weights == "random" else where(self.weights),
        )
        if self.shard_block == 1:  # the default is not recorded (earlier stage digests stay valid)
            data.pop("shard_block")
        return data


def bucket_window(section: Any, dev: Any) -> int:
    """``extract.bucket_window``: ``auto`` = 4 on CUDA (real folders batch at ~1 otherwise), 0 elsewhere (the loader's
    batches as they come, so CPU outputs do not depend on which photos wait together)."""
    value = section.bucket_window if "bucket_window" in section else "auto"
    if str(value) == "auto":
        return 4 if dev.type == "cuda" else 0
    try:
        window = int(value)
    except (TypeError, ValueError):
        window = -1
    if window < 0 or isinstance(value, bool):
        raise ConfigError(f"extract.bucket_window must be auto or an integer >= 0, got {value!r}")
    return window


def stage_config(section: Config, job: ExtractJob) -> Config:
    """The config of an extraction stage: ``{"extract": section, "job": job}`` (its digest decides "already done")."""
    return Config({"extract": section.to_dict(), "job": job.to_config()})


def selection_mode(section: Config, weights: str | None = None) -> str | None:
    """Check the preset and the recipe settings of an ``extract:`` section (``preset``, ``recipe``, ``recipes``, the
    shorthands) before any work; returns its ``boxes`` mode (``None``: the recipe's own). The run's recipe itself
    is built by :func:`extractors.recipes.recipe_from_config` once the weights' layout is known."""
    preset = str(section.preset)
    known = available_extractors()
    if preset != "auto" and preset not in known:
        raise UsageError(f"unknown preset {preset!r} for extract.preset / --preset (known: auto, {', '.join(known)})")
    claimed = release_of_weights(weights)  # weights with their own recipes (CLIP encoders): the release checks
    if claimed is not None:
        return claimed[0].own.check(section, "extract", weights)
    mode = None if section.boxes is None else str(section.boxes)
    if mode is not None and mode not in BOX_MODES:
        raise UsageError(f"--boxes must be one of {', '.join(BOX_MODES)}, not {mode!r}")
    validate_config(section)
    return mode


def collect_items(job: ExtractJob, mode: str) -> list[Any]:
    """The images of ``job`` (folders, file list, COCO file), sharded and limited; usage errors when there are none."""
    if mode == "given" and job.coco is None:
        raise UsageError("--boxes given needs --coco ANNOTATIONS (the boxes come from its 'annotations')")
    items = []
    if job.paths:
        items += items_from_paths(list(job.paths))
    if job.file_list is not None:
        items += items_from_file_list(Path(job.file_list), None if job.image_root is None else Path(job.image_root))
    if job.coco is not None:
        items += items_from_coco(
            Path(job.coco), None if job.image_root is None else Path(job.image_root), with_boxes=mode == "given"
        )
    if not items:
        raise UsageError("no images found in the given inputs")
    if all(it.problem is not None for it in items):  # every input missing, a dangling link, not a file, ...
        shown = "; ".join(f"{key_to_text(str(it.path))} ({it.problem[1]})" for it in items[:5])
        raise UsageError(f"no usable images in the given inputs: {shown}{' ...' if len(items) > 5 else ''}")
    if job.shard is not None:
        items = shard_items(items, *job.shard, block=job.shard_block)
    if job.limit is not None:
        items = items[: max(0, job.limit)]
    return items


def _device(section: Config, job: ExtractJob) -> Any:
    """``extract.device``; under torchrun with shards, ``cuda`` (or ``auto`` on a CUDA machine) means this rank's
    GPU, and more processes than visible GPUs share them: local rank ``r`` runs on ``cuda:(r mod GPUs)``
    (:func:`pipeline.core.distributed.shared_gpu`; each process holds its own detector, no collective runs on
    the GPU), said in the log."""
    name = str(section.device)
    if (
        job.shard is not None
        and "LOCAL_RANK" in os.environ
        and (name == "cuda" or (name == "auto" and torch.cuda.is_available()))
    ):
        local_rank = launcher_int("LOCAL_RANK", 0)
        dev = shared_gpu(local_rank)
        procs, gpus = local_processes(local_rank), visible_gpus()
        if procs > gpus:  # said by rank 0 (the other ranks log warnings only), for every rank
            log.info(
                "%d processes share %d visible GPU%s: local rank r extracts on cuda:(r mod %d) "
                "(this process: local rank %d on %s)",
                procs,
                gpus,
                "" if gpus == 1 else "s",
                gpus,
                local_rank,
                dev,
            )
        return dev
    return resolve_device(name)


def extract_work(
    section: Config, job: ExtractJob, items: list[Any] | None = None
) -> Callable[[Path, Config], tuple[dict[str, Any], dict[str, Any]]]:
    """The stage function: extract ``job``'s images (or the already collected ``items``) with the settings of
    ``section`` into ``STAGE/job.store``.

    Resumable (images already in the store are skipped); the summary holds the counts, boxes, speed and failure
    reasons (each failure is a line of ``STAGE/failures.jsonl``).
    """

    def work(stage_dir: Path, cfg: Config) -> tuple[dict[str, Any], dict[str, Any]]:
        todo = items if items is not None else collect_items(job, selection_mode(section, job.weights))
        dev = _device(section, job)
        precision = resolve_precision(
            str(section.precision), dev, "extract.precision", fp16=False
        )  # auto -> fp32 | bf16
        spec = section.spec.to_dict() if hasattr(section.spec, "to_dict") else dict(section.spec)
        labelmap = section.labelmap if "labelmap" in section else None
        if labelmap:
            labelmap = resolve_file(labelmap, "extract.labelmap file", "labelmap")
        model, identity, _info = load_for_inference(
            job.weights, str(section.preset), spec, int(section.random_seed), dev, labelmap=labelmap, section=section
        )
        recipe, selector = configure_recipe(model, identity.layout, section)
        model.roi_chunk = int(section.roi_chunk)
        use_channels_last(model, bool(section.channels_last) if "channels_last" in section else False)
        identity = record_settings(identity, model, selector, precision)  # the recipe next to the weights' SHA-256
        store = stage_dir / job.store
        log.info(
            "extracting %d images with %s (recipe %s) on %s (%s) into %s",
            len(todo),
            identity.name,
            recipe.name,
            dev,
            precision,
            store,
        )
        with open_writer(store, identity, feature_dtype=str(section.feature_dtype)) as writer:
            summary = run_extraction(
                model,
                todo,
                writer,
                selector,
                batch_size=int(section.batch_size),
                workers=int(section.num_workers),
                precision=precision,
                max_pixels=int(section.max_pixels),
                failures_path=stage_dir / FAILURES,
                commit_every=int(section.commit_every),
                bucket_window=bucket_window(section, dev),
            )
        reasons: dict[str, int] = {}
        for failure in summary.failures:
            reasons[failure["reason"]] = reasons.get(failure["reason"], 0) + 1
        return {"store": job.store, "failures": FAILURES}, {
            "images": summary.total,
            "extracted": summary.done,
            "already_in_store": summary.already_done,
            "failed": summary.failed,
            "boxes": summary.boxes,
            "boxes_per_image": round(summary.boxes / max(summary.done, 1), 2),
            "images_per_second": round(summary.done / summary.seconds, 2) if summary.seconds > 0 else 0.0,
            "failure_reasons": dict(sorted(reasons.items())),
        }

    return work


def _reopen(stage_dir: Path, digest: str) -> None:
    """Let a finished or interrupted extraction run again over its store: a new pass when the last one recorded
    failures or ran with another config (the store itself skips what it holds and refuses another extractor)."""
    manifest = read_manifest(stage_dir)
    if manifest is not None and (manifest["config_digest"] != digest or manifest.get("summary", {}).get("failed")):
        log.info(
            "extract: %s holds an earlier extraction (%s); extracting again into its store",
            stage_dir,
            "other inputs or settings" if manifest["config_digest"] != digest else "with failures",
        )
        (stage_dir / MANIFEST).unlink()
    if (stage_dir / RUNNING).exists():
        (stage_dir / RUNNING).unlink()


def extract_features(
    run_dir: str | Path,
    name: str,
    section: Config,
    job: ExtractJob,
    *,
    force: bool = False,
    config: Config | None = None,
    reopen: bool = False,
    out_option: str = "--out",
) -> StageResult:
    """Run (or resume, or skip when done) the extraction stage ``run_dir/name`` through :func:`run_stage`.

    ``config`` is the stage config whose digest is recorded (default :func:`stage_config`); ``reopen``: a store
    that accumulates (see the module docstring) instead of the strict stage rule. The selection settings, the
    inputs and the weights file are checked before the stage folder is touched. ``out_option``: the option that
    named the folder, for the message refusing a second writer (:func:`run_stage`).
    """
    if job.weights != "random":  # a catalogue name or hf: id becomes its file in the cache (docs/downloads.md)
        job = replace(job, weights=resolve_file(job.weights, "weights file", "detector"))
    cfg = config if config is not None else stage_config(section, job)
    items = collect_items(job, selection_mode(section, job.weights))
    if job.weights != "random" and not Path(job.weights).is_file():
        raise UsageError(f"weights file not found: {job.weights}")
    digest = cfg.digest()
    return run_stage(
        run_dir,
        name,
        cfg,
        extract_work(section, job, items),
        force=force,
        out_option=out_option,
        reopen=(lambda stage_dir: _reopen(stage_dir, digest)) if reopen else None,  # under the stage's lock
    )
