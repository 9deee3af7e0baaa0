"""Spatial semantics of the captions, computed from pixel boxes ``(x1, y1, x2, y2)``.

* ``A left of B``  iff  ``A.x2 < B.x1`` (no horizontal overlap); ``right of`` is the mirror.
* ``A above B``    iff  ``A.y2 < B.y1`` (no vertical overlap); ``below`` is the mirror.
* A group relation (``two red circles to the left of a blue square``) holds iff it holds for every pair.
* The absolute position of an object is the third of the image its box centre falls in, horizontally
  (left / centre / right) and vertically (top / middle / bottom).
"""

from __future__ import annotations

from collections.abc import Sequence

Box = Sequence[float]

RELATIONS: tuple[str, ...] = ("left", "right", "above", "below")
RELATION_PHRASES: dict[str, str] = {
    "left": "to the left of",
    "right": "to the right of",
    "above": "above",
    "below": "below",
}


def relation_holds(rel: str, a: Box, b: Box) -> bool:
    """True if box ``a`` is ``rel`` of box ``b``."""
    if rel == "left":
        return a[2] < b[0]
    if rel == "right":
        return b[2] < a[0]
    if rel == "above":
        return a[3] < b[1]
    if rel == "below":
        return b[3] < a[1]
    raise ValueError(f"unknown relation {rel!r}")


def group_relation_holds(rel: str, group_a: Sequence[Box], group_b: Sequence[Box]) -> bool:
    return bool(group_a) and bool(group_b) and all(relation_holds(rel, a, b) for a in group_a for b in group_b)


def position(box: Box, width: float, height: float) -> tuple[str, str]:
    """(horizontal, vertical) third of the image holding the box centre."""
    cx = (box[0] + box[2]) / 2.0 / width
    cy = (box[1] + box[3]) / 2.0 / height
    h = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else "centre"
    v = "top" if cy < 1 / 3 else "bottom" if cy > 2 / 3 else "middle"
    return h, v


def intersection_area(a: Box, b: Box) -> float:
    w = min(a[2], b[2]) - max(a[0], b[0])
    h = min(a[3], b[3]) - max(a[1], b[1])
    return max(0.0, w) * max(0.0, h)


def box_area(a: Box) -> float:
    return max(0.0, a[2] - a[0]) * max(0.0, a[3] - a[1])
