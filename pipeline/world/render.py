"""Drawing a :class:`~pipeline.world.scene.Scene`: textured grey background, anti-aliased solid shapes."""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from pipeline.world.scene import Scene
from pipeline.world.vocab import COLOURS

SUPERSAMPLE = 3


def _background(rng: np.random.Generator, kind: str, width: int, height: int) -> np.ndarray:
    """A low-saturation grey texture (float32 HxWx3 in 0..255)."""
    level = float(rng.uniform(95, 165))
    tint = rng.uniform(-12, 12, size=3)
    img = np.empty((height, width, 3), np.float32)
    img[:] = level + tint
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    if kind == "striped":
        period = float(rng.uniform(8, 18))
        theta = float(rng.uniform(0, np.pi))
        phase = (xx * np.cos(theta) + yy * np.sin(theta)) * (2 * np.pi / period)
        img += (18.0 * np.sign(np.sin(phase)))[..., None]
    elif kind == "cloudy":
        coarse = rng.normal(0, 1, size=(height // 16 + 2, width // 16 + 2)).astype(np.float32)
        blob = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)
        img += (14.0 * blob)[..., None]
    img += rng.normal(0, 9.0, size=img.shape).astype(np.float32)
    return img


def render_scene(scene: Scene, rng: np.random.Generator) -> Image.Image:
    """Render ``scene`` to an RGB image; ``rng`` drives only texture and colour jitter."""
    w, h = scene.width, scene.height
    img = _background(rng, scene.background, w, h)
    k = SUPERSAMPLE
    for obj in scene.objects:
        mask_img = Image.new("L", (w * k, h * k), 0)
        draw = ImageDraw.Draw(mask_img)
        draw.polygon([(x * k, y * k) for x, y in obj.polygon], fill=255)
        if obj.hole:
            draw.polygon([(x * k, y * k) for x, y in obj.hole], fill=0)
        alpha = np.asarray(mask_img.resize((w, h), Image.Resampling.BOX), dtype=np.float32)[..., None] / 255.0
        colour = np.asarray(COLOURS[obj.colour], np.float32) + rng.uniform(-12, 12, size=3).astype(np.float32)
        shade = colour[None, None, :] + rng.normal(0, 4.0, size=(h, w, 1)).astype(np.float32)
        img = img * (1.0 - alpha) + shade * alpha
    return Image.fromarray(np.clip(img + 0.5, 0, 255).astype(np.uint8), "RGB")
