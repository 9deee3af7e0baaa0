"""Shared pytest fixtures and settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("BUTD_NO_PROGRESS", "1")

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``../shared/data`` beside the checkout (real photos and Caffe feature rows); skip if absent."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"shared data not found at {path}")
    return path
