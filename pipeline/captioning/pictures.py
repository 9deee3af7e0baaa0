"""Pictures of captioned photos: labelled boxes and the caption, plus a strip with one heat overlay per word.

Top panel: the photo with its detected regions (the ``max_boxes_drawn`` most confident), each labelled
``attribute class``, and the caption underneath. Strip: for every generated word, a thumbnail of the photo
where each region is brightened by its relevance for that word (see
:func:`pipeline.captioning.engine.region_relevance`); the word and its most relevant region's label are
written below.
"""

from __future__ import annotations

import io
import textwrap
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pipeline.captioning.engine import CaptionResult
from pipeline.core.fileio import atomic_write_bytes

PALETTE = [(230, 25, 75), (60, 180, 75), (255, 225, 25), (0, 130, 200), (245, 130, 48), (145, 30, 180),
           (70, 240, 240), (240, 50, 230), (210, 245, 60), (250, 190, 212), (0, 128, 128), (170, 110, 40)]


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def region_labels(regions: dict[str, np.ndarray], classes: Sequence[str], attributes: Sequence[str]) -> list[str]:
    labels = []
    for i, c in enumerate(regions["class_ids"]):
        name = classes[int(c)] if 0 <= int(c) < len(classes) else f"class{int(c)}"
        attr = ""
        if "attr_ids" in regions and regions.get("attr_ids") is not None:
            a = int(regions["attr_ids"][i])
            score = float(regions["attr_scores"][i]) if regions.get("attr_scores") is not None else 1.0
            if 0 <= a < len(attributes) and score >= 0.1:
                attr = attributes[a] + " "
        labels.append(f"{attr}{name}")
    return labels


def _draw_boxes(img: Image.Image, boxes: np.ndarray, labels: list[str], scale: float, order: np.ndarray) -> None:
    draw = ImageDraw.Draw(img)
    font = _font(12)
    for rank, i in enumerate(order):
        x1, y1, x2, y2 = (float(v) * scale for v in boxes[i])
        colour = PALETTE[rank % len(PALETTE)]
        draw.rectangle([x1, y1, x2, y2], outline=colour, width=2)
        text = labels[i]
        tw = draw.textlength(text, font=font)
        ty = max(0.0, y1 - 14)
        draw.rectangle([x1, ty, x1 + tw + 4, ty + 14], fill=colour)
        draw.text((x1 + 2, ty), text, fill=(0, 0, 0), font=font)


def _heat(thumb: np.ndarray, boxes: np.ndarray, weights: np.ndarray, scale: float) -> np.ndarray:
    h, w = thumb.shape[:2]
    heat = np.zeros((h, w), np.float32)
    for (x1, y1, x2, y2), a in zip(boxes * scale, weights):
        heat[max(0, int(y1)) : min(h, int(np.ceil(y2))), max(0, int(x1)) : min(w, int(np.ceil(x2)))] += float(a)
    if heat.max() > 0:
        heat /= heat.max()
    dim = thumb.astype(np.float32) * 0.25
    lit = thumb.astype(np.float32) * 0.55 + np.array([255, 80, 0], np.float32) * 0.45
    out = dim * (1 - heat[..., None]) + lit * heat[..., None]
    return np.clip(out, 0, 255).astype(np.uint8)


def render_picture(
    result: CaptionResult, classes: Sequence[str], attributes: Sequence[str], width: int = 520, max_boxes_drawn: int = 12, thumb: int = 130
) -> Image.Image:
    """The picture for one captioned photo (needs ``result.image`` and ``result.regions``)."""
    assert result.image is not None and result.regions is not None
    rgb = result.image
    h0, w0 = rgb.shape[:2]
    scale = width / w0
    main = Image.fromarray(rgb).resize((width, max(1, round(h0 * scale))), Image.Resampling.BILINEAR)
    regions = result.regions
    labels = region_labels(regions, classes, attributes)
    order = np.argsort(-np.asarray(regions["class_scores"], dtype=np.float32), kind="stable")[:max_boxes_drawn]
    _draw_boxes(main, np.asarray(regions["boxes"]), labels, scale, order)
    font = _font(16)
    caption_lines = textwrap.wrap(result.caption or "(empty caption)", width=60)
    cap_h = 8 + 20 * len(caption_lines)
    words = result.tokens if result.relevance is not None else []
    per_row = max(1, width // (thumb + 6))
    rows = (len(words) + per_row - 1) // per_row
    tscale = thumb / w0
    th = max(1, round(h0 * tscale))
    strip_h = rows * (th + 34) + (24 if words else 0)
    canvas = Image.new("RGB", (width, main.height + cap_h + strip_h), (255, 255, 255))
    canvas.paste(main, (0, 0))
    draw = ImageDraw.Draw(canvas)
    for k, line in enumerate(caption_lines):
        draw.text((6, main.height + 4 + 20 * k), line, fill=(0, 0, 0), font=font)
    if words:
        y0 = main.height + cap_h
        draw.text((6, y0 + 2), "regions each word depends on (occlusion)", fill=(90, 90, 90), font=_font(13))
        small = np.asarray(Image.fromarray(rgb).resize((thumb, th), Image.Resampling.BILINEAR))
        boxes = np.asarray(regions["boxes"], dtype=np.float32)
        for t, word in enumerate(words):
            r, c = divmod(t, per_row)
            x, y = 3 + c * (thumb + 6), y0 + 24 + r * (th + 34)
            weights = result.relevance[t]
            canvas.paste(Image.fromarray(_heat(small, boxes, weights, tscale)), (x, y))
            top = int(np.argmax(weights)) if weights.sum() > 0 else -1
            draw.text((x, y + th + 1), word, fill=(0, 0, 0), font=_font(14))
            if top >= 0:
                draw.text((x, y + th + 16), labels[top][:22], fill=(110, 110, 110), font=_font(11))
    return canvas


def write_pictures(results: Sequence[CaptionResult], out_dir: str | Path, classes: Sequence[str], attributes: Sequence[str]) -> list[Path]:
    """One PNG per captioned photo in ``out_dir`` (named after the photo); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    used: set[str] = set()
    for res in results:
        if res.error or res.image is None:
            continue
        name = Path(res.key).stem or res.path.stem
        base, k = name, 1
        while name in used:
            k += 1
            name = f"{base}_{k}"
        used.add(name)
        buf = io.BytesIO()
        render_picture(res, classes, attributes).save(buf, format="PNG")
        written.append(atomic_write_bytes(out / f"{name}.png", buf.getvalue()))
    return written
