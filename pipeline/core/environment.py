"""Environment variables: one reader, one rule for odd values.

Two kinds of variable, two rules:

* **Settings** (ours and the terminal's: ``BUTD_THREADS``, ``OMP_NUM_THREADS``, ``BUTD_WORKER_WAIT``,
  ``BUTD_NO_PROGRESS``, ``COLUMNS``, ``LINES``): a value that is not a number in its range (``COLUMNS=0``,
  ``BUTD_THREADS=abc`` or ``10**30``) falls back to the default, with one warning per process and value naming the
  variable, the value and what is used instead. A stray export never stops a command nor hides its output.
* **The launcher's** (torchrun's ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``): no default can
  stand in for a process's rank (two processes would take the same one), so an odd value is a
  :class:`~pipeline.core.errors.UsageError` in one line naming the variable.

``COLUMNS`` and ``LINES`` are read by every rich console of the process, the CLI framework's help and usage errors
included: :func:`drop_odd_terminal_size` removes an odd one from ``os.environ`` (warning once), so they all fall
back to the terminal's own size. Variables that belong to others and hold no number (``CI``, ``TERM``,
``JAVA_HOME``) are read where they are used.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from typing import TypeVar

from pipeline.core.errors import UsageError

#: the sizes a terminal variable may take; outside them a console folds every word or pads every line to megabytes
TERMINAL_RANGE = {"COLUMNS": (20, 1000), "LINES": (5, 1000)}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"", "0", "false", "no", "off"})
_warned: set[tuple[str, str]] = set()
N = TypeVar("N", int, float)


def _warn(name: str, raw: str, expected: str, instead: str) -> None:
    """One warning per process for each odd (variable, value) pair."""
    if (name, raw) in _warned:
        return
    _warned.add((name, raw))
    shown = raw if len(raw) <= 40 else raw[:40] + "..."
    # a child of the project logger ("butd", pipeline.core.console); before its handler exists, Python prints the
    # bare line to stderr
    log = logging.getLogger("butd.environment")
    log.warning("environment variable %s=%r is not %s; %s", name, shown, expected, instead)


def _number(name: str, parse: Callable[[str], N]) -> tuple[str, N | None]:
    """``$name`` stripped, and the number ``parse`` reads in it (None when blank or when ``parse`` raises
    ValueError)."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return raw, None
    try:
        return raw, parse(raw)
    except ValueError:
        return raw, None


def setting_int(
    name: str, default: int | None, low: int, high: int, instead: str | None = None, list_form: bool = False
) -> int | None:
    """The whole number ``low..high`` in ``$name``; ``default`` when unset or blank, and when odd (with a warning
    that says ``instead``, or "using <default>"). ``list_form``: the first of comma-separated entries counts
    (OpenMP's ``OMP_NUM_THREADS=4,2``)."""
    raw, value = _number(name, lambda text: int(text.split(",")[0] if list_form else text))
    if not raw:
        return default
    if value is None or not low <= value <= high:
        _warn(name, raw, f"a whole number from {low} to {high}", instead or f"using {default}")
        return default
    return value


def setting_float(name: str, default: float, high: float = 1e9) -> float:
    """The finite positive number (at most ``high``) in ``$name``; ``default`` when unset, blank or odd (warned)."""
    raw, value = _number(name, float)
    if not raw:
        return default
    if value is None or not (math.isfinite(value) and 0 < value <= high):
        _warn(name, raw, f"a positive number of at most {high:g}", f"using {default:g}")
        return default
    return value


def setting_flag(name: str) -> bool:
    """An on/off switch: ``1``/``true``/``yes``/``on`` is on, unset/blank/``0``/``false``/``no``/``off`` is off; any
    other value is on (it was set, after all), with a warning."""
    raw = os.environ.get(name, "").strip()
    if raw.lower() in _FALSE:
        return False
    if raw.lower() not in _TRUE:
        _warn(name, raw, "1/true/yes/on or 0/false/no/off", "taking it as on")
    return True


def launcher_int(name: str, default: int, low: int = 0) -> int:
    """A number torchrun sets (``RANK``, ``WORLD_SIZE``, ...): ``default`` when unset or blank; a value that is not a
    whole number of at least ``low`` is a :class:`UsageError` (no default can replace a process's rank)."""
    raw, value = _number(name, int)
    if not raw:
        return default
    if value is None or value < low:
        raise UsageError(
            f"environment variable {name}={raw[:40]!r} must be a whole number of at least {low} "
            "(torchrun sets it; unset it to run one process)"
        )
    return value


def drop_odd_terminal_size() -> None:
    """Remove ``COLUMNS`` / ``LINES`` from ``os.environ`` when they are not a size in :data:`TERMINAL_RANGE`
    (warning once), so that every console of the process uses the terminal's size or its own default."""
    instead = "using the terminal's size (off a terminal, the default)"
    for name, (low, high) in TERMINAL_RANGE.items():
        if name in os.environ and setting_int(name, None, low, high, instead) is None:
            del os.environ[name]
