"""Stop on a signal: SIGTERM/SIGINT set a flag; the trainer saves at the next step boundary and stops.

    with StopOnSignal() as stop:
        for batch in batches:
            step(batch)
            stop.check(ctx, save, f"epoch {epoch}, batch {position}", checkpoint_path)

:meth:`StopOnSignal.check` asks every rank (one collective), so all processes of a ``torchrun`` job stop at
the same step; it then calls ``save`` and raises :class:`TrainingInterrupted` (exit code 130, one line).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pipeline.core.console import get_logger
from pipeline.core.distributed import DistContext, any_rank
from pipeline.core.errors import PipelineError

log = get_logger("train")

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingInterrupted(PipelineError):
    """Stopped by SIGTERM/SIGINT after saving; rerunning the command resumes."""

    exit_code = 130


class StopOnSignal:
    """Context manager that turns SIGTERM/SIGINT into a stop request polled at step boundaries.

    Handlers are installed only in the main thread (Python allows no other); ``signum`` may also be set by
    hand (tests) and is kept across ``__enter__``.
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self._old: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:  # noqa: ARG002
        if self.signum is None:
            log.warning("received %s: saving at the next step boundary, then stopping", signal.Signals(signum).name)
        self.signum = signum

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in STOP_SIGNALS}
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old = {}

    def requested(self, ctx: DistContext) -> bool:
        """True on every rank when any rank received a stop signal."""
        return any_rank(self.signum is not None, ctx)

    def check(self, ctx: DistContext, save: Callable[[], None], where: str, checkpoint: str | Path) -> None:
        """When a stop was requested: ``save()`` and raise :class:`TrainingInterrupted` naming ``where`` and the
        file."""
        if self.requested(ctx):
            save()
            raise TrainingInterrupted(
                f"stopped by a signal at {where}; checkpoint saved to {checkpoint}: "
                "run the same command again to resume"
            )
