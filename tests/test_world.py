"""The synthetic world: determinism, caption/annotation consistency (independent parser), formats."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from pipeline.core.config import load_config
from pipeline.world.generate import generate_world

NUM = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6}
SHAPE_WORDS = {
    "circle": "circle",
    "circles": "circle",
    "square": "square",
    "squares": "square",
    "triangle": "triangle",
    "triangles": "triangle",
    "diamond": "diamond",
    "diamonds": "diamond",
    "star": "star",
    "stars": "star",
    "cross": "cross",
    "crosses": "cross",
    "ring": "ring",
    "rings": "ring",
}
COLOURS = {"red", "orange", "yellow", "green", "blue", "purple", "white", "black"}
SIZES = {"small", "large"}
RELS = {
    ("to", "the", "left", "of"): "left",
    ("to", "the", "right", "of"): "right",
    ("above",): "above",
    ("below",): "below",
}
POS = {
    "in the top left corner": ("left", "top"),
    "in the top right corner": ("right", "top"),
    "in the bottom left corner": ("left", "bottom"),
    "in the bottom right corner": ("right", "bottom"),
    "at the top": ("centre", "top"),
    "at the bottom": ("centre", "bottom"),
    "on the left": ("left", "middle"),
    "on the right": ("right", "middle"),
    "in the centre": ("centre", "middle"),
}


def world_cfg(n: int, seed: int = 0, **kw):
    sets = [f"world.num_images={n}", f"world.seed={seed}"] + [f"world.{k}={v}" for k, v in kw.items()]
    return load_config("world", overrides=sets).world


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("world")
    generate_world(out, world_cfg(120, seed=3))
    return out


def parse_nps(tokens: list[str]) -> list[tuple[int, int, int, dict]]:
    """Noun phrases as (start, end, count, fields) found left to right."""
    out = []
    i = 0
    while i < len(tokens):
        if tokens[i] in NUM:
            j = i + 1
            fields: dict = {}
            if j < len(tokens) and tokens[j] in SIZES:
                fields["size"] = tokens[j]
                j += 1
            if j < len(tokens) and tokens[j] in COLOURS:
                fields["colour"] = tokens[j]
                j += 1
            if j < len(tokens) and tokens[j] in SHAPE_WORDS:
                fields["shape"] = SHAPE_WORDS[tokens[j]]
                out.append((i, j + 1, NUM[tokens[i]], fields))
                i = j + 1
                continue
        i += 1
    return out


def members(objs: list[dict], fields: dict) -> list[int]:
    return [k for k, o in enumerate(objs) if all(o[f] == v for f, v in fields.items())]


def check_caption(raw: str, tokens: list[str], img: dict) -> str:
    """Return the caption's kind after asserting every claim it makes against the annotations."""
    objs = img["objects"]
    text = " ".join(tokens)
    assert tokens == re.findall(r"[a-z]+", raw.lower())
    nps = parse_nps(tokens)
    total = re.match(r"(\w+) (shapes?|objects?)\b", text)
    assert nps or total, f"no noun phrase in {raw!r}"
    for _s, _e, count, fields in nps:
        assert len(members(objs, fields)) == count, f"{raw!r}: count of {fields} is {len(members(objs, fields))}"
    m = re.search(r"on a (\w+) background", text)
    if m:
        assert m.group(1) == img["background"], raw
    for rel_tokens, rel in RELS.items():
        n = len(rel_tokens)
        for k in range(len(tokens) - n + 1):
            if tuple(tokens[k : k + n]) == rel_tokens:
                left = [p for p in nps if p[1] <= k][-1]
                right = [p for p in nps if p[0] >= k + n][0]
                a = [objs[i]["box"] for i in members(objs, left[3])]
                b = [objs[i]["box"] for i in members(objs, right[3])]
                for x in a:
                    for y in b:
                        ok = {"left": x[2] < y[0], "right": y[2] < x[0], "above": x[3] < y[1], "below": y[3] < x[1]}[
                            rel
                        ]
                        assert ok, f"{raw!r}: {rel} fails for {x} vs {y}"
                return "relation"
    for phrase, (h, v) in POS.items():
        if text.endswith(phrase):
            ((_, _, count, fields),) = nps
            assert count == 1
            (k,) = members(objs, fields)
            x1, y1, x2, y2 = objs[k]["box"]
            cx, cy = (x1 + x2) / 2 / img["width"], (y1 + y2) / 2 / img["height"]
            assert h == ("left" if cx < 1 / 3 else "right" if cx > 2 / 3 else "centre"), raw
            assert v == ("top" if cy < 1 / 3 else "bottom" if cy > 2 / 3 else "middle"), raw
            return "position"
    if total:
        assert NUM[total.group(1)] == len(objs), raw
    # enumeration (also after "N shapes:"): the phrases partition all objects
    covered = [i for _s, _e, _c, f in nps for i in members(objs, f)]
    if nps:
        assert sorted(covered) == list(range(len(objs))), f"{raw!r} does not partition the objects"
    return "count" if total else "enumeration"


def test_same_seed_gives_identical_bytes(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    generate_world(a, world_cfg(40, seed=7, num_workers=1))
    generate_world(b, world_cfg(40, seed=7, num_workers=2))
    generate_world(c, world_cfg(40, seed=8, num_workers=1))

    def digest(root: Path) -> dict[str, str]:
        return {
            str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*"))
            if p.is_file()
        }

    assert digest(a) == digest(b)
    assert len(digest(a)) == 40 + 7 + 1
    da, dc = digest(a), digest(c)
    assert sum(da[k] != dc[k] for k in da) >= 40


def test_every_caption_matches_the_annotations(world: Path) -> None:
    karpathy = json.loads((world / "annotations" / "dataset_coco.json").read_text())
    records = {}
    for split in ("train", "val", "test"):
        inst = json.loads((world / "annotations" / f"instances_{split}.json").read_text())
        cats = {c["id"]: c["name"] for c in inst["categories"]}
        attrs = {a["id"]: a["name"] for a in inst["attributes"]}
        for im in inst["images"]:
            records[im["id"]] = {
                "width": im["width"],
                "height": im["height"],
                "background": im["background"],
                "objects": [],
            }
        for ann in inst["annotations"]:
            x, y, w, h = ann["bbox"]
            names = [attrs[i] for i in ann["attribute_ids"]]
            records[ann["image_id"]]["objects"].append(
                {
                    "shape": cats[ann["category_id"]],
                    "colour": next(n for n in names if n in COLOURS),
                    "size": next(n for n in names if n in SIZES),
                    "box": [x, y, x + w, y + h],
                }
            )
    world_meta = json.loads((world / "world.json").read_text())
    assert world_meta["summary"]["images"] == 120
    kinds: dict[str, int] = {}
    n_obj = []
    for im in karpathy["images"]:
        rec = records[im["cocoid"]]
        assert len(im["sentences"]) == 5
        n_obj.append(len(rec["objects"]))
        for s in im["sentences"]:
            kind = check_caption(s["raw"], s["tokens"], rec)
            kinds[kind] = kinds.get(kind, 0) + 1
    assert min(n_obj) >= 1 and max(n_obj) <= 6 and len(set(n_obj)) >= 4
    # every kind of template is used, and spatial relations are frequent
    assert set(kinds) == {"relation", "position", "count", "enumeration"}
    assert kinds["relation"] >= 0.25 * sum(kinds.values())


def test_boxes_inside_images_and_overlap_limited(world: Path) -> None:
    for split in ("train", "val", "test"):
        inst = json.loads((world / "annotations" / f"instances_{split}.json").read_text())
        sizes = {im["id"]: (im["width"], im["height"]) for im in inst["images"]}
        by_image: dict[int, list] = {}
        for ann in inst["annotations"]:
            x, y, w, h = ann["bbox"]
            W, H = sizes[ann["image_id"]]
            assert 0 <= x and 0 <= y and x + w <= W and y + h <= H and w > 4 and h > 4
            assert 0 < ann["area"] <= w * h + 1e-6
            by_image.setdefault(ann["image_id"], []).append((x, y, x + w, y + h))
        for boxes in by_image.values():
            for i in range(len(boxes)):
                for j in range(i + 1, len(boxes)):
                    a, b = boxes[i], boxes[j]
                    inter = max(0, min(a[2], b[2]) - max(a[0], b[0])) * max(0, min(a[3], b[3]) - max(a[1], b[1]))
                    small = min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]))
                    assert inter <= 0.1 * small + 0.05


def test_images_show_the_annotated_colours(world: Path) -> None:
    """The pixel at each object's centroid has the object's colour (not the grey background)."""
    from pipeline.world.vocab import COLOURS as RGB

    inst = json.loads((world / "annotations" / "instances_train.json").read_text())
    attrs = {a["id"]: a["name"] for a in inst["attributes"]}
    files = {im["id"]: im["file_name"] for im in inst["images"]}
    checked = 0
    for ann in inst["annotations"][:80]:
        if ann["category_id"] in (6, 7):  # cross/ring centres can be background; star centre is solid
            continue
        img = np.asarray(Image.open(world / "images" / files[ann["image_id"]]).convert("RGB"), dtype=np.float32)
        poly = np.asarray(ann["segmentation"][0]).reshape(-1, 2)
        cx, cy = poly.mean(0)
        patch = img[int(cy) - 1 : int(cy) + 2, int(cx) - 1 : int(cx) + 2].reshape(-1, 3).mean(0)
        colour = next(attrs[i] for i in ann["attribute_ids"] if attrs[i] in RGB)
        dists = {n: np.linalg.norm(patch - np.asarray(c)) for n, c in RGB.items()}
        assert min(dists, key=dists.get) == colour, (files[ann["image_id"]], colour, patch)
        checked += 1
    assert checked >= 30


def test_files_load_with_pycocotools(world: Path) -> None:
    from pycocotools.coco import COCO

    for split in ("train", "val", "test"):
        caps = COCO(str(world / "annotations" / f"captions_{split}.json"))
        inst = COCO(str(world / "annotations" / f"instances_{split}.json"))
        assert len(caps.getImgIds()) == len(inst.getImgIds()) > 0
        assert len(caps.getAnnIds()) == 5 * len(caps.getImgIds())
        assert len(inst.getCatIds()) == 7
        img = inst.loadImgs(inst.getImgIds()[0])[0]
        mask = inst.annToMask(inst.loadAnns(inst.getAnnIds(imgIds=img["id"]))[0])
        assert mask.shape == (img["height"], img["width"]) and mask.sum() > 0
    karpathy = json.loads((world / "annotations" / "dataset_coco.json").read_text())
    splits = [im["split"] for im in karpathy["images"]]
    assert splits.count("train") == 96 and splits.count("val") == 12 and splits.count("test") == 12


def test_resume_skips_existing_images(tmp_path: Path) -> None:
    cfg = world_cfg(30, seed=1, num_workers=1)
    generate_world(tmp_path, cfg)
    victim = tmp_path / "images" / "world_000007.jpg"
    before = victim.read_bytes()
    mtime = (tmp_path / "images" / "world_000001.jpg").stat().st_mtime_ns
    victim.unlink()
    generate_world(tmp_path, cfg)
    assert victim.read_bytes() == before
    assert (tmp_path / "images" / "world_000001.jpg").stat().st_mtime_ns == mtime
