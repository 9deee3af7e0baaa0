"""Photos -> regions: the one path every command takes from image files to the detector's regions.

``extract``, ``eval-detector`` and ``caption`` all run it:

1. :class:`PhotoDataset` decodes a photo in a DataLoader worker (:func:`photo_batches`, ``num_workers``
   processes after the thread policy, :mod:`pipeline.core.threads`; 0: in this process):
   :func:`extractors.preprocess.load_rgb` with the decompression-bomb cap, then the recipe's input blob
   (:func:`extractors.preprocess.recipe_blob`) and the thin-image check (:func:`thin_image_reason`). Every
   failure comes back as a value (:class:`Photo` ``failure``), never as an exception, in the input order.
   Pixels and blobs travel as tensors (shared memory), so a worker never blocks on a full result pipe. Every
   wait is bounded (:mod:`pipeline.core.loaders`): a photo a worker cannot hand over (``/dev/shm`` full) is
   decoded again in the main process, a dead or stuck worker hands the rest to the main process, each with
   one line of advice (``--ipc=host``, ``--shm-size``, ``--num-workers 0``).
2. :func:`detect_guarded` runs the detector on a batch of decoded photos under the command's precision
   (:func:`pipeline.core.precision.autocast`, a resolved precision); if the batch raises, each photo runs alone
   and the ones that still raise fail with ``detector_failed``, so one odd photo never costs the others.

The reasons are those of :data:`pipeline.core.errors.FAILURE_REASONS` (one list, one spelling).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from extractors.inputs import ImageItem
from extractors.preprocess import Frame, ImageLoadError, load_rgb, recipe_blob
from pipeline.core import threads as thread_policy
from pipeline.core.console import get_logger
from pipeline.core.errors import Failure, PipelineError, exception_line
from pipeline.core.loaders import (
    SHM_HINT,
    UntilWorkerFailure,
    loader_timeout,
    share_in_worker,
    worker_failure_line,
)
from pipeline.core.precision import autocast

log = get_logger("photos")


class Need(Enum):
    """What a command needs of one photo: ``DETECT`` (pixels and the detector's blob), ``IMAGE`` (pixels only:
    its regions come from a feature cache, its picture needs the image) or ``NOTHING`` (cached, no picture)."""

    DETECT = "detect"
    IMAGE = "image"
    NOTHING = "nothing"


@dataclass
class Photo:
    """One photo as the loader hands it over: ``index`` into the input list, its ``item``, and what was asked
    for; ``failure`` when it cannot go on (found before reading, while decoding, building the blob, or thin)."""

    index: int
    item: ImageItem
    image: torch.Tensor | None = None  # (H, W, 3) uint8 RGB, when kept
    blob: torch.Tensor | None = None  # the recipe's (3, h, w) input blob, when detected
    frame: Frame | None = None
    size: tuple[int, int] | None = None  # (H, W) of the decoded photo
    failure: Failure | None = None
    handover: str | None = (
        None  # a worker could not put its tensors in shared memory: decoded again in the main process
    )

    def pin_memory(self) -> "Photo":
        """The ``DataLoader(pin_memory=True)`` hook (it leaves objects without one unpinned): the blob in page-locked
        memory, so that its copy to the GPU is asynchronous (:func:`extractors.to_host.stack_to_device`)."""
        if self.blob is not None:
            self.blob = self.blob.pin_memory()
        return self


def thin_image_reason(orig_hw: tuple[int, int], blob_hw: tuple[int, int], min_side: int) -> str | None:
    """Why an image is too thin for the network, or None.

    After the test-time resize (longest side capped) a 2000x2 photo becomes 1000x1: below the backbone's
    feature stride (``min_side``, 16 px for the ResNet-101 C4 detector) the feature map has no full cell, the
    detector either fails or sees nothing, so such images are refused with this reason before the model runs.
    """
    h, w = int(blob_hw[0]), int(blob_hw[1])
    if min(h, w) >= min_side:
        return None
    return (
        f"{orig_hw[1]}x{orig_hw[0]} image resizes to {w}x{h} for the network: its short side {min(h, w)} px is "
        f"below the {min_side} px minimum (the backbone's feature stride)"
    )


class PhotoDataset(Dataset):
    """Decodes photo ``i`` as ``needs[i]`` asks (default: every photo detected); failures are returned, never raised.

    ``min_side``: the detector's feature stride (the thin-image check); ``keep_images``: every decoded photo
    keeps its pixels (pictures, gallery)."""

    def __init__(
        self,
        items: Sequence[ImageItem],
        recipe: Any,
        max_pixels: int,
        min_side: int,
        needs: Sequence[Need] | None = None,
        keep_images: bool = False,
    ) -> None:
        needs = [Need.DETECT] * len(items) if needs is None else list(needs)
        if len(items) != len(needs):
            raise ValueError(f"{len(items)} photos but {len(needs)} needs")
        self.items, self.needs, self.recipe = list(items), needs, recipe
        self.max_pixels, self.min_side, self.keep_images = int(max_pixels), int(min_side), keep_images

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> Photo:
        it, need = self.items[i], self.needs[i]
        out = Photo(i, it)
        if it.problem is not None:  # missing, dangling link, folder named x.jpg, ...
            out.failure = Failure(*it.problem)
            return out
        if need is Need.NOTHING:
            return out
        try:
            data = getattr(
                it, "data", None
            )  # an upload (``cli serve``) carries its bytes and is never read from a path
            rgb = load_rgb(data if data is not None else it.path, self.max_pixels)
        except ImageLoadError as exc:
            out.failure = Failure(exc.reason, exc.detail)
            return out
        except OSError as exc:
            out.failure = Failure("unreadable", exception_line(exc))
            return out
        out.size = (int(rgb.shape[0]), int(rgb.shape[1]))
        if need is Need.DETECT:
            try:
                blob, out.frame = recipe_blob(rgb, self.recipe)
            except (cv2.error, ValueError, MemoryError) as exc:
                out.failure = Failure("decode_error", f"cannot build the image blob: {exception_line(exc)}")
                return out
            thin = thin_image_reason(rgb.shape[:2], blob.shape[1:], self.min_side)
            if thin is not None:
                out.failure = Failure("too_thin", thin)
                return out
            out.blob = torch.from_numpy(blob)
        if self.keep_images or need is Need.IMAGE:  # a tensor travels through shared memory, not the result pipe
            out.image = torch.from_numpy(rgb if rgb.flags.writeable else rgb.copy())
        # in a worker the tensors go to shared memory here, where a shortage can be caught (pipeline.core.loaders)
        out.handover = share_in_worker((out.image, out.blob))
        if out.handover is not None:
            out.image = out.blob = None
        return out


def as_list(batch: list[Any]) -> list[Any]:
    """A DataLoader ``collate_fn`` that hands a batch over as the list of its items."""
    return batch


def photo_batches(
    dataset: Dataset, batch_size: int, num_workers: int, prefetch: int = 2, pin_memory: bool = False
) -> Iterator[list[Any]]:
    """The dataset's items in input order, ``batch_size`` at a time, decoded by ``num_workers`` processes (after
    the thread policy; 0: in this process), at most ``prefetch`` batches per worker ahead of the caller.
    Torch's thread count is restored when the iteration ends."""
    with thread_policy.loader_threads(int(num_workers)) as n:
        loader = DataLoader(
            dataset,
            batch_size=max(1, int(batch_size)),
            shuffle=False,
            num_workers=n,
            collate_fn=as_list,
            prefetch_factor=max(1, int(prefetch)) if n else None,
            persistent_workers=False,
            pin_memory=pin_memory,
            timeout=loader_timeout(n),
        )
        yield from _bounded(loader, dataset, max(1, int(batch_size)))


def _bounded(loader: DataLoader, dataset: Dataset, batch_size: int) -> Iterator[list[Any]]:
    """Every wait on the workers is bounded (:mod:`pipeline.core.loaders`): a photo a worker could not hand over is
    decoded again here; a dead or stuck worker ends the workers and the rest is decoded in this process. Each
    says once, in one line, why and what to do."""
    done, warned = 0, False
    batches = UntilWorkerFailure(loader)
    for batch in batches:
        redo = [k for k, p in enumerate(batch) if getattr(p, "handover", None) is not None]
        if redo:
            if not warned:
                log.warning(
                    "the photo-decoding workers could not hand photos over (%s): decoding those in this process; %s",
                    batch[redo[0]].handover,
                    SHM_HINT,
                )
                warned = True
            for k in redo:
                batch[k] = dataset[batch[k].index]
        done += len(batch)
        yield batch
    if batches.failure is not None:
        log.warning(
            "%s; decoding the remaining %d photos in this process",
            worker_failure_line(batches.failure, "the photo-decoding workers"),
            len(dataset) - done,
        )  # type: ignore[arg-type]
        for lo in range(done, len(dataset), batch_size):  # type: ignore[arg-type]
            yield [dataset[i] for i in range(lo, min(lo + batch_size, len(dataset)))]  # type: ignore[arg-type]


def _clip_given(boxes: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    h, w = size
    b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4).copy()
    b[:, 0::2] = b[:, 0::2].clip(0, w)
    b[:, 1::2] = b[:, 1::2].clip(0, h)
    return b


def _detect(model: Any, photos: list[Photo], selector: Any, precision: str, dev: torch.device) -> list[Any]:
    given = [_clip_given(p.item.boxes, p.size) for p in photos] if selector.given else None
    with autocast(dev, precision):
        return model.detect([p.blob for p in photos], [p.frame for p in photos], selector, given)


def detect_guarded(
    model: Any,
    photos: list[Photo],
    selector: Any,
    precision: str,
    dev: torch.device,
    fail: Callable[[Photo, Failure], None],
) -> list[tuple[Photo, Any]]:
    """The per-image guard: detect the batch (``RegionRecord`` per photo); if the model raises, run each photo
    alone and send the ones that still raise to ``fail(photo, Failure("detector_failed", ...))``.
    Project errors (:class:`PipelineError`) are not a photo's failure: they stop the run."""
    if not photos:
        return []
    try:
        return list(zip(photos, _detect(model, photos, selector, precision, dev)))
    except PipelineError:
        raise
    except Exception as exc:  # noqa: BLE001 - the per-image guard: any model failure is this image's
        if len(photos) == 1:
            fail(photos[0], Failure("detector_failed", exception_line(exc)))
            return []
        log.debug("batch of %d failed (%s); retrying image by image", len(photos), exc)
    out = []
    for p in photos:
        out += detect_guarded(model, [p], selector, precision, dev, fail)
    return out
