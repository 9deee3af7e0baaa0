"""Robust image loading (every failure recorded, nothing half-decoded) and the Caffe test-time blob (docs/recipes.md).

``load_rgb`` never lets a bad file crash a run: it raises :class:`ImageLoadError` with a short ``reason``
(``empty``, ``unreadable``, ``not_an_image``, ``format_not_allowed``, ``too_large``, ``truncated``,
``decode_error``) that the extraction loop writes to its failures manifest.

``caffe_blob`` reproduces ``_get_image_blob``: BGR float32, pixel means subtracted **before** a linear resize
by ``scale = min_size / min(h, w)`` (``max_size / max(h, w)`` if ``round(scale * max(h, w)) > max_size``),
``cv2.resize(..., fx=scale, fy=scale, INTER_LINEAR)``, no std division, HWC -> CHW.
"""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import cv2
import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from pipeline.core.errors import exception_line

ALLOWED_FORMATS = ("JPEG", "PNG", "WEBP", "BMP", "TIFF", "GIF")  # the JPEG opener also yields MPO (phone) files
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff", ".gif")
DEFAULT_MAX_PIXELS = 100_000_000


class ImageLoadError(Exception):
    """A file that cannot be used as an image: ``reason`` (short code) and ``detail`` (one line)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def _to_rgb_uint8(im: Image.Image) -> np.ndarray:
    """Normalise any PIL mode to RGB uint8 (alpha composited on white; 16-bit / int / float rescaled)."""
    mode = im.mode
    if (
        mode in ("RGBA", "LA", "PA")
        or (mode == "P" and "transparency" in im.info)
        or (mode in ("RGB", "L") and "transparency" in im.info)
    ):
        rgba = im.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return np.asarray(Image.alpha_composite(white, rgba).convert("RGB"))
    if mode.startswith("I;16") or mode in ("I", "F"):
        arr = np.asarray(im).astype(np.float64)
        if mode.startswith("I;16"):
            arr = arr / 257.0
        else:
            hi = float(arr.max(initial=0.0))
            lo = float(arr.min(initial=0.0))
            if lo < 0 or hi > 255:
                span = hi - lo if hi > lo else 1.0
                arr = (arr - lo) / span * 255.0
        g = np.clip(np.rint(arr), 0, 255).astype(np.uint8)
        return np.repeat(g[:, :, None], 3, axis=2)
    if mode != "RGB":
        im = im.convert("RGB")
    return np.asarray(im)


_BOMB_LOCK = threading.Lock()
_BOMB_USERS = 0
_BOMB_FILTER = ("error", None, Image.DecompressionBombWarning, None, 0)


@contextmanager
def _bomb_warning_is_an_error() -> Iterator[None]:
    """Pillow's ``DecompressionBombWarning`` raises inside the block, in every thread decoding at the time.

    ``warnings.catch_warnings`` is not thread-safe (a thread leaving it restores the filters it saw on entry,
    dropping the filter of a thread still decoding, or leaving its own behind), and ``cli serve`` decodes uploads
    in several threads: the filter is put in place by the first decoder in and taken out by the last one out."""
    global _BOMB_USERS
    with _BOMB_LOCK:
        if _BOMB_USERS == 0:
            warnings.filters.insert(0, _BOMB_FILTER)
            _filters_changed()
        _BOMB_USERS += 1
    try:
        yield
    finally:
        with _BOMB_LOCK:
            _BOMB_USERS -= 1
            if _BOMB_USERS == 0:
                if _BOMB_FILTER in warnings.filters:
                    warnings.filters.remove(_BOMB_FILTER)
                _filters_changed()


def _filters_changed() -> None:
    """Tell the warnings module its filters changed (what ``warnings.filterwarnings`` does), so that no warning
    registry keeps an earlier decision."""
    mutated = getattr(warnings, "_filters_mutated", None)
    if mutated is not None:
        mutated()


def load_rgb(path: str | Path | bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """Decode ``path`` (a file, or the bytes of one, e.g. an upload to ``cli serve``, decoded in memory) into an
    (H, W, 3) RGB uint8 array in its EXIF-corrected orientation.

    Policy: Pillow restricted to :data:`ALLOWED_FORMATS`; pixel count checked before decoding (decompression
    bombs); truncated files are failures (never ``LOAD_TRUNCATED_IMAGES``); multi-frame images use frame 0.
    """
    if isinstance(path, (bytes, bytearray, memoryview)):
        source: Any = io.BytesIO(path)
        size = len(source.getbuffer())
    else:
        source = path = Path(path)
        try:
            size = path.stat().st_size
        except OSError as exc:
            raise ImageLoadError("unreadable", f"{type(exc).__name__}: {exc.strerror or exc}") from None
    if size == 0:
        raise ImageLoadError("empty", "zero-byte file")
    try:
        with _bomb_warning_is_an_error():
            with Image.open(source, formats=ALLOWED_FORMATS) as im:
                w, h = im.size
                if w * h > max_pixels:
                    raise ImageLoadError("too_large", f"{w}x{h} = {w * h} pixels exceeds the cap of {max_pixels}")
                try:
                    im.load()
                except OSError as exc:
                    raise ImageLoadError(
                        "truncated", str(exc).splitlines()[0] if str(exc) else "truncated data"
                    ) from None
                try:
                    im2 = ImageOps.exif_transpose(im) or im
                except Exception:  # a broken EXIF block: keep the unrotated image (detectron2 does the same)
                    im2 = im
                arr = _to_rgb_uint8(im2)
    except ImageLoadError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageLoadError("too_large", str(exc).splitlines()[0]) from None
    except UnidentifiedImageError:
        raise ImageLoadError(
            "not_an_image", f"not a decodable image in the allowed formats ({', '.join(ALLOWED_FORMATS)})"
        ) from None
    except PermissionError as exc:
        raise ImageLoadError("unreadable", f"permission denied ({exc.strerror})") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:  # decoder errors from odd files
        raise ImageLoadError("decode_error", exception_line(exc)) from None
    if arr.ndim != 3 or arr.shape[2] != 3 or arr.shape[0] < 1 or arr.shape[1] < 1:
        raise ImageLoadError("decode_error", f"unexpected decoded shape {arr.shape}")
    return np.ascontiguousarray(arr)


def compute_scale(height: int, width: int, min_size: int = 600, max_size: int = 1000) -> float:
    """``im_scale`` of ``_get_image_blob``: shortest side to ``min_size`` unless the longest exceeds ``max_size``."""
    short, long = min(height, width), max(height, width)
    scale = float(min_size) / float(short)
    if np.round(scale * long) > max_size:
        scale = float(max_size) / float(long)
    return scale


def caffe_blob(
    rgb: np.ndarray, min_size: int = 600, max_size: int = 1000, pixel_means=(102.9801, 115.9465, 122.7717)
) -> tuple[np.ndarray, float]:
    """(3, H', W') float32 mean-subtracted BGR blob and its scale, exactly as the Caffe test script."""
    bgr = rgb[:, :, ::-1].astype(np.float32)
    bgr -= np.asarray(pixel_means, dtype=np.float32)
    h, w = bgr.shape[:2]
    scale = compute_scale(h, w, min_size, max_size)
    if round(h * scale) >= 1 and round(w * scale) >= 1:
        resized = cv2.resize(bgr, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
    else:  # extreme aspect ratio: the short side would round to 0 pixels; keep one
        resized = cv2.resize(bgr, (max(1, round(w * scale)), max(1, round(h * scale))), interpolation=cv2.INTER_LINEAR)
        resized = resized.reshape(resized.shape[0], resized.shape[1], 3)
    return np.ascontiguousarray(resized.transpose(2, 0, 1)), scale


@dataclass(frozen=True)
class Frame:
    """Where a blob came from: the original ``height`` x ``width``, the resized ``blob_h`` x ``blob_w``, and the
    resize factor ``im_scale`` of the rule (Caffe's one factor; the RPN's minimum size is ``16 * im_scale``)."""

    height: int
    width: int
    blob_h: int
    blob_w: int
    im_scale: float

    @property
    def scale_xy(self) -> tuple[float, float]:
        """(original / resized) along x and y: detectron2 ``detector_postprocess`` and the HF port's
        ``scales_yx`` (per-axis box rescaling)."""
        return self.width / self.blob_w, self.height / self.blob_h


def shortest_edge_size(height: int, width: int, short: int, max_size: int) -> tuple[int, int, float]:
    """detectron2 ``ResizeShortestEdge`` (also the HF port's): (new_h, new_w, factor). The short side goes to
    ``short``; if the long side then exceeds ``max_size`` both shrink by ``max_size / long``; sizes are
    rounded with ``int(x + 0.5)`` (never below one pixel)."""
    scale = short * 1.0 / min(height, width)
    if height < width:
        newh, neww = float(short), scale * width
    else:
        newh, neww = scale * height, float(short)
    if max(newh, neww) > max_size:
        factor = max_size * 1.0 / max(newh, neww)
        newh, neww, scale = newh * factor, neww * factor, scale * factor
    return max(1, int(newh + 0.5)), max(1, int(neww + 0.5)), scale


def mrcnn_size(height: int, width: int, short: int, max_size: int) -> tuple[int, int]:
    """maskrcnn_benchmark ``Resize.get_size`` (VinVL): short side ``short`` unless the long side would pass
    ``max_size`` (then ``short = int(round(max_size * short_side / long_side))``); the long side is
    ``int(short * long / short_side)`` (truncated); an image whose short side already equals ``short`` is kept."""
    size = short
    lo, hi = float(min(width, height)), float(max(width, height))
    if hi / lo * size > max_size:
        size = int(round(max_size * lo / hi))
    if (width <= height and width == size) or (height <= width and height == size):
        return height, width
    if width < height:
        return max(1, int(size * height / width)), size
    return size, max(1, int(size * width / height))


def recipe_blob(rgb: np.ndarray, recipe) -> tuple[np.ndarray, Frame]:
    """(3, H', W') float32 blob and its :class:`Frame` for a :class:`extractors.recipes.Recipe` (resolved).

    * ``cv2-linear`` + ``caffe`` rule: :func:`caffe_blob` (means subtracted before the resize).
    * ``torch-bilinear`` (HF ``processing_image.py``): float image, ``nn.functional.interpolate(bilinear,
      align_corners=False)`` to the rounded size, then ``(x - mean) / std``.
    * ``pil-bilinear`` (detectron2 ``ResizeTransform``): PIL ``BILINEAR`` on the uint8 image, then float and
      ``(x - mean) / std``; with ``to_bgr255`` (maskrcnn_benchmark ``ToTensor`` + ``Normalize(to_bgr255=True)``)
      the float is ``(x / 255) * 255`` in float32, as the release computes it.
    """
    own = getattr(recipe, "input_blob", None)
    if own is not None:  # an encoder that builds its own input (the CLIP recipes, extractors.clip.run)
        return own(rgb)
    img = rgb[:, :, ::-1] if recipe.colour == "bgr" else rgb
    h, w = rgb.shape[:2]
    mean = np.asarray(recipe.pixel_mean, dtype=np.float32)
    plain_std = all(v == 1.0 for v in recipe.pixel_std)
    if recipe.resize == "caffe":
        scale = compute_scale(h, w, recipe.min_size, recipe.max_size)
        newh, neww = max(1, round(h * scale)), max(1, round(w * scale))
    elif recipe.resize == "mrcnn":
        newh, neww = mrcnn_size(h, w, recipe.min_size, recipe.max_size)
        scale = newh / h if h <= w else neww / w
    else:
        newh, neww, scale = shortest_edge_size(h, w, recipe.min_size, recipe.max_size)
    if recipe.interpolation == "cv2-linear":
        if recipe.resize == "caffe" and recipe.colour == "bgr":
            blob, scale = caffe_blob(rgb, recipe.min_size, recipe.max_size, recipe.pixel_mean)
        else:
            f = img.astype(np.float32) - mean
            blob = cv2.resize(f, (neww, newh), interpolation=cv2.INTER_LINEAR).reshape(newh, neww, 3).transpose(2, 0, 1)
        if not plain_std:
            blob = blob / np.asarray(recipe.pixel_std, dtype=np.float32)[:, None, None]
    else:
        if recipe.interpolation == "torch-bilinear":
            t = torch.from_numpy(np.ascontiguousarray(img).astype(np.float32)).permute(2, 0, 1).unsqueeze(0)
            t = torch.nn.functional.interpolate(t, (newh, neww), mode="bilinear", align_corners=False).squeeze(0)
        else:
            small = np.ascontiguousarray(img)
            if (newh, neww) != (h, w):
                small = np.asarray(Image.fromarray(small).resize((neww, newh), Image.BILINEAR))
            t = torch.from_numpy(np.ascontiguousarray(small.transpose(2, 0, 1))).float()
            if getattr(recipe, "to_bgr255", False):
                t = t.div(255).mul(255)
        t = (t - torch.tensor(recipe.pixel_mean, dtype=torch.float32).view(3, 1, 1)) / torch.tensor(
            recipe.pixel_std, dtype=torch.float32
        ).view(3, 1, 1)
        blob = t.numpy()
    blob = np.ascontiguousarray(blob, dtype=np.float32)
    return blob, Frame(int(h), int(w), int(blob.shape[1]), int(blob.shape[2]), float(scale))
