"""The benchmark harness: the project against a named baseline on identical inputs, outputs compared first.

Every :class:`Case` has a project side and a baseline side that do the same work on the same inputs. The
harness runs them interleaved (ABAB on even repeats, BABA on odd ones, so drifts of the machine's load hit
both sides alike), after ``warmup`` untimed rounds, for ``repeats`` timed rounds, and compares the outputs of
*every timed round* with the case's ``check`` before it reports anything: a difference above the case's
stated tolerance raises :class:`Mismatch` and no ratio is printed. Results are one table (stdout) and JSON.

Throughput rows (``baseline is None``: the GPU table) report the project's time only, never a ratio.
Command line: ``python -m bench --help`` (:mod:`bench.__main__`).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

log = logging.getLogger("bench")


class Mismatch(RuntimeError):
    """The project's output differs from the baseline's beyond the case's tolerance."""


@dataclass
class Case:
    """One comparison. ``check(project_output, baseline_output)`` returns the difference (max |a - b| for
    numbers, the count of differing items for exact checks); ``tolerance`` is the largest difference allowed
    (0: exact). ``work`` says what one timed call does; ``sync`` runs after each call (CUDA)."""

    name: str
    project: str
    baseline: str | None
    work: str
    run_project: Callable[[], Any]
    run_baseline: Callable[[], Any] | None = None
    check: Callable[[Any, Any], float] | None = None
    tolerance: float = 0.0
    note: str = ""
    sync: Callable[[], None] = field(default=lambda: None)
    per_call: float = 1.0  # divide times by this (e.g. per image); ``unit`` names it
    unit: str = "ms"
    reports: str = "time"  # "value": an unpaired ``run_project`` returns the figure itself (in ``unit``)
    after: Callable[[], str] | None = None  # read after the timed rounds, appended to the note (peak memory, lengths)


@dataclass
class Row:
    """A measured case: times in ``unit`` (min / median over the timed repeats), the speed-up
    ``baseline / project`` and the largest output difference seen over the timed repeats."""

    name: str
    project: str
    baseline: str | None
    work: str
    unit: str
    repeats: int
    project_min: float
    project_median: float
    baseline_min: float | None
    baseline_median: float | None
    speedup_min: float | None
    speedup_median: float | None
    max_diff: float | None
    tolerance: float | None
    load_before: float
    load_after: float
    note: str = ""


def _timed(fn: Callable[[], Any], sync: Callable[[], None]) -> tuple[float, Any]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return time.perf_counter() - t0, out


def _checked(case: Case, ours: Any, theirs: Any, label: str) -> float:
    assert case.check is not None
    diff = float(case.check(ours, theirs))
    if not diff <= case.tolerance:  # also catches NaN
        raise Mismatch(
            f"{case.name}: {case.project} and {case.baseline} outputs differ on {label} "
            f"(difference {diff:.3g}, tolerance {case.tolerance:.3g}); no ratio reported"
        )
    return diff


def measure(case: Case, repeats: int = 3, warmup: int = 1) -> Row:
    """Run ``case``: ``warmup`` untimed rounds, then ``repeats`` interleaved timed rounds, each round's two
    outputs compared (:class:`Mismatch` on a difference). Returns the :class:`Row`."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    load_before = os.getloadavg()[0]
    paired = case.run_baseline is not None
    if paired and case.check is None:
        raise ValueError(f"{case.name}: a case with a baseline needs a check")
    for w in range(warmup):
        ours = case.run_project()
        if paired:
            _checked(case, ours, case.run_baseline(), f"warm-up round {w + 1}")  # type: ignore[misc]
    t_ours: list[float] = []
    t_base: list[float] = []
    diffs: list[float] = []
    for r in range(repeats):
        if not paired:
            dt, value = _timed(case.run_project, case.sync)
            t_ours.append(float(value) if case.reports == "value" else dt)
            continue
        if r % 2 == 0:
            dt_o, ours = _timed(case.run_project, case.sync)
            dt_b, theirs = _timed(case.run_baseline, case.sync)  # type: ignore[arg-type]
        else:
            dt_b, theirs = _timed(case.run_baseline, case.sync)  # type: ignore[arg-type]
            dt_o, ours = _timed(case.run_project, case.sync)
        diffs.append(_checked(case, ours, theirs, f"timed round {r + 1}"))
        t_ours.append(dt_o)
        t_base.append(dt_b)
    scale = (1e3 if case.unit == "ms" and case.reports == "time" else 1.0) / case.per_call
    p_min, p_med = min(t_ours) * scale, statistics.median(t_ours) * scale
    b_min = b_med = s_min = s_med = None
    if paired:
        b_min, b_med = min(t_base) * scale, statistics.median(t_base) * scale
        s_min, s_med = b_min / p_min, b_med / p_med
    extra = case.after() if case.after is not None else ""
    note = "; ".join(x for x in (case.note, extra) if x)
    return Row(
        case.name,
        case.project,
        case.baseline,
        case.work,
        case.unit,
        repeats,
        p_min,
        p_med,
        b_min,
        b_med,
        s_min,
        s_med,
        max(diffs) if diffs else None,
        case.tolerance if paired else None,
        load_before,
        os.getloadavg()[0],
        note,
    )


def environment(device: str, threads: int) -> dict[str, Any]:
    """Machine facts printed above the table and kept in the JSON."""
    name = torch.cuda.get_device_name() if device == "cuda" else platform.processor() or platform.machine()
    return {
        "device": device,
        "device_name": name,
        "torch": torch.__version__,
        "numpy": np.__version__,
        "python": platform.python_version(),
        "torch_threads": threads,
        "cores": len(os.sched_getaffinity(0)),
        "load_average": list(os.getloadavg()),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _num(v: float | None, fmt: str = ".3g") -> str:
    return "-" if v is None else format(v, fmt)


def table(rows: list[Row], env: dict[str, Any]) -> str:
    """The results as one fixed-width table (header line with the machine and its load first)."""
    head = (
        f"# {env['device_name']} ({env['device']}), {env['cores']} cores, torch {env['torch']} with "
        f"{env['torch_threads']} thread(s); load average at start {env['load_average'][0]:.2f}"
    )
    cols = (
        "bench",
        "project",
        "baseline",
        "work",
        "unit",
        "project min/med",
        "baseline min/med",
        "speed-up min/med",
        "max diff (tol)",
        "load",
    )
    lines = []
    for r in rows:
        speed = "-" if r.speedup_min is None else f"x{r.speedup_min:.1f} / x{r.speedup_median:.1f}"
        diff = "-" if r.max_diff is None else f"{r.max_diff:.2g} ({r.tolerance:.2g})"
        lines.append(
            (
                r.name,
                r.project,
                r.baseline or "-",
                r.work,
                r.unit,
                f"{_num(r.project_min)} / {_num(r.project_median)}",
                f"{_num(r.baseline_min)} / {_num(r.baseline_median)}" if r.baseline else "-",
                speed,
                diff,
                f"{r.load_before:.2f}-{r.load_after:.2f}",
            )
        )
    widths = [max(len(c), *(len(line[i]) for line in lines)) if lines else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [head, fmt.format(*cols)] + [fmt.format(*line) for line in lines]
    notes = [f"  {r.name}: {r.note}" for r in rows if r.note]
    return "\n".join(out + (["notes:"] + notes if notes else []))


def to_json(rows: list[Row], env: dict[str, Any]) -> str:
    """The results as JSON: ``{"environment": {...}, "rows": [...]}``."""
    return json.dumps({"environment": env, "rows": [asdict(r) for r in rows]}, indent=1)
