"""Photo decoding for ``caption`` in DataLoader worker processes (``caption.num_workers``, ``--num-workers``).

:func:`decoded_batches` runs a :class:`PhotoDataset` through a ``torch.utils.data.DataLoader``: each worker
decodes a photo (:func:`extractors.preprocess.load_rgb` with the decompression-bomb cap) and, when the photo
needs detection, builds the recipe's input blob (:func:`extractors.preprocess.recipe_blob`). Failures come
back as values (:class:`DecodedPhoto` ``error`` / ``blob_error``), never as exceptions, so the engine's
per-image guard reports them exactly as when it decoded in the main process. Batches keep the input order
(the loader's in-order delivery), hold ``batch_size`` photos, and at most ``prefetch`` batches per worker are
decoded ahead of the model, so memory stays bounded by a few batches. Pixels and blobs travel as tensors
(shared memory): the workers' result pipe carries only small messages, so a worker never blocks on a full pipe
and exits by itself when the main process is killed. With 0 workers the same dataset runs in the main process. The worker count goes through the thread policy (:mod:`pipeline.core.threads`), as in
``extract``: workers take cores from the torch threads, never beyond this process's share.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from extractors.preprocess import Frame, ImageLoadError, load_rgb, recipe_blob


class Need(Enum):
    """What the engine needs of one photo: ``DETECT`` (pixels and the detector's blob), ``IMAGE`` (pixels only:
    its regions come from the feature cache, its picture needs the image) or ``NOTHING`` (cached, no picture)."""

    DETECT = "detect"
    IMAGE = "image"
    NOTHING = "nothing"


@dataclass
class DecodedPhoto:
    """One photo as the loader hands it over: ``index`` into the input list and what was asked for.

    ``error`` is the per-image error row (``reason: detail``: a problem found before reading, or a decoding
    failure); ``blob_error`` is the one-line form of an exception raised while building the recipe's blob
    (the engine reports it as the detector's failure, as when the blob was built in the detector's batch)."""

    index: int
    image: torch.Tensor | None = None  # (H, W, 3) uint8 RGB
    blob: torch.Tensor | None = None
    frame: Frame | None = None
    error: str | None = None
    blob_error: str | None = None


def one_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (at most 300 characters of it)."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300]}" if text else type(exc).__name__


class PhotoDataset(Dataset):
    """Decodes photo ``i`` as ``needs[i]`` asks; every failure is returned in the item, never raised."""

    def __init__(self, items: Sequence[Any], needs: Sequence[Need], recipe: Any, max_pixels: int, keep_images: bool) -> None:
        if len(items) != len(needs):
            raise ValueError(f"{len(items)} photos but {len(needs)} needs")
        self.items, self.needs, self.recipe = list(items), list(needs), recipe
        self.max_pixels, self.keep_images = int(max_pixels), keep_images

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> DecodedPhoto:
        it, need = self.items[i], self.needs[i]
        out = DecodedPhoto(i)
        problem = getattr(it, "problem", None)
        if problem is not None:  # missing, dangling link, folder named x.jpg, ...
            out.error = f"{problem[0]}: {problem[1]}"
            return out
        if need is Need.NOTHING:
            return out
        try:
            rgb = load_rgb(it.path, self.max_pixels)
        except ImageLoadError as exc:
            out.error = f"{exc.reason}: {exc.detail}"
            return out
        except OSError as exc:
            out.error = f"unreadable: {exc}"
            return out
        if need is Need.DETECT:
            try:
                blob, out.frame = recipe_blob(rgb, self.recipe)
                out.blob = torch.from_numpy(blob)
            except Exception as exc:  # noqa: BLE001 - the per-image guard: reported as this image's failure
                out.blob_error = one_line(exc)
        if self.keep_images or need is Need.IMAGE:  # a tensor travels through shared memory, not the result pipe
            out.image = torch.from_numpy(rgb if rgb.flags.writeable else rgb.copy())
        return out


def decoded_batches(dataset: PhotoDataset, batch_size: int, workers: int, prefetch: int = 2) -> Iterator[list[DecodedPhoto]]:
    """The dataset's photos in input order, ``batch_size`` at a time, decoded by ``workers`` processes (after
    the thread policy; 0: in this process). Torch's thread count is restored when the iteration ends."""
    from extractors.run import as_list
    from pipeline.core import threads as thread_policy

    with thread_policy.loader_threads(workers) as n:
        loader = DataLoader(dataset, batch_size=max(1, int(batch_size)), shuffle=False, num_workers=n, collate_fn=as_list,
                            prefetch_factor=max(1, int(prefetch)) if n else None, persistent_workers=False)
        yield from loader
