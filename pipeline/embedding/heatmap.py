"""PNG heatmaps of the self-attention rows over the words of sentences (as in the attention figure of Yoo et al.
2017).

One panel per sentence: a grid with one row per attention vector a_i (i = 1..n_a) and one column per word
(``<eos>`` included), each cell shaded by its weight A[i, t] relative to the panel's largest weight (white 0 -> dark
red = that maximum, written under the panel), the words written above their columns, and a last row with the
mean over the rows. Drawn with Pillow (no plotting library needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from pipeline.core.fileio import atomic_write

CELL_W, CELL_H, LABEL_W, WORD_H, GAP = 46, 12, 46, 70, 26


def _font(size: int) -> ImageFont.ImageFont:
    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1
        return ImageFont.load_default()


def _shade(value: float) -> tuple[int, int, int]:
    v = float(np.clip(value, 0.0, 1.0))
    return (255 - int(75 * v), 255 - int(235 * v), 255 - int(225 * v))


def attention_heatmap(
    sentences: Sequence[Sequence[str]], attentions: Sequence[np.ndarray], path: str | Path, rows: int | None = None
) -> Path:
    """Write the heatmaps of ``attentions[k]`` (n_a, T_k) over ``sentences[k]`` (T_k words) to ``path`` (PNG)."""
    if len(sentences) != len(attentions):
        raise ValueError("one attention matrix per sentence is needed")
    mats = [np.asarray(a, dtype=np.float64)[:rows] for a in attentions]
    for words, a in zip(sentences, mats):
        if a.shape[1] != len(words):
            raise ValueError(f"attention over {a.shape[1]} steps for a sentence of {len(words)} tokens")
    width = LABEL_W + CELL_W * max((len(w) for w in sentences), default=1) + 10
    heights = [WORD_H + CELL_H * (a.shape[0] + 1) + 4 + GAP for a in mats]
    img = Image.new("RGB", (width, max(sum(heights), 1)), "white")
    draw = ImageDraw.Draw(img)
    small, word_font = _font(9), _font(12)
    y = 0
    for words, a in zip(sentences, mats):
        for t, word in enumerate(words):  # words written upwards above their columns
            label = Image.new("RGBA", (WORD_H - 4, CELL_W), (255, 255, 255, 0))
            ImageDraw.Draw(label).text((2, CELL_W // 2 - 7), word[:10], fill="black", font=word_font)
            rotated = label.rotate(90, expand=True)
            img.paste(rotated, (LABEL_W + t * CELL_W, y + 2), rotated)
        top = y + WORD_H
        grid = np.vstack([a, a.mean(0, keepdims=True)])
        scale = float(grid.max()) if grid.size and grid.max() > 0 else 1.0
        for i, row in enumerate(grid):
            yy = top + i * CELL_H + (4 if i == len(a) else 0)
            draw.text((2, yy), "mean" if i == len(a) else f"a{i + 1}", fill="black", font=small)
            for t, value in enumerate(row):
                x = LABEL_W + t * CELL_W
                draw.rectangle([x, yy, x + CELL_W - 2, yy + CELL_H - 2], fill=_shade(value / scale))
        draw.text((LABEL_W, top + CELL_H * (len(a) + 1) + 5), f"dark = {scale:.3f}", fill="gray", font=small)
        y += WORD_H + CELL_H * (len(a) + 1) + 4 + GAP

    def write(fh) -> None:  # noqa: ANN001
        img.save(fh, format="PNG")

    return atomic_write(path, write)
