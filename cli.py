"""butd-caption command line: ``python cli.py COMMAND --help`` (or the ``butd-caption`` entry point).

Exit codes: 0 ok, 1 runtime failure, 2 usage or validation error.
"""

from __future__ import annotations

import importlib

import typer

from pipeline.commands import COMMAND_MODULES

app = typer.Typer(
    name="butd-caption",
    help=(
        "Bottom-up region features, attention captioners and captions, end to end.\n\n"
        "Start with `demo` (the whole pipeline on the embedded synthetic world)."
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_show_locals=False,
    rich_markup_mode="rich",
)

for _module in COMMAND_MODULES:
    importlib.import_module(_module).register(app)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="butd-caption")


if __name__ == "__main__":
    main()
