"""`cli caption`: raw photos -> captions (table, JSON lines, JSON, CSV or COCO results), pictures and a gallery."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.captioning.output import FORMATS
from pipeline.commands.captioner_opts import CaptionerModelOpt, CaptionerOpt, DetectorWeightsOpt, VocabOpt
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command, output_option

#: --num-workers: photo-decoding processes (extractors/photos.py); --precision (pipeline/core/precision.py) applied by
#: the engine
CAPTION_EVERYDAY = Everyday.section("caption")


def register(app: typer.Typer) -> None:
    @command(
        app, "caption", everyday=CAPTION_EVERYDAY, force=True, decoding=True, help_fields={"run": str(DEFAULT_RUN)}
    )
    def caption_command(
        opts: CommandOptions,
        photos: Annotated[
            Optional[list[str]], typer.Argument(help="Image files, folders (recursive) or globs.")
        ] = None,
        model: CaptionerModelOpt = DEFAULT_RUN,
        vocab: VocabOpt = None,
        weights: DetectorWeightsOpt = None,
        output: output_option("Write results: .jsonl, .json or .csv (streamed; a rerun only does the rest).") = None,
        fmt: Annotated[
            Optional[str],
            typer.Option(
                "--format",
                "-f",
                help=f"Output format: {' | '.join(FORMATS)} (coco: COCO results [{{image_id, caption}}]); default "
                "from the --output suffix.",
            ),
        ] = None,
        image_ids: Annotated[
            Optional[Path],
            typer.Option("--image-ids", help="For --format coco: JSON {file name: id} or a COCO annotations file."),
        ] = None,
        file_list: Annotated[
            Optional[Path],
            typer.Option(
                "--file-list", help="A text file with one image path per line (relative to the current folder)."
            ),
        ] = None,
        captioner: CaptionerOpt = None,
        gallery: Annotated[
            Optional[Path],
            typer.Option(
                "--gallery", help="Write a static HTML gallery (index.html, thumbnails, pictures) into this folder."
            ),
        ] = None,
        visualize: Annotated[
            Optional[Path],
            typer.Option(
                "--visualize",
                help="Write one PNG per photo (the regions the caption attends to, a legend, the caption).",
            ),
        ] = None,
        cache: Annotated[
            Optional[Path], typer.Option("--cache", help="Feature store to reuse and extend (keys as in `extract`).")
        ] = None,
    ) -> None:
        """Caption raw photos: files, folders or globs in; the detector extracts regions on the fly and a trained
        captioner describes them. Bad images are reported per file and skipped.

        --model takes a captioner checkpoint or a run directory (default {run}, where `demo` and `train` write), whose
        detector is used unless --weights names another (any supported checkpoint, or `random`); in a run folder with
        several captioners the one with the best validation CIDEr-D is used (--captioner NAME picks one). It also takes
        the released M2 (meshed_memory_transformer.pth with --vocab vocab.pkl) and AoANet (model-best.pth with --vocab
        infos_*.pkl) files: converted once to a native checkpoint, captioned with the Caffe bottom-up features and the
        decoding of their papers.

        Results stream to --output as they are produced, with the images that failed in <output>.failures.jsonl; a
        rerun on the same --output (or --gallery) captions only the photos not done yet (--force starts them over).

        Examples:

            butd-caption caption photo.jpg

            butd-caption caption photos/ --model runs/demo --output captions.jsonl --visualize pictures/

            butd-caption caption 'shots/*.jpg' --model best.pt --weights bua-caffe-frcn-r101_with_attributes.pth --n-best 3

            butd-caption caption photos/ --model meshed_memory_transformer.pth --vocab vocab.pkl --weights bua.pth

            butd-caption caption photos/ --model m2-coco --weights bua-r101   (catalogue names: fetched on first use)

            butd-caption caption --file-list val.txt --model runs/coco --output results.json --format coco

            butd-caption caption photos/ --gallery gallery/   (then open gallery/index.html)
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        from pipeline.captioning.run import caption_photos  # noqa: PLC0415 -- keeps cli --help fast

        root = opts.resolve("caption")  # the decoding flags are decoding.* overrides, as in evaluate and serve
        cfg, decoding = root.caption, root.decoding.to_dict()
        caption_photos(
            photos,
            model,
            weights,
            cfg,
            output=output,
            visualize=visualize,
            cache=cache,
            decoding=decoding,
            vocab=vocab,
            file_list=file_list,
            fmt=fmt,
            captioner=captioner,
            gallery=gallery,
            image_ids=image_ids,
            force=opts.force,
        )
