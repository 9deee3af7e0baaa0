"""`cli caption`: raw photos -> captions (table, JSON lines or CSV), optionally pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.options import CommandOptions, Everyday, command, output_option

DEFAULT_RUN = Path("runs/demo")
CAPTION_EVERYDAY = Everyday(device="caption.device", batch_size="caption.batch_size")


def register(app: typer.Typer) -> None:
    @command(app, "caption", everyday=CAPTION_EVERYDAY)
    def caption_command(
        opts: CommandOptions,
        photos: Annotated[list[str], typer.Argument(help="Image files, folders (recursive) or globs.")],
        model: Annotated[Path, typer.Option("--model", "-m", help="Captioner checkpoint (.pt) or run directory.")] = DEFAULT_RUN,
        weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="Detector weights file, or `random` (smoke tests).")] = None,
        output: output_option("Write results: .jsonl, .json or .csv.") = None,
        n_best: Annotated[Optional[int], typer.Option("--n-best", help="Hypotheses per photo (beam search).")] = None,
        beam_size: Annotated[Optional[int], typer.Option("--beam-size", help="Beam size (default: the checkpoint's).")] = None,
        visualize: Annotated[Optional[Path], typer.Option("--visualize", help="Write one PNG per photo (boxes, caption, word heat strip).")] = None,
        cache: Annotated[Optional[Path], typer.Option("--cache", help="Feature store to reuse and extend (keys as in `extract`).")] = None,
    ) -> None:
        """Caption raw photos: files, folders or globs in; the detector extracts regions on the fly and a trained
        captioner describes them. Bad images are reported per file and skipped.

        --model takes a captioner checkpoint or a run directory (default runs/demo, made by `demo`), whose
        detector is used unless --weights names another (any supported checkpoint, or `random`).

        Examples:

            butd-caption caption photo.jpg

            butd-caption caption photos/ --model runs/demo --output captions.jsonl --visualize pictures/

            butd-caption caption 'shots/*.jpg' --model best.pt --weights bua-caffe-frcn-r101_with_attributes.pth --n-best 3
        """
        extra = [f"caption.{key}={value}" for key, value in (("n_best", n_best), ("beam_size", beam_size)) if value is not None]
        cfg = opts.resolve("caption", extra).caption
        from pipeline.captioning.run import caption_photos

        caption_photos(photos, model, weights, cfg, output=output, visualize=visualize, cache=cache)
