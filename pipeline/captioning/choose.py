"""Which captioner and which detector ``cli caption`` uses for ``--model`` (a checkpoint or a run folder).

A run folder may hold several trained captioners (``train-<name>/best.pt``, e.g. after the demo's comparison
mode). ``--captioner NAME`` picks one by name; otherwise the one with the best validation score is used: each
train stage's ``manifest.json`` records ``summary.best = {metric, value, stage, epoch}`` (validation CIDEr-D
unless ``train.validation.metric`` said otherwise), and ``best.pt`` carries the same record. The choice is
said in one log line naming the others.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.checkpoints import CaptionerCheckpoint
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.core.fileio import read_json
from pipeline.hub import resolve_file

log = get_logger("caption")


def _stage_name(best: Path) -> str:
    stage = best.parent.name
    return stage[len("train-") :] if stage.startswith("train-") else stage


def validation_score(best: Path) -> dict[str, Any] | None:
    """``{metric, value, ...}`` of the train stage that wrote ``best`` (its manifest, else the checkpoint)."""
    manifest = best.parent / "manifest.json"
    record: Any = None
    if manifest.is_file():
        record = (read_json(manifest, "train stage manifest").get("summary") or {}).get("best")
    if not record:
        progress = CaptionerCheckpoint.load(best).progress
        record = progress.best if progress else None
    if isinstance(record, dict) and isinstance(record.get("value"), (int, float)) and record.get("metric"):
        return record
    return None


def _pick_best(model: Path, found: list[Path]) -> Path:
    scored = [(p, validation_score(p)) for p in found]
    listing = ", ".join(_stage_name(p) for p in found)
    missing = [_stage_name(p) for p, s in scored if s is None]
    if missing:
        raise UsageError(
            f"{model} holds several captioners ({listing}) and {', '.join(missing)} has no validation score: pass "
            "--captioner NAME"
        )
    metrics = {s["metric"] for _, s in scored if s}
    if len(metrics) > 1:
        raise UsageError(
            f"{model} holds captioners validated on different metrics ({', '.join(sorted(metrics))}): pass "
            f"--captioner NAME ({listing})"
        )
    ranked = sorted(scored, key=lambda ps: -float(ps[1]["value"]))  # type: ignore[index]
    (best, score), rest = ranked[0], ranked[1:]
    metric = "CIDEr-D" if score["metric"] == "CIDEr" else score["metric"]
    others = ", ".join(f"{_stage_name(p)} {float(s['value']):.3f}" for p, s in rest)  # type: ignore[index]
    log.info(
        "captioner: %s (best validation %s %.3f of %d; others: %s; --captioner NAME picks another)",
        _stage_name(best),
        metric,
        float(score["value"]),
        len(found),
        others,
    )
    return best


def find_checkpoint(model: Path, captioner: str | None = None) -> Path:
    """A checkpoint file, or the chosen captioner's ``best.pt`` in a run folder (by name, else by validation score).
    A catalogue name or ``hf:`` id (docs/downloads.md) is fetched into the cache first, with its vocabulary."""
    model = Path(resolve_file(model, "captioner", "captioner"))
    if model.is_file():
        if captioner:
            raise UsageError(
                "--captioner picks a captioner inside a run folder; --model names a checkpoint file already"
            )
        return model
    if not model.exists():
        raise UsageError(
            f"no captioner at {model}: run `python cli.py demo` to train the demo model, "
            "or pass --model CHECKPOINT.pt (a checkpoint written by `train`)"
        )
    found = sorted(model.glob("train-*/best.pt")) or sorted(model.glob("best.pt"))
    if not found:
        raise UsageError(
            f"{model} holds no trained captioner (no train-*/best.pt): run `python cli.py demo --out {model}` "
            "or pass --model CHECKPOINT.pt"
        )
    if captioner:
        named = [p for p in found if _stage_name(p) == captioner or p.parent.name == captioner]
        if not named:
            raise UsageError(f"--captioner {captioner}: {model} holds {', '.join(_stage_name(p) for p in found)}")
        return named[0]
    return found[0] if len(found) == 1 else _pick_best(model, found)


def find_detector(model: Path, checkpoint: Path, weights: str | None) -> str:
    """``--weights`` if given, else the detector of the run directory the checkpoint belongs to."""
    if weights:
        if weights != "random":
            weights = resolve_file(weights, "detector weights", "detector")
        if weights != "random" and not Path(weights).is_file():
            raise UsageError(f"detector weights not found: {weights}")
        return weights
    for run in ([model] if model.is_dir() else []) + [checkpoint.parent.parent]:
        manifest = run / "detector" / "manifest.json"
        if manifest.is_file():
            data = read_json(manifest, what="detector stage manifest")
            rel = data.get("outputs", {}).get("weights")
            if rel and (run / "detector" / rel).is_file():
                return str(run / "detector" / rel)
    raise UsageError(
        "no detector found for this captioner: pass --weights (a bottom-up checkpoint such as "
        "bua-caffe-frcn-r101_with_attributes.pth, or the demo's runs/demo/detector/... weights)"
    )
