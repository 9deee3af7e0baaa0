"""`cli evaluate`: Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present)."""

from __future__ import annotations

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, not_implemented


def register(app: typer.Typer) -> None:
    @app.command(
        "evaluate",
        help="Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present).\n\nExample:\n\n    butd-caption evaluate --predictions results.json --references captions_test.json",
        context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    )
    @guarded
    def evaluate_command(
        ctx: typer.Context,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        not_implemented("`evaluate`", "issue 5, evaluation")
