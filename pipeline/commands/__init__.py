"""CLI command modules. Each module exposes ``register(app)`` adding its commands to the root Typer app.

Heavy imports (torch, h5py, the models) happen inside the commands so that ``cli --help`` stays fast.
"""

from __future__ import annotations

COMMAND_MODULES = (
    "pipeline.commands.extract",
    "pipeline.commands.import_features",
    "pipeline.commands.prepare",
    "pipeline.commands.train",
    "pipeline.commands.train_detector",
    "pipeline.commands.evaluate",
    "pipeline.commands.embed",
    "pipeline.commands.caption",
    "pipeline.commands.convert",
    "pipeline.commands.demo",
    "pipeline.commands.info",
)
