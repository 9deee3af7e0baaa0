"""Checking one image's arrays before it enters a store, and the growing row buffers of the writer."""

from __future__ import annotations

import numpy as np

from pipeline.core.errors import PipelineError
from pipeline.core.keys import check_key

BOX_TOLERANCE = 1.0  # pixels a box may reach past the image border (Caffe clips at W-1 in the scaled image)
MAX_IMAGE_SIDE = 2**31 - 1  # the largest image width or height a segment's int32 ``image_size`` holds


def validate_image(
    key: str,
    features: np.ndarray,
    boxes: np.ndarray,
    image_w: int,
    image_h: int,
    extras: dict[str, np.ndarray],
    feature_dim: int | None,
    where: str,
    check_features: bool = True,
) -> None:
    """Check one image's arrays; raise a one-line :class:`PipelineError` naming ``where`` and the key."""
    if not isinstance(key, str) or not key:
        raise PipelineError(f"{where}: image id must be a non-empty string, got {key!r}")
    check_key(key, where)
    if features.ndim != 2 or features.shape[0] < 1 or features.shape[1] < 1:
        raise PipelineError(f"{where}: image {key}: features must be (N>=1, D>=1), got shape {features.shape}")
    if feature_dim is not None and features.shape[1] != feature_dim:
        raise PipelineError(
            f"{where}: image {key}: feature dimension {features.shape[1]} != store dimension {feature_dim}"
        )
    n = features.shape[0]
    if boxes.shape != (n, 4):
        raise PipelineError(f"{where}: image {key}: boxes must be ({n}, 4), got {boxes.shape}")
    if check_features and not np.isfinite(features).all():
        raise PipelineError(f"{where}: image {key}: features contain NaN or infinity")
    if not np.isfinite(boxes).all():
        raise PipelineError(f"{where}: image {key}: boxes contain NaN or infinity")
    if not (0 < int(image_w) <= MAX_IMAGE_SIDE and 0 < int(image_h) <= MAX_IMAGE_SIDE):
        raise PipelineError(f"{where}: image {key}: image size {image_w}x{image_h} is outside 1..{MAX_IMAGE_SIDE}")
    t = BOX_TOLERANCE
    x1, y1, x2, y2 = boxes[:, 0], boxes[:, 1], boxes[:, 2], boxes[:, 3]
    bad = (x1 < -t) | (y1 < -t) | (x2 > image_w + t) | (y2 > image_h + t) | (x2 < x1) | (y2 < y1)
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise PipelineError(
            f"{where}: image {key}: box {i} {boxes[i].tolist()} lies outside the {image_w}x{image_h} image or is "
            "inverted"
        )
    for name, arr in extras.items():
        if arr.shape != (n,):
            raise PipelineError(f"{where}: image {key}: {name} must have shape ({n},), got {arr.shape}")
        if name.endswith("_scores") and not np.isfinite(arr).all():
            raise PipelineError(f"{where}: image {key}: {name} contain NaN or infinity")
        if name.endswith("_ids") and (arr < 0).any():
            raise PipelineError(f"{where}: image {key}: {name} has negative ids")


def _all_finite(arr: np.ndarray) -> bool:
    """``np.isfinite(arr).all()``; for float16 via the exponent bits (numpy's half isfinite is ~10x slower)."""
    if arr.dtype == np.float16:
        return not bool(((arr.view(np.uint16) & 0x7C00) == 0x7C00).any())
    return bool(np.isfinite(arr).all())


class _RowBuffer:
    """Pending rows of one field in one growing array (amortised doubling): add copies once, commit
    writes one slice, no concatenation."""

    def __init__(self, dtype: np.dtype, width: int | None) -> None:
        self.width = width
        self.data = np.empty((1024,) if width is None else (1024, width), dtype=dtype)
        self.rows = 0

    def append(self, arr: np.ndarray) -> None:
        n = len(arr)
        if self.rows + n > len(self.data):
            cap = max(2 * len(self.data), self.rows + n)
            grown = np.empty((cap,) + self.data.shape[1:], dtype=self.data.dtype)
            grown[: self.rows] = self.data[: self.rows]
            self.data = grown
        with np.errstate(over="ignore", invalid="ignore"):  # overflow is detected (and reported) by the caller
            self.data[self.rows : self.rows + n] = arr  # casts to the store dtype while copying
        self.rows += n

    def view(self) -> np.ndarray:
        return self.data[: self.rows]
