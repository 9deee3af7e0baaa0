"""CLI command modules. Each module exposes ``register(app)`` adding its commands to the root Typer app.

Imports sit at the top of each module; a command whose implementation loads torchvision or the web server imports it
inside the command (one commented import), so that ``cli --help`` stays fast.
"""

from __future__ import annotations

import importlib
import os

from pipeline.core.errors import UsageError

COMMAND_MODULES = (
    "pipeline.commands.extract",
    "pipeline.commands.import_features",
    "pipeline.commands.prepare",
    "pipeline.commands.train",
    "pipeline.commands.train_detector",
    "pipeline.commands.evaluate",
    "pipeline.commands.embed",
    "pipeline.commands.caption",
    "pipeline.commands.serve",
    "pipeline.commands.convert",
    "pipeline.commands.demo",
    "pipeline.commands.info",
    "pipeline.commands.fetch",
)

#: environment variable naming extension modules (comma-separated) that the CLI imports before building its commands
PLUGINS_ENV = "BUTD_PLUGINS"


def load_plugins(spec: str | None = None) -> list[str]:
    """Import the extension modules named in ``spec`` (default: ``$BUTD_PLUGINS``), comma-separated module names
    importable from ``sys.path`` (e.g. through ``PYTHONPATH``). Importing one runs its registrations
    (``@models.register_captioner``, ``pipeline.importers.register_format``, ...), so the commands, their help and
    their checks see the new names (docs/extending.md). Returns the names imported; a module that cannot be
    imported is a :class:`pipeline.core.errors.UsageError` naming it."""
    names = [n.strip() for n in (os.environ.get(PLUGINS_ENV, "") if spec is None else spec).split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # any failure of a user's module is reported as one line
            raise UsageError(f"{PLUGINS_ENV}: cannot import {name!r} ({type(exc).__name__}: {exc})") from None
    return names
