"""The training core shared by the three trainers (captioners ``pipeline/training/engine.py``, the sentence
encoder ``pipeline/embedding/train.py`` and the detector ``extractors/training/loop.py``).

Each trainer keeps only its batches, its loss and its validation; everything else comes from here:

* :mod:`.loop`       :class:`TrainLoop` and its hooks (:class:`HookBase`): the one loop every trainer runs, with
  logging, checkpoints, best-checkpoint selection, the stop on a signal and the distributed entry/exit as hooks;

* :mod:`pipeline.core.precision` (re-exported) the one ``precision`` vocabulary: resolver, autocast, gradient scaler;
* :mod:`.seeding`    :func:`seed_everything` (Python, NumPy, torch CPU and CUDA generators);
* :mod:`.signals`    :class:`StopOnSignal` (SIGTERM/SIGINT: save at the next step, then stop with
  :class:`TrainingInterrupted`, exit code 130);
* :mod:`.step`       :func:`check_finite` (on every rank) and :func:`optimizer_step` (scaler, clipping, step);
* :mod:`.resume`     exact-resume bookkeeping: every rank's RNG states, optimizer and scaler states.

The device and the distributed context (:class:`~pipeline.core.distributed.DistContext`,
:func:`~pipeline.core.distributed.resolve_device`, :func:`~pipeline.core.distributed.setup`) live in
:mod:`pipeline.core.distributed`.
"""

from pipeline.core.precision import PRECISIONS, autocast, make_scaler, resolve_precision
from pipeline.core.training.loop import HookBase, TrainLoop
from pipeline.core.training.resume import (
    ResumeState,
    gather_rng_states,
    restore_rng_states,
    restore_training_state,
    training_state,
)
from pipeline.core.training.seeding import seed_everything
from pipeline.core.training.signals import StopOnSignal, TrainingInterrupted
from pipeline.core.training.step import check_finite, optimizer_step

__all__ = [
    "PRECISIONS",
    "HookBase",
    "ResumeState",
    "StopOnSignal",
    "TrainLoop",
    "TrainingInterrupted",
    "autocast",
    "check_finite",
    "gather_rng_states",
    "make_scaler",
    "optimizer_step",
    "resolve_precision",
    "restore_rng_states",
    "restore_training_state",
    "seed_everything",
    "training_state",
]
