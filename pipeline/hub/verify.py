"""The strict reader of each kind of catalogue file, run once on every download before it is given its name.

A verifier takes the path and raises :class:`pipeline.core.errors.PipelineError` (one line) when the file is
not what its kind promises: a detector must pass the layout check of docs/extractor.md#weights-layouts, the
files of a release with its own extraction (CLIP) that release record's ``verify``, M2's weights and vocabulary
their release readers (docs/models.md), an HDF5 or zip file must open.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import h5py
import yaml

from extractors.factory import read_labelmap
from extractors.releases import available_releases
from extractors.weights import describe
from models.released import load_release
from models.released.m2 import read_vocab
from pipeline.core.catalogue import DETECTOR_LAYOUTS
from pipeline.core.errors import PipelineError


def detector(path: Path, layout: str | None = None) -> None:
    """Any detector layout (``layout=None``) or exactly ``layout``."""
    found = describe(path)["layout"]  # reads the state dict and checks every key and shape of its layout
    if layout is not None and found != layout:
        raise PipelineError(f"{path} holds detector weights in the {found} layout, not {layout}")


def labelmap(path: Path) -> None:
    read_labelmap(str(path))


def hf_config(path: Path) -> None:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise PipelineError(f"{path}: not a YAML file ({type(exc).__name__})") from None
    if not isinstance(data, dict):
        raise PipelineError(f"{path}: a detector config.yaml holds a mapping")


def _release(path: Path, kind: str) -> None:
    found, _ = load_release(path)
    if found != kind:
        raise PipelineError(f"{path}: not the released {kind} weights (found {found or 'another file'})")


def m2_weights(path: Path) -> None:
    _release(path, "m2")


def aoanet(path: Path) -> None:
    _release(path, "aoanet")


def m2_vocab(path: Path) -> None:
    read_vocab(path)


def hdf5(path: Path) -> None:
    try:
        with h5py.File(path, "r") as fh:
            if not len(fh):
                raise PipelineError(f"{path}: an empty HDF5 file")
    except OSError as exc:
        raise PipelineError(f"{path}: not a readable HDF5 file ({exc})") from None


def zip_archive(path: Path) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            if not archive.namelist():
                raise PipelineError(f"{path}: an empty zip archive")
    except (zipfile.BadZipFile, OSError) as exc:
        raise PipelineError(f"{path}: not a complete zip archive ({exc})") from None


#: catalogue kind (pipeline.core.catalogue.KINDS) -> its reader
VERIFIERS: dict[str, Callable[[Path], None]] = {
    **{layout: partial(detector, layout=layout) for layout in DETECTOR_LAYOUTS},
    "detector": detector,
    "labelmap": labelmap,
    "hf-config": hf_config,
    "m2-weights": m2_weights,
    "m2-vocab": m2_vocab,
    "aoanet": aoanet,
    "hdf5": hdf5,
    "zip": zip_archive,
}


def verifier(kind: str) -> Callable[[Path], None]:
    """The reader of ``kind``: :data:`VERIFIERS`, else the ``verify`` of the release whose own files are of that
    kind (:class:`extractors.releases.OwnExtraction`, e.g. CLIP encoders)."""
    if kind in VERIFIERS:
        return VERIFIERS[kind]
    for release in available_releases():
        if release.own is not None and release.own.kind == kind and release.own.verify is not None:
            return release.own.verify
    raise KeyError(kind)
