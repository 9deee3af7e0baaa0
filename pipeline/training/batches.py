"""Batches for training and evaluation, from a preloaded :class:`~pipeline.data.FeatureBank` or the store.

The order of the training batches is a pure function of (seed, epoch) (:class:`BucketBatchSampler`), so a
resumed run skips exactly the batches it already did (``start``) and every DDP rank sees the same global
batches (each takes its :func:`~pipeline.core.distributed.shard`). ``preload: auto`` puts the features on
the GPU when they fit in ``preload_fraction`` of its free memory, in RAM when they fit in half of the
available RAM, and otherwise reads the store in ``num_workers`` DataLoader processes.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from pipeline.core import threads as thread_policy
from pipeline.core.console import get_logger
from pipeline.core.distributed import DistContext, shard
from pipeline.core.errors import UsageError
from pipeline.core.loaders import guarded, loader_timeout
from pipeline.data import BucketBatchSampler, CaptionDataset, FeatureBank, PreloadedLoader, collate_images

log = get_logger("train.data")


def feature_bytes(dataset: CaptionDataset) -> int:
    store = dataset.store
    itemsize = np.dtype(store.feature_dtype).itemsize
    return int(dataset.num_boxes().sum()) * int(store.feature_dim or 0) * itemsize


def choose_preload(mode: str, datasets: list[CaptionDataset], device: torch.device, fraction: float) -> str:
    """Resolve ``auto`` to ``cuda``, ``memory`` or ``none`` (see the module docstring)."""
    if mode != "auto":
        if mode not in ("none", "memory", "pinned", "cuda"):
            raise UsageError(f"train.preload must be auto, none, memory, pinned or cuda, got {mode!r}")
        return mode
    need = sum(feature_bytes(d) for d in datasets)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if need < fraction * free:
            return "cuda"
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        avail = 0
    return "memory" if need < 0.5 * avail else "none"


class BatchSource:
    """Makes batches (dicts as :func:`pipeline.data.collate_images`) of given dataset positions."""

    def __init__(self, dataset: CaptionDataset, preload: str, device: torch.device, num_workers: int = 0) -> None:
        self.dataset = dataset
        self.device = device
        self.num_workers = num_workers
        self.bank = None
        if preload != "none":
            self.bank = FeatureBank(
                dataset, device if preload == "cuda" else "cpu", pin=preload == "pinned"
            )  # this rank's GPU

    def iterate(self, batches: list[list[int]], seed: int = 0) -> Iterator[dict[str, Any]]:
        """Yield the batches on ``device`` (features as float32), lazily, in order.

        ``seed`` seeds the DataLoader's own generator (worker seeds), so reading the store never draws from
        the global RNG (which must stay identical between an interrupted and an uninterrupted run)."""
        if not batches:
            return
        if self.bank is not None:
            it: Any = PreloadedLoader(self.dataset, self.bank, batches)  # type: ignore[arg-type]
        else:
            workers = thread_policy.loader_workers(self.num_workers)
            it = guarded(
                DataLoader(
                    self.dataset,
                    batch_sampler=batches,
                    collate_fn=collate_images,
                    num_workers=workers,
                    pin_memory=self.device.type == "cuda",
                    generator=torch.Generator().manual_seed(seed),
                    timeout=loader_timeout(workers),
                ),
                "the feature-reading workers",
            )
        for batch in it:
            yield to_device(batch, self.device)


def to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    out = {}
    for k, v in batch.items():
        if torch.is_tensor(v):
            v = v.to(device, non_blocking=True)
            if k == "feats":
                v = v.float()
        out[k] = v
    return out


def epoch_batches(
    dataset: CaptionDataset, batch_size: int, seed: int, epoch: int, ctx: DistContext, mode: str = "bucket"
) -> list[list[int]]:
    """This rank's batches of training ``epoch``: the global order from (seed, epoch), sharded by rank.

    Global batches smaller than the number of ranks are dropped (every rank must take the same steps).
    """
    sampler = BucketBatchSampler(dataset.num_boxes(), batch_size, mode, seed=seed)
    sampler.set_epoch(epoch)
    return [shard(b, ctx) for b in sampler if len(b) >= ctx.world]


def eval_batches(
    dataset: CaptionDataset, batch_size: int, ctx: DistContext, max_images: int | None = None
) -> list[list[int]]:
    """This rank's share of the evaluation images (each image on exactly one rank), sorted by box count."""
    n = len(dataset) if not max_images else min(len(dataset), int(max_images))
    mine = np.arange(n)[ctx.rank :: ctx.world]
    counts = dataset.num_boxes()[mine]
    mine = mine[np.argsort(counts, kind="stable")]
    return [mine[i : i + batch_size].tolist() for i in range(0, len(mine), batch_size)]
