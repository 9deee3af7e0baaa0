"""Reading a captioner file: a native checkpoint (:class:`~models.checkpoints.CaptionerCheckpoint`), or a released
M2 / AoANet model converted once into the native format (:mod:`models.released`) and read from that cache.

The released readers are looked up on :mod:`models.released` at call time, so the one conversion path is the one
that module defines.
"""

from __future__ import annotations

from pathlib import Path

import torch

import models.released as released
from models.captioners.base import Captioner
from models.checkpoints import CaptionerCheckpoint
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.vocab import Vocab


def read_captioner_file(path: str | Path, companion: str | Path | None = None) -> tuple[Path, CaptionerCheckpoint]:
    """The native checkpoint at ``path`` (and its path), or the cached native conversion of a released M2 / AoANet
    model (``models.released``; ``companion`` is its vocab.pkl / infos pickle, found next to it when omitted)."""
    path = Path(path)
    try:
        native = CaptionerCheckpoint.load(path)
    except PipelineError as native_error:
        if path.is_file():
            cached = released.cached_native(path, companion)  # converted before: only the native copy is read
            if cached is not None:
                return cached, CaptionerCheckpoint.load(cached)
        try:
            loaded = released.load_release(path)
        except UsageError:
            raise native_error from None
        if loaded[0] is None:
            raise native_error from None
        target = released.ensure_native(path, companion, loaded)
        return target, CaptionerCheckpoint.load(target)
    if companion is not None:  # silently unused otherwise: the checkpoint's own vocabulary decides the words
        raise UsageError(
            f"{path} is a butd-caption checkpoint with its own vocabulary: a vocabulary file ({companion}, --vocab) "
            "is only for a released M2 / AoANet captioner"
        )
    return path, native


def load_captioner(
    path: str | Path,
    device: torch.device | str = "cpu",
    vocab: Vocab | None = None,
    companion: str | Path | None = None,
) -> tuple[Captioner, CaptionerCheckpoint]:
    """Rebuild the captioner stored in ``path`` (checked against ``vocab`` when given) with its weights.

    ``path`` may also be a released M2 / AoANet weights file (converted once, see :func:`read_captioner_file`);
    such a model brings its own vocabulary, so ``vocab`` is not compared with it.
    """
    path, ckpt = read_captioner_file(path, companion)
    ckpt.check_compatible(path, None, None, None if ckpt.release else vocab)
    return ckpt.build(path, device), ckpt
