"""Self-describing checkpoints: tensors and plain containers only, written atomically, read with
``torch.load(weights_only=True)`` (no arbitrary unpickling), validated with errors that name the file.

A checkpoint is a dict with ``format``/``version`` plus whatever the writer stores (model name and
config, vocabulary, weights, optimizer/scheduler/scaler states, RNG states, epoch, iteration, data-order
position, metric history). :func:`capture_rng_state` / :func:`restore_rng_state` cover every global
generator (Python, NumPy, torch CPU and each CUDA device) so that a resumed run continues bit-identically.
"""

from __future__ import annotations

import io
import random
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_bytes
from pipeline.core.tensor_bounds import check_archive

FORMAT = "butd-caption-checkpoint"
VERSION = 1


def capture_rng_state() -> dict[str, Any]:
    """The state of every global random generator, as tensors and plain Python values."""
    version, py_state, gauss = random.getstate()
    np_state = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(py_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`capture_rng_state` returned (CUDA states only where devices exist)."""
    py = state["python"]
    random.setstate((int(py["version"]), tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    npst = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            npst["keys"].numpy().astype(np.uint32),
            int(npst["pos"]),
            int(npst["has_gauss"]),
            float(npst["cached_gaussian"]),
        )
    )
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    """Write ``payload`` (plus format/version) atomically; a kill never leaves a partial file."""
    data = {"format": FORMAT, "version": VERSION, **payload}
    buf = io.BytesIO()
    torch.save(data, buf)
    return atomic_write_bytes(path, buf.getvalue())


def load_checkpoint(
    path: str | Path, required: Iterable[str] = (), map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load and validate a checkpoint written by :func:`save_checkpoint`.

    Only tensors and plain containers are admitted (``weights_only=True``); a file that holds anything else,
    is truncated, has another format or lacks a ``required`` key fails with a message naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"checkpoint not found: {path}")
    check_archive(path)  # members that would inflate past the file's size: refused unread (pipeline.core.tensor_bounds)
    try:
        data = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch raises many types for corrupt or unsafe files
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise PipelineError(f"cannot read checkpoint {path}: {reason[:200]}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise PipelineError(f"{path} is not a butd-caption checkpoint")
    if data.get("version") != VERSION:
        raise PipelineError(f"checkpoint {path} has unsupported version {data.get('version')!r} (expected {VERSION})")
    missing = [k for k in required if k not in data]
    if missing:
        raise PipelineError(f"checkpoint {path} lacks {', '.join(missing)}")
    return data
