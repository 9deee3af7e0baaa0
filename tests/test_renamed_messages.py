"""No message or docstring of the detector trainer / sentence-encoder code advises a key the config refuses.

``train:`` of the detector became ``detector_train:`` and ``encoder:`` became ``sentence_encoder:``
(pipeline/core/renamed.py); a one-line error that says "set train.clip_grad_norm" sends the user to a refusal.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pipeline.core.config import load_config

REPO = Path(__file__).resolve().parents[1]


def _strings(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            out.append((node.lineno, node.value))
    return out


@pytest.mark.parametrize(
    "folder,section,old",
    [("extractors/training", "detector_train", "train"), ("pipeline/embedding", "sentence_encoder", "encoder")],
)
def test_no_string_names_a_renamed_section_key(folder: str, section: str, old: str) -> None:
    cfg = load_config("train_detector" if section == "detector_train" else "embed")
    keys = sorted(cfg[section].to_dict())
    pattern = re.compile(rf"(?<![\w.]){old}\.({'|'.join(keys)})\b")
    found = [
        f"{p.relative_to(REPO)}:{line}: {m.group(0)}"
        for p in sorted((REPO / folder).glob("*.py"))
        for line, text in _strings(p)
        for m in pattern.finditer(text)
    ]
    assert found == [], f"refused {old}.* keys named (use {section}.*): {found}"
