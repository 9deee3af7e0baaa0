"""`cli extract`: Extract bottom-up region features from image folders into an HDF5 store."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "extract",
        help="Extract bottom-up region features from image folders into an HDF5 store.\n\nExample:\n\n    butd-caption extract photos/ --store runs/feats.h5",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def extract_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`extract`", "issue 6, the bottom-up extractor")
