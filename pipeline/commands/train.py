"""`cli train`: Train a captioner (cross-entropy, then self-critical CIDEr-D)."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "train",
        help="Train a captioner (cross-entropy, then self-critical CIDEr-D).\n\nExample:\n\n    butd-caption train --config configs/train.yaml --set model.name=ngsan",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def train_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`train`", "issue 5, training")
