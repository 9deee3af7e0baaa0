"""`cli caption`: raw photos -> captions (table, JSON lines or CSV), optionally pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import ConfigOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, resolve_config

DEFAULT_RUN = Path("runs/demo")


def register(app: typer.Typer) -> None:
    @app.command(
        "caption",
        help=(
            "Caption raw photos: files, folders or globs in; the detector extracts regions on the fly and a "
            "trained captioner describes them. Bad images are reported per file and skipped.\n\n"
            "--model takes a captioner checkpoint or a run directory (default runs/demo, made by `demo`), whose "
            "detector is used unless --weights names another (any supported checkpoint, or `random`).\n\n"
            "Examples:\n\n"
            "    butd-caption caption photo.jpg\n\n"
            "    butd-caption caption photos/ --model runs/demo --output captions.jsonl --visualize pictures/\n\n"
            "    butd-caption caption 'shots/*.jpg' --model best.pt --weights bua-caffe-frcn-r101_with_attributes.pth --n-best 3"
        ),
    )
    @guarded
    def caption_command(
        photos: Annotated[list[str], typer.Argument(help="Image files, folders (recursive) or globs.")],
        model: Annotated[Path, typer.Option("--model", "-m", help="Captioner checkpoint (.pt) or run directory.")] = DEFAULT_RUN,
        weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="Detector weights file, or `random` (smoke tests).")] = None,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Write results: .jsonl, .json or .csv.")] = None,
        n_best: Annotated[Optional[int], typer.Option("--n-best", min=1, help="Hypotheses per photo (beam search).")] = None,
        beam_size: Annotated[Optional[int], typer.Option("--beam-size", min=1, help="Beam size (default: the checkpoint's).")] = None,
        visualize: Annotated[Optional[Path], typer.Option("--visualize", help="Write one PNG per photo (boxes, caption, word heat strip).")] = None,
        cache: Annotated[Optional[Path], typer.Option("--cache", help="Feature store to reuse and extend (keys as in `extract`).")] = None,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        overrides = list(set_ or [])
        if n_best is not None:
            overrides.append(f"caption.n_best={n_best}")
        if beam_size is not None:
            overrides.append(f"caption.beam_size={beam_size}")
        cfg = resolve_config("caption", config, overrides, show=verbose).caption
        from pipeline.captioning.run import caption_photos

        caption_photos(photos, model, weights, cfg, output=output, visualize=visualize, cache=cache)
