"""`cli prepare`: captions and the vocabulary from Karpathy or COCO caption files (the `data` stage)."""

from __future__ import annotations

from pathlib import Path

import typer

from pipeline.commands.common import print_stage_result
from pipeline.commands.options import CommandOptions, command, out_option


def register(app: typer.Typer) -> None:
    @command(app, "prepare", force=True)
    def prepare_command(opts: CommandOptions, out: out_option("Run directory; the stage writes OUT/data.") = Path("runs/data")) -> None:
        """Prepare captions and the vocabulary from Karpathy or COCO caption files into RUN/data (vocab.json,
        labels.npz, images.json, references.json). Done once per config; skipped when already
        done.

        Examples:

            butd-caption prepare --set prepare.karpathy_json=dataset_coco.json --out runs/coco

            butd-caption prepare --set prepare.coco_captions.train=world/annotations/captions_train.json --set prepare.coco_captions.val=world/annotations/captions_val.json --out runs/world
        """
        from pipeline.caption_data.prepare import prepare_captions
        from pipeline.core.stages import run_stage

        result = run_stage(out, "data", opts.resolve("prepare").prepare, prepare_captions, force=opts.force)
        print_stage_result(result, outputs=False, summary=True)
