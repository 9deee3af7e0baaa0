"""Feature-file formats as one record each: :class:`Format` (reader, default keys, whether image sizes are
needed, exporter), registered in :data:`FORMATS` by the module that implements the format.

A new format is one module that defines a reader and registers one record (docs/extending.md)::

    register_format(Format("my-npz", read_my_npz, help="my_features/*.npz (one file per image)"))

A reader is called as ``reader(paths, keys=..., sizes=...)`` (plus the format's ``options`` the user gave) and
yields ``(where, decode)`` per image: ``where`` names the file and row for error messages, ``decode()`` returns
the image's record ``{"key", "features", "boxes", "image_w", "image_h"}`` plus optional ``class_ids``,
``class_scores``, ``attr_ids``, ``attr_scores`` and the per-image ``pooled`` vector, raising
:class:`pipeline.core.errors.PipelineError` for a bad row. An exporter is called as ``exporter(binary_file,
records)`` and returns the number of rows written.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

from pipeline.core.errors import UsageError
from pipeline.core.registry import Registry

Record = dict[str, Any]
Reader = Callable[..., Iterator[tuple[str, Callable[[], Record]]]]
Exporter = Callable[[BinaryIO, Iterator[Record]], int]
KEY_RULES = ("raw", "coco-id")


@dataclass(frozen=True)
class Format:
    """One feature-file format.

    ``name``: the ``--format`` value; ``reader``: see the module docstring; ``default_keys``: ``raw`` (ids as in
    the file) or ``coco-id`` (``COCO_train2014_000000123`` -> ``123``); ``needs_sizes``: the files carry no image
    sizes (``--sizes COCO_JSON`` is required); ``exporter``: writes a store back in this format (None: import
    only); ``help``: one line for the CLI help and the README table; ``options``: the reader's keyword options
    beyond ``keys`` and ``sizes`` (``fc``: the folder of per-image pooled vectors, ``--fc``), which other formats
    refuse.

    A format names no detector release: the release that made a format's public files lists the format in its
    record (:attr:`extractors.releases.Release.import_formats`), and an imported store records that release; the
    files of a format no release claims need ``import-features --release``.
    """

    name: str
    reader: Reader
    default_keys: str = "raw"
    needs_sizes: bool = False
    exporter: Exporter | None = None
    help: str = ""
    options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.default_keys not in KEY_RULES:
            raise ValueError(f"format {self.name}: default_keys must be one of {KEY_RULES}, not {self.default_keys!r}")


FORMATS: Registry[Format] = Registry("feature format")


def register_format(fmt: Format) -> Format:
    """Add ``fmt`` to :data:`FORMATS` (a name registered twice is a programming error)."""
    return FORMATS.register(fmt.name)(fmt)


def require_sizes(sizes: dict[str, tuple[int, int]] | None, files: str) -> dict[str, tuple[int, int]]:
    """``sizes`` (image id -> width, height) for a format whose ``files`` hold none; None is a usage error that
    asks for ``--sizes``."""
    if sizes is None:
        raise UsageError(f"{files} carry no image sizes: pass --sizes COCO_JSON (captions_*.json or instances_*.json)")
    return sizes


def import_formats() -> list[Format]:
    """Every registered format, by name."""
    return [FORMATS.get(name) for name in FORMATS.names()]


def export_formats() -> list[Format]:
    """The formats a store can be written back to."""
    return [f for f in import_formats() if f.exporter is not None]


def format_choices(export: bool = False) -> str:
    """``a | b | c``: the ``--format`` values of import-features (or export-features)."""
    return " | ".join(f.name for f in (export_formats() if export else import_formats()))


def sizes_formats() -> str:
    """``a, b``: the formats that need ``--sizes``."""
    return ", ".join(f.name for f in import_formats() if f.needs_sizes)


def option_formats(option: str) -> str:
    """``a, b``: the formats whose reader takes ``option`` (:attr:`Format.options`)."""
    return ", ".join(f.name for f in import_formats() if option in f.options)


def format_help(export: bool = False) -> str:
    """One help paragraph listing the formats (generated from the registry)."""
    if export:
        return "Formats: " + "; ".join(f"{f.name} ({f.help})" for f in export_formats()) + "."
    parts = [f"{f.name} ({f.help}{', needs --sizes' if f.needs_sizes else ''})" for f in import_formats()]
    return "Formats: " + "; ".join(parts) + "."


def formats_table() -> str:
    """The README's table of feature formats (Markdown), generated from the registry."""
    rows = ["| `--format` | files | keys by default | needs `--sizes` | `export-features` |", "|---|---|---|---|---|"]
    for f in import_formats():
        rows.append(
            f"| `{f.name}` | {f.help} | {f.default_keys} | {'yes' if f.needs_sizes else 'no'} | "
            f"{'yes' if f.exporter else 'no'} |"
        )
    return "\n".join(rows)
