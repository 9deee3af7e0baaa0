"""Training checkpoints: what they hold, compatibility checks, and rebuilding a captioner from one.

Payload (plain containers and tensors only, written by :func:`pipeline.core.checkpoint.save_checkpoint`)::

    kind        "train" (last.pt: everything to resume) | "weights" (best.pt, xe.pt: no optimizer/RNG)
    model       {"name", "config" (resolved constructor kwargs), "vocab_size"}
    vocab       [words]                    weights  model state_dict
    stage       "xe" | "scst"              stage_done  bool (the stage finished; resuming moves on)
    epoch       epochs finished in the stage   position  batches done in the current epoch
    iteration   optimiser steps in the stage   global_step  steps over all stages
    optimizer, schedule, scaler   states   rng  capture_rng_state()
    best        {"metric", "value", "stage", "epoch"}   history  [validation records]
    bad_epochs  epochs without improvement (patience)   train_config  the resolved train section
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from models import build_captioner
from models.base import Captioner
from pipeline.core.checkpoint import load_checkpoint
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.vocab import Vocab

REQUIRED = ("kind", "model", "vocab", "weights")


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


def check_compatible(ckpt: dict[str, Any], path: str | Path, model_name: str | None, model_config: dict[str, Any] | None, vocab: Vocab | None) -> None:
    """Refuse a checkpoint of another model, model config or vocabulary, with one line naming the file."""
    saved = ckpt["model"]
    if model_name is not None and saved.get("name") != model_name:
        raise UsageError(f"checkpoint {path} holds a '{saved.get('name')}' model, not '{model_name}'")
    if model_config is not None and not _same(dict(saved.get("config", {})), dict(model_config)):
        diff = sorted(k for k in set(saved.get("config", {})) | set(model_config)
                      if not _same(saved.get("config", {}).get(k), model_config.get(k)))
        raise UsageError(f"checkpoint {path} was trained with another '{saved.get('name')}' configuration (differs in: {', '.join(diff)})")
    if vocab is not None and list(ckpt["vocab"]) != list(vocab.words):
        raise UsageError(
            f"checkpoint {path} was trained with another vocabulary ({len(ckpt['vocab'])} words) than the prepared data ({len(vocab)} words)"
        )


def read_training_checkpoint(path: str | Path) -> dict[str, Any]:
    """Load and validate a training checkpoint (weights_only)."""
    ckpt = load_checkpoint(path, REQUIRED)
    if not isinstance(ckpt["model"], dict) or "name" not in ckpt["model"] or "config" not in ckpt["model"]:
        raise PipelineError(f"checkpoint {path}: malformed model description")
    return ckpt


def read_captioner_file(path: str | Path, companion: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """The native checkpoint at ``path`` (and its path), or the cached native conversion of a released M2 / AoANet
    model (``models.released``; ``companion`` is its vocab.pkl / infos pickle, found next to it when omitted)."""
    path = Path(path)
    try:
        return path, read_training_checkpoint(path)
    except PipelineError as native_error:
        from models.released import cached_native, ensure_native, load_release

        if path.is_file():
            cached = cached_native(path, companion)  # converted before: only the native copy is read
            if cached is not None:
                return cached, read_training_checkpoint(cached)
        try:
            loaded = load_release(path)
        except UsageError:
            raise native_error from None
        if loaded[0] is None:
            raise native_error from None
        target = ensure_native(path, companion, loaded)
        return target, read_training_checkpoint(target)


def load_captioner(path: str | Path, device: torch.device | str = "cpu", vocab: Vocab | None = None,
                   companion: str | Path | None = None) -> tuple[Captioner, dict[str, Any]]:
    """Rebuild the captioner stored in ``path`` (checked against ``vocab`` when given) with its weights.

    ``path`` may also be a released M2 / AoANet weights file (converted once, see :func:`read_captioner_file`);
    such a model brings its own vocabulary, so ``vocab`` is not compared with it.
    """
    path, ckpt = read_captioner_file(path, companion)
    check_compatible(ckpt, path, None, None, None if ckpt.get("release") else vocab)
    name, config = ckpt["model"]["name"], dict(ckpt["model"]["config"])
    model = build_captioner(name, len(ckpt["vocab"]), **config)
    try:
        model.load_state_dict(ckpt["weights"])
    except RuntimeError as exc:
        raise PipelineError(f"checkpoint {path}: weights do not fit a '{name}' model: {str(exc).splitlines()[0][:200]}") from None
    return model.to(device), ckpt
