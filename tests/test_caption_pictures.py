"""Pictures draw the few regions the caption's words depend on (de-duplicated), with a legend; no model needed."""

from __future__ import annotations

import numpy as np

from pipeline.captioning.engine import CaptionResult
from pipeline.captioning.pictures import PALETTE, attended_regions, picture_name, region_labels, render_picture

CLASSES = ["__background__", "circle", "square", "ring"]
ATTRS = ["__no_attribute__", "red", "blue"]


def result(relevance: bool = True) -> CaptionResult:
    boxes = np.array(
        [[10, 10, 60, 60], [12, 12, 58, 62], [14, 8, 62, 58], [120, 40, 180, 100], [70, 120, 100, 150]], np.float32
    )
    regions = {
        "boxes": boxes,
        "class_ids": np.array([1, 1, 2, 2, 3]),
        "class_scores": np.array([0.9, 0.8, 0.7, 0.95, 0.3], np.float32),
        "attr_ids": np.array([1, 1, 1, 2, 2]),
        "attr_scores": np.array([0.9, 0.9, 0.9, 0.9, 0.05], np.float32),
    }
    tokens = ["a", "red", "circle", "left", "of", "a", "blue", "square"]
    rel = np.zeros((len(tokens), len(boxes)), np.float32)
    rel[1, 0], rel[2, 1], rel[2, 0] = 1.0, 0.7, 0.3  # "red" -> 0, "circle" -> 1 (the same object as 0)
    rel[3, 2] = 1.0  # "left" -> 2 (inside / overlapping 0): merged too
    rel[6, 3], rel[7, 3] = 1.0, 1.0  # "blue", "square" -> 3
    rel[0, 4] = rel[4, 4] = rel[5, 4] = 1.0  # function words only -> region 4 is never drawn
    img = np.full((160, 200, 3), 200, np.uint8)
    return CaptionResult(
        "x.jpg",
        "x.jpg",
        caption="a red circle left of a blue square",
        score=-3.0,
        regions=regions,
        tokens=tokens,
        relevance=rel if relevance else None,
        image=img,
    )


def test_attended_regions_merge_one_object_and_skip_function_words() -> None:
    res = result()
    labels = region_labels(res.regions, CLASSES, ATTRS)
    assert labels == ["red circle", "red circle", "red square", "blue square", "ring"]  # attribute below 0.1 dropped
    chosen = attended_regions(res, labels)
    assert [c.index for c in chosen] == [3, 0]  # ranked by total relevance: 2.0 ("blue", "square") before 1.3
    assert chosen[0].words == ["blue", "square"] and sorted(chosen[1].words) == ["circle", "left", "red"]
    assert len(attended_regions(res, labels, max_regions=1)) == 1


def test_without_relevance_the_most_confident_distinct_objects() -> None:
    res = result(relevance=False)
    chosen = attended_regions(res, region_labels(res.regions, CLASSES, ATTRS))
    assert [c.index for c in chosen] == [3, 0, 4] and all(not c.words for c in chosen)


def test_picture_has_one_box_colour_per_region_and_a_legend() -> None:
    res = result()
    pic = np.asarray(render_picture(res, CLASSES, ATTRS, width=400))
    photo_h = round(160 * 400 / 200)
    assert pic.shape[1] == 400 and pic.shape[0] > photo_h + 2 * 26  # caption and a two-row legend under the photo
    colours = {c for c in PALETTE if np.all(pic[:photo_h] == c, axis=-1).any()}
    assert colours == set(PALETTE[:2])


def test_picture_names_are_safe_and_distinct() -> None:
    assert picture_name("dog.jpg") == "dog" and picture_name("photos/dog.jpg").startswith(
        "photos__dog-"
    )  # mangled: hashed
    odd = picture_name("caf\udce9.jpg")
    assert odd.isascii() and odd.startswith("caf") and odd != picture_name("caf\udce8.jpg")
