"""Five captions per scene from varied templates: classes, attributes, counts, spatial relations, positions.

Semantics (the tests re-check every caption against the boxes with an independent parser):

* A noun phrase ``COUNT [SIZE] [COLOUR] SHAPE`` says that exactly COUNT objects match the given fields.
* An enumeration (``there are two red circles and a blue square``) lists noun phrases that partition all
  objects of the image.
* ``N shapes`` / ``N objects`` says the image holds N objects in all.
* ``NP1 [is|are] REL NP2`` says that the relation (see :mod:`pipeline.world.geometry`) holds between every
  object of NP1 and every object of NP2.
* ``NP POSITION`` (count one) says which third of the image holds the object's centre.
* ``on a B background`` names the background texture.

Two caption styles (``world.captions``): ``mixed`` (the default: enumerations, counts, positions and at least two
relations between any disjoint phrases) and ``relations`` (every caption states one relation between two
objects that each have a name of their own, in either order; the comparison world of
``configs/demo_relations.yaml``, where the relation is the only thing a caption can get wrong about geometry).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pipeline.world.geometry import RELATION_PHRASES, RELATIONS, group_relation_holds, position
from pipeline.world.scene import Scene, WorldObject
from pipeline.world.vocab import NUMBER_WORDS, PLURALS

POSITION_PHRASES: dict[tuple[str, str], str] = {
    ("left", "top"): "in the top left corner",
    ("right", "top"): "in the top right corner",
    ("left", "bottom"): "in the bottom left corner",
    ("right", "bottom"): "in the bottom right corner",
    ("centre", "top"): "at the top",
    ("centre", "bottom"): "at the bottom",
    ("left", "middle"): "on the left",
    ("right", "middle"): "on the right",
    ("centre", "middle"): "in the centre",
}

CAPTIONS_PER_IMAGE = 5
CAPTION_STYLES = ("mixed", "relations")


@dataclass(frozen=True)
class Descriptor:
    """Which objects a noun phrase refers to: ``None`` fields are unconstrained."""

    size: str | None
    colour: str | None
    shape: str

    def matches(self, obj: WorldObject) -> bool:
        return (
            obj.shape == self.shape
            and (self.size is None or obj.size == self.size)
            and (self.colour is None or obj.colour == self.colour)
        )


def _members(desc: Descriptor, objects: Sequence[WorldObject]) -> list[int]:
    return [i for i, o in enumerate(objects) if desc.matches(o)]


def noun_phrase(desc: Descriptor, count: int, rng: np.random.Generator) -> str:
    words = [w for w in (desc.size, desc.colour) if w]
    head = desc.shape if count == 1 else PLURALS[desc.shape]
    body = " ".join([*words, head])
    if count == 1:
        if rng.random() < 0.2:
            return f"one {body}"
        return ("an " if body[0] in "aeiou" else "a ") + body
    return f"{NUMBER_WORDS[count]} {body}"


def _join(parts: Sequence[str]) -> str:
    if len(parts) == 1:
        return parts[0]
    return ", ".join(parts[:-1]) + " and " + parts[-1]


def _partition(objects: Sequence[WorldObject], rng: np.random.Generator) -> list[Descriptor]:
    """Descriptors whose matched sets partition ``objects`` (shape-only, colour+shape, or split by size)."""
    descs: list[Descriptor] = []
    for shape in sorted({o.shape for o in objects}):
        of_shape = [o for o in objects if o.shape == shape]
        if len({o.colour for o in of_shape}) > 1 and rng.random() < 0.15:
            descs.append(Descriptor(None, None, shape))
            continue
        for colour in sorted({o.colour for o in of_shape}):
            group = [o for o in of_shape if o.colour == colour]
            sizes = sorted({o.size for o in group})
            if len(sizes) == 1:
                descs.append(Descriptor(sizes[0] if rng.random() < 0.5 else None, colour, shape))
            elif rng.random() < 0.5:
                descs.append(Descriptor(None, colour, shape))
            else:
                descs.extend(Descriptor(s, colour, shape) for s in sizes)
    order = rng.permutation(len(descs))
    return [descs[i] for i in order]


def _candidate_descriptors(objects: Sequence[WorldObject]) -> list[Descriptor]:
    out: set[Descriptor] = set()
    for o in objects:
        out.add(Descriptor(None, o.colour, o.shape))
        out.add(Descriptor(o.size, o.colour, o.shape))
        out.add(Descriptor(None, None, o.shape))
    return sorted(out, key=lambda d: (d.shape, d.colour or "", d.size or ""))


def _enumeration(scene: Scene, rng: np.random.Generator) -> str:
    descs = _partition(scene.objects, rng)
    nps = [noun_phrase(d, len(_members(d, scene.objects)), rng) for d in descs]
    listing = _join(nps)
    first_count = len(_members(descs[0], scene.objects))
    prefixes = [
        "",
        "there is " if first_count == 1 else "there are ",
        "an image of ",
        "a picture showing ",
        "a photo with ",
    ]
    text = prefixes[int(rng.integers(len(prefixes)))] + listing
    if rng.random() < 0.3:
        text += f" on a {scene.background} background"
    return text


def _count(scene: Scene, rng: np.random.Generator) -> str:
    total = len(scene.objects)
    noun = ("shape" if total == 1 else "shapes") if rng.random() < 0.5 else ("object" if total == 1 else "objects")
    head = f"{NUMBER_WORDS[total]} {noun}"
    if rng.random() < 0.35:
        return f"{head} on a {scene.background} background"
    nps = [noun_phrase(d, len(_members(d, scene.objects)), rng) for d in _partition(scene.objects, rng)]
    return f"{head}: {_join(nps)}"


def _relations(scene: Scene) -> list[tuple[Descriptor, str, Descriptor]]:
    objs = scene.objects
    cands = _candidate_descriptors(objs)
    out = []
    for d1 in cands:
        m1 = _members(d1, objs)
        for d2 in cands:
            m2 = _members(d2, objs)
            if set(m1) & set(m2):
                continue
            for rel in RELATIONS:
                if group_relation_holds(rel, [objs[i].box for i in m1], [objs[i].box for i in m2]):
                    out.append((d1, rel, d2))
    return out


def _relation_caption(scene: Scene, triple: tuple[Descriptor, str, Descriptor], rng: np.random.Generator) -> str:
    d1, rel, d2 = triple
    n1 = len(_members(d1, scene.objects))
    n2 = len(_members(d2, scene.objects))
    np1, np2 = noun_phrase(d1, n1, rng), noun_phrase(d2, n2, rng)
    verb = "is" if n1 == 1 else "are"
    form = int(rng.integers(3))
    if form == 0:
        return f"{np1} {RELATION_PHRASES[rel]} {np2}"
    if form == 1:
        return f"{np1} {verb} {RELATION_PHRASES[rel]} {np2}"
    return f"there {verb} {np1} {RELATION_PHRASES[rel]} {np2}"


def _position_caption(scene: Scene, rng: np.random.Generator) -> str | None:
    singles = [d for d in _candidate_descriptors(scene.objects) if len(_members(d, scene.objects)) == 1]
    if not singles:
        return None
    d = singles[int(rng.integers(len(singles)))]
    obj = scene.objects[_members(d, scene.objects)[0]]
    phrase = POSITION_PHRASES[position(obj.box, scene.width, scene.height)]
    prefix = "there is " if rng.random() < 0.3 else ""
    return f"{prefix}{noun_phrase(d, 1, rng)} {phrase}"


def tokenize(raw: str) -> list[str]:
    """Lower-case words without punctuation (the Karpathy ``tokens`` convention)."""
    return re.findall(r"[a-z]+", raw.lower())


def finish(text: str) -> str:
    """Capitalise and end with a period (the ``raw`` form)."""
    return text[0].upper() + text[1:] + "."


def _own_name(i: int, objects: Sequence[WorldObject]) -> Descriptor | None:
    """The shortest descriptor (colour + shape, else size + colour + shape) that names object ``i`` alone."""
    o = objects[i]
    for desc in (Descriptor(None, o.colour, o.shape), Descriptor(o.size, o.colour, o.shape)):
        if _members(desc, objects) == [i]:
            return desc
    return None


def pair_relations(scene: Scene) -> list[tuple[Descriptor, str, Descriptor]]:
    """Every true ``(A, REL, B)`` between two objects that each have a name of their own (both orders)."""
    objs = scene.objects
    names = [_own_name(i, objs) for i in range(len(objs))]
    out = []
    for i, a in enumerate(names):
        for j, b in enumerate(names):
            if i == j or a is None or b is None:
                continue
            out += [(a, rel, b) for rel in RELATIONS if group_relation_holds(rel, [objs[i].box], [objs[j].box])]
    return out


def make_relation_captions(scene: Scene, rng: np.random.Generator, n: int = CAPTIONS_PER_IMAGE) -> list[str]:
    """``relations`` style: ``n`` captions, each one true relation between two singly named objects (each
    drawn uniformly from :func:`pair_relations`); a scene without such a pair gets the ``mixed`` captions."""
    relations = pair_relations(scene)
    if not relations:
        return make_captions(scene, rng, n)
    captions: list[str] = []
    for attempt in range(8 * n):
        raw = finish(_relation_caption(scene, relations[int(rng.integers(len(relations)))], rng))
        if raw not in captions or attempt >= 4 * n:
            captions.append(raw)
        if len(captions) == n:
            break
    return captions


def make_captions(scene: Scene, rng: np.random.Generator, n: int = CAPTIONS_PER_IMAGE) -> list[str]:
    """``mixed`` style: ``n`` distinct raw captions (when the scene allows that many), at least two spatial ones
    if possible."""
    relations = _relations(scene)
    plan: list[str] = []
    if relations:
        plan += ["relation", "relation"]
    plan += ["enumeration", "count", "position" if not relations or rng.random() < 0.5 else "relation", "enumeration"]
    captions: list[str] = []
    attempts = 0
    kind_index = 0
    while len(captions) < n and attempts < 40:
        kind = plan[kind_index % len(plan)] if attempts < 20 else ("enumeration", "count", "position")[attempts % 3]
        kind_index += 1
        attempts += 1
        text: str | None
        if kind == "relation" and relations:
            text = _relation_caption(scene, relations[int(rng.integers(len(relations)))], rng)
        elif kind == "position":
            text = _position_caption(scene, rng)
        elif kind == "count":
            text = _count(scene, rng)
        else:
            text = _enumeration(scene, rng)
        if text is None:
            continue
        raw = finish(text)
        if raw not in captions:
            captions.append(raw)
    while len(captions) < n:  # a tiny scene may not allow n distinct sentences
        captions.append(finish(_enumeration(scene, rng)))
    return captions
