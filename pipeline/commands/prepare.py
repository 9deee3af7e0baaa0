"""`cli prepare`: captions and the vocabulary from Karpathy or COCO caption files (the `data` stage)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import ConfigOpt, ForceOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, print_stage_result, resolve_config


def register(app: typer.Typer) -> None:
    @app.command(
        "prepare",
        help=(
            "Prepare captions and the vocabulary from Karpathy or COCO caption files into RUN/data "
            "(vocab.json, labels.npz, images.json, references.json, cider_df.json). Done once per config; "
            "skipped when already done.\n\nExamples:\n\n"
            "    butd-caption prepare --set prepare.karpathy_json=dataset_coco.json --out runs/coco\n\n"
            "    butd-caption prepare --set prepare.coco_captions.train=world/annotations/captions_train.json "
            "--set prepare.coco_captions.val=world/annotations/captions_val.json --out runs/world"
        ),
    )
    @guarded
    def prepare_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Run directory; the stage writes OUT/data.")] = Path("runs/data"),
        config: ConfigOpt = None,
        set_: SetOpt = None,
        force: ForceOpt = False,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from pipeline.caption_data.prepare import prepare_captions
        from pipeline.core.stages import run_stage

        cfg = resolve_config("prepare", config, set_)
        result = run_stage(out, "data", cfg.prepare, prepare_captions, force=force)
        print_stage_result(result, outputs=False, summary=True)
