"""Logs and tables written to a file or pipe (docker logs, CI) are not folded at rich's 80-column fallback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

CHILD = """
from pipeline.core.console import get_logger, setup_logging, stdout_console
from rich.table import Table
setup_logging()
get_logger("t").info("a log line of " + "x" * 120 + " END")
t = Table("image", "caption")
t.add_row("runs/demo/world/images/world_000903.jpg", "a small white cross is to the left of a small yellow circle")
stdout_console().print(t)
"""


def _run(columns: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    if columns:
        env["COLUMNS"] = columns
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return subprocess.run(
        [sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120, check=True
    )


def test_a_piped_log_line_and_table_row_stay_on_one_line() -> None:
    out = _run(None)
    line = [ln for ln in out.stderr.splitlines() if "a log line of" in ln]
    assert len(line) == 1 and line[0].rstrip().endswith("END"), out.stderr  # one line, not folded at 80 columns
    assert any("world_000903.jpg" in ln and "small yellow circle" in ln for ln in out.stdout.splitlines()), out.stdout


def test_columns_still_decides_when_set() -> None:
    out = _run("60")
    assert all(len(ln) <= 60 for ln in out.stderr.splitlines()), out.stderr
    assert not any("a log line of" in ln and "END" in ln for ln in out.stderr.splitlines())
