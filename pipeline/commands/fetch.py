"""`cli fetch`: download catalogue files (or hub files) into the cache ahead of time, or list the catalogue."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from pipeline.commands.options import CommandOptions, command
from pipeline.core.catalogue import ENTRIES, get_entry
from pipeline.core.console import stdout_console
from pipeline.core.errors import UsageError
from pipeline.hub import resolve_file
from pipeline.hub.resolve import entry_download


def register(app: typer.Typer) -> None:
    @command(app, "fetch", config=False, overrides=False)
    def fetch_command(
        opts: CommandOptions,
        names: Annotated[
            Optional[list[str]],
            typer.Argument(
                help="Catalogue names (see --list) or hub ids (hf:OWNER/NAME, hf:OWNER/NAME/FILE, "
                "hf:OWNER/NAME@REVISION)."
            ),
        ] = None,
        list_: Annotated[
            bool, typer.Option("--list", help="Print the catalogue as a table (name, kind, file, cached, purpose).")
        ] = False,
    ) -> None:
        """Download public weights and data by name into the cache ($BUTD_CACHE, default ~/.cache/butd-caption),
        each file checked by its strict reader and its SHA-256 recorded; prints each file's path. Options that
        take a weights or model file take the same names and fetch on first use (docs/downloads.md).

        Examples:

            butd-caption fetch --list

            butd-caption fetch vinvl-x152c4 m2-coco bua-r101

            butd-caption fetch hf:unc-nlp/frcnn-vg-finetuned
        """
        con = stdout_console()
        if list_:
            con.print(_catalogue_table())
            return
        if not names:
            raise UsageError("give catalogue names or hf: ids to fetch, or --list")

        for name in names:
            if not name.startswith("hf:"):
                get_entry(name)  # an unknown name is refused before anything is fetched
            con.print(resolve_file(name, "catalogue file", "detector"), markup=False, highlight=False, soft_wrap=True)


def _catalogue_table():
    table = Table(title="catalogue (cli fetch NAME; --weights / --model NAME)", show_edge=False)
    for column in ("name", "kind", "file", "cached", "purpose"):
        table.add_column(column, overflow="fold")
    for entry in ENTRIES:
        cached = "yes" if entry_download(entry).dest.is_file() else ("manual" if entry.manual else "no")
        table.add_row(entry.name, entry.kind, entry.filename, cached, entry.purpose)
    return table
