"""Karpathy prep: empty captions are reported (count and first few); non-string tokens dropped with a message."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from pipeline.caption_data.prepare import read_coco_captions, read_karpathy


def _image(i: int, sentences: list, split: str = "train") -> dict:
    return {"cocoid": i, "filename": f"{i}.jpg", "filepath": "x", "split": split, "sentences": sentences}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture()
def warnings():
    handler = _Lines()
    logging.getLogger("butd").addHandler(handler)
    yield handler.lines
    logging.getLogger("butd").removeHandler(handler)


def test_empty_captions_and_non_string_tokens(tmp_path: Path, warnings) -> None:
    data = {
        "images": [
            _image(1, [{"tokens": ["a", "dog", 5, None, ["x"]], "raw": "A dog."}, {"tokens": [], "raw": ""}]),
            _image(2, [{"tokens": [".", ","], "raw": ". ,"}, {"tokens": ["two", "cats"], "raw": "two cats"}]),
            _image(
                3,
                [
                    {"tokens": ["ok"], "raw": "ok"},
                    {"tokens": [], "raw": ""},
                    {"tokens": [], "raw": ""},
                    {"tokens": [], "raw": ""},
                ],
            ),
        ]
    }
    path = tmp_path / "k.json"
    path.write_text(json.dumps(data))
    entries = read_karpathy(path, "cocoid", True)
    assert entries[0].captions[0] == ["a", "dog"]  # 5, null and ["x"] dropped, not turned into "5", "none"
    dropped = [line for line in warnings if "non-string tokens" in line]
    assert len(dropped) == 1 and "dropped 3 non-string tokens" in dropped[0]
    assert "images[0].sentences[0].tokens[2] = 5" in dropped[0] and "tokens[3] = null" in dropped[0]
    empty = [line for line in warnings if "captions are empty" in line]
    assert len(empty) == 1 and "5 captions are empty" in empty[0] and str(path) in empty[0]
    assert "images[0].sentences[1], images[1].sentences[0], images[2].sentences[1]" in empty[0]
    assert "images[2].sentences[2]" not in empty[0]  # only the first few


def test_clean_file_warns_nothing(tmp_path: Path, warnings) -> None:
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"images": [_image(1, [{"tokens": ["a", "dog"], "raw": "a dog"}])]}))
    read_karpathy(path, "cocoid", True)
    assert warnings == []


def test_coco_captions_empty_caption_warned(tmp_path: Path, warnings) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "images": [{"id": 1, "file_name": "1.jpg"}],
                "annotations": [{"image_id": 1, "caption": "a dog"}, {"image_id": 1, "caption": " . "}],
            }
        )
    )
    read_coco_captions({"train": str(path)}, None, "cocoid")
    assert any("1 captions are empty" in line and "annotations[1]" in line for line in warnings)
