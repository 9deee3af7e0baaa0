"""The bytes-safe key rule (pipeline.core.keys): lossless through HDF5, JSON, CSV, TSV and rich."""

from __future__ import annotations

import csv
import io
import json
import os

import pytest
from rich.console import Console

from pipeline.core.errors import UsageError
from pipeline.core.keys import (
    check_key,
    display_key,
    key_from_bytes,
    key_from_name,
    key_from_text,
    key_to_bytes,
    key_to_text,
    markup_escape,
)

NAMES = [
    b"caf\xe9.jpg",  # Latin-1 byte, not UTF-8
    "café.jpg".encode(),
    b"a\nb.jpg",
    b"tab\there.jpg",
    b"back\\slash\\x41.jpg",
    b"[/x].jpg",
    b"[bold]red[/bold].png",
    b"\xff\xfe\x80",
    b"line\xe2\x80\xa8sep.jpg",  # U+2028
    b"del\x7f.jpg",
    b"trailing\\",
    "日本語.jpg".encode(),
    b"397133",
]


@pytest.mark.parametrize("name", NAMES)
def test_round_trip_every_form(name: bytes) -> None:
    key = key_from_name(name)
    assert key_to_bytes(key) == name
    assert key_from_bytes(key_to_bytes(key)) == key
    text = key_to_text(key)
    text.encode("utf-8")  # always valid UTF-8
    assert "\n" not in text and "\t" not in text and "\r" not in text and len(text.splitlines()) <= 1
    assert key_from_text(text) == key
    # JSON (written as UTF-8), CSV and TSV carry the text form and give the key back
    assert key_from_text(json.loads(json.dumps({"k": text}, ensure_ascii=False).encode().decode())["k"]) == key
    buf = io.StringIO()
    csv.writer(buf).writerow([text, "caption"])
    assert key_from_text(next(csv.reader(io.StringIO(buf.getvalue())))[0]) == key
    assert key_from_text((text + "\t1\n").rstrip("\n").split("\t")[0]) == key
    check_key(key)


def test_plain_keys_unchanged() -> None:
    for key in ("397133", "photos/dog.jpg", "café.jpg", "a b.jpg"):
        assert key_to_text(key) == key


def test_text_form_spelling() -> None:
    assert key_to_text(key_from_name(b"caf\xe9.jpg")) == "caf\\xe9.jpg"
    assert key_to_text("a\nb") == "a\\u000ab"
    assert key_to_text("a\\b") == "a\\\\b"
    # a literal backslash-x in a name is not confused with an undecodable byte
    assert key_to_text("\\xe9") == "\\\\xe9" != key_to_text("\udce9")


@pytest.mark.parametrize("bad", ["a\\", "a\\q", "a\\x4", "a\\u12", "a\\xzz"])
def test_malformed_text_refused(bad: str) -> None:
    with pytest.raises(UsageError, match="malformed escape"):
        key_from_text(bad)


@pytest.mark.parametrize("bad", ["", "a\x00b", "lone\ud800", 7])
def test_store_refuses_unrepresentable(bad: object) -> None:
    with pytest.raises(UsageError):
        check_key(bad)


def test_hdf5_bytes_round_trip(tmp_path) -> None:
    h5py = pytest.importorskip("h5py")
    keys = [key_from_name(n) for n in NAMES]
    with h5py.File(tmp_path / "k.h5", "w") as fh:
        ds = fh.create_dataset("keys", shape=(len(keys),), dtype=h5py.string_dtype("utf-8"))
        ds[:] = [key_to_bytes(k) for k in keys]
    with h5py.File(tmp_path / "k.h5", "r") as fh:
        assert [key_from_bytes(b) for b in fh["keys"][()]] == keys


def test_markup_escape_prints_literally() -> None:
    con = Console(file=io.StringIO(), width=200, color_system=None)
    for raw in ("[/x].jpg", "[bold]x[/bold]", "a\\[b].jpg", "ends\\"):
        con.print(f"[bold]{markup_escape(raw)}[/bold]", end="|")
    assert con.file.getvalue() == "[/x].jpg|[bold]x[/bold]|a\\[b].jpg|ends\\|"
    con = Console(file=io.StringIO(), width=200, color_system=None)
    con.print(display_key(key_from_name(b"[/x]caf\xe9.jpg")))
    assert con.file.getvalue().strip() == "[/x]caf\\xe9.jpg"


def test_fs_round_trip(tmp_path) -> None:
    """A real non-UTF-8 file name from the OS comes back to the same file through its key."""
    if os.name != "posix":
        pytest.skip("bytes file names are a POSIX feature")
    raw = os.path.join(os.fsencode(tmp_path), b"caf\xe9.jpg")
    try:
        with open(raw, "wb") as fh:
            fh.write(b"x")
    except OSError as exc:
        pytest.skip(f"filesystem refuses non-UTF-8 names: {exc}")
    (entry,) = os.listdir(tmp_path)
    key = key_from_name(entry)
    assert open(os.path.join(tmp_path, key_from_text(key_to_text(key))), "rb").read() == b"x"
