"""M2 Transformer's ``coco_detections.hdf5``: datasets ``<id>_features`` [K, 2048], ``<id>_boxes`` [K, 4]
and optionally ``<id>_cls_prob`` [K, C] (aimagelab/meshed-memory-transformer). Read one image at a time.

Class probabilities become ``class_ids``/``class_scores``: with C = 1601 column 0 is the Caffe background
and is dropped, so ids are 0-based lines of the VG object vocabulary like the obj36 ``objects_id``.
The file has no image sizes: they come from a COCO json (``--sizes``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.core.errors import PipelineError, UsageError
from pipeline.importers.formats import Format, register_format, require_sizes
from pipeline.importers.untrusted import read_dataset
from pipeline.store.segment import open_hdf5_readonly

SUFFIX = "_features"


def read_m2(
    sources: list[Path], sizes: dict[str, tuple[int, int]] | None = None, **_: Any
) -> Iterator[tuple[str, Callable[[], dict[str, Any]]]]:
    sizes = require_sizes(sizes, "M2 detection files")
    for path in sources:
        if not path.is_file():
            raise UsageError(f"M2 detections file not found: {path}")
        with open_hdf5_readonly(path) as fh:
            names = [n for n in fh.keys() if n.endswith(SUFFIX)]
            if not names:
                raise PipelineError(f"{path} is an HDF5 file but not M2 detections (no '<id>_features' datasets)")
            keys = sorted((n[: -len(SUFFIX)] for n in names), key=lambda k: (len(k), k))
            for key in keys:
                where = f"{path}:{key}"

                def decode(key: str = key, where: str = where) -> dict[str, Any]:
                    if key not in sizes:
                        raise PipelineError(f"{where}: image {key} has no size in the --sizes file")
                    feats = read_dataset(fh, f"{key}{SUFFIX}", where, ndim=2)
                    boxes = read_dataset(fh, f"{key}_boxes", where, ndim=2)
                    rec: dict[str, Any] = {
                        "key": key,
                        "features": feats,
                        "boxes": boxes,
                        "image_w": sizes[key][0],
                        "image_h": sizes[key][1],
                    }
                    if fh.id.links.exists(f"{key}_cls_prob".encode("utf-8", "surrogateescape")):
                        prob = read_dataset(fh, f"{key}_cls_prob", where, ndim=2).astype(np.float32)
                        if len(prob) != len(feats):
                            raise PipelineError(
                                f"{where}: {key}_cls_prob has shape {prob.shape}, expected ({len(feats)}, C)"
                            )
                        if prob.shape[1] == 1601:
                            prob = prob[:, 1:]
                        rec["class_ids"] = prob.argmax(1)
                        rec["class_scores"] = prob.max(1)
                    return rec

                yield where, decode


register_format(
    Format(
        "m2-hdf5",
        read_m2,
        "raw",
        True,
        None,
        help="M2 Transformer coco_detections.hdf5",
    )
)
