"""The one training loop and its hooks, shared by the captioner, sentence-encoder and detector trainers.

A trainer subclasses :class:`TrainLoop` and supplies two things: :meth:`TrainLoop.batches` (a generator that
resumes, sets up what a stage or epoch needs, yields the step inputs and calls :meth:`TrainLoop.end_epoch`
between epochs) and :meth:`TrainLoop.run_step` (one optimisation step and its counters). Everything around
the steps is a hook (:class:`HookBase`), called in registration order at fixed points::

    before_train
    (before_step, run_step, after_step)*  with  after_epoch  after an epoch's last step
    after_train                           (also when a step or a hook raised: hooks check ``trainer.completed``)

The hooks here cover what every trainer needs: :class:`LogHook` (periodic step records, epoch records),
:class:`PeriodicCheckpoint` (``last.pt`` every N steps), :class:`SignalStop` (SIGTERM/SIGINT: save, then stop
with :class:`~pipeline.core.training.signals.TrainingInterrupted`), :class:`ValidationHook` and
:class:`BestCheckpoint` (a validation metric selects ``best.pt``; another metric is another ``BestCheckpoint``)
and :class:`DistributedSync` (every rank enters and leaves the loop together). The structure follows the
trainer/hook split of detectron2's ``TrainerBase``/``HookBase``.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pipeline.core.distributed import DistContext, barrier
from pipeline.core.errors import UsageError
from pipeline.core.fileio import open_own_file
from pipeline.core.training.signals import StopOnSignal

EVENTS = ("before_train", "before_step", "after_step", "after_epoch", "after_train")


class HookBase:
    """One concern of a training run; every method is a no-op unless overridden. ``trainer`` is set on registration."""

    trainer: TrainLoop

    def before_train(self) -> None:
        """Before the first step (and before the trainer resumes)."""

    def before_step(self) -> None:
        """Before each step."""

    def after_step(self) -> None:
        """After each step; ``trainer.step_stats`` holds its outputs."""

    def after_epoch(self) -> None:
        """After an epoch's last step (epoch-based trainers)."""

    def after_train(self) -> None:
        """After the last step, or after a step or hook raised (then ``trainer.completed`` is False)."""


class TrainLoop:
    """The loop: hooks around the steps of :meth:`batches`, each run by :meth:`run_step`."""

    def __init__(self) -> None:
        self.hooks: list[HookBase] = []
        self.step_stats: dict[str, float] = {}
        self.scores: dict[str, float] | None = None  # the latest validation's scores (None: not validated)
        self.completed = False

    def register_hooks(self, hooks: Iterable[HookBase | None]) -> None:
        """Append ``hooks`` (None entries skipped); they run in this order at each event."""
        for hook in hooks:
            if hook is not None:
                hook.trainer = self
                self.hooks.append(hook)

    def call_hooks(self, event: str) -> None:
        """Call ``event`` (one of :data:`EVENTS`) on every hook, in registration order."""
        for hook in self.hooks:
            getattr(hook, event)()

    def batches(self) -> Iterator[Any]:
        """Resume, then yield every step's input; call :meth:`end_epoch` after an epoch's last step."""
        raise NotImplementedError

    def run_step(self, batch: Any) -> dict[str, float]:
        """One step on ``batch`` (its counters included) -> the step's statistics."""
        raise NotImplementedError

    def end_epoch(self) -> None:
        """The epoch's hooks (log, validation, best checkpoint, ...); called by :meth:`batches`."""
        self.call_hooks("after_epoch")

    def train(self) -> None:
        """before_train, every step between before_step and after_step, after_train (always)."""
        self.completed = False
        self.call_hooks("before_train")
        try:
            for batch in self.batches():
                self.call_hooks("before_step")
                self.step_stats = self.run_step(batch)
                self.call_hooks("after_step")
            self.completed = True
        finally:
            self.call_hooks("after_train")


class JsonlLog:
    """``log.jsonl`` of a run directory (main process only): one JSON record per line, ``time`` first.

    ``scalars``: an optional TensorBoard ``SummaryWriter`` that also receives every number of a record."""

    def __init__(self, path: Path, ctx: DistContext) -> None:
        self.path, self.ctx = Path(path), ctx
        self.scalars: Any = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.ctx.main:
            return
        record = {"time": round(time.time(), 3), **record}
        log_fd = open_own_file(self.path, "training log", append=True)
        with os.fdopen(log_fd, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record) + "\n")
        if self.scalars is not None:
            step = record.get("global_step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k not in ("time", "global_step", "epoch", "iteration"):
                    self.scalars.add_scalar(f"{record.get('event')}/{record.get('stage')}/{k}", v, step)


class LogHook(HookBase):
    """Writes ``step_record()`` after every ``every``-th step (by ``count()``, and after step ``last`` when
    given) and ``epoch_record()`` after each epoch, through ``write``; a record of None is skipped."""

    def __init__(
        self,
        write: Callable[[dict[str, Any]], None],
        every: int = 0,
        count: Callable[[], int] | None = None,
        step_record: Callable[[], dict[str, Any] | None] | None = None,
        epoch_record: Callable[[], dict[str, Any] | None] | None = None,
        last: int | None = None,
    ) -> None:
        self.write, self.every, self.count, self.last = write, int(every), count, last
        self.step_record, self.epoch_record = step_record, epoch_record

    def after_step(self) -> None:
        if self.step_record is None or self.count is None or self.every <= 0:
            return
        n = self.count()
        if n % self.every == 0 or n == self.last:
            record = self.step_record()
            if record is not None:
                self.write(record)

    def after_epoch(self) -> None:
        if self.epoch_record is not None:
            record = self.epoch_record()
            if record is not None:
                self.write(record)


class PeriodicCheckpoint(HookBase):
    """Calls ``save()`` (the resumable checkpoint) after every ``every``-th step by ``count()`` (0: never) and
    after step ``last`` when given; ``saved_at`` is the count of the latest save."""

    def __init__(self, save: Callable[[], None], every: int, count: Callable[[], int], last: int | None = None) -> None:
        self.save, self.every, self.count, self.last = save, int(every), count, last
        self.saved_at: int | None = None

    def after_step(self) -> None:
        n = self.count()
        if (self.every and n % self.every == 0) or n == self.last:
            self.save()
            self.saved_at = n


class SignalStop(HookBase):
    """SIGTERM/SIGINT: after the current step, ``save()`` and stop with ``TrainingInterrupted`` naming ``where()``
    and ``checkpoint`` (every rank stops at the same step). ``when()`` False skips the check (a last step).

    The handlers are installed for the whole loop; ``stop.signum`` may be set by hand to stop after the next step.
    """

    def __init__(
        self,
        ctx: DistContext,
        save: Callable[[], None],
        where: Callable[[], str],
        checkpoint: str | Path,
        when: Callable[[], bool] | None = None,
    ) -> None:
        self.ctx, self.save, self.where, self.checkpoint, self.when = ctx, save, where, checkpoint, when
        self.stop = StopOnSignal()

    def before_train(self) -> None:
        self.stop.__enter__()

    def after_step(self) -> None:
        if self.when is None or self.when():
            self.stop.check(self.ctx, self.save, self.where(), self.checkpoint)

    def after_train(self) -> None:
        self.stop.__exit__(None, None, None)


class ValidationHook(HookBase):
    """After an epoch for which ``due()`` holds: ``trainer.scores = validate()`` (None: not validated), then
    ``report(scores)`` (history, log record) when there are scores."""

    def __init__(
        self,
        validate: Callable[[], dict[str, float] | None],
        due: Callable[[], bool] | None = None,
        report: Callable[[dict[str, float]], None] | None = None,
    ) -> None:
        self.validate, self.due, self.report = validate, due, report

    def after_epoch(self) -> None:
        self.trainer.scores = self.validate() if self.due is None or self.due() else None
        if self.trainer.scores is not None and self.report is not None:
            self.report(self.trainer.scores)


class BestCheckpoint(HookBase):
    """The best-checkpoint selection: after validation, ``progress().best`` and ``save()`` (``best.pt``) follow
    the ``metric`` score of ``trainer.scores`` (higher is better unless ``lower_is_better``).

    ``best`` is ``{"metric", "value", **fields()}``; ``improved`` says whether the latest validation set it
    (None: no scores). An epoch without scores calls ``unvalidated()`` when given (a run without a validation
    split keeps its last epoch). A different selection metric is a different ``metric`` (its score must be in
    the validation's scores) or a subclass overriding :meth:`better`.
    """

    def __init__(
        self,
        metric: str,
        progress: Callable[[], Any],
        save: Callable[[], None],
        fields: Callable[[], dict[str, Any]] = dict,
        unvalidated: Callable[[], None] | None = None,
        lower_is_better: bool = False,
    ) -> None:
        self.metric, self.progress, self.save, self.fields = metric, progress, save, fields
        self.unvalidated, self.lower_is_better = unvalidated, lower_is_better
        self.improved: bool | None = None

    def better(self, value: float, best: float) -> bool:
        """Whether ``value`` beats the best so far."""
        return value < best if self.lower_is_better else value > best

    def after_epoch(self) -> None:
        scores = self.trainer.scores
        self.improved = None
        if scores is None:
            if self.unvalidated is not None:
                self.unvalidated()
            return
        if self.metric not in scores:
            raise UsageError(
                f"the checkpoint selection metric {self.metric!r} is not computed (available: {', '.join(scores)})"
            )
        value = float(scores[self.metric])
        prog = self.progress()
        self.improved = not prog.best or self.better(value, float(prog.best["value"]))
        if self.improved:
            prog.best = {"metric": self.metric, "value": value, **self.fields()}
            self.save()


class DistributedSync(HookBase):
    """Every process enters the loop together and, after a completed run, leaves it together (a barrier each;
    nothing in one process). The process group itself is joined before the model is built (DDP wraps it) and
    left by the command after the stage manifest is written."""

    def __init__(self, ctx: DistContext) -> None:
        self.ctx = ctx

    def before_train(self) -> None:
        barrier(self.ctx)

    def after_train(self) -> None:
        if self.trainer.completed:
            barrier(self.ctx)
