"""`cli caption`: raw photos -> captions (table, JSON lines or CSV), optionally pictures."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.decoding_opts import (
    BeamSizeOpt, LengthPenaltyOpt, MaxLenOpt, NBestOpt, StopRuleOpt, TrigramOpt, decoding_overrides,
)
from pipeline.commands.options import CommandOptions, Everyday, command, output_option

DEFAULT_RUN = Path("runs/demo")
CAPTION_EVERYDAY = Everyday(device="caption.device", batch_size="caption.batch_size")


def register(app: typer.Typer) -> None:
    @command(app, "caption", everyday=CAPTION_EVERYDAY)
    def caption_command(
        opts: CommandOptions,
        photos: Annotated[list[str], typer.Argument(help="Image files, folders (recursive) or globs.")],
        model: Annotated[Path, typer.Option("--model", "-m", help="Captioner checkpoint (.pt), run directory, or released M2/AoANet .pth.")] = DEFAULT_RUN,
        vocab: Annotated[Optional[Path], typer.Option("--vocab", help="Released model's vocabulary: M2 vocab.pkl or AoANet infos_*.pkl (default: found next to --model).")] = None,
        weights: Annotated[Optional[str], typer.Option("--weights", "-w", help="Detector weights file, or `random` (smoke tests).")] = None,
        output: output_option("Write results: .jsonl, .json or .csv.") = None,
        n_best: NBestOpt = None,
        beam_size: BeamSizeOpt = None,
        max_len: MaxLenOpt = None,
        length_penalty: LengthPenaltyOpt = None,
        block_trigrams: TrigramOpt = None,
        stop_rule: StopRuleOpt = None,
        visualize: Annotated[Optional[Path], typer.Option("--visualize", help="Write one PNG per photo (boxes, caption, word heat strip).")] = None,
        cache: Annotated[Optional[Path], typer.Option("--cache", help="Feature store to reuse and extend (keys as in `extract`).")] = None,
    ) -> None:
        """Caption raw photos: files, folders or globs in; the detector extracts regions on the fly and a trained
        captioner describes them. Bad images are reported per file and skipped.

        --model takes a captioner checkpoint or a run directory (default runs/demo, made by `demo`), whose
        detector is used unless --weights names another (any supported checkpoint, or `random`). It also takes the
        released M2 (meshed_memory_transformer.pth with --vocab vocab.pkl) and AoANet (model-best.pth with --vocab
        infos_*.pkl) files: converted once to a native checkpoint, captioned with the Caffe bottom-up features and
        the decoding of their papers.

        Examples:

            butd-caption caption photo.jpg

            butd-caption caption photos/ --model runs/demo --output captions.jsonl --visualize pictures/

            butd-caption caption 'shots/*.jpg' --model best.pt --weights bua-caffe-frcn-r101_with_attributes.pth --n-best 3

            butd-caption caption photos/ --model meshed_memory_transformer.pth --vocab vocab.pkl --weights bua.pth
        """
        extra = [f"caption.{key}={value}" for key, value in (("n_best", n_best), ("beam_size", beam_size)) if value is not None]
        cfg = opts.resolve("caption", extra).caption
        from pipeline.captioning.run import caption_photos

        decoding = decoding_overrides(max_len=max_len, length_penalty=length_penalty, block_trigrams=block_trigrams, stop_rule=stop_rule)
        caption_photos(photos, model, weights, cfg, output=output, visualize=visualize, cache=cache, decoding=decoding, vocab=vocab)
