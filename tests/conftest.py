"""Shared pytest fixtures and settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("BUTD_NO_PROGRESS", "1")

REPO = Path(__file__).resolve().parent.parent
#: the fixtures folder: ``../shared`` beside the checkout, else ``./shared`` inside it (a copy carried to another
#: machine, e.g. by ``.ci/gpu``); ``BUTD_SHARED`` names another one
SHARED_CANDIDATES = [Path(p) for p in (os.environ.get("BUTD_SHARED"),) if p] + [REPO.parent / "shared", REPO / "shared"]
SHARED = next((p for p in SHARED_CANDIDATES if (p / "data").is_dir()), SHARED_CANDIDATES[0])


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``shared/data`` (real photos and Caffe feature rows) beside or inside the checkout; skip if absent."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"shared data not found at {' or '.join(str(p / 'data') for p in SHARED_CANDIDATES)}")
    return path


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
