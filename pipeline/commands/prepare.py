"""`cli prepare`: captions and the vocabulary from Karpathy or COCO caption files (the `data` stage)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.caption_data.prepare import prepare_captions
from pipeline.commands.common import print_stage_result
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, command, out_option
from pipeline.core.stages import run_stage


def register(app: typer.Typer) -> None:
    @command(app, "prepare", force=True, help_fields={"run": str(DEFAULT_RUN)})
    def prepare_command(
        opts: CommandOptions,
        karpathy: Annotated[
            Optional[Path],
            typer.Argument(
                help="Karpathy split file (dataset_coco.json: images[].sentences[].tokens, split, cocoid); or give "
                "COCO caption files with --set prepare.coco_captions.SPLIT=FILE.",
                show_default=False,
            ),
        ] = None,
        out: out_option("Run directory; the stage writes OUT/data, which `train` and `evaluate` read.") = DEFAULT_RUN,
    ) -> None:
        """Prepare captions and the vocabulary from a Karpathy split file (or COCO caption files) into OUT/data
        (vocab.json, labels.npz, images.json, references.json); OUT defaults to {run}, the run directory every
        stage reads and writes. Done once per config; skipped when already done.

        Examples:

            butd-caption prepare dataset_coco.json

            butd-caption prepare dataset_coco.json --out runs/coco

            butd-caption prepare --set prepare.coco_captions.train=world/annotations/captions_train.json --set prepare.coco_captions.val=world/annotations/captions_val.json --out runs/world
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        extra = [f"prepare.karpathy_json={json.dumps(str(karpathy))}"] if karpathy is not None else []
        result = run_stage(out, "data", opts.resolve("prepare", extra).prepare, prepare_captions, force=opts.force)
        print_stage_result(result, outputs=False, summary=True)
