"""The synthetic world's closed vocabulary.

Category ids (COCO ``category_id``) are 1-based in :data:`SHAPES` order; attribute ids follow the Visual
Genome convention (0 = "no attribute"): colours are ``1..len(COLOURS)``, then the sizes.
"""

from __future__ import annotations

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond", "star", "cross", "ring")
PLURALS: dict[str, str] = {s: ("crosses" if s == "cross" else s + "s") for s in SHAPES}

#: colour name -> RGB (well separated in hue/lightness, none close to the grey backgrounds)
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 35, 35),
    "orange": (250, 135, 10),
    "yellow": (240, 220, 25),
    "green": (35, 165, 55),
    "blue": (35, 75, 220),
    "purple": (135, 45, 175),
    "white": (248, 248, 248),
    "black": (18, 18, 18),
}
COLOUR_NAMES: tuple[str, ...] = tuple(COLOURS)

#: size name -> range of the object's longer box side, as a fraction of the image's shorter side
SIZES: dict[str, tuple[float, float]] = {"small": (0.13, 0.19), "large": (0.29, 0.37)}
SIZE_NAMES: tuple[str, ...] = tuple(SIZES)

BACKGROUNDS: tuple[str, ...] = ("noisy", "striped", "cloudy")

NUMBER_WORDS: dict[int, str] = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five", 6: "six"}


def category_id(shape: str) -> int:
    return SHAPES.index(shape) + 1


def colour_attribute_id(colour: str) -> int:
    return COLOUR_NAMES.index(colour) + 1


def size_attribute_id(size: str) -> int:
    return len(COLOUR_NAMES) + SIZE_NAMES.index(size) + 1


def attribute_names() -> list[str]:
    """Attribute names in id order (id = index + 1)."""
    return list(COLOUR_NAMES) + list(SIZE_NAMES)
