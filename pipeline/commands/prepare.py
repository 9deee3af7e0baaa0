"""`cli prepare`: Prepare captions and the vocabulary from Karpathy or COCO caption files."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "prepare",
        help="Prepare captions and the vocabulary from Karpathy or COCO caption files.\n\nExample:\n\n    butd-caption prepare --set prepare.karpathy_json=dataset_coco.json --out runs/data",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def prepare_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`prepare`", "issue 4, caption data")
