"""Logging and progress bars: rich on stderr, only on rank 0, quiet when not interactive.

stdout stays machine-readable (tables and results only); everything else goes to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable, Iterator
from typing import TypeVar

from rich.console import Console
from rich.logging import RichHandler
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from pipeline.core.environment import drop_odd_terminal_size, setting_flag, setting_int

T = TypeVar("T")

LOGGER_NAME = "butd"


def get_rank() -> int:
    """Process rank under torchrun (``RANK``), 0 otherwise."""
    return setting_int("RANK", 0, 0, 1 << 20) or 0  # logging must come up: an odd value is warned, not fatal


def is_main_process() -> bool:
    """True on rank 0 (or without torchrun)."""
    return get_rank() == 0


PIPE_WIDTH = 200  # columns of a console whose stream is a file or pipe (docker logs, CI, `> log`) unless COLUMNS says


def console_width(stream) -> int | None:
    """The width to lay out for ``stream``: rich's own choice for a terminal or when ``COLUMNS`` is set, else
    :data:`PIPE_WIDTH` (rich falls back to 80 columns off a terminal, which folds every log line, path and table cell
    of a container's or a CI job's log). An odd ``COLUMNS`` or ``LINES`` (``0``, ``abc``, ``100000``) is dropped
    with one warning first (:func:`pipeline.core.environment.drop_odd_terminal_size`): a console 0 columns wide
    prints nothing, not even the error line."""
    drop_odd_terminal_size()
    if os.environ.get("COLUMNS"):
        return None
    try:
        interactive = stream.isatty()
    except (AttributeError, ValueError):
        interactive = False
    return None if interactive else PIPE_WIDTH


def stderr_console() -> Console:
    """A rich console on stderr (logs, progress, errors)."""
    return Console(stderr=True, soft_wrap=True, width=console_width(sys.stderr))


def stdout_console() -> Console:
    """A rich console on stdout (results only)."""
    return Console(soft_wrap=True, width=console_width(sys.stdout))


def setup_logging(verbose: bool = False, quiet: bool = False) -> logging.Logger:
    """Configure the project logger once per process (idempotent). Non-zero ranks log warnings only."""
    logger = logging.getLogger(LOGGER_NAME)
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    if not is_main_process():
        level = max(level, logging.WARNING)
    logger.setLevel(level)
    if not any(getattr(h, "_butd", False) for h in logger.handlers):
        handler = RichHandler(
            console=stderr_console(), show_path=False, show_time=False, markup=False, rich_tracebacks=False
        )
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler._butd = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        logger.propagate = False
    return logger


def get_logger(name: str | None = None) -> logging.Logger:
    """A child of the project logger, e.g. ``get_logger(__name__)``."""
    return logging.getLogger(LOGGER_NAME if not name else f"{LOGGER_NAME}.{name}")


def progress_enabled() -> bool:
    """Live bars only for an interactive stderr on rank 0, and never when ``CI`` is set (any value) or
    ``BUTD_NO_PROGRESS`` is on (:func:`pipeline.core.environment.setting_flag`: ``1``, ``true``, ...; ``0`` is off)."""
    if not is_main_process() or setting_flag("BUTD_NO_PROGRESS") or os.environ.get("CI"):
        return False
    return sys.stderr.isatty() and os.environ.get("TERM") != "dumb"


def _stderr_progress(*counts: ProgressColumn) -> Progress:
    """A rich Progress on stderr: the description, the bar, ``counts``, the time left; disabled (no output) when
    :func:`progress_enabled` is false."""
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        *counts,
        TimeRemainingColumn(),
        console=stderr_console(),
        disable=not progress_enabled(),
        transient=False,
    )


def make_progress() -> Progress:
    """A rich Progress on stderr (items done of total, time elapsed, time left); disabled (no output) when
    :func:`progress_enabled` is false."""
    return _stderr_progress(MofNCompleteColumn(), TimeElapsedColumn())


def make_download_progress() -> Progress:
    """A rich Progress for byte transfers (bytes done of total, speed, time left); the same rules as
    :func:`make_progress`."""
    return _stderr_progress(DownloadColumn(), TransferSpeedColumn())


def track(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate with a progress bar on stderr (rank 0, interactive only)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with make_progress() as progress:
        task = progress.add_task(description, total=total)
        for item in items:
            yield item
            progress.advance(task)
