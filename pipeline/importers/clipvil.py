"""CLIP-ViL's caption feature folders (clip-vil/CLIP-ViL ``CLIP-ViL-Direct/caption/scripts/clip_prepro_feats.py``).

``<output_dir>_clip_<model>_att/<cocoid>.npz`` holds key ``feat``: float32 (g, g, C), the grid (the ResNet's
``layer4`` map, ``tmp_att[0].permute(1, 2, 0)``, or a ViT's patch tokens), g = 14 at the release's 448 x 448
input; ``<output_dir>_clip_<model>_fc/<cocoid>.npy`` holds the pooled vector. The release resizes every image to
448 x 448 whatever its aspect ratio, so cell (i, j) of a g_h x g_w grid covers ``[j W / g_w, i H / g_h, (j + 1)
W / g_w, (i + 1) H / g_h]`` of the original image (the boxes ``extractors/clip/recipe.py`` gives the same
cells); the files carry no image size, so sizes come from a COCO json (``--sizes``). Cells are stored row-major
as regions, and each image's ``_fc`` vector as its pooled vector (the store's ``pooled`` field,
``store.get(key)["pooled"]``): from the folder given as ``--fc``, or else from the ``_fc`` folder beside the
``_att`` one (``data_clip_RN50_att`` -> ``data_clip_RN50_fc``) when there is one; without either the store holds
the cells only. An image with a grid and no vector in that folder is a bad row naming the missing file. Arrays are
read from their ``.npy`` headers first, never with pickle.
"""

from __future__ import annotations

import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.importers.formats import Format, register_format, require_sizes
from pipeline.importers.untrusted import read_npy

log = get_logger("import")


def grid_boxes(gh: int, gw: int, width: int, height: int) -> np.ndarray:
    """(gh * gw, 4) float32 boxes of a grid that spans the whole image (row-major)."""
    ys, xs = np.meshgrid(np.arange(gh, dtype=np.float64), np.arange(gw, dtype=np.float64), indexing="ij")
    xs, ys = xs.ravel(), ys.ravel()
    boxes = np.stack([xs * width / gw, ys * height / gh, (xs + 1) * width / gw, (ys + 1) * height / gh], axis=1)
    return boxes.astype(np.float32)


def _load_grid(path: Path) -> np.ndarray:
    try:
        with zipfile.ZipFile(path) as zf:
            if "feat.npy" not in zf.namelist():
                names = [n[:-4] if n.endswith(".npy") else n for n in zf.namelist()]
                raise PipelineError(f"{path}: npz has no 'feat' array, only {names}")
            with zf.open("feat.npy") as fp:
                return read_npy(fp, str(path), "array feat", ndim=3)
    except (OSError, zipfile.BadZipFile, EOFError, ValueError, NotImplementedError) as exc:
        raise PipelineError(f"{path}: not a readable npz file ({str(exc).splitlines()[0][:80]})") from None


def fc_folder(att: Path, fc: Path | None = None) -> Path | None:
    """The folder of ``<cocoid>.npy`` pooled vectors of the ``_att`` folder ``att``: ``fc`` when given (it must be a
    directory), else the sibling named with ``_att`` -> ``_fc`` if it exists, else None (no pooled vectors)."""
    if fc is not None:
        if not Path(fc).is_dir():
            raise UsageError(f"--fc {fc}: not a directory (the release's *_fc folder of <cocoid>.npy vectors)")
        return Path(fc)
    name = att.resolve().name
    if "_att" not in name:
        return None
    head, _, tail = name.rpartition("_att")
    sibling = att.resolve().parent / f"{head}_fc{tail}"
    return sibling if sibling.is_dir() else None


def _load_pooled(path: Path, key: str, grid_path: Path) -> np.ndarray:
    """The ``_fc`` vector of image ``key`` (a 1-D ``.npy``); a missing file is a bad row naming it."""
    if not path.is_file():
        raise PipelineError(f"{path}: no pooled vector (_fc file) for image {key}, whose grid is {grid_path}")
    try:
        with open(path, "rb") as fp:
            return read_npy(fp, str(path), "pooled vector", ndim=1)
    except OSError as exc:
        raise PipelineError(f"{path}: not a readable .npy file ({str(exc).splitlines()[0][:80]})") from None


def _warn_if_constant(pooled_dir: Path) -> None:
    """Warn when the folder's first vector has every entry equal: the signature of the ``_fc`` files CLIP-ViL's
    first feature script wrote (``caption/clip/model.py`` @ ba46052: an attention pool with a zero positional
    embedding and an all-ones output projection, clip-vil/CLIP-ViL issues #13 and #18), which are not the CLIP
    embedding ``extract`` stores as the pooled vector. They are imported as they are."""
    first = next(iter(sorted(pooled_dir.glob("*.npy"))), None)
    if first is None:
        return
    try:
        with open(first, "rb") as fp:
            vec = read_npy(fp, str(first), "pooled vector", ndim=1)
    except (OSError, PipelineError):
        return  # the row that reads it reports the file
    if vec.size > 1 and bool(np.all(vec == vec.flat[0])):
        log.warning(
            "clip-vil: every entry of %s is equal (%d values): vectors of CLIP-ViL's first feature script (an "
            "attention pool with an all-ones output projection), not comparable with the pooled vectors of "
            "`extract` (docs/recipes.md#clip); imported as they are",
            first,
            vec.size,
        )


def read_clipvil(
    sources: list[Path], sizes: dict[str, tuple[int, int]] | None = None, fc: Path | None = None, **_: Any
) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    """Sources: one ``*_att`` directory of ``<cocoid>.npz`` files; ``fc``: the ``*_fc`` directory of ``<cocoid>.npy``
    pooled vectors (default: the ``_fc`` sibling of the ``_att`` directory, if there is one)."""
    if len(sources) != 1 or not sources[0].is_dir():
        raise UsageError("clip-vil import takes one directory of <cocoid>.npz files (the release's *_att folder)")
    sizes = require_sizes(sizes, "clip-vil files")
    pooled_dir = fc_folder(sources[0], fc)
    if pooled_dir is not None:
        log.info("clip-vil: pooled vectors from %s", pooled_dir)
        _warn_if_constant(pooled_dir)
    for path in sorted(sources[0].glob("*.npz")):
        key = path.stem

        def decode(path: Path = path, key: str = key) -> dict[str, Any]:
            if key not in sizes:
                raise PipelineError(f"{path}: image {key} has no size in the --sizes file")
            grid = _load_grid(path)
            gh, gw, c = grid.shape
            w, h = sizes[key]
            feats = np.ascontiguousarray(grid.reshape(gh * gw, c))
            rec = {"key": key, "features": feats, "boxes": grid_boxes(gh, gw, w, h), "image_w": w, "image_h": h}
            if pooled_dir is not None:
                rec["pooled"] = np.ascontiguousarray(_load_pooled(pooled_dir / f"{key}.npy", key, path))
            return rec

        yield str(path), decode


register_format(
    Format(
        "clip-vil",
        read_clipvil,
        "raw",
        True,
        None,
        help="CLIP-ViL *_clip_<model>_att directory of <cocoid>.npz grids (feat: g x g x C); cells become regions, "
        "the *_fc <cocoid>.npy vectors (--fc, default the sibling *_fc folder) the pooled vector",
        options=("fc",),
    )
)
