"""Grounding accuracy of generated captions on the synthetic world: is what a caption says true of its image?

n-gram metrics reward the templates' wording; these scores check the claims themselves against the image's
COCO instances (shape = category, colour and size = attribute ids), with the world's own semantics
(:mod:`pipeline.world.geometry`):

* a **noun phrase** ``NUMBER [size] [colour] SHAPE`` ("two red circles", "a triangle") is true iff the image
  holds exactly that many objects with those attributes (the templates' counting semantics);
* a **relation** ``PHRASE_A ... to the left of / to the right of / above / below ... PHRASE_B`` is true iff
  every object of A lies in that direction of every object of B (no overlap along the axis), and both
  phrases denote at least one object;
* a **position** ``... in the top left corner / at the bottom / on the left / in the centre ...`` at the end of
  a caption with one single-object phrase is true iff that object's box centre lies in that third.

:func:`grounding_scores` gives the fraction of true claims of each kind over a set of captions (and how many
claims there were): ``relation_accuracy`` is what geometry-aware attention should improve. ``relation_chance``
is its guessing rate: the share of the four relation words that would have been true between the same two
phrases, averaged over the relation claims (what a captioner that names the same objects but draws the
relation word at random would score).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.core.errors import PipelineError
from pipeline.core.fileio import read_json
from pipeline.world.captions import tokenize
from pipeline.world.geometry import RELATIONS, group_relation_holds, position
from pipeline.world.vocab import PLURALS

NUMBERS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
RELATION_WORDS: dict[tuple[str, ...], str] = {
    ("to", "the", "left", "of"): "left",
    ("to", "the", "right", "of"): "right",
    ("above",): "above",
    ("below",): "below",
}
POSITION_WORDS: dict[tuple[str, ...], tuple[str | None, str | None]] = {
    ("in", "the", "top", "left", "corner"): ("left", "top"),
    ("in", "the", "top", "right", "corner"): ("right", "top"),
    ("in", "the", "bottom", "left", "corner"): ("left", "bottom"),
    ("in", "the", "bottom", "right", "corner"): ("right", "bottom"),
    ("at", "the", "top"): ("centre", "top"),
    ("at", "the", "bottom"): ("centre", "bottom"),
    ("on", "the", "left"): ("left", "middle"),
    ("on", "the", "right"): ("right", "middle"),
    ("in", "the", "centre"): ("centre", "middle"),
}


@dataclass(frozen=True)
class SceneObject:
    """One annotated object: shape, colour, size and its pixel box ``(x1, y1, x2, y2)``."""

    shape: str
    colour: str | None
    size: str | None
    box: tuple[float, float, float, float]


@dataclass(frozen=True)
class Scene:
    width: float
    height: float
    objects: tuple[SceneObject, ...]


@dataclass
class Phrase:
    """A parsed noun phrase: token span, count and the attributes it names."""

    start: int
    end: int
    count: int
    fields: dict[str, str] = field(default_factory=dict)

    def members(self, scene: Scene) -> list[SceneObject]:
        return [o for o in scene.objects if all(getattr(o, k) == v for k, v in self.fields.items())]

    def holds(self, scene: Scene) -> bool:
        return len(self.members(scene)) == self.count


def load_scenes(instances_json: str | Path) -> dict[int, Scene]:
    """Scenes by image id from a world's COCO instances file (``annotations/instances_<split>.json``)."""
    path = Path(instances_json)
    data = read_json(path, "instances file")
    try:
        shapes = {int(c["id"]): str(c["name"]) for c in data["categories"]}
        attrs = {int(a["id"]): (str(a.get("type", "")), str(a["name"])) for a in data["attributes"]}
        images = {int(im["id"]): (float(im["width"]), float(im["height"])) for im in data["images"]}
        objects: dict[int, list[SceneObject]] = {i: [] for i in images}
        for ann in data["annotations"]:
            x, y, w, h = (float(v) for v in ann["bbox"])
            named = [attrs[int(a)] for a in ann.get("attribute_ids", [])]
            colour = next((n for t, n in named if t == "colour"), None)
            size = next((n for t, n in named if t == "size"), None)
            objects[int(ann["image_id"])].append(
                SceneObject(shapes[int(ann["category_id"])], colour, size, (x, y, x + w, y + h))
            )
    except (ValueError, KeyError, TypeError) as exc:
        raise PipelineError(f"{path}: not a synthetic-world instances file ({type(exc).__name__}: {exc})") from exc
    return {i: Scene(w, h, tuple(objects[i])) for i, (w, h) in images.items()}


def _shape_words(shapes: Iterable[str]) -> dict[str, str]:
    """Singular and plural word -> shape name (the world's plurals, ``+s`` for other names)."""
    return {word: s for s in shapes for word in (s, PLURALS.get(s, s + "s"))}


def parse_phrases(tokens: Sequence[str], shapes: Iterable[str], colours: set[str], sizes: set[str]) -> list[Phrase]:
    """Noun phrases ``NUMBER [size] [colour] SHAPE(S)``, left to right."""
    shape_of = _shape_words(shapes)
    out: list[Phrase] = []
    i = 0
    while i < len(tokens):
        if tokens[i] in NUMBERS:
            j, fields = i + 1, {}
            if j < len(tokens) and tokens[j] in sizes:
                fields["size"], j = tokens[j], j + 1
            if j < len(tokens) and tokens[j] in colours:
                fields["colour"], j = tokens[j], j + 1
            shape = shape_of.get(tokens[j]) if j < len(tokens) else None
            if shape is not None:
                fields["shape"] = shape
                out.append(Phrase(i, j + 1, NUMBERS[tokens[i]], fields))
                i = j + 1
                continue
        i += 1
    return out


def _find(tokens: Sequence[str], words: tuple[str, ...], start: int, end: int) -> bool:
    n = len(words)
    return any(tuple(tokens[k : k + n]) == words for k in range(start, max(start, end - n + 1)))


def judge_caption(caption: str, scene: Scene, vocab: Mapping[str, set[str]]) -> dict[str, Any]:
    """The claims of one caption and whether each holds: ``phrases`` (list of bools), ``relation`` and
    ``position`` (None when the caption makes no such claim), and ``relation_chance`` (the share of the four
    relation words that hold between the relation's two phrases; None without a relation claim)."""
    tokens = tokenize(caption)
    phrases = parse_phrases(tokens, vocab["shapes"], vocab["colours"], vocab["sizes"])
    verdict: dict[str, Any] = {
        "phrases": [p.holds(scene) for p in phrases],
        "relation": None,
        "position": None,
        "relation_chance": None,
    }
    for a, b in zip(phrases, phrases[1:]):
        rel = next((r for words, r in RELATION_WORDS.items() if _find(tokens, words, a.end, b.start)), None)
        if rel is not None:
            boxes_a = [o.box for o in a.members(scene)]
            boxes_b = [o.box for o in b.members(scene)]
            verdict["relation"] = group_relation_holds(rel, boxes_a, boxes_b)
            verdict["relation_chance"] = sum(group_relation_holds(r, boxes_a, boxes_b) for r in RELATIONS) / len(
                RELATIONS
            )
            break
    if verdict["relation"] is None and len(phrases) == 1 and phrases[0].count == 1:
        for words, (h, v) in POSITION_WORDS.items():
            if tuple(tokens[-len(words) :]) == words:
                members = phrases[0].members(scene)
                verdict["position"] = len(members) == 1 and position(members[0].box, scene.width, scene.height) == (
                    h,
                    v,
                )
                break
    return verdict


def grounding_scores(predictions: Iterable[Mapping[str, Any]], scenes: Mapping[int, Scene]) -> dict[str, Any]:
    """Fractions of true claims over ``predictions`` (``[{image_id, caption}]``): ``object_accuracy``
    (noun phrases), ``relation_accuracy`` (with its guessing rate ``relation_chance``), ``position_accuracy``, with
    the number of claims of each kind and ``captions_without_claims`` (captions in which no noun phrase could be
    parsed)."""
    vocab: dict[str, set[str]] = {
        "shapes": {o.shape for s in scenes.values() for o in s.objects},
        "colours": set(),
        "sizes": set(),
    }
    for scene in scenes.values():
        vocab["colours"] |= {o.colour for o in scene.objects if o.colour}
        vocab["sizes"] |= {o.size for o in scene.objects if o.size}
    phrases: list[bool] = []
    relations: list[bool] = []
    chances: list[float] = []
    positions: list[bool] = []
    empty = 0
    for pred in predictions:
        image_id = int(pred["image_id"])
        if image_id not in scenes:
            raise PipelineError(f"prediction for image {image_id}, which the instances file does not hold")
        v = judge_caption(str(pred["caption"]), scenes[image_id], vocab)
        phrases += v["phrases"]
        empty += not v["phrases"]
        if v["relation"] is not None:
            relations.append(v["relation"])
            chances.append(v["relation_chance"])
        if v["position"] is not None:
            positions.append(v["position"])

    def frac(xs: list[bool] | list[float]) -> float | None:
        return round(sum(xs) / len(xs), 4) if xs else None

    return {
        "object_accuracy": frac(phrases),
        "phrases": len(phrases),
        "relation_accuracy": frac(relations),
        "relations": len(relations),
        "relation_chance": frac(chances),
        "position_accuracy": frac(positions),
        "positions": len(positions),
        "captions_without_claims": empty,
    }
