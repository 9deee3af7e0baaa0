"""`cli extract`: Extract bottom-up region features from images into a feature store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.options import CommandOptions, Everyday, command
from pipeline.core.errors import PipelineError, UsageError


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        world = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if world > 1:  # torchrun: one shard per rank
            return int(os.environ.get("RANK", "0")), world
        return None
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard must look like i/n (e.g. 0/4), not {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {text}: need 0 <= i < n")
    return i, n


def shard_store_path(store: Path, shard: tuple[int, int] | None) -> Path:
    """Shard i of n writes ``STORE.shards/i-of-n`` (merge them with the store's merge tool)."""
    if shard is None:
        return store
    return store.parent / f"{store.name}.shards" / f"{shard[0]}-of-{shard[1]}"


def merge_shard_stores(store: Path) -> None:
    """Merge ``STORE.shards/i-of-n`` (all n present) into ``STORE``; each image must appear exactly once."""
    from pipeline.core.console import stdout_console
    from pipeline.store import merge_stores

    folder = store.parent / f"{store.name}.shards"
    shards = sorted(p for p in folder.glob("*-of-*") if p.is_dir()) if folder.is_dir() else []
    if not shards:
        raise UsageError(f"no shards found in {folder}")
    counts = {p.name.split("-of-")[1] for p in shards}
    if len(counts) != 1:
        raise UsageError(f"{folder} mixes shard counts ({', '.join(sorted(counts))})")
    n = int(counts.pop())
    have = sorted(int(p.name.split("-of-")[0]) for p in shards)
    if have != list(range(n)):
        missing = sorted(set(range(n)) - set(have))
        raise UsageError(f"{folder}: shards {missing} of {n} are missing; run them first")
    total = merge_stores(shards, store)
    stdout_console().print(f"merged {n} shards ({total} images) into {store}")


#: extraction autocasts to bf16 or uses TF32 matmuls; fp16 is not offered (see extractors.run.precision_context)
EXTRACT_EVERYDAY = Everyday(device="extract.device", batch_size="extract.batch_size", precision="extract.precision",
                            num_workers="extract.workers", precision_choices=("fp32", "tf32", "bf16"))


def register(app: typer.Typer) -> None:
    @command(app, "extract", everyday=EXTRACT_EVERYDAY)
    def extract_command(
        opts: CommandOptions,
        paths: Annotated[Optional[list[Path]], typer.Argument(help="Image folders (recursive), files or globs.")] = None,
        weights: Annotated[str, typer.Option("--weights", "-w", help="Detector weights (.pth MILVLG, .pkl airsplay, .bin HF) or 'random'.")] = "",
        store: Annotated[Optional[Path], typer.Option("--store", help="Feature store directory (created or resumed).")] = None,
        boxes: Annotated[Optional[str], typer.Option("--boxes", help="adaptive (10-100) | 36 | given (needs --coco).")] = None,
        coco: Annotated[Optional[Path], typer.Option("--coco", help="COCO annotations file: its images (keys = image ids) and, with --boxes given, its boxes.")] = None,
        image_root: Annotated[Optional[Path], typer.Option("--image-root", help="Folder of the COCO / file-list images.")] = None,
        file_list: Annotated[Optional[Path], typer.Option("--file-list", help="Text file with one image path per line.")] = None,
        preset: Annotated[Optional[str], typer.Option("--preset", help="auto | bottom-up-caffe-r101 | bottom-up-d2-r101")] = None,
        shard: Annotated[Optional[str], typer.Option("--shard", help="i/n: process every n-th image from i into STORE.shards/i-of-n.")] = None,
        limit: Annotated[Optional[int], typer.Option("--limit", help="Only the first N images (after sharding).")] = None,
        strict: Annotated[bool, typer.Option("--strict", help="Exit 1 if any image failed.")] = False,
        merge_shards: Annotated[bool, typer.Option("--merge-shards", help="Merge the finished STORE.shards/i-of-n into STORE (no extraction).")] = False,
    ) -> None:
        # strings as JSON (= YAML) strings, so that `--boxes 36` stays the string "36"
        """Extract bottom-up region features (boxes, 2048-d features, classes, attributes) from images into a
        feature store. Resumable: images already in the store are skipped. Bad images are listed in
        STORE/failures.jsonl and the run continues.

        Examples:

            butd-caption extract photos/ --weights bua-caffe-frcn-r101_with_attributes.pth --store runs/feats

            butd-caption extract --coco annotations/instances_val2014.json --image-root val2014 --boxes given --weights W --store S

            butd-caption extract photos/ --weights random --store /tmp/smoke   (random weights: smoke tests only)
        """
        extra = [f"extract.{key}={json.dumps(val)}" for key, val in (("boxes", boxes), ("preset", preset)) if val is not None]
        cfg = opts.resolve("extract", extra).extract
        if store is None:
            raise UsageError("--store is required")
        if merge_shards:
            merge_shard_stores(store)
            return
        if not weights:
            raise UsageError("--weights is required (a .pth/.pkl/.bin file, or 'random' for smoke tests)")
        if not paths and coco is None and file_list is None:
            raise UsageError("give image folders/files, --file-list or --coco")
        run(paths or [], weights, store, cfg, coco, image_root, file_list, _parse_shard(shard), limit, strict)


def run(paths, weights, store, cfg, coco, image_root, file_list, shard, limit, strict) -> None:
    from extractors.bottom_up import BOX_MODES, SelectionRule
    from extractors.factory import build_for_extract, resolve_device
    from extractors.run import items_from_coco, items_from_file_list, items_from_paths, run_extraction, shard_items
    from pipeline.core.console import get_logger, stdout_console
    from pipeline.store import open_writer

    log = get_logger("extract")
    mode = str(cfg.boxes)
    if mode not in BOX_MODES:
        raise UsageError(f"--boxes must be one of {', '.join(BOX_MODES)}, not {mode!r}")
    if mode == "given" and coco is None:
        raise UsageError("--boxes given needs --coco ANNOTATIONS (the boxes come from its 'annotations')")
    items = []
    if paths:
        items += items_from_paths(paths)
    if file_list is not None:
        items += items_from_file_list(file_list, image_root)
    if coco is not None:
        items += items_from_coco(coco, image_root, with_boxes=mode == "given")
    if not items:
        raise UsageError("no images found in the given inputs")
    if shard is not None:
        items = shard_items(items, *shard)
    if limit is not None:
        items = items[: max(0, limit)]
    rule_kw = {"conf_thresh": float(cfg.conf_thresh), "nms_thresh": float(cfg.nms_thresh)}
    if cfg.min_boxes is not None:
        rule_kw["min_boxes"] = int(cfg.min_boxes)
    if cfg.max_boxes is not None:
        rule_kw["max_boxes"] = int(cfg.max_boxes)
    rule = SelectionRule.for_mode(mode, **rule_kw)
    dev = resolve_device(str(cfg.device))
    if dev.type == "cuda" and shard is not None and "LOCAL_RANK" in os.environ and dev.index is None:
        import torch

        dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    model, identity = build_for_extract(weights, str(cfg.preset), cfg.spec.to_dict() if hasattr(cfg.spec, "to_dict") else dict(cfg.spec),
                                        None if cfg.min_size is None else int(cfg.min_size), None if cfg.max_size is None else int(cfg.max_size), int(cfg.random_seed), dev)
    model.roi_chunk = int(cfg.roi_chunk)
    identity["config"]["precision"] = str(cfg.precision)
    identity["config"]["boxes"] = {"mode": rule.mode, "min": rule.min_boxes, "max": rule.max_boxes, "conf": rule.conf_thresh, "nms": rule.nms_thresh}
    target = shard_store_path(store, shard)
    log.info("extracting %d images with %s on %s (%s) into %s", len(items), identity["name"], dev, cfg.precision, target)
    with open_writer(target, identity, feature_dtype=str(cfg.feature_dtype)) as writer:
        summary = run_extraction(model, items, writer, rule, batch_size=int(cfg.batch_size), workers=int(cfg.workers),
                                 precision=str(cfg.precision), max_pixels=int(cfg.max_pixels),
                                 failures_path=Path(target) / "failures.jsonl", commit_every=int(cfg.commit_every))
    rate = summary.extracted / summary.seconds if summary.seconds > 0 else 0.0
    stdout_console().print(
        f"extracted {summary.extracted}, skipped (already in store) {summary.skipped}, failed {summary.failed} "
        f"of {summary.total} images; {summary.boxes} boxes; {rate:.2f} images/s; store {target}"
    )
    if summary.failed:
        reasons: dict[str, int] = {}
        for f in summary.failures:
            reasons[f["reason"]] = reasons.get(f["reason"], 0) + 1
        stdout_console().print("failures: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())) + f" (see {Path(target) / 'failures.jsonl'})")
        if strict:
            raise PipelineError(f"{summary.failed} images failed (--strict)")
