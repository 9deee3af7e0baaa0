"""Grounding accuracy on the synthetic world: every reference caption is true, mirrored relations are false,
and hand-made scenes score as the world's semantics say."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from pipeline.core.config import load_config
from pipeline.core.errors import PipelineError
from pipeline.world.generate import generate_world
from pipeline.world.grounding import Scene, SceneObject, grounding_scores, judge_caption, load_scenes

VOCAB = {"shapes": {"circle", "square", "cross"}, "colours": {"red", "blue"}, "sizes": {"small", "large"}}
# a small red circle top-left, a large blue square bottom-right, two crosses in the middle row
SCENE = Scene(
    300.0,
    300.0,
    (
        SceneObject("circle", "red", "small", (10, 10, 50, 50)),
        SceneObject("square", "blue", "large", (200, 200, 290, 290)),
        SceneObject("cross", "red", "small", (60, 120, 90, 150)),
        SceneObject("cross", "blue", "small", (110, 120, 140, 150)),
    ),
)


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gworld")
    generate_world(
        out,
        load_config(
            "world",
            overrides=[
                "world.num_images=80",
                "world.seed=11",
                "world.num_workers=1",
                "world.splits={train: 1.0, val: 0.0, test: 0.0}",
            ],
        ).world,
    )
    return out


def test_every_reference_caption_is_true_and_every_mirrored_relation_false(world: Path) -> None:
    scenes = load_scenes(world / "annotations" / "instances_train.json")
    refs = json.loads((world / "annotations" / "captions_train.json").read_text())["annotations"]
    scores = grounding_scores(refs, scenes)
    assert (
        scores["object_accuracy"] == 1.0 and scores["relation_accuracy"] == 1.0 and scores["position_accuracy"] == 1.0
    )
    assert scores["phrases"] > 300 and scores["relations"] > 30 and scores["positions"] > 5
    swap = {"left": "right", "right": "left", "above": "below", "below": "above"}
    mirrored = [
        {
            "image_id": r["image_id"],
            "caption": re.sub(r"\b(left|right|above|below)\b(?! corner)", lambda m: swap[m.group(1)], r["caption"]),
        }
        for r in refs
        if re.search(r"to the (left|right) of|\babove\b|\bbelow\b", r["caption"])
    ]
    flipped = grounding_scores(mirrored, scenes)
    assert flipped["relations"] == scores["relations"] and flipped["relation_accuracy"] == 0.0


@pytest.mark.parametrize(
    ("caption", "phrases", "relation", "position"),
    [
        ("A small red circle is to the left of a large blue square.", [True, True], True, None),
        ("a small red circle is to the right of a large blue square", [True, True], False, None),
        ("a blue square is below a red circle", [True, True], True, None),
        ("a red cross is to the left of a blue cross", [True, True], True, None),
        ("two crosses are above a square", [True, True], True, None),
        ("two crosses are below a square", [True, True], False, None),
        (
            "three crosses are above a square",
            [False, True],
            True,
            None,
        ),  # the count is wrong, the relation still holds for what exists
        (
            "a green circle is to the left of a square",
            [True],
            None,
            None,
        ),  # 'green' is no colour of this world: no phrase
        (
            "a blue circle is to the left of a square",
            [False, True],
            False,
            None,
        ),  # no blue circle: the relation has no subject
        ("one small red circle in the top left corner", [True], None, True),
        ("a large blue square on the left", [True], None, False),
        ("there is a large orange the", [], None, None),
    ],
)
def test_hand_scene(caption: str, phrases: list[bool], relation: bool | None, position: bool | None) -> None:
    verdict = judge_caption(caption, SCENE, VOCAB)
    chance = verdict.pop("relation_chance")
    assert verdict == {"phrases": phrases, "relation": relation, "position": position}
    assert (chance is None) == (relation is None)


# Hand-made two-object scenes for every relation word: the red circle's box against the blue square's box
# (x1, y1, x2, y2), and which of the four words hold for "circle REL square". Strict separation along the
# axis: touching or overlapping boxes are in no relation along that axis.
SQUARE = (100.0, 100.0, 140.0, 140.0)
PAIRS = [
    ((10, 100, 50, 140), {"left"}),  # same row, circle left of square
    ((200, 100, 240, 140), {"right"}),  # same row, circle right
    ((100, 10, 140, 50), {"above"}),  # same column, circle above
    ((100, 200, 140, 240), {"below"}),  # same column, circle below
    ((10, 10, 50, 50), {"left", "above"}),  # diagonal: both hold
    ((200, 200, 240, 240), {"right", "below"}),
    ((60, 100, 100, 140), set()),  # touching at x = 100: not strictly left
    ((90, 90, 110, 110), set()),  # overlapping: nothing
    ((60, 10, 120, 50), {"above"}),  # overlapping in x, above in y
]
PHRASES = {"left": "to the left of", "right": "to the right of", "above": "above", "below": "below"}


@pytest.mark.parametrize(("circle", "true_words"), PAIRS)
@pytest.mark.parametrize("word", list(PHRASES))
@pytest.mark.parametrize("form", ["{a} {rel} {b}", "{a} is {rel} {b}", "there is {a} {rel} {b}"])
def test_every_relation_word_true_and_false_on_hand_scenes(circle, true_words: set[str], word: str, form: str) -> None:
    scene = Scene(
        300.0, 300.0, (SceneObject("circle", "red", "small", circle), SceneObject("square", "blue", "large", SQUARE))
    )
    mirror = {"left": "right", "right": "left", "above": "below", "below": "above"}
    forward = judge_caption(form.format(a="a red circle", rel=PHRASES[word], b="a blue square"), scene, VOCAB)
    backward = judge_caption(
        form.format(a="a large blue square", rel=PHRASES[mirror[word]], b="one small red circle"), scene, VOCAB
    )
    assert forward["phrases"] == [True, True] and backward["phrases"] == [True, True]
    assert forward["relation"] is (word in true_words)
    assert backward["relation"] is (word in true_words)  # "B mirror(REL) A" says the same as "A REL B"
    assert forward["relation_chance"] == backward["relation_chance"] == len(true_words) / 4
    assert forward["position"] is None


def test_scores_count_claims_and_bad_files_name_themselves(tmp_path: Path) -> None:
    scenes = {1: SCENE}
    preds = [
        {"image_id": 1, "caption": "a small red circle is to the left of a large blue square"},
        {"image_id": 1, "caption": "a small red circle is to the right of a large blue square"},
        {"image_id": 1, "caption": "two blue squares"},
        {"image_id": 1, "caption": "the the the"},
    ]
    s = grounding_scores(preds, scenes)
    assert s == {
        "object_accuracy": 0.8,
        "phrases": 5,
        "relation_accuracy": 0.5,
        "relations": 2,
        "relation_chance": 0.5,
        "position_accuracy": None,
        "positions": 0,
        "captions_without_claims": 1,
    }
    with pytest.raises(PipelineError, match="image 7"):
        grounding_scores([{"image_id": 7, "caption": "a circle"}], scenes)
    bad = tmp_path / "instances.json"
    bad.write_text('{"images": []}')
    with pytest.raises(PipelineError, match=str(bad)):
        load_scenes(bad)
