"""`cli train`: Train a captioner (cross-entropy, then self-critical CIDEr-D) into RUN/train-<model>."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.commands.common import print_stage_result
from pipeline.commands.options import CommandOptions, Everyday, command, out_option
from pipeline.core.console import is_main_process

#: the everyday options of `train`: both stages' batch size
TRAIN_EVERYDAY = Everyday(device="train.device", batch_size=("train.xe.batch_size", "train.scst.batch_size"),
                          precision="train.precision", num_workers="train.num_workers")


def register(app: typer.Typer) -> None:
    @command(app, "train", force=True, everyday=TRAIN_EVERYDAY)
    def train_command(
        opts: CommandOptions,
        out: out_option("Run directory (train.store / train.data default to OUT/features/store and OUT/data).") = Path("runs/train"),
    ) -> None:
        """Train a captioner: cross-entropy, then self-critical CIDEr-D, with the paper schedule of
        configs/models/<model>.yaml. Writes OUT/train-<model>/ (last.pt, best.pt, xe.pt, log.jsonl); an
        interrupted run resumes from the exact batch when the command is run again.

        Examples:

            butd-caption train --out runs/coco --set train.model=ngsan

            butd-caption train --out runs/w --set train.model=san --set train.xe.epochs=5 --set train.scst.epochs=2

            torchrun --nproc_per_node 8 cli.py train --out runs/coco --set train.model=m2
        """
        from pipeline.training.api import train_captioner

        result = train_captioner(out, opts.resolve("train", show=opts.verbose), force=opts.force)
        if is_main_process():
            print_stage_result(result)
