"""butd-caption command line: ``python cli.py COMMAND --help`` (or the ``butd-caption`` entry point).

Exit codes: 0 ok, 1 runtime failure, 2 usage or validation error.
"""

from __future__ import annotations

import importlib
import os
import sys

# Before anything imports torch (the command modules do): OpenMP reads its wait policy once, when it loads.
# Idle threads sleep instead of spinning, which keeps a run usable next to other processes
# (pipeline/core/threads.py).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from typing import Annotated, Optional

import typer

from pipeline.commands import COMMAND_MODULES, load_plugins
from pipeline.commands.common import fail
from pipeline.commands.grammar import GrammarGroup
from pipeline.core import threads as thread_policy
from pipeline.core.config import check_config_dir
from pipeline.core.environment import drop_odd_terminal_size
from pipeline.core.errors import UsageError
from pipeline.core.threads import drop_odd_openmp_count

# Every console of the process (ours, and the help and usage errors of the CLI framework) reads COLUMNS / LINES,
# and OpenMP reads OMP_NUM_THREADS when torch loads: an odd value (COLUMNS=0 prints nothing at all) is dropped,
# with one warning, before anything is printed or torch is imported.
drop_odd_terminal_size()
drop_odd_openmp_count()

app = typer.Typer(
    name="butd-caption",
    cls=GrammarGroup,
    help=(
        "Bottom-up region features, attention captioners and captions, end to end.\n\n"
        "Start with `demo` (the whole pipeline on the embedded synthetic world)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)


@app.callback()
def _global_options(
    threads: Annotated[
        Optional[str],
        typer.Option(
            "--threads",
            show_default=False,
            metavar="INT",
            help="Torch CPU threads per process (default: BUTD_THREADS, else the cores this process may use, "
            "minus its DataLoader workers, divided among torchrun processes; see pipeline/core/threads.py). Before "
            "the command or after it: `butd-caption --threads 1 demo`.",
        ),
    ] = None,
) -> None:
    """Process-wide settings applied before any command runs (the thread policy)."""
    try:
        if threads is not None and not threads.strip().isdigit():
            raise UsageError(f"--threads must be a whole number, got {threads!r}")
        # BUTD_THREADS is read by the thread policy itself: an odd value there is warned about, not fatal
        thread_policy.prepare_process(None if threads is None else int(threads))
    except UsageError as exc:
        fail(str(exc))


def _load_plugins() -> None:
    """Extension modules from $BUTD_PLUGINS register their captioners and formats before the commands are built."""
    try:
        load_plugins()
    except UsageError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(2) from None


# The plugins and the command modules import torch: they are imported here, after the environment checks above
# (no module imported at the top of this file loads torch).
_load_plugins()
for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point (from the source checkout: see ``pipeline.core.config.check_config_dir``)."""
    try:
        check_config_dir()
    except UsageError as exc:
        sys.stderr.write(f"error: {exc}\n")
        raise SystemExit(exc.exit_code) from None
    app(prog_name="butd-caption")


if __name__ == "__main__":
    main()
