"""Human-readable class and attribute names for a detector (for labels in pictures and captions output).

The Visual Genome vocabularies (1600 objects, 400 attributes; ``extractors/vocab/``, identical to the files
of the bottom-up-attention release) name the classes of the public checkpoints: 0-based vocabulary ids as
in :class:`extractors.bottom_up.RegionRecord`. Detectors trained here (``butd`` layout) carry their own
names in the weights file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

VOCAB_DIR = Path(__file__).resolve().parent / "vocab"


def _read_names(path: Path) -> list[str]:
    # synonyms are comma-separated on one line: the first is the display name
    return [line.split(",")[0].strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def detector_names(info: dict[str, Any], num_classes: int, num_attributes: int) -> tuple[list[str], list[str]]:
    """(class names, attribute names) for a detector loaded with ``info`` (from ``load_detector``)."""
    classes = list(info.get("classes") or [])
    attributes = list(info.get("attributes") or [])
    if not classes:
        vg = _read_names(VOCAB_DIR / "vg_objects.txt")
        classes = vg if len(vg) == num_classes else [f"class{i}" for i in range(num_classes)]
    if not attributes:
        vg = _read_names(VOCAB_DIR / "vg_attributes.txt")
        attributes = vg if len(vg) == num_attributes else [f"attr{i}" for i in range(num_attributes)]
    return [str(c) for c in classes], [str(a) for a in attributes]
