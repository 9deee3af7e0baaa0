"""The detector-training checkpoint: one typed record (:class:`DetectorCheckpoint`), one writer, one reader.

``train-detector`` writes ``checkpoints/last.pt`` with :meth:`DetectorCheckpoint.save` and resumes it with
:meth:`DetectorCheckpoint.load` (``weights_only`` loading, errors name the file). The exported weights
(``detector.pth``) are a detector-weights file of their own (:mod:`extractors.training.export`).

On disk (plain containers and tensors, :func:`pipeline.core.checkpoint.save_checkpoint`)::

    format, version   "butd-caption-checkpoint", 1
    model       the detector's state dict (weights and frozen statistics)
    optimizer, scaler, rng   :class:`~pipeline.core.training.resume.ResumeState` (rng: one state per process)
    iteration   iterations done
    identity    the training config parts a resumed run must agree with
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pipeline.core.checkpoint import load_checkpoint, save_checkpoint
from pipeline.core.errors import PipelineError
from pipeline.core.training.resume import ResumeState

REQUIRED = ("model", "optimizer", "iteration", "rng", "identity")


@dataclass
class DetectorCheckpoint:
    """The resumable state of a detector training run after ``iteration`` iterations."""

    weights: dict[str, torch.Tensor]
    iteration: int
    identity: dict[str, Any]
    state: ResumeState

    @property
    def processes(self) -> int:
        """How many processes wrote it (one RNG state each)."""
        return len(self.state.rng) if isinstance(self.state.rng, list) else 1

    # -- the one writer ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The on-disk payload (without ``format``/``version``, which :func:`save_checkpoint` adds)."""
        return {"model": self.weights, **self.state.to_dict(), "iteration": self.iteration, "identity": self.identity}

    def save(self, path: str | Path) -> Path:
        """Write atomically (a kill never leaves a partial file)."""
        return save_checkpoint(path, self.to_dict())

    # -- the one reader ---------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str | Path) -> DetectorCheckpoint:
        """Validate a loaded payload; every problem is one line naming ``path``."""
        missing = [k for k in REQUIRED if k not in data]
        if missing:
            raise PipelineError(f"checkpoint {path} lacks {', '.join(missing)}")
        weights = data["model"]
        if not isinstance(weights, dict) or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()
        ):
            raise PipelineError(f"checkpoint {path}: the model is not a state dict of named tensors")
        iteration = data["iteration"]
        if not isinstance(iteration, int) or isinstance(iteration, bool) or iteration < 0:
            raise PipelineError(f"checkpoint {path}: iteration {iteration!r} is not an integer >= 0")
        if not isinstance(data["identity"], dict):
            raise PipelineError(f"checkpoint {path}: the training identity is not a mapping")
        if "scaler" not in data:  # a checkpoint without a gradient scaler state restores none
            data = {**data, "scaler": {}}
        return cls(
            weights=weights, iteration=iteration, identity=data["identity"], state=ResumeState.from_dict(data, path)
        )

    @classmethod
    def load(cls, path: str | Path) -> DetectorCheckpoint:
        """Read and validate ``path`` (``weights_only``): a foreign, truncated, unsafe or malformed file fails in one
        line naming it."""
        return cls.from_dict(load_checkpoint(path, REQUIRED), path)
