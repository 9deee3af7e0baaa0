"""Pictures of captioned photos for a person: the few regions the caption talks about, a legend, the caption.

Which regions: for every content word of the caption (articles, prepositions and other function words
skipped), the region its relevance points to most (per-word relevance by occlusion, see
:func:`pipeline.captioning.engine.region_relevance`); regions are ranked by their total relevance over the
caption's words and de-duplicated (a region showing the same object as an already chosen one: IoU above
``iou``, mostly inside it, or the same label overlapping it, adds its words to it instead of a second box),
at most ``max_regions``. Without relevance (or when
no word depends on any region) the most confident detections are drawn, de-duplicated the same way.

The drawing is meant to stay readable at thumbnail size: thick outlines, one large numbered tag per region,
and the labels in a legend under the photo (``number  attribute class: words``) instead of text on the photo.
"""

from __future__ import annotations

import hashlib
import io
import re
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pipeline.captioning.engine import CaptionResult
from pipeline.core.fileio import atomic_write_bytes

PALETTE = [
    (230, 25, 75),
    (0, 130, 200),
    (60, 180, 75),
    (245, 130, 48),
    (145, 30, 180),
    (240, 50, 230),
    (0, 128, 128),
    (170, 110, 40),
]
FUNCTION_WORDS = frozenset(
    "a an the of on in at to with and or is are was were be its it this that there some by for from near next "
    "into onto over under above below behind beside while his her their".split()
)
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


@dataclass
class Region:
    """A region to draw: its index among the detections, box (original pixels), label, words and weight."""

    index: int
    box: np.ndarray
    label: str
    weight: float
    words: list[str] = field(default_factory=list)


def region_labels(regions: dict[str, np.ndarray], classes: Sequence[str], attributes: Sequence[str]) -> list[str]:
    """``attribute class`` per region (the attribute only when its score reaches 0.1)."""
    labels = []
    for i, c in enumerate(regions["class_ids"]):
        name = classes[int(c)] if 0 <= int(c) < len(classes) else f"class{int(c)}"
        attr = ""
        if regions.get("attr_ids") is not None:
            a = int(regions["attr_ids"][i])
            score = float(regions["attr_scores"][i]) if regions.get("attr_scores") is not None else 1.0
            if 0 <= a < len(attributes) and score >= 0.1:
                attr = attributes[a] + " "
        labels.append(f"{attr}{name}")
    return labels


def box_iou(a: np.ndarray, b: np.ndarray) -> float:
    """Intersection over union of two ``x1 y1 x2 y2`` boxes."""
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return float(inter / union) if union > 0 else 0.0


def _same_object(a: np.ndarray, b: np.ndarray, label_a: str, label_b: str, iou: float) -> bool:
    """Boxes that show one object: IoU above ``iou``, one box mostly inside the other, or one label overlapping."""
    overlap = box_iou(a, b)
    if overlap > iou or (label_a == label_b and overlap > 0.1):
        return True
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    smaller = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
    return bool(smaller > 0 and iw * ih / smaller > 0.7)


def attended_regions(
    result: CaptionResult, labels: Sequence[str], max_regions: int = 5, iou: float = 0.5
) -> list[Region]:
    """The few regions the caption's words depend on, de-duplicated by IoU (see the module docstring)."""
    regions = result.regions or {}
    boxes = np.asarray(regions.get("boxes", np.zeros((0, 4))), dtype=np.float32)
    words: dict[int, list[str]] = {}
    weight = np.zeros(len(boxes), np.float64)
    if result.relevance is not None and len(boxes):
        for word, row in zip(result.tokens, result.relevance):
            if word in FUNCTION_WORDS or row.sum() <= 0:
                continue
            weight += row[: len(boxes)]
            words.setdefault(int(np.argmax(row)), []).append(word)
    if words:
        order = sorted(words, key=lambda r: -weight[r])
    else:  # no relevance: the most confident detections
        scores = np.asarray(regions.get("class_scores", np.zeros(len(boxes))), dtype=np.float32)
        order = [int(i) for i in np.argsort(-scores, kind="stable")]
        weight = scores.astype(np.float64)
    chosen: list[Region] = []
    for r in order:
        same = next(
            (
                c
                for c in chosen
                if _same_object(c.box, boxes[r], c.label, labels[r], iou) or (not words and c.label == labels[r])
            ),
            None,
        )
        if same is not None:
            same.words += [w for w in words.get(r, []) if w not in same.words]
            continue
        if len(chosen) < max_regions:
            chosen.append(Region(r, boxes[r], labels[r], float(weight[r]), list(dict.fromkeys(words.get(r, [])))))
    return chosen


def _draw_regions(img: Image.Image, chosen: Sequence[Region], scale: float) -> None:
    draw = ImageDraw.Draw(img)
    line = max(3, round(img.width / 160))
    font = _font(max(16, img.width // 26))
    for n, reg in enumerate(chosen, 1):
        x1, y1, x2, y2 = (float(v) * scale for v in reg.box)
        colour = PALETTE[(n - 1) % len(PALETTE)]
        draw.rectangle([x1, y1, x2, y2], outline=colour, width=line)
        tag = str(n)
        tw = draw.textlength(tag, font=font)
        th = font.size if hasattr(font, "size") else 12
        tx, ty = min(max(0.0, x1), img.width - tw - 8), min(max(0.0, y1), img.height - th - 6)
        draw.rectangle([tx, ty, tx + tw + 8, ty + th + 6], fill=colour)
        draw.text((tx + 4, ty + 1), tag, fill=(255, 255, 255), font=font)


def render_picture(
    result: CaptionResult, classes: Sequence[str], attributes: Sequence[str], width: int = 520, max_regions: int = 5
) -> Image.Image:
    """The picture for one captioned photo (needs ``result.image`` and ``result.regions``)."""
    assert result.image is not None and result.regions is not None
    rgb = result.image
    h0, w0 = rgb.shape[:2]
    scale = width / w0
    main = Image.fromarray(rgb).resize((width, max(1, round(h0 * scale))), Image.Resampling.BILINEAR)
    chosen = attended_regions(result, region_labels(result.regions, classes, attributes), max_regions)
    _draw_regions(main, chosen, scale)
    cap_font, leg_font, size = _font(22), _font(18), 22
    lines = textwrap.wrap(result.caption or "(empty caption)", width=max(20, width // 12))
    cap_h = 10 + (size + 6) * len(lines)
    leg_h = 8 + 26 * len(chosen)
    canvas = Image.new("RGB", (width, main.height + cap_h + leg_h), (255, 255, 255))
    canvas.paste(main, (0, 0))
    draw = ImageDraw.Draw(canvas)
    for k, text in enumerate(lines):
        draw.text((8, main.height + 6 + (size + 6) * k), text, fill=(0, 0, 0), font=cap_font)
    y = main.height + cap_h
    for n, reg in enumerate(chosen, 1):
        colour = PALETTE[(n - 1) % len(PALETTE)]
        draw.rectangle([8, y + 2, 30, y + 22], fill=colour)
        draw.text((13 if n < 10 else 9, y + 2), str(n), fill=(255, 255, 255), font=leg_font)
        draw.text((38, y + 2), reg.label, fill=(0, 0, 0), font=leg_font)
        if reg.words:
            x = 38 + draw.textlength(reg.label, font=leg_font)
            draw.text((x, y + 2), ": " + ", ".join(reg.words), fill=(90, 90, 90), font=leg_font)
        y += 26
    return canvas


def picture_name(key: str) -> str:
    """A file-system-safe, ASCII, deterministic name for a photo's key (a hash keeps mangled names unique)."""
    stem = key.rsplit(".", 1)[0] if "." in key.rsplit("/", 1)[-1] else key
    safe = _UNSAFE.sub("_", stem.replace("/", "__")).strip("._") or "photo"
    if safe != stem:
        safe = f"{safe[:80]}-{hashlib.sha1(key.encode('utf-8', 'surrogateescape')).hexdigest()[:8]}"
    return safe


def write_pictures(
    results: Sequence[CaptionResult], out_dir: str | Path, classes: Sequence[str], attributes: Sequence[str]
) -> list[Path]:
    """One PNG per captioned photo in ``out_dir`` (named by :func:`picture_name`); returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for res in results:
        if res.error or res.image is None or res.regions is None:
            continue
        buf = io.BytesIO()
        render_picture(res, classes, attributes).save(buf, format="PNG")
        written.append(atomic_write_bytes(out / f"{picture_name(res.key)}.png", buf.getvalue()))
    return written
