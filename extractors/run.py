"""The extraction loop behind ``cli extract``: image items -> photos -> regions (:mod:`extractors.photos`) -> store.

Resumable (images already committed are skipped), robust (a bad image goes to ``failures.jsonl`` in the store
with its reason, one of :data:`pipeline.core.errors.FAILURE_REASONS`, and the run goes on). The inputs and
their keys are :mod:`extractors.inputs`; decoding in workers, the thin-image check and the per-image guard
around the detector are :mod:`extractors.photos`, shared with ``eval-detector`` and ``caption``. Failures
records and messages carry the key's text form (:mod:`pipeline.core.keys`).
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from extractors.bucketing import InOrder, ShapeBuckets
from extractors.detector import Detector
from extractors.inputs import ImageItem
from extractors.photos import Photo, PhotoDataset, detect_guarded, photo_batches
from extractors.selector import Selector
from pipeline.core.console import get_logger, make_progress
from pipeline.core.errors import Failure, PipelineError
from pipeline.core.fileio import open_own_file
from pipeline.core.keys import key_to_text
from pipeline.core.precision import resolve_precision
from pipeline.core.stages import RunTally
from pipeline.core.training.signals import StopOnSignal

log = get_logger("extract")


class ExtractionInterrupted(PipelineError):
    """Stopped by SIGTERM/SIGINT after committing every finished image; rerunning the command resumes."""

    exit_code = 130


@dataclass
class RunSummary(RunTally):
    """An extraction run's tally, the boxes it stored, its time and the failures it listed."""

    boxes: int = 0
    seconds: float = 0.0
    failures: list[dict[str, str]] = field(default_factory=list)


def run_extraction(
    model: Detector,
    items: list[ImageItem],
    writer,
    selector: Selector,
    *,
    batch_size: int = 4,
    workers: int = 0,
    precision: str = "fp32",
    max_pixels: int = 100_000_000,
    failures_path: Path | None = None,
    commit_every: int = 64,
    bucket_window: int = 0,
) -> RunSummary:
    """Extract every item not yet in ``writer`` and add it; returns counts (bad images are listed, not raised).

    ``selector`` (:func:`extractors.selector.make_selector`) carries the resolved recipe whose preprocessing the
    image loader applies. ``bucket_window`` > 0: photos are detected in batches of equal blob shape gathered across the
    folder (up to that many batches of photos wait for partners, :mod:`extractors.bucketing`); 0: each loader batch as
    it comes (its equal shapes share a pass). Either way the store and the failures list get them in input order."""
    spec = model.spec
    dev = next(model.parameters()).device
    precision = resolve_precision(precision, dev, "extract.precision", fp16=False)
    summary = RunSummary(total=len(items))
    todo = [it for it in items if not writer.has(it.key)]
    summary.already_done = len(items) - len(todo)
    if summary.already_done:
        log.info("resuming: %d of %d images already in the store", summary.already_done, len(items))
    fail_fh = (
        os.fdopen(open_own_file(failures_path, "failures list", truncate=True), "w", encoding="utf-8")
        if failures_path is not None
        else None
    )
    t0 = time.perf_counter()
    ds = PhotoDataset(todo, selector.recipe, max_pixels, spec.feature_stride)
    since_commit = 0

    def fail(photo: Photo, failure: Failure) -> None:
        path = key_to_text(os.fsdecode(photo.item.path))
        rec = {
            "key": key_to_text(photo.item.key),
            "path": path,
            "reason": failure.reason,
            "detail": key_to_text(failure.detail),
        }
        summary.failures.append(rec)
        summary.failed += 1
        log.warning("skipped %s: %s (%s)", path, failure.reason, rec["detail"])
        if fail_fh is not None:
            fail_fh.write(json.dumps(rec) + "\n")
            fail_fh.flush()

    def apply(outcome: tuple[Photo, Any]) -> int:  # one photo's result, in input order (bucketing.InOrder)
        photo, result = outcome
        if isinstance(result, Failure):
            fail(photo, result)
            return 0
        return _store(photo, result, writer, fail, summary)

    buckets = ShapeBuckets(batch_size, bucket_window * max(1, batch_size)) if bucket_window > 0 else None
    order = InOrder(list(range(len(todo))), apply)

    def detect(groups: list[list[Photo]]) -> None:
        for group in groups:
            for photo, rec in detect_guarded(
                model, group, selector, precision, dev, lambda p, f: order.put(p.index, (p, f))
            ):
                order.put(photo.index, (photo, rec))

    try:
        with make_progress() as progress, StopOnSignal() as stop:
            task = progress.add_task("extract", total=len(todo))
            for batch in photo_batches(ds, batch_size, workers, pin_memory=dev.type == "cuda"):
                good = []
                for photo in batch:
                    failure = _precheck(photo, selector)
                    if failure is not None:
                        order.put(photo.index, (photo, failure))
                    elif buckets is None:
                        good.append(photo)
                    else:
                        detect(buckets.add(photo))
                detect([good] if good else [])
                if stop.signum is not None and buckets is not None:  # SIGTERM / SIGINT: finish the decoded photos first
                    detect(buckets.flush())
                since_commit += order.release()
                if commit_every and since_commit >= commit_every:
                    writer.commit()
                    since_commit = 0
                progress.advance(task, len(batch))
                if stop.signum is not None:
                    writer.commit()
                    raise ExtractionInterrupted(
                        f"stopped by {signal.Signals(stop.signum).name} after {summary.done} new images, "
                        f"all committed to {writer.path}: run the same command again to resume"
                    )
            detect(buckets.flush() if buckets is not None else [])
            order.release()
        writer.commit()
    finally:
        if fail_fh is not None:
            fail_fh.close()
    summary.seconds = time.perf_counter() - t0
    return summary


def _precheck(photo: Photo, selector: Selector) -> Failure | None:
    """Why a decoded photo cannot be detected (its loader failure, no given box), or None."""
    if photo.failure is not None:
        return photo.failure
    if selector.given and (photo.item.boxes is None or len(photo.item.boxes) == 0):
        return Failure("no_boxes", "given-boxes mode and no box for this image")
    return None


def _store(photo: Photo, o: Any, writer: Any, fail: Any, summary: RunSummary) -> int:
    """Add one photo's regions to the store (the per-image guard around the writer); returns 1 if added."""
    if o.boxes.shape[0] == 0:
        fail(photo, Failure("no_regions", "the detector returned no region for this image"))
        return 0
    try:
        writer.add(photo.item.key, o)
    except PipelineError as exc:  # e.g. NaN features: this image only, never the batch
        fail(photo, Failure("invalid_output", str(exc)))
        return 0
    summary.done += 1
    summary.boxes += int(o.boxes.shape[0])
    return 1
