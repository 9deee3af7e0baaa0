"""Regions of a whole batch to the host in one device-to-host copy.

Every per-region field of every image of a batch (features, boxes, class / attribute ids and scores) is flattened
into one float32 buffer on the device, copied once, and cut back into per-image :class:`RegionRecord` fields on
the host (ids are small integers, exact in float32; the float fields are cast to float32 as the records store
them). On a GPU this replaces six small ``.cpu()`` copies per image, each a host sync, by one per batch; on CPU it
gives the same arrays. The other direction, :func:`stack_to_device`: the blobs of a batch stacked into pinned
memory (the loader pins each blob; a plain ``torch.stack`` would put the batch back in pageable memory and make the
``non_blocking`` copy synchronous).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from pipeline.core.regions import RegionRecord

INT_FIELDS = ("class_ids", "attr_ids")  # stored as int64, carried as float32 (exact below 2**24)


def records_to_host(
    fields: Sequence[Mapping[str, torch.Tensor | None]], sizes: Sequence[tuple[int, int]]
) -> list[RegionRecord]:
    """One :class:`RegionRecord` per image from its device tensors ``fields[i]`` (``features``, ``boxes`` and the
    optional fields, None where absent) and its original ``(width, height)``."""
    pieces: list[torch.Tensor] = []
    layout: list[list[tuple[str, tuple[int, ...] | None]]] = []
    for image in fields:
        entry = []
        for name, t in image.items():
            if t is None:
                entry.append((name, None))
                continue
            if name in INT_FIELDS and t.numel() and t.is_floating_point():
                raise TypeError(f"{name} must be an integer tensor")
            entry.append((name, tuple(t.shape)))
            pieces.append(t.reshape(-1).float())
        layout.append(entry)
    flat = torch.cat(pieces).cpu().numpy() if pieces else np.zeros(0, np.float32)  # the batch's one copy
    out, start = [], 0
    for entry, (w, h) in zip(layout, sizes):
        rec: dict[str, np.ndarray | None] = {}
        for name, shape in entry:
            if shape is None:
                rec[name] = None
                continue
            n = int(np.prod(shape))
            part = flat[start : start + n].reshape(shape)
            start += n
            rec[name] = part.astype(np.int64) if name in INT_FIELDS else part.astype(np.float32)
        out.append(RegionRecord(image_w=int(w), image_h=int(h), **rec))
    return out


def stack_to_device(blobs: Sequence[torch.Tensor], device: torch.device, channels_last: bool = False) -> torch.Tensor:
    """``torch.stack(blobs).to(device)``; for a CUDA device from pinned memory when the blobs are pinned; in the
    channels-last layout with ``channels_last`` (``extract.channels_last``: the detector's weights are converted
    too)."""
    first = torch.as_tensor(blobs[0])
    if device.type != "cuda" or not first.is_pinned():
        batch = torch.stack([torch.as_tensor(b) for b in blobs]).to(device)
    elif len(blobs) == 1:
        batch = first[None].to(device, non_blocking=True)
    else:
        staged = torch.empty((len(blobs), *first.shape), dtype=first.dtype, pin_memory=True)
        torch.stack(list(blobs), out=staged)
        batch = staged.to(device, non_blocking=True)
    return batch.contiguous(memory_format=torch.channels_last) if channels_last else batch


def use_channels_last(model: torch.nn.Module, on: bool) -> None:
    """``extract.channels_last``: the detector's convolution weights and its input batches in the NHWC layout
    (faster cuDNN convolutions under TF32/bf16 on recent GPUs; other kernels, so the numbers differ in rounding)."""
    model.channels_last = bool(on)
    if on:
        model.to(memory_format=torch.channels_last)
