"""The work behind ``cli caption``: resolve the model and detector, caption batch by batch, stream the results.

Streaming: each batch's rows are appended to the results journal and committed (see
:mod:`pipeline.captioning.journal`), its pictures and gallery thumbnails are written, and only then is its part
of the table printed; memory is one batch. A rerun on the same ``--output`` (and ``--gallery``) captions only
the photos that are not committed there yet. ``.json``, ``.csv`` and COCO files are written from the journal
at the end (:mod:`pipeline.captioning.output`); the gallery page too (:mod:`pipeline.captioning.gallery`).
"""

from __future__ import annotations

import sys
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from rich.table import Table

from extractors.factory import configure_recipe, load_for_inference, record_settings
from extractors.inputs import items_from_file_list, items_from_paths, unique_items
from extractors.names import detector_names
from models.decoding import check_max_len
from models.decoding.captions import command_decoding, decoding_for
from models.loading import load_captioner
from models.released import features_line
from pipeline.captioning.choose import find_checkpoint, find_detector
from pipeline.captioning.engine import FeatureCache, PhotoCaptioner
from pipeline.captioning.gallery import GallerySink
from pipeline.captioning.journal import Journal
from pipeline.captioning.output import OutputPlan, coco_ids, failure_row, finalize, load_id_map, plan_output, result_row
from pipeline.captioning.pictures import write_pictures
from pipeline.core.config import Config
from pipeline.core.console import get_logger, make_progress, progress_enabled, stdout_console
from pipeline.core.distributed import resolve_device
from pipeline.core.errors import ConfigError, PipelineError, UsageError
from pipeline.core.identity import FeatureIdentity
from pipeline.core.keys import key_to_text, markup_escape
from pipeline.core.locks import acquire_lock
from pipeline.core.precision import check_precision
from pipeline.core.stages import RunTally
from pipeline.core.vocab import Vocab
from pipeline.hub import resolve_file

if TYPE_CHECKING:
    from models.checkpoints import ReleaseInfo

log = get_logger("caption")


@dataclass
class CaptionSummary(RunTally):
    """What a ``caption`` run did (photos given, already captioned by an earlier run, captioned now, failed now),
    the pictures it drew and where it wrote."""

    pictures: int = 0
    output: Path | None = None
    gallery: Path | None = None


def collect_items(photos: list[str] | None, file_list: Path | None) -> list[Any]:
    """Items (key, path) from photo arguments and a ``--file-list`` (one path per line, ``#`` comments)."""
    items = items_from_paths(list(photos or [])) if photos else []
    if file_list is not None:
        items = unique_items(items + items_from_file_list(file_list, Path.cwd()))
    if not items:
        where = ", ".join(list(photos or []) + ([str(file_list)] if file_list else []))
        raise UsageError(
            f"no image files found in {where or 'the arguments'} (give photos, folders, globs or --file-list FILE)"
        )
    if all(it.problem is not None for it in items):
        shown = "; ".join(f"{key_to_text(str(it.path))} ({it.problem[1]})" for it in items[:5])
        raise UsageError(f"no usable images in the given inputs: {shown}{' ...' if len(items) > 5 else ''}")
    return items


#: caption.KEY -> (least value, greatest value or None, may be null)
_NUMBERS = {
    "batch_size": (1, None, False),
    "num_workers": (0, None, False),
    "max_pixels": (1, None, False),
    "max_boxes": (1, None, True),
    "conf_thresh": (0.0, 1.0, True),
    "nms_thresh": (0.0, 1.0, True),
    "min_size": (1, None, True),
    "max_size": (1, None, True),
}


def check_numbers(cfg: Any) -> None:
    """Every numeric ``caption`` setting in range before any work (one line naming the key); NaN/inf never get
    here (the config refuses them). The decoding settings are checked where they are layered
    (:func:`models.decoding.captions.layered_decoding`)."""
    if cfg is None:
        return

    check_precision(cfg.precision, "caption.precision", fp16=False)  # the detector runs under it too
    for key, (low, high, nullable) in _NUMBERS.items():
        if key not in cfg:
            continue
        value = cfg[key]
        if value is None and nullable:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or value < low
            or (high is not None and value > high)
        ):
            span = f"between {low} and {high}" if high is not None else f"{low} or more"
            raise UsageError(f"caption.{key} must be {span}, not {value!r}")


def _checked_decoding(decoding: dict[str, Any] | None) -> None:
    """The command's ``decoding:`` keys and types, before any work (one line, exit 2)."""
    try:
        command_decoding(decoding)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None


def build_engine(
    ckpt_path: Path, det_weights: str, cfg: Config, decoding: dict[str, Any] | None = None, vocab: Path | None = None
) -> tuple[Any, list[str], list[str], dict[str, Any]]:
    """The :class:`PhotoCaptioner`, class and attribute names, and the settings a resumed output must share.

    ``decoding``: the command's ``decoding:`` section (over the checkpoint's,
    :func:`models.decoding.captions.layered_decoding`); ``vocab`` is a released model's vocabulary file.
    ``caption.precision`` is resolved as ``evaluate`` resolves its own (:func:`models.decoding.captions.decoding_for`).
    """
    device = resolve_device(str(cfg.device))
    if vocab is not None:  # a file, or a catalogue name such as m2-vocab (docs/downloads.md)
        vocab = Path(resolve_file(vocab, "vocabulary file", "vocab"))
    captioner, ckpt = load_captioner(ckpt_path, device, companion=vocab)
    cfg = _release_features(cfg, ckpt.release)
    vocab = Vocab(ckpt.vocab)
    try:
        options, precision = decoding_for(ckpt, decoding, str(cfg.precision), device, "caption.precision", fp16=False)
        check_max_len(options, captioner, "--max-len")
    except ConfigError as exc:
        raise UsageError(str(exc)) from None

    detector, identity, info = load_for_inference(det_weights, "auto", {}, 0, device, section=cfg, where="caption")
    # caption.max_boxes is what the captioner gets, not a recipe field
    recipe, rule = configure_recipe(
        detector, identity.layout, cfg, "caption", ("min_size", "max_size", "conf_thresh", "nms_thresh")
    )
    if recipe.selector == "given":
        raise UsageError(
            "caption.boxes given: photos have no boxes to give; use adaptive, 36 or null (the recipe's own)"
        )
    trained_with = (
        FeatureIdentity.from_dict(ckpt.store_identity, f"{ckpt_path}: store_identity") if ckpt.store_identity else None
    )
    if (
        trained_with is not None
        and trained_with.weights_sha256
        and trained_with.weights_sha256 != identity.weights_sha256
    ):
        log.warning(
            "the captioner was trained on features of another detector (%s); captions may be poor", trained_with.name
        )
    classes, attributes = detector_names(info, detector.spec.num_classes - 1, detector.spec.num_attributes - 1)
    max_boxes = cfg.max_boxes if cfg.max_boxes is not None else ckpt.max_boxes
    engine = PhotoCaptioner(
        detector,
        rule,
        captioner,
        vocab,
        options,
        device,
        max_boxes=max_boxes,
        max_pixels=int(cfg.max_pixels),
        precision=precision,
        store_settings=record_settings(identity, detector, rule, precision),
    )
    settings = {
        "captioner": str(Path(ckpt_path).resolve()),
        "captioner_step": ckpt.progress.global_step if ckpt.progress else None,
        "detector": engine.store_settings.to_dict() if engine.store_settings else {},
        "decoding": asdict(options),
        "max_boxes": max_boxes,
    }
    return engine, list(classes), list(attributes), settings


def caption_photos(
    photos: list[str] | None,
    model: Path,
    weights: str | None,
    cfg: Config,
    output: Path | None = None,
    visualize: Path | None = None,
    cache: Path | None = None,
    *,
    file_list: Path | None = None,
    fmt: str | None = None,
    captioner: str | None = None,
    gallery: Path | None = None,
    image_ids: Path | None = None,
    force: bool = False,
    decoding: dict[str, Any] | None = None,
    vocab: Path | None = None,
) -> CaptionSummary:
    """Caption ``photos`` (and ``file_list``) with streaming, resumable output; returns the counts.

    ``decoding``: the command's ``decoding:`` section (``configs/decoding.yaml`` keys over the checkpoint's own);
    ``vocab`` is a released model's vocabulary file.
    """
    if output is None and fmt is not None:
        raise UsageError("--format needs --output FILE")
    check_numbers(cfg)
    _checked_decoding(decoding)
    plan = plan_output(output, fmt) if output is not None else None
    items = collect_items(photos, file_list)
    ids = (
        coco_ids(items, load_id_map(image_ids) if image_ids else None)
        if plan is not None and plan.fmt == "coco"
        else None
    )
    with ExitStack() as held:
        locks = _take_locks(held, plan, gallery, visualize)
        ckpt_path = find_checkpoint(model, captioner)
        det_weights = find_detector(model, ckpt_path, weights)
        return _caption_locked(
            items, ids, plan, locks, ckpt_path, det_weights, cfg, visualize, cache, gallery, force, decoding, vocab
        )


def _take_locks(
    held: ExitStack, plan: OutputPlan | None, gallery: Path | None, visualize: Path | None
) -> dict[str, Any]:
    """One writer per artifact, before any work: the output (``OUT.lock``), the gallery and pictures folders
    (``DIR/.lock``); a second process is refused naming the holder (:mod:`pipeline.core.locks`)."""
    hint = "wait for it to finish or choose another {}"
    locks: dict[str, Any] = {}
    if plan is not None:
        locks["output"] = held.enter_context(
            acquire_lock(
                plan.path.with_name(plan.path.name + ".lock"), f"caption output {plan.path}", hint.format("--output")
            )
        )
    if gallery is not None:
        locks["gallery"] = held.enter_context(
            acquire_lock(gallery / ".lock", f"gallery {gallery}", hint.format("--gallery"))
        )
    same = gallery is not None and visualize is not None and Path(visualize).absolute() == Path(gallery).absolute()
    if visualize is not None and not same:
        locks["pictures"] = held.enter_context(
            acquire_lock(visualize / ".lock", f"pictures folder {visualize}", hint.format("--visualize"))
        )
    return locks


def _caption_locked(
    items: list[Any],
    ids: dict[str, int] | None,
    plan: OutputPlan | None,
    locks: dict[str, Any],
    ckpt_path: Path,
    det_weights: str,
    cfg: Config,
    visualize: Path | None,
    cache: Path | None,
    gallery: Path | None,
    force: bool,
    decoding: dict[str, Any] | None,
    vocab: Path | None,
) -> CaptionSummary:
    engine, classes, attributes, settings = build_engine(ckpt_path, det_weights, cfg, decoding, vocab)
    n_best = int(engine.options.n_best)
    results_journal = _open_results(plan, settings, n_best, force, locks.get("output"))
    gallery_sink = None
    if gallery is not None:
        gallery_sink = GallerySink(gallery, settings, classes, attributes, force=force, lock=locks.get("gallery"))
    journals = [j for j in (results_journal, gallery_sink and gallery_sink.journal) if j is not None]
    summary = CaptionSummary(total=len(items), output=plan.path if plan else None, gallery=gallery)
    todo = [it for it in items if not journals or any(key_to_text(it.key) not in j.done for j in journals)]
    summary.already_done = len(items) - len(todo)
    if summary.already_done:
        log.info(
            "%d of %d photos are already captioned in this output; captioning the other %d",
            summary.already_done,
            len(items),
            len(todo),
        )
    writer = None
    if cache is not None:
        writer = FeatureCache(cache, engine.store_settings)
    try:
        try:
            _run_batches(
                engine, todo, cfg, summary, results_journal, gallery_sink, visualize, writer, ids, classes, attributes
            )
        finally:
            if writer is not None:
                writer.close()
        if plan is not None and results_journal is not None and plan.fmt != "jsonl":
            finalize(plan, results_journal.read("results"), n_best > 1)
        if plan is not None:
            log.info(
                "results: %s (%d photos; failures listed in %s)",
                plan.path,
                results_journal.rows if results_journal else 0,
                plan.failures,
            )
        if gallery_sink is not None:
            page = gallery_sink.write_page()
            log.info("gallery: %s", page)
    finally:
        for j in journals:  # the locks go last: the final files are written under them
            j.close()
    if summary.failed:
        log.warning("%d of %d photos could not be captioned (listed above)", summary.failed, len(todo))
    if todo and summary.failed == len(todo):
        raise PipelineError(f"none of the {len(todo)} photos could be captioned")
    return summary


def _release_features(cfg: Config, release: ReleaseInfo | None) -> Config:
    """A released model expects the Caffe bottom-up features it was trained on: its recipe and box limits
    unless the config names others (models.released); says so in one line."""
    if not release:
        return cfg

    feats = release.features
    changes: dict[str, Any] = {}
    if "recipe" in cfg and cfg.recipe in (None, "auto"):
        changes["recipe"] = feats.get("recipe", "caffe")
    if "boxes" in cfg and cfg.boxes is None:
        changes["boxes"] = feats.get("boxes", "adaptive")
    log.info("%s", features_line(release))
    return cfg.with_overrides(changes, source="released model") if changes else cfg


def _open_results(
    plan: OutputPlan | None, settings: dict[str, Any], n_best: int, force: bool, lock: Any = None
) -> Journal | None:
    if plan is None:
        return None
    return Journal(
        {"results": plan.journal, "failures": plan.failures},
        {**settings, "format": plan.fmt, "n_best": n_best},
        force=force,
        lock=lock,
        products=[plan.path] if plan.path != plan.journal else [],
    )


def _run_batches(
    engine: Any,
    todo: list[Any],
    cfg: Config,
    summary: CaptionSummary,
    results: Journal | None,
    gallery: Any,
    visualize: Path | None,
    cache: Any,
    ids: dict[str, int] | None,
    classes: list[str],
    attributes: list[str],
) -> None:
    """Caption ``todo`` batch by batch: files first (results, failures, pictures, gallery), then the table rows."""
    n_best = int(engine.options.n_best)
    want_images = visualize is not None or gallery is not None
    with make_progress() as progress, torch.inference_mode(False):
        task = progress.add_task("caption", total=len(todo))
        first = True
        for batch in engine.caption_batches(
            todo,
            int(cfg.batch_size),
            cache=cache,
            keep_images=want_images,
            relevance=want_images,
            workers=int(cfg.num_workers),
        ):
            if visualize is not None:
                summary.pictures += len(write_pictures(batch, visualize, classes, attributes))
            if gallery is not None:
                gallery.add(batch)
            if results is not None:
                fresh = [r for r in batch if key_to_text(r.key) not in results.done]
                results.append(
                    {
                        "results": [result_row(r, n_best > 1, ids[r.key] if ids else None) for r in fresh],
                        "failures": [failure_row(r) for r in fresh if r.error],
                    }
                )
            summary.done += sum(r.error is None for r in batch)
            summary.failed += sum(r.error is not None for r in batch)
            _print_batch(progress, batch, n_best, first)
            first = False
            progress.advance(task, len(batch))
            for r in batch:  # nothing of a finished batch outlives it
                r.image = r.regions = r.relevance = None


def _print_batch(progress: Any, batch: list[Any], n_best: int, header: bool) -> None:
    """This batch's rows of the results table (every user string escaped for rich markup)."""
    table = Table(show_edge=False, show_header=header, expand=True)
    table.add_column("image", ratio=2, overflow="fold")
    table.add_column("caption", ratio=5)
    table.add_column("score", justify="right", width=7)
    for r in batch:
        name = markup_escape(key_to_text(str(r.path)))
        if r.error:
            table.add_row(name, f"[red]skipped: {markup_escape(r.error)}[/red]", "")
            continue
        table.add_row(name, markup_escape(r.caption), f"{r.score:.3f}")
        for c, s in r.nbest[1:n_best]:
            table.add_row("", f"[dim]{markup_escape(c)}[/dim]", f"[dim]{s:.3f}[/dim]")
    live = progress_enabled() and sys.stdout.isatty()
    (progress.console if live else stdout_console()).print(table)
