"""`cli caption`: Caption raw photos with a detector and a trained captioner."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "caption",
        help="Caption raw photos with a detector and a trained captioner.\n\nExample:\n\n    butd-caption caption photo.jpg --model runs/demo/train-ngsan/best.pt",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def caption_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`caption`", "issue 8, end to end")
