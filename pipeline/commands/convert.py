"""`cli convert-captioner`: a released M2 / AoANet captioner -> one native checkpoint (models/released/)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from models.released import convert_release, write_native
from pipeline.commands.common import refuse_existing_output
from pipeline.commands.options import CommandOptions, command
from pipeline.core.console import stdout_console
from pipeline.core.errors import UsageError


def register(app: typer.Typer) -> None:
    @command(app, "convert-captioner", config=False, overrides=False, force=True)
    def convert_command(
        opts: CommandOptions,
        source: Annotated[Path, typer.Argument(help="Released weights file (.pth).")],
        output: Annotated[Path, typer.Option("--output", help="Native checkpoint to write (.pt).", show_default=False)],
        vocab: Annotated[
            Optional[Path],
            typer.Option("--vocab", help="M2 vocab.pkl or AoANet infos_*.pkl (default: found next to SOURCE)."),
        ] = None,
    ) -> None:
        """Convert a released captioner into a native checkpoint (safe to load; usable by caption, evaluate and info):
        M2's meshed_memory_transformer.pth with its vocab.pkl, or AoANet's model-best.pth with its infos_*.pkl.
        The pickles are read with a restricted unpickler; nothing from the files is run. caption and evaluate also
        convert on first use, into a cache ($BUTD_CACHE or ~/.cache/butd-caption).

        Examples:

            butd-caption convert-captioner meshed_memory_transformer.pth --vocab vocab.pkl --output m2.pt

            butd-caption convert-captioner model-best.pth --vocab infos_aoanet-best.pkl --output aoanet.pt
        """
        for given, what in ((source, "SOURCE"), (vocab, "--vocab")):
            if given is not None and output.exists() and given.exists() and output.resolve() == given.resolve():
                raise UsageError(f"--output {output} is the {what} file: it would be overwritten; choose another path")
        refuse_existing_output(output, opts.force)
        ckpt = convert_release(source, vocab)
        write_native(ckpt, output)
        n = sum(int(w.numel()) for w in ckpt.weights.values())
        con = stdout_console()
        title = ckpt.release.title if ckpt.release else source.name
        con.print(
            f"{output}: {title} -> '{ckpt.model_name}' ({n:,} weights, {len(ckpt.vocab):,} words)",
            highlight=False,
            markup=False,
        )
        con.print(f"decoding: {ckpt.decoding}", highlight=False, markup=False)
