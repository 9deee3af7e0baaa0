"""Batches of equal input shape across a folder, written back in input order.

The backbone batches only blobs of the same size (no padding: a batched image gives the numbers it gives alone up to
float rounding, since a convolution over another batch sums in another order; ``tests/test_bucketing.py``,
:mod:`extractors.bottom_up`). Photos of a real folder come in many sizes, so loader batches in file order run at
batch ~1. :class:`ShapeBuckets` regroups the photos as they are decoded into per-shape buckets and hands out a
bucket when it holds ``batch_size`` photos, or, when more than ``window`` photos wait, the bucket holding the
oldest one (memory and write-back delay stay bounded). :class:`InOrder` holds each photo's outcome until every
earlier photo has one, so the store receives images, and ``failures.jsonl`` its lines, in input order whatever
the detection order was.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class ShapeBuckets:
    """Photos (with a ``blob`` and an ``index``) grouped by blob shape; see the module docstring."""

    def __init__(self, batch_size: int, window: int) -> None:
        self.batch_size, self.window = max(1, int(batch_size)), max(1, int(window))
        self.buckets: dict[tuple[int, ...], list[Any]] = {}

    def __len__(self) -> int:
        return sum(len(b) for b in self.buckets.values())

    def add(self, photo: Any) -> list[list[Any]]:
        """Queue ``photo``; returns the batches that are ready (a full bucket, the oldest one over the window)."""
        shape = tuple(photo.blob.shape)
        bucket = self.buckets.setdefault(shape, [])
        bucket.append(photo)
        ready = []
        if len(bucket) >= self.batch_size:
            ready.append(self.buckets.pop(shape))
        while len(self) > self.window:
            oldest = min(self.buckets, key=lambda s: self.buckets[s][0].index)
            ready.append(self.buckets.pop(oldest))
        return ready

    def flush(self) -> list[list[Any]]:
        """Every waiting photo, oldest bucket first."""
        ready = sorted(self.buckets.values(), key=lambda b: b[0].index)
        self.buckets = {}
        return ready


class InOrder:
    """Outcomes keyed by input index, applied in index order (``apply(outcome)`` for each, once)."""

    def __init__(self, indices: list[int], apply: Callable[[Any], int]) -> None:
        self.pending = sorted(indices)  # every index that will get an outcome, in input order
        self.apply, self.outcomes, self.next = apply, {}, 0

    def put(self, index: int, outcome: Any) -> None:
        self.outcomes[index] = outcome

    def release(self) -> int:
        """Apply the outcomes of the longest complete prefix; returns the sum of what ``apply`` returned."""
        total = 0
        while self.next < len(self.pending) and self.pending[self.next] in self.outcomes:
            total += self.apply(self.outcomes.pop(self.pending[self.next]))
            self.next += 1
        return total
