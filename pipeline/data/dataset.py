"""A torch Dataset joining the feature store and the prepared captions, and the padding collate.

One item is one image: its region features (store dtype), boxes, size and *all* its captions (or
``captions_per_image`` sampled ones). The dataset holds only paths and small arrays, so it pickles cheaply
to DataLoader workers (``fork``, ``forkserver`` or ``spawn``); the store is opened lazily in each worker.

A batch (what :func:`collate_images` returns) matches :class:`models.captioners.base.Captioner`'s inputs:

* ``feats`` (B, N, D) zero-padded to the batch's most boxes (store dtype: cast on the device),
* ``mask`` (B, N) bool, True for real regions; ``boxes`` (B, N, 4) float32 pixels; ``sizes`` (B, 2) float32 w, h,
* ``num_boxes`` (B,), ``keys`` (list of B image keys), ``index`` (B,) dataset positions,
* ``captions`` (C, T) int64 ``BOS w1 .. wn EOS PAD..``, ``caption_image`` (C,) the image row of each caption,
  ``caption_lengths`` (C,) = n + 1 (the number of predicted tokens, EOS included).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError
from pipeline.store import FeatureStore
from pipeline.core.vocab import BOS, EOS, PAD

log = get_logger("data")


def cap_boxes(rec: dict[str, Any], max_boxes: int | None) -> dict[str, Any]:
    """Keep at most ``max_boxes`` regions: the highest ``class_scores`` when the store has them, else the
    first ones in the extractor's order."""
    n = len(rec["boxes"])
    if not max_boxes or n <= max_boxes:
        return rec
    if "class_scores" in rec:
        keep = np.sort(np.argsort(-rec["class_scores"], kind="stable")[:max_boxes])
    else:
        keep = np.arange(max_boxes)
    out = dict(rec)
    for name in ("features", "boxes", "class_ids", "class_scores", "attr_ids", "attr_scores"):
        if name in rec:
            out[name] = rec[name][keep]
    return out


def _fill(dst: torch.Tensor, src: Any) -> None:
    """Copy ``src`` (a tensor, or a possibly read-only numpy array) into ``dst``."""
    if isinstance(src, torch.Tensor):
        dst.copy_(src)
    elif dst.device.type == "cpu" and dst.dtype in (torch.float16, torch.float32, torch.float64):
        dst.numpy()[...] = src  # numpy casts; no tensor view of a read-only store buffer
    else:
        dst.copy_(torch.from_numpy(np.array(src)))


def pad_regions(
    features: Sequence[Any],
    boxes: Sequence[Any],
    dtype: torch.dtype | None = None,
    device: str | torch.device | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Zero-pad per-image regions (numpy arrays or tensors, image j with K_j rows) to the batch's most regions N.

    Returns ``feats`` (B, N, D) in ``dtype`` (default: the first image's), ``boxes`` (B, N, 4) float32 and
    ``mask`` (B, N) bool, True for the K_j real regions of row j; on ``device`` (default CPU). The one padding
    of region inputs: the training collate, the preloaded feature bank and captioning photos all use it.
    """
    counts = [len(f) for f in features]
    b, n = len(counts), max(counts, default=0)
    first = features[0] if counts else np.zeros((0, 0), np.float32)
    if dtype is None:
        dtype = (
            first.dtype if isinstance(first, torch.Tensor) else torch.from_numpy(np.zeros(0, dtype=first.dtype)).dtype
        )
    feats = torch.zeros((b, n, first.shape[1]), dtype=dtype, device=device)
    out_boxes = torch.zeros((b, n, 4), dtype=torch.float32, device=device)
    for j, k in enumerate(counts):
        _fill(feats[j, :k], features[j])
        _fill(out_boxes[j, :k], boxes[j])
    mask = torch.arange(n, device=device)[None, :] < torch.tensor(counts, dtype=torch.int64, device=device)[:, None]
    return feats, out_boxes, mask


class CaptionDataset(Dataset):
    """Images of one split that have features in the store, with their captions.

    Args:
        store: a :class:`FeatureStore` or its path.
        captions: :class:`PreparedCaptions` or the prepared ``data`` folder.
        split: ``train``, ``val``, ``test`` (or ``restval``), or ``None`` for all images.
        max_boxes: cap on regions per image (``None``: all).
        captions_per_image: sample this many captions per image (with replacement when an image has fewer);
            ``None`` returns all of them.
        allow_missing: drop images absent from the store (logged) instead of failing.
    """

    def __init__(
        self,
        store: FeatureStore | str | Path,
        captions: PreparedCaptions | str | Path,
        split: str | None = "train",
        max_boxes: int | None = None,
        captions_per_image: int | None = None,
        allow_missing: bool = False,
    ) -> None:
        self.store = store if isinstance(store, FeatureStore) else FeatureStore(store)
        self.data = captions if isinstance(captions, PreparedCaptions) else PreparedCaptions.load(captions)
        positions = range(len(self.data)) if split is None else self.data.split_indices(split)
        if not positions:
            raise PipelineError(f"prepared captions in {self.data.directory} have no image in split {split!r}")
        missing = [self.data.images[i]["key"] for i in positions if self.data.images[i]["key"] not in self.store]
        if missing and not allow_missing:
            raise PipelineError(
                f"{len(missing)} of {len(positions)} {split or 'all'} images have no features in {self.store.path}, "
                f"e.g. {missing[:3]} (keys must match: see prepare.key)"
            )
        if missing:
            log.warning("%d %s images have no features in %s and are left out", len(missing), split, self.store.path)
        missing_set = set(missing)
        self.positions = [i for i in positions if self.data.images[i]["key"] not in missing_set]
        self.keys = [self.data.images[i]["key"] for i in self.positions]
        self.max_boxes = max_boxes
        self.captions_per_image = captions_per_image

    def __len__(self) -> int:
        return len(self.positions)

    def num_boxes(self) -> np.ndarray:
        """Regions per item (after the cap), for bucketed batching."""
        st = self.store._st()
        counts = np.array([st.count[st.index[k]] for k in self.keys], dtype=np.int64)
        return np.minimum(counts, self.max_boxes) if self.max_boxes else counts

    def item_captions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        labels, lengths = self.data.captions(self.positions[i])
        k = self.captions_per_image
        if k is not None and k != len(labels):
            pick = (
                torch.randint(len(labels), (k,)).numpy() if k > len(labels) else torch.randperm(len(labels))[:k].numpy()
            )
            labels, lengths = labels[pick], lengths[pick]
        return labels, lengths

    def __getitem__(self, i: int) -> dict[str, Any]:
        rec = cap_boxes(self.store.get(self.keys[i]), self.max_boxes)
        labels, lengths = self.item_captions(i)
        return {
            "index": i,
            "key": self.keys[i],
            "features": rec["features"],
            "boxes": rec["boxes"],
            "size": (rec["image_w"], rec["image_h"]),
            "labels": labels,
            "lengths": lengths,
        }


def caption_tensor(
    labels: Sequence[np.ndarray], lengths: Sequence[np.ndarray]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-image (k, L) label arrays -> (captions (C, T) BOS..EOS PAD, caption_image (C,), caption_lengths (C,))."""
    all_lengths = np.concatenate(lengths).astype(np.int64)
    c = len(all_lengths)
    t = int(all_lengths.max(initial=0)) + 2
    caps = np.full((c, t), PAD, dtype=np.int64)
    caps[:, 0] = BOS
    rows = np.concatenate(labels)
    for r in range(c):
        n = all_lengths[r]
        caps[r, 1 : n + 1] = rows[r, :n]
        caps[r, n + 1] = EOS
    image = np.repeat(np.arange(len(labels)), [len(x) for x in lengths])
    return torch.from_numpy(caps), torch.from_numpy(image), torch.from_numpy(all_lengths + 1)


def collate_images(items: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Pad a list of dataset items into one batch (see the module docstring)."""
    counts = [len(it["boxes"]) for it in items]
    feats, boxes, mask = pad_regions(
        [it["features"] for it in items], [it["boxes"] for it in items]
    )  # one copy out of the store buffers
    captions, caption_image, caption_lengths = caption_tensor(
        [it["labels"] for it in items], [it["lengths"] for it in items]
    )
    return {
        "keys": [it["key"] for it in items],
        "index": torch.tensor([it["index"] for it in items], dtype=torch.int64),
        "feats": feats,
        "mask": mask,
        "boxes": boxes,
        "sizes": torch.tensor([it["size"] for it in items], dtype=torch.float32),
        "num_boxes": torch.tensor(counts, dtype=torch.int64),
        "captions": captions,
        "caption_image": caption_image,
        "caption_lengths": caption_lengths,
    }
