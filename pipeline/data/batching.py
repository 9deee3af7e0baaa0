"""Batching: bucketed/sorted batch samplers, a preloaded (RAM, pinned RAM or GPU) feature bank, and
:func:`build_loader`, the one entry point training and evaluation use.

Bucketing: shuffled indices are cut into pools of ``batch_size * bucket_pools`` images, each pool is
sorted by box count and cut into batches, and the batches are shuffled; padding then stays small while
the order stays random. ``sorted`` (evaluation) sorts all images by box count.

Preloading: fp16 COCO features (~123k images x 36 x 2048 x 2 B ~ 18 GB for 36 boxes) fit one GPU, so
``preload="cuda"`` reads the store once into one flat device tensor and builds padded batches with a
device-to-device copy per image (:func:`pipeline.data.dataset.pad_regions`), no worker processes and no
host-device copy per step.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from pipeline.core import threads as thread_policy
from pipeline.core.errors import UsageError
from pipeline.core.loaders import loader_timeout
from pipeline.data.dataset import CaptionDataset, cap_boxes, caption_tensor, collate_images, pad_regions

PRELOAD_MODES = ("none", "memory", "pinned", "cuda")


class BucketBatchSampler(Sampler[list[int]]):
    """Batches of indices grouped by similar box counts. ``mode``: ``bucket`` (random order, little
    padding), ``sorted`` (by box count, deterministic) or ``random``. Call :meth:`set_epoch` each epoch.

    Under DDP give ``rank``/``world_size``: every rank builds the same batch list (same seed and epoch)
    and takes every ``world_size``-th batch; the list is padded by repeating its first batches so that all
    ranks run the same number of steps."""

    def __init__(
        self,
        num_boxes: Sequence[int] | np.ndarray,
        batch_size: int,
        mode: str = "bucket",
        bucket_pools: int = 50,
        drop_last: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise UsageError(f"rank {rank} is not in 0..{world_size - 1}")
        if mode not in ("bucket", "sorted", "random"):
            raise UsageError(f"batching mode must be bucket, sorted or random, not {mode!r}")
        if batch_size < 1:
            raise UsageError("batch_size must be >= 1")
        self.num_boxes = np.asarray(num_boxes)
        self.batch_size = batch_size
        self.mode = mode
        self.bucket_pools = bucket_pools
        self.drop_last = drop_last
        self.seed = seed
        self.epoch = 0
        self.rank = rank
        self.world_size = world_size

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self) -> list[list[int]]:
        n = len(self.num_boxes)
        rng = np.random.default_rng((self.seed, self.epoch))
        if self.mode == "sorted":
            order = np.argsort(self.num_boxes, kind="stable")
        else:
            order = rng.permutation(n)
        if self.mode == "bucket":
            pool = self.batch_size * self.bucket_pools
            order = (
                np.concatenate(
                    [
                        chunk[np.argsort(self.num_boxes[chunk], kind="stable")]
                        for chunk in np.array_split(order, max(1, -(-n // pool)))
                    ]
                )
                if n
                else order
            )
        batches = [order[i : i + self.batch_size].tolist() for i in range(0, n, self.batch_size)]
        if self.drop_last and batches and len(batches[-1]) < self.batch_size:
            batches.pop()
        if self.mode == "bucket":
            batches = [batches[i] for i in rng.permutation(len(batches))]
        if self.world_size > 1 and batches:
            extra = -len(batches) % self.world_size
            batches = (batches + batches[:extra])[self.rank :: self.world_size]
        return batches

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        n = len(self.num_boxes)
        total = n // self.batch_size if self.drop_last else -(-n // self.batch_size)
        return -(-total // self.world_size)


class FeatureBank:
    """All features and boxes of a dataset's images in one flat tensor on ``device`` (optionally pinned).

    On a GPU the table is filled in place through a host staging buffer of at most ``stage_bytes`` (per process:
    under ``torchrun`` every rank holds its own copy on its own GPU, and none builds the whole table in host RAM).
    """

    def __init__(
        self,
        dataset: CaptionDataset,
        device: str | torch.device = "cpu",
        pin: bool = False,
        stage_bytes: int = 64 << 20,
        staged: bool | None = None,
    ) -> None:
        store = dataset.store
        counts = dataset.num_boxes()
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        total = int(counts.sum())
        dim = int(store.feature_dim or 0)
        first = store.get(dataset.keys[0])["features"]
        dtype = torch.from_numpy(first[:1].copy()).dtype
        self.device = torch.device(device)
        on_host = self.device.type == "cpu" if staged is None else not staged  # staged: through the bounded buffer
        self.features = torch.empty(
            (total, dim), dtype=dtype, device=self.device, pin_memory=pin and self.device.type == "cpu"
        )
        self.boxes = torch.empty(
            (total, 4), dtype=torch.float32, device=self.device, pin_memory=pin and self.device.type == "cpu"
        )
        sizes = np.zeros((len(dataset), 2), dtype=np.float32)
        row_bytes = dim * self.features.element_size() + 16
        stage_rows = total if on_host else max(int(stage_bytes // max(row_bytes, 1)), int(counts.max(initial=1)))
        if on_host:  # fill the table itself
            fstage, bstage = self.features.numpy(), self.boxes.numpy()
        else:  # fill a bounded host buffer, copy it over when full
            fstage = np.empty((min(stage_rows, total), dim), dtype=first.dtype)
            bstage = np.empty((min(stage_rows, total), 4), dtype=np.float32)

        base = fill = 0  # table row of the staging buffer's first row; rows staged

        def flush() -> None:
            if not on_host and fill:
                self.features[base : base + fill].copy_(torch.from_numpy(fstage[:fill]))
                self.boxes[base : base + fill].copy_(torch.from_numpy(bstage[:fill]))

        for i, key in enumerate(dataset.keys):
            rec = cap_boxes(store.get(key), dataset.max_boxes)
            c = int(counts[i])
            if not on_host and fill + c > stage_rows:
                flush()
                base, fill = base + fill, 0
            at = starts[i] if on_host else fill
            fstage[at : at + c] = rec["features"]
            bstage[at : at + c] = rec["boxes"]
            fill += c
            sizes[i] = (rec["image_w"], rec["image_h"])
        flush()
        self.starts = torch.from_numpy(starts).to(self.device)
        self.counts = torch.from_numpy(counts).to(self.device)
        self.sizes = torch.from_numpy(sizes).to(self.device)

    def gather(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """Padded ``feats``, ``mask``, ``boxes``, ``sizes``, ``num_boxes`` for dataset positions ``index``."""
        index = index.to(self.device)
        counts = self.counts[index]
        spans = list(zip(self.starts[index].tolist(), counts.tolist()))
        feats, boxes, mask = pad_regions(
            [self.features[s : s + c] for s, c in spans], [self.boxes[s : s + c] for s, c in spans], device=self.device
        )
        return {"feats": feats, "mask": mask, "boxes": boxes, "sizes": self.sizes[index], "num_boxes": counts}


class PreloadedLoader:
    """Iterates batches from a :class:`FeatureBank` (no workers); the same batch dict as the DataLoader."""

    def __init__(self, dataset: CaptionDataset, bank: FeatureBank, batch_sampler: BucketBatchSampler) -> None:
        self.dataset = dataset
        self.bank = bank
        self.batch_sampler = batch_sampler

    def __len__(self) -> int:
        return len(self.batch_sampler)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.batch_sampler:
            index = torch.tensor(batch, dtype=torch.int64)
            out: dict[str, Any] = self.bank.gather(index)
            caps = [self.dataset.item_captions(i) for i in batch]
            captions, image, lengths = caption_tensor([c[0] for c in caps], [c[1] for c in caps])
            dev = self.bank.device
            out.update(
                keys=[self.dataset.keys[i] for i in batch],
                index=index,
                captions=captions.to(dev),
                caption_image=image.to(dev),
                caption_lengths=lengths.to(dev),
            )
            yield out


def build_loader(
    store: str | Path,
    captions: str | Path,
    split: str | None,
    batch_size: int,
    *,
    batching: str = "bucket",
    num_workers: int = 0,
    preload: str = "none",
    max_boxes: int | None = None,
    captions_per_image: int | None = None,
    seed: int = 0,
    drop_last: bool = False,
    multiprocessing_context: str | None = None,
    allow_missing: bool = False,
    rank: int = 0,
    world_size: int = 1,
) -> DataLoader | PreloadedLoader:
    """A loader over ``split`` of (store, prepared captions); see the module docstring for the options.

    ``preload``: ``none`` (read the store per item, in ``num_workers`` processes), ``memory``, ``pinned``
    (page-locked RAM for fast copies) or ``cuda`` (everything on the GPU). The returned object has
    ``.batch_sampler.set_epoch(e)`` for reshuffling; ``rank``/``world_size`` split batches across DDP ranks.
    """
    if preload not in PRELOAD_MODES:
        raise UsageError(f"preload must be one of {', '.join(PRELOAD_MODES)}, not {preload!r}")
    dataset = CaptionDataset(
        store, captions, split, max_boxes=max_boxes, captions_per_image=captions_per_image, allow_missing=allow_missing
    )
    sampler = BucketBatchSampler(
        dataset.num_boxes(), batch_size, batching, drop_last=drop_last, seed=seed, rank=rank, world_size=world_size
    )
    if preload != "none":
        if preload == "cuda" and not torch.cuda.is_available():
            raise UsageError("preload=cuda needs a CUDA device; use memory or pinned")
        bank = FeatureBank(dataset, "cuda" if preload == "cuda" else "cpu", pin=preload == "pinned")
        return PreloadedLoader(dataset, bank, sampler)
    num_workers = thread_policy.loader_workers(num_workers)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        collate_fn=collate_images,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        multiprocessing_context=multiprocessing_context if num_workers > 0 else None,
        timeout=loader_timeout(num_workers),
    )
