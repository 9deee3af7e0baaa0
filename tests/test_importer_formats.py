"""Importers as one Format record each: the registry drives import_features, the CLI help and the README table."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import pipeline.importers  # noqa: F401  (registers the built-in formats)
from cli import app
from pipeline.core.errors import UsageError
from pipeline.importers.formats import FORMATS, Format, format_choices, formats_table, import_formats

README = Path(__file__).resolve().parent.parent / "README.md"


def test_builtin_formats_are_records():
    by_name = {f.name: f for f in import_formats()}
    assert sorted(by_name) == ["butd-tsv", "clip-vil", "cocobu", "grid-hdf5", "m2-hdf5", "obj36-tsv", "vinvl-tsv"]
    assert by_name["obj36-tsv"].default_keys == "coco-id" and by_name["butd-tsv"].default_keys == "raw"
    assert sorted(n for n, f in by_name.items() if f.needs_sizes) == [
        "clip-vil",
        "cocobu",
        "grid-hdf5",
        "m2-hdf5",
        "vinvl-tsv",
    ]
    assert sorted(n for n, f in by_name.items() if f.exporter) == ["butd-tsv", "obj36-tsv", "vinvl-tsv"]
    with pytest.raises(ValueError, match="default_keys"):
        Format("x", lambda *a, **k: iter(()), default_keys="filename")
    with pytest.raises(UsageError, match="unknown feature format 'npy'.*butd-tsv"):
        FORMATS.get("npy")


def test_readme_table_is_the_registry_table():
    assert formats_table() in README.read_text()


def test_cli_help_lists_the_registered_formats():
    def flat(text: str) -> str:  # rich wraps the options panel at 80 columns: join the wrapped cells
        return " ".join(text.replace("│", " ").split())

    imp = flat(CliRunner().invoke(app, ["import-features", "--help"], terminal_width=400).output)
    exp = flat(CliRunner().invoke(app, ["export-features", "--help"], terminal_width=400).output)
    assert format_choices() in imp and format_choices(export=True) in exp
    for f in import_formats():
        assert f.name in imp and (f.name in exp) == (f.exporter is not None)


def test_unknown_formats_are_one_line_usage_errors(tmp_path):
    src = tmp_path / "x.tsv"
    src.write_text("")
    res = CliRunner().invoke(app, ["import-features", str(src), "--format", "npy", "--store", str(tmp_path / "s")])
    assert res.exit_code == 2 and "unknown feature format 'npy'" in res.output
    res = CliRunner().invoke(
        app, ["export-features", str(tmp_path / "s"), "--format", "cocobu", "--output", str(tmp_path / "o")]
    )
    assert res.exit_code == 2 and "cannot export to 'cocobu'; choose one of butd-tsv, obj36-tsv" in res.output
