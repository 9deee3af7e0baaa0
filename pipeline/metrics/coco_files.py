"""Reading and validating COCO caption files: references (COCO captions format) and results.

* References: ``{"images": [...], "annotations": [{"image_id": ID, "caption": TEXT, ...}, ...]}``
  (``captions_val2014.json``, or ``captions_{split}.json`` from the synthetic world).
* Results: ``[{"image_id": ID, "caption": TEXT}, ...]`` (the COCO results format; extra keys are ignored).

Every problem is reported as one line naming the file and the offending entry. Policies for imperfect
results files (``evaluate:`` config) are applied by :func:`match_predictions`:

* duplicate image ids: ``error`` (default) or ``first`` (keep the first caption of each image);
* predictions for images absent from the references: ``error`` (default) or ``drop``;
* empty captions: ``keep`` (default: scored as an empty caption, which scores 0 on every metric except
  where a reference is empty too) or ``error``;
* reference images without a prediction are not scored (the standard COCO practice of evaluating the
  predicted images); a note says how many.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import read_json

ImageId = Hashable
DUPLICATES = ("error", "first")
UNKNOWN_IMAGES = ("error", "drop")
EMPTY_CAPTIONS = ("keep", "error")


def _valid_id(value: Any) -> bool:
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _examples(ids: list[Any], k: int = 5) -> str:
    shown = ", ".join(repr(i) for i in ids[:k])
    return shown + (f", ... ({len(ids)} in all)" if len(ids) > k else "")


def _read(path: str | Path, what: str, expect: type | None) -> Any:
    """read_json, with a corrupt user file reported as a usage error (exit 2)."""
    try:
        return read_json(path, what, expect=expect)
    except UsageError:
        raise
    except PipelineError as exc:
        raise UsageError(str(exc)) from None


def load_references(path: str | Path) -> tuple[dict[ImageId, list[str]], list[str]]:
    """Reference captions per image from a COCO captions file, and notes (e.g. dropped empty captions)."""
    data = _read(path, "references file", dict)
    anns = data.get("annotations")
    if not isinstance(anns, list):
        raise UsageError(f"references file {path} is not in COCO captions format (no 'annotations' list)")
    refs: dict[ImageId, list[str]] = {}
    empty = 0
    for k, ann in enumerate(anns):
        image_id, caption = _caption_entry(ann, f"references file {path}, annotation {k}")
        if not caption.strip():
            empty += 1
            continue
        refs.setdefault(image_id, []).append(caption)
    if not refs:
        raise UsageError(f"references file {path} holds no reference captions")
    notes = [f"{empty} empty reference captions in {path} were ignored"] if empty else []
    return refs, notes


def load_predictions(path: str | Path) -> list[tuple[ImageId, str]]:
    """(image_id, caption) pairs from a COCO results file, in file order."""
    data = _read(path, "predictions file", None)
    if not isinstance(data, list):
        raise UsageError(
            f"predictions file {path} must hold a JSON list of {{image_id, caption}} objects (COCO results format)"
        )
    if not data:
        raise UsageError(f"predictions file {path} is empty")
    out = []
    for k, item in enumerate(data):
        out.append(_caption_entry(item, f"predictions file {path}, entry {k}"))
    return out


def _caption_entry(item: Any, where: str) -> tuple[ImageId, str]:
    """``(image_id, caption)`` of one ``{image_id, caption}`` object of a COCO file; ``where`` names it in errors."""
    if not isinstance(item, dict) or "image_id" not in item or "caption" not in item:
        raise UsageError(f"{where}: expected an object with 'image_id' and 'caption'")
    image_id, caption = item["image_id"], item["caption"]
    if not _valid_id(image_id):
        raise UsageError(f"{where}: 'image_id' must be an integer or a string, got {image_id!r}")
    if not isinstance(caption, str):
        raise UsageError(f"{where}: 'caption' must be a string, got {type(caption).__name__}")
    return image_id, caption


@dataclass
class Matched:
    """Predictions to score (one per image, in file order) with their references, and what was done."""

    predictions: dict[ImageId, str]
    references: dict[ImageId, list[str]]
    notes: list[str] = field(default_factory=list)


def match_predictions(
    predictions: list[tuple[ImageId, str]],
    references: dict[ImageId, list[str]],
    predictions_path: str | Path = "predictions",
    duplicates: str = "error",
    unknown_images: str = "error",
    empty_captions: str = "keep",
) -> Matched:
    """Apply the policies of the module docstring; raises :class:`UsageError` naming the file."""
    for name, value, allowed in (
        ("duplicates", duplicates, DUPLICATES),
        ("unknown_images", unknown_images, UNKNOWN_IMAGES),
        ("empty_captions", empty_captions, EMPTY_CAPTIONS),
    ):
        if value not in allowed:
            raise UsageError(f"evaluate.{name} must be one of {', '.join(allowed)}, got {value!r}")
    notes: list[str] = []
    chosen: dict[ImageId, str] = {}
    dup: list[ImageId] = []
    for image_id, caption in predictions:
        if image_id in chosen:
            if image_id not in dup:
                dup.append(image_id)
            continue
        chosen[image_id] = caption
    if dup:
        if duplicates == "error":
            raise UsageError(
                f"predictions file {predictions_path}: {len(dup)} image ids have more than one caption "
                f"({_examples(dup)}); set evaluate.duplicates=first to keep the first caption of each"
            )
        notes.append(f"{len(dup)} image ids had several captions; the first of each was kept")
    unknown = [i for i in chosen if i not in references]
    if unknown:
        hint = ""
        pred_types = {type(i).__name__ for i in unknown}
        ref_types = {type(i).__name__ for i in references}
        if pred_types != ref_types:
            hint = (
                f" (predictions use {'/'.join(sorted(pred_types))} ids, references {'/'.join(sorted(ref_types))} ids)"
            )
        if unknown_images == "error" or len(unknown) == len(chosen):
            raise UsageError(
                f"predictions file {predictions_path}: {len(unknown)} of {len(chosen)} image ids have no reference "
                f"captions ({_examples(unknown)}){hint}"
                + ("; set evaluate.unknown_images=drop to ignore them" if len(unknown) < len(chosen) else "")
            )
        for i in unknown:
            del chosen[i]
        notes.append(f"{len(unknown)} predictions for images without references were dropped{hint}")
    empty = [i for i, c in chosen.items() if not c.strip()]
    if empty:
        if empty_captions == "error":
            raise UsageError(f"predictions file {predictions_path}: {len(empty)} empty captions ({_examples(empty)})")
        notes.append(f"{len(empty)} empty predicted captions were scored as empty")
    missing = len(references) - len(chosen)
    if missing:
        notes.append(f"{len(chosen)} of {len(references)} reference images have a prediction; only those are scored")
    return Matched(chosen, {i: references[i] for i in chosen}, notes)
