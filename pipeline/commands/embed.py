"""`cli train-encoder` and `cli embed`: the visually grounded sentence encoder (configs/embed.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import print_stage_result
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command, out_option, output_option
from pipeline.core.console import is_main_process, stdout_console
from pipeline.core.errors import UsageError
from pipeline.embedding.embed import embed_file
from pipeline.embedding.train import train_encoder

ENCODER_EVERYDAY = Everyday.section("sentence_encoder")
EMBED_EVERYDAY = Everyday.section("embed")


def register(app: typer.Typer) -> None:
    @command(app, "train-encoder", force=True, everyday=ENCODER_EVERYDAY)
    def train_encoder_command(
        opts: CommandOptions,
        out: out_option(
            "Run directory (sentence_encoder.store / sentence_encoder.data default to OUT/features/store and OUT/data)."
        ) = DEFAULT_RUN,
    ) -> None:
        """Train the self-attentive visually grounded sentence encoder (CAP2IMG, CAP2CAP or CAP2ALL) into
        OUT/encoder/ (best.pt by validation caption-to-image R@1, last.pt to resume, log.jsonl).

        Examples:

            butd-caption train-encoder --out runs/w --set sentence_encoder.model_overrides.objective=cap2img

            butd-caption train-encoder --out runs/w --set 'sentence_encoder.model_overrides={self_attention: false, hidden_size: 2048}'
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        result = train_encoder(out, opts.resolve("embed", show=opts.verbose), force=opts.force)
        if is_main_process():
            print_stage_result(result, best_format=".2f")

    @command(app, "embed", everyday=EMBED_EVERYDAY)
    def embed_command(
        opts: CommandOptions,
        checkpoint: Annotated[
            Path,
            typer.Option(
                "--checkpoint", "-k", help="Encoder checkpoint (train-encoder's best.pt).", show_default=False
            ),
        ],
        input_path: Annotated[
            Path,
            typer.Option(
                "--input", "-i", help="Sentences: text (one per line) or .jsonl with 'text'.", show_default=False
            ),
        ],
        output: output_option("Embeddings file: .npy or .jsonl.", required=True),
        visualize: Annotated[
            Optional[Path],
            typer.Option("--visualize", help="Also write a PNG heatmap of the attention rows over the words."),
        ] = None,
    ) -> None:
        """Sentence embeddings from a trained encoder for a file of sentences (one per line, or JSON lines with
        'text'), written as .npy or .jsonl; --visualize also draws the self-attention rows over the words
        (PNG).

        Example:

            butd-caption embed --checkpoint runs/w/encoder/best.pt --input sents.txt --output emb.npy --visualize att.png
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        if visualize is not None and visualize.suffix.lower() != ".png":
            raise UsageError(f"--visualize must name a .png file, not {visualize.name!r}")

        result = embed_file(checkpoint, input_path, output, opts.resolve("embed", show=opts.verbose).embed, visualize)
        con = stdout_console()
        con.print(
            f"{result['sentences']} sentences -> {result['output']} ({result['dim']}-d)", highlight=False, markup=False
        )
        if result.get("failed"):
            con.print(
                f"not embedded: {result['failed']} (rows left empty; see {result['failures']})",
                highlight=False,
                markup=False,
            )
        if "heatmap" in result:
            con.print(f"attention heatmap: {result['heatmap']}", highlight=False)
