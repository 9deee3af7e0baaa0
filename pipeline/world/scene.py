"""Sampling scenes: 1-6 objects (shape, colour, size) at random positions with limited overlap."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from pipeline.world.geometry import box_area, intersection_area
from pipeline.world.vocab import BACKGROUNDS, COLOUR_NAMES, SHAPES, SIZES


@dataclass(frozen=True)
class WorldObject:
    """One object: class, attributes, tight pixel box and outline polygon (for drawing and segmentation)."""

    shape: str
    colour: str
    size: str
    box: tuple[float, float, float, float]
    polygon: tuple[tuple[float, float], ...]
    hole: tuple[tuple[float, float], ...] = ()  # inner outline of a ring (drawn in background colour)


@dataclass(frozen=True)
class Scene:
    width: int
    height: int
    background: str
    objects: tuple[WorldObject, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class SceneParams:
    """Scene sampling parameters (the ``world`` config section holds them)."""

    min_size: int = 160
    max_size: int = 224
    min_objects: int = 1
    max_objects: int = 6
    max_large: int = 3
    large_prob: float = 0.4
    max_overlap: float = 0.1
    rotation_jitter_deg: float = 8.0
    placement_tries: int = 60


def _circle(r: float, n: int = 48) -> list[tuple[float, float]]:
    return [(r * math.cos(2 * math.pi * k / n), r * math.sin(2 * math.pi * k / n)) for k in range(n)]


def shape_outline(shape: str, r: float) -> tuple[list[tuple[float, float]], list[tuple[float, float]]]:
    """Outline (and hole, for rings) of ``shape`` centred at the origin with circumradius ~``r``."""
    if shape == "circle":
        return _circle(r), []
    if shape == "ring":
        return _circle(r), _circle(0.55 * r)
    if shape == "square":
        a = 0.82 * r
        return [(-a, -a), (a, -a), (a, a), (-a, a)], []
    if shape == "triangle":
        return [(r * math.cos(math.radians(a)), r * math.sin(math.radians(a))) for a in (-90, 30, 150)], []
    if shape == "diamond":
        return [(0.0, -r), (0.68 * r, 0.0), (0.0, r), (-0.68 * r, 0.0)], []
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.45 * r
            ang = math.radians(-90 + 36 * k)
            pts.append((rad * math.cos(ang), rad * math.sin(ang)))
        return pts, []
    if shape == "cross":
        a, w = r * 0.92, r * 0.32
        return [
            (-w, -a),
            (w, -a),
            (w, -w),
            (a, -w),
            (a, w),
            (w, w),
            (w, a),
            (-w, a),
            (-w, w),
            (-a, w),
            (-a, -w),
            (-w, -w),
        ], []
    raise ValueError(f"unknown shape {shape!r}")


def _transform(
    points: list[tuple[float, float]], angle: float, cx: float, cy: float
) -> tuple[tuple[float, float], ...]:
    c, s = math.cos(angle), math.sin(angle)
    return tuple((cx + x * c - y * s, cy + x * s + y * c) for x, y in points)


def sample_scene(rng: np.random.Generator, params: SceneParams) -> Scene:
    """Draw one scene; objects that cannot be placed without too much overlap are dropped (>= 1 kept)."""
    width = int(rng.integers(params.min_size, params.max_size + 1))
    height = int(rng.integers(params.min_size, params.max_size + 1))
    background = BACKGROUNDS[int(rng.integers(len(BACKGROUNDS)))]
    n = int(rng.integers(params.min_objects, params.max_objects + 1))
    short = min(width, height)
    objects: list[WorldObject] = []
    n_large = 0
    for _ in range(n):
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        colour = COLOUR_NAMES[int(rng.integers(len(COLOUR_NAMES)))]
        size = "large" if (rng.random() < params.large_prob and n_large < params.max_large) else "small"
        lo, hi = SIZES[size]
        side = float(rng.uniform(lo, hi)) * short
        angle = math.radians(float(rng.uniform(-params.rotation_jitter_deg, params.rotation_jitter_deg)))
        outline, hole = shape_outline(shape, side / 2.0)
        base = _transform(outline, angle, 0.0, 0.0)
        xs = [p[0] for p in base]
        ys = [p[1] for p in base]
        placed = None
        for _try in range(params.placement_tries):
            cx = float(rng.uniform(1 - min(xs), width - 1 - max(xs)))
            cy = float(rng.uniform(1 - min(ys), height - 1 - max(ys)))
            box = (cx + min(xs), cy + min(ys), cx + max(xs), cy + max(ys))
            if all(
                intersection_area(box, o.box) <= params.max_overlap * min(box_area(box), box_area(o.box))
                for o in objects
            ):
                placed = (cx, cy, box)
                break
        if placed is None:
            continue
        cx, cy, box = placed
        objects.append(
            WorldObject(
                shape=shape,
                colour=colour,
                size=size,
                box=tuple(round(v, 2) for v in box),  # type: ignore[arg-type]
                polygon=tuple((round(x, 2), round(y, 2)) for x, y in _transform(outline, angle, cx, cy)),
                hole=tuple((round(x, 2), round(y, 2)) for x, y in _transform(hole, angle, cx, cy)) if hole else (),
            )
        )
        n_large += size == "large"
    return Scene(width=width, height=height, background=background, objects=tuple(objects))
