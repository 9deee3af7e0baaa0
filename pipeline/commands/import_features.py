"""`cli import-features` (public feature files -> store), `cli export-features` (store -> TSV) and
`cli merge-features` (shards -> one store, each image exactly once)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import refuse_existing_output
from pipeline.commands.options import CommandOptions, command
from pipeline.core.console import stdout_console
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.keys import key_from_text
from pipeline.importers import export_tsv, import_features, read_sizes
from pipeline.importers.formats import (
    KEY_RULES,
    format_choices,
    format_help,
    option_formats,
    sizes_formats,
)
from pipeline.store import load_identity_file, merge_stores


def _user_error(exc: PipelineError) -> UsageError:
    """A bad input file named on the command line is the user's to fix: exit 2, one line."""
    return exc if isinstance(exc, UsageError) else UsageError(str(exc))


def register(app: typer.Typer) -> None:
    @command(app, "import-features", config=False, overrides=False, help_fields={"formats": format_help()})
    def import_features_command(
        opts: CommandOptions,
        sources: Annotated[list[Path], typer.Argument(help="Input files (or cocobu directories).")],
        fmt: Annotated[str, typer.Option("--format", "-f", help=format_choices())],
        store: Annotated[Path, typer.Option("--store", help="Destination store directory (created or resumed).")],
        dtype: Annotated[
            Optional[str],
            typer.Option(
                "--dtype",
                help="Store dtype: float32 or float16 (half the disk; captions can change, see "
                "docs/benchmarks.md#float16-features). Default: the source's (float32 for the public files: an exact "
                "round trip).",
            ),
        ] = None,
        identity: Annotated[
            Optional[Path], typer.Option("--identity", help="JSON file with the extractor identity.")
        ] = None,
        release: Annotated[
            Optional[str],
            typer.Option(
                "--release",
                help="Release (test-time recipe) the features came from: a release name (`butd-caption info "
                "--releases` lists them, each with the formats of the public files it made; default: the release "
                "that made the format's public files).",
            ),
        ] = None,
        keys: Annotated[
            Optional[str],
            typer.Option(
                "--keys",
                help=f"{' | '.join(KEY_RULES)}: ids as in the file (raw) or COCO ids "
                "(coco-id: COCO_train2014_000000123 -> 123).",
            ),
        ] = None,
        sizes: Annotated[
            Optional[Path],
            typer.Option("--sizes", help=f"COCO json with images[].id/width/height ({sizes_formats()})."),
        ] = None,
        skip_bad: Annotated[
            bool, typer.Option("--skip-bad", help="Skip and report bad rows instead of stopping.")
        ] = False,
        commit_every: Annotated[
            int, typer.Option("--commit-every", help="Commit every N images (0: only by size).")
        ] = 1000,
        fc: Annotated[
            Optional[Path],
            typer.Option(
                "--fc",
                help=f"Folder of one pooled vector per image (<id>.npy), stored per image ({option_formats('fc')}; "
                "default: the *_fc folder beside the *_att one, if there is one).",
            ),
        ] = None,
    ) -> None:
        """Import public feature files into a store (streaming, resumable).

        {formats}

        Example:

            butd-caption import-features --format butd-tsv trainval_36.tsv --store feats
        """
        if commit_every < 0:
            raise UsageError(f"--commit-every must be 0 (commit by size only) or more, not {commit_every}")
        try:
            report = import_features(
                fmt,
                list(sources),
                store,
                identity=load_identity_file(identity) if identity else None,
                release=release,
                feature_dtype=dtype,
                keys=keys,
                sizes=read_sizes(sizes) if sizes else None,
                skip_bad=skip_bad,
                commit_every=commit_every,
                fc=fc,
            )
        except PipelineError as exc:
            raise _user_error(exc) from None
        con = stdout_console()
        con.print(f"rows read: {report.seen}", highlight=False)
        con.print(f"imported: {report.imported}", highlight=False)
        con.print(f"already in store: {report.already_present}", highlight=False)
        con.print(f"bad rows: {len(report.bad)}", highlight=False)
        for where, message in report.bad:
            con.print(f"  bad: {message}", highlight=False, markup=False)

    @command(
        app,
        "export-features",
        config=False,
        overrides=False,
        force=True,
        help_fields={"formats": format_help(export=True)},
    )
    def export_features_command(
        opts: CommandOptions,
        store: Annotated[Path, typer.Argument(help="Store directory or file.")],
        output: Annotated[Path, typer.Option("--output", help="Feature file to write.", show_default=False)],
        fmt: Annotated[str, typer.Option("--format", "-f", help=format_choices(export=True))] = "butd-tsv",
    ) -> None:
        """Write a store back to a feature file; a float32 store round-trips byte for byte.

        {formats}

        Example:

            butd-caption export-features feats --format butd-tsv --output feats.tsv
        """
        refuse_existing_output(output, opts.force)
        try:
            n = export_tsv(store, output, fmt)
        except PipelineError as exc:
            raise _user_error(exc) from None
        stdout_console().print(f"rows written: {n} -> {output}", highlight=False)

    @command(app, "merge-features", config=False, overrides=False)
    def merge_features_command(
        opts: CommandOptions,
        shards: Annotated[list[Path], typer.Argument(help="Shard store directories.")],
        store: Annotated[
            Path, typer.Option("--store", help="Destination feature store (must not exist).", show_default=False)
        ],
        expect: Annotated[
            Optional[Path], typer.Option("--expect", help="Text file of image ids that must be present, one per line.")
        ] = None,
    ) -> None:
        """Merge store shards (one per GPU or machine) into one store, checking that each image appears exactly
        once. A destination ending in .h5 becomes a single-file store.

        Example:

            butd-caption merge-features shard-0 shard-1 --store feats
        """
        expected = None
        if expect is not None:
            if not expect.is_file():
                raise UsageError(f"id list not found: {expect}")
            text = expect.read_bytes().decode("utf-8", "surrogateescape")  # ids in the text form of pipeline.core.keys
            expected = [key_from_text(line.strip()) for line in text.splitlines() if line.strip()]
        try:
            n = merge_stores(shards, store, expected_keys=expected)
        except PipelineError as exc:
            raise _user_error(exc) from None
        stdout_console().print(f"images: {n} -> {store}", highlight=False)
