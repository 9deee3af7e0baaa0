"""`cli train`: Train a captioner (cross-entropy, then self-critical CIDEr-D) into RUN/train-<model>."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from pipeline.commands.common import ConfigOpt, ForceOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, print_stage_result, resolve_config
from pipeline.core.console import is_main_process


def register(app: typer.Typer) -> None:
    @app.command(
        "train",
        help=(
            "Train a captioner: cross-entropy, then self-critical CIDEr-D, with the paper schedule of "
            "configs/models/<model>.yaml. Writes OUT/train-<model>/ (last.pt, best.pt, xe.pt, log.jsonl); an "
            "interrupted run resumes from the exact batch when the command is run again.\n\nExamples:\n\n"
            "    butd-caption train --out runs/coco --set train.model=ngsan\n\n"
            "    butd-caption train --out runs/w --set train.model=san --set train.xe.epochs=5 --set train.scst.epochs=2\n\n"
            "    torchrun --nproc_per_node 8 cli.py train --out runs/coco --set train.model=m2"
        ),
    )
    @guarded
    def train_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (train.store / train.data default to OUT/features/store and OUT/data).")] = Path("runs/train"),
        config: ConfigOpt = None,
        set_: SetOpt = None,
        force: ForceOpt = False,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from pipeline.training.api import train_captioner

        cfg = resolve_config("train", config, set_, show=verbose)
        result = train_captioner(out, cfg, force=force)
        if not is_main_process():
            return
        print_stage_result(result)
