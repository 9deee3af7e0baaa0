"""ruotianluo ``cocobu_att`` / ``cocobu_box`` directories (ruotianluo/ImageCaptioning.pytorch
``scripts/make_bu_data.py``).

``<dir>_att/<image_id>.npz`` holds key ``feat`` (or ``z``, as in ``cocotest_bu``): float32 [K, 2048];
``<dir>_box/<image_id>.npy``: float32 [K, 4] pixels. The files carry no image size, so sizes come from a
COCO json (``--sizes``). Files are read one image at a time, never with pickle, each array checked from its
.npy header first.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import PipelineError, UsageError
from pipeline.importers.formats import Format, register_format, require_sizes
from pipeline.importers.untrusted import read_npy


def _load_npz(path: Path) -> np.ndarray:
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            for name in ("feat", "z"):
                if f"{name}.npy" in names:
                    with zf.open(f"{name}.npy") as fp:
                        return read_npy(fp, str(path), f"array {name}", ndim=2)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise PipelineError(f"{path}: not a readable npz file ({str(exc).splitlines()[0][:80]})") from None
    files = [n[:-4] if n.endswith(".npy") else n for n in names]
    raise PipelineError(f"{path}: npz has no 'feat' (or 'z') array, only {files}")


def _load_npy(path: Path) -> np.ndarray:
    if not path.is_file():
        raise PipelineError(f"box file {path} is missing")
    try:
        with path.open("rb") as fp:
            return read_npy(fp, str(path), "the boxes", ndim=2)
    except OSError as exc:
        raise PipelineError(f"{path}: not a readable npy file ({exc})") from None


def box_dir_for(att_dir: Path) -> Path:
    """``.../cocobu_att`` -> ``.../cocobu_box``."""
    name = att_dir.name
    if not name.endswith("_att"):
        raise UsageError(
            f"{att_dir}: cannot infer the box directory (name does not end in _att); pass both directories"
        )
    return att_dir.with_name(name[:-4] + "_box")


def read_cocobu(
    sources: list[Path], sizes: dict[str, tuple[int, int]] | None = None, **_: Any
) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """Sources: ``ATT_DIR`` (box dir inferred) or ``ATT_DIR BOX_DIR``."""
    if not sources or len(sources) > 2:
        raise UsageError("cocobu import takes ATT_DIR [BOX_DIR]")
    att_dir = sources[0]
    box_dir = sources[1] if len(sources) == 2 else box_dir_for(att_dir)
    for d in (att_dir, box_dir):
        if not d.is_dir():
            raise UsageError(f"cocobu directory not found: {d}")
    sizes = require_sizes(sizes, "cocobu files")
    for path in sorted(att_dir.glob("*.npz")):
        key = path.stem

        def decode(path: Path = path, key: str = key) -> dict[str, Any]:
            if key not in sizes:
                raise PipelineError(f"{path}: image {key} has no size in the --sizes file")
            feats = _load_npz(path)
            boxes = _load_npy(box_dir / f"{key}.npy")
            w, h = sizes[key]
            return {"key": key, "features": feats, "boxes": boxes, "image_w": w, "image_h": h}

        yield str(path), decode


register_format(
    Format(
        "cocobu",
        read_cocobu,
        "raw",
        True,
        None,
        help="ruotianluo cocobu_att and cocobu_box directories of npz/npy: give ATT_DIR, optionally BOX_DIR",
    )
)
