"""Dropout confined to the leading rows of a batch.

SCST's greedy baseline is decoded in eval mode (no dropout) and its samples in train mode. To run both in one
decoding loop (:func:`models.decoding.sample_with_greedy`: each token step one forward for the samples' rows
followed by the baseline's rows) every dropout of the captioners goes through :func:`dropout`, which, inside
:func:`dropout_rows`, drops only the first ``rows`` rows of its input and passes the others through as eval mode
does. The leading rows draw their noise on exactly the rows they would have on their own and apply it as
``F.dropout`` does on CPU (``x * bernoulli(1 - p) / (1 - p)``), so on CPU their random numbers and values, and
therefore the sampled captions, are those of two separate loops (``tests/test_scst_one_loop.py`` checks it against
``F.dropout``).

Outside :func:`dropout_rows` it is plain ``F.dropout`` / ``nn.Dropout``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


class _Rows(threading.local):
    rows: int | None = None  # rows that take dropout (None: all)
    total: int = 0  # the batch every dropout input must have as its first dimension


_SCOPE = _Rows()


@contextmanager
def dropout_rows(rows: int, total: int) -> Iterator[None]:
    """Within the block, dropout acts on the first ``rows`` of ``total`` rows only (see :func:`set_dropout_rows`)."""
    saved = (_SCOPE.rows, _SCOPE.total)
    set_dropout_rows(rows, total)
    try:
        yield
    finally:
        _SCOPE.rows, _SCOPE.total = saved


def set_dropout_rows(rows: int, total: int) -> None:
    """Change the split inside :func:`dropout_rows` (the decoding loop drops finished rows every step)."""
    _SCOPE.rows, _SCOPE.total = int(rows), int(total)


def rows_limited() -> bool:
    """True inside :func:`dropout_rows` while some rows are exempt (fused kernels with their own dropout must not
    run)."""
    return _SCOPE.rows is not None and _SCOPE.rows < _SCOPE.total


def dropout(x: torch.Tensor, p: float, training: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``, on the first :func:`dropout_rows` rows only while a split is active."""
    rows = _SCOPE.rows
    if rows is None or not training or p == 0 or rows >= _SCOPE.total:
        return F.dropout(x, p, training)
    if x.shape[0] != _SCOPE.total:
        raise RuntimeError(
            f"dropout input of {x.shape[0]} rows inside a {_SCOPE.total}-row split: dim 0 must be the batch"
        )
    if rows == 0:
        return x
    # F.dropout's own CPU computation (x * bernoulli(1 - p) / (1 - p)) with the noise drawn on the leading rows only
    # (the same random numbers as F.dropout(x[:rows])) and 1 on the others: one multiply, forward and backward
    low = x.dtype in (torch.float16, torch.bfloat16)  # under autocast: F.dropout's kernels scale in float32, round once
    noise = torch.ones_like(x, dtype=torch.float32 if low else x.dtype)
    noise[:rows].bernoulli_(1 - p).div_(1 - p)
    return (x.float() * noise).to(x.dtype) if low else x * noise


class Dropout(nn.Dropout):
    """``nn.Dropout`` that honours :func:`dropout_rows` (same parameters, same state dict: none)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training)
