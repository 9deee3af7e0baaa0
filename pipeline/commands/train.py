"""`cli train`: Train a captioner (cross-entropy, then self-critical CIDEr-D) into RUN/train-<model>."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

import models
from pipeline.commands.common import print_stage_result
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command, out_option
from pipeline.core.console import is_main_process
from pipeline.training.api import train_captioner

#: the everyday options of `train`: both stages' batch size
TRAIN_EVERYDAY = Everyday(
    device="train.device",
    batch_size=("train.xe.batch_size", "train.scst.batch_size"),
    precision="train.precision",
    num_workers="train.num_workers",
)


def register(app: typer.Typer) -> None:
    @command(app, "train", force=True, everyday=TRAIN_EVERYDAY, help_fields={"run": str(DEFAULT_RUN)})
    def train_command(
        opts: CommandOptions,
        model: Annotated[
            Optional[str],
            typer.Option(
                "--model",
                "-m",
                help=f"Captioner architecture: {' | '.join(models.available_captioners())} (default train.model).",
            ),
        ] = None,
        out: out_option(
            "Run directory: reads OUT/features/store and OUT/data (train.store / train.data), writes OUT/train-<model>."
        ) = DEFAULT_RUN,
    ) -> None:
        """Train a captioner: cross-entropy, then self-critical CIDEr-D, with the paper schedule of
        configs/models/<model>.yaml. Reads the run directory's features and prepared captions (OUT defaults to
        {run}, where `extract --store` and `prepare` write) and writes OUT/train-<model>/ (last.pt, best.pt,
        xe.pt, log.jsonl), which `evaluate` and `caption` read; an interrupted run resumes from the exact batch
        when the command is run again.

        Examples:

            butd-caption train --model ngsan

            butd-caption train --out runs/coco --model ngsan

            butd-caption train --out runs/w --model san --set train.xe.epochs=5 --set train.scst.epochs=2

            torchrun --nproc_per_node 8 cli.py train --out runs/coco --model m2
        """
        extra = [f"train.model={model}"] if model is not None else []
        if model is not None:
            models.CAPTIONERS.get(model)  # an unknown name: one line listing the known ones
        result = train_captioner(out, opts.resolve("train", extra, show=opts.verbose), force=opts.force)
        if is_main_process():
            print_stage_result(result)
