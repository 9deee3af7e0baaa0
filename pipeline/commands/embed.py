"""`cli train-encoder` and `cli embed`: the visually grounded sentence encoder (configs/embed.yaml)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import ConfigOpt, ForceOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, print_stage_result, resolve_config
from pipeline.core.console import is_main_process, stdout_console
from pipeline.core.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command(
        "train-encoder",
        help=(
            "Train the self-attentive visually grounded sentence encoder (CAP2IMG, CAP2CAP or CAP2ALL) into "
            "OUT/encoder/ (best.pt by validation caption-to-image R@1, last.pt to resume, log.jsonl).\n\nExamples:\n\n"
            "    butd-caption train-encoder --out runs/w --set encoder.model_overrides.objective=cap2img\n\n"
            "    butd-caption train-encoder --out runs/w --set encoder.model_overrides={self_attention: false, hidden_size: 2048}"
        ),
    )
    @guarded
    def train_encoder_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (encoder.store / encoder.data default to OUT/features/store and OUT/data).")] = Path("runs/train"),
        config: ConfigOpt = None,
        set_: SetOpt = None,
        force: ForceOpt = False,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from pipeline.embedding.train import train_encoder

        cfg = resolve_config("embed", config, set_, show=verbose)
        result = train_encoder(out, cfg, force=force)
        if not is_main_process():
            return
        print_stage_result(result, best_format=".2f")

    @app.command(
        "embed",
        help=(
            "Sentence embeddings from a trained encoder for a file of sentences (one per line, or JSON lines with "
            "'text'), written as .npy or .jsonl; --visualize also draws the self-attention rows over the words (PNG).\n\n"
            "Example:\n\n    butd-caption embed --checkpoint runs/w/encoder/best.pt --input sents.txt --output emb.npy --visualize att.png"
        ),
    )
    @guarded
    def embed_command(
        checkpoint: Annotated[Optional[Path], typer.Option("--checkpoint", "-k", help="Encoder checkpoint (train-encoder's best.pt).")] = None,
        input_path: Annotated[Optional[Path], typer.Option("--input", "-i", help="Sentences: text (one per line) or .jsonl with 'text'.")] = None,
        output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Embeddings file: .npy or .jsonl.")] = None,
        visualize: Annotated[Optional[Path], typer.Option("--visualize", help="Also write a PNG heatmap of the attention rows over the words.")] = None,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        if checkpoint is None or input_path is None or output is None:
            raise UsageError("give --checkpoint ENCODER.pt, --input SENTENCES and --output EMBEDDINGS.npy|.jsonl")
        if visualize is not None and visualize.suffix.lower() != ".png":
            raise UsageError(f"--visualize must name a .png file, not {visualize.name!r}")
        from pipeline.embedding.embed import embed_file

        cfg = resolve_config("embed", config, set_, show=verbose)
        result = embed_file(checkpoint, input_path, output, cfg.embed, visualize)
        con = stdout_console()
        con.print(f"{result['sentences']} sentences -> {result['output']} ({result['dim']}-d)", highlight=False)
        if "heatmap" in result:
            con.print(f"attention heatmap: {result['heatmap']}", highlight=False)
