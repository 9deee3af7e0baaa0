"""`cli import-features`: Import public feature files (BUTD TSV, LXMERT obj36, cocobu npz, M2 hdf5) into a store."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "import-features",
        help="Import public feature files (BUTD TSV, LXMERT obj36, cocobu npz, M2 hdf5) into a store.\n\nExample:\n\n    butd-caption import-features --format butd-tsv trainval_36.tsv --store feats.h5",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def import_features_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`import-features`", "issue 4, the feature store")
