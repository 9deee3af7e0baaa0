"""Training and evaluation data of the grounded sentence encoder.

Image side (Yoo et al. 2017 use a global ResNet-101 vector): one vector per image, the mean of its region features
in our store (the store holds no global feature), read once into an (N, D) float32 table, in
``num_workers`` DataLoader processes when asked (:func:`image_table`).

Caption side: the prepared labels (``cli prepare``). A training batch holds B distinct images of the split;
for each, a source caption X and a target caption Y, another caption of the same image when it has
several (Yoo et al. 2017 §3). Batches are a pure function of (seed, epoch), so a resumed run sees the same ones.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.core import threads as thread_policy
from pipeline.core.console import track
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.loaders import guarded, loader_timeout
from pipeline.core.vocab import EOS, PAD
from pipeline.data.dataset import cap_boxes, caption_tensor
from pipeline.store import FeatureStore


class ImageMeans(Dataset):
    """Item ``i``: the mean region feature (float32, D) of image ``keys[i]`` (the first ``max_boxes`` regions when
    capped; zeros for an image without regions). Holds the store's path only when pickled, so DataLoader workers
    (fork, forkserver or spawn) each open the store lazily (:class:`~pipeline.store.FeatureStore`)."""

    def __init__(self, store: FeatureStore, keys: Sequence[str], max_boxes: int | None = None) -> None:
        self.store, self.keys, self.max_boxes = store, list(keys), max_boxes
        self.dim = int(store.feature_dim or 0)

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: int) -> np.ndarray:
        feats = cap_boxes(self.store.get(self.keys[i]), self.max_boxes)["features"]
        if not len(feats):
            return np.zeros(self.dim, dtype=np.float32)
        return feats.astype(np.float32).mean(0)


def image_table(
    store: FeatureStore, keys: Sequence[str], max_boxes: int | None = None, num_workers: int = 0, chunk: int = 64
) -> np.ndarray:
    """(N, D) float32: the mean region feature of each image (the first ``max_boxes`` regions when capped).

    The store is read in ``num_workers`` DataLoader processes (0: in this process; the thread policy of
    :func:`pipeline.core.threads.loader_workers` caps the count), ``chunk`` images per transfer. Each row is
    computed by the same code whatever the worker count, so the table is identical for any ``num_workers``.
    """
    if num_workers < 0:
        raise UsageError(f"num_workers must be >= 0, not {num_workers}")
    missing = [k for k in keys if k not in store]
    if missing:
        raise PipelineError(f"{len(missing)} images have no features in {store.path}, e.g. {missing[:3]}")
    dataset = ImageMeans(store, keys, max_boxes)
    out = np.zeros((len(keys), dataset.dim), dtype=np.float32)
    with thread_policy.loader_threads(num_workers if len(keys) else 0) as workers:
        # an own generator: a DataLoader otherwise draws its base seed from the global RNG (the encoder's initial
        # weights)
        loader = DataLoader(
            dataset,
            batch_size=chunk,
            shuffle=False,
            num_workers=workers,
            collate_fn=np.stack,
            generator=torch.Generator().manual_seed(0),
            timeout=loader_timeout(workers),
        )
        start = 0
        for rows in track(guarded(loader, "the feature-reading workers"), "image vectors", total=len(loader)):
            out[start : start + len(rows)] = rows
            start += len(rows)
    return out


def encoder_inputs(labels: np.ndarray, lengths: np.ndarray) -> tuple[Tensor, Tensor]:
    """Prepared label rows (k, L) and word counts -> (tokens (k, T) = words, EOS, PAD..; lengths k = n + 1)."""
    n = np.asarray(lengths, dtype=np.int64)
    t = int(n.max(initial=0)) + 1
    tokens = np.full((len(n), t), PAD, dtype=np.int64)
    for r in range(len(n)):
        tokens[r, : n[r]] = labels[r, : n[r]]
        tokens[r, n[r]] = EOS
    return torch.from_numpy(tokens), torch.from_numpy(n + 1)


@dataclass
class SplitCaptions:
    """Images of one split (their keys, prepared positions) and every caption with its image row."""

    keys: list[str]
    positions: list[int]
    data: PreparedCaptions

    @classmethod
    def load(cls, data: PreparedCaptions, split: str, store: FeatureStore | None = None) -> "SplitCaptions":
        positions = data.split_indices(split)
        if store is not None:
            positions = [p for p in positions if data.images[p]["key"] in store]
        if not positions:
            raise PipelineError(
                f"no {split} image of {data.directory} has features" + (f" in {store.path}" if store else "")
            )
        return cls([data.images[p]["key"] for p in positions], positions, data)

    def all_captions(self) -> tuple[Tensor, Tensor, Tensor]:
        """Every caption of the split: (tokens (C, T), lengths (C,), caption_image (C,) image rows)."""
        labels, lengths, image = [], [], []
        for row, p in enumerate(self.positions):
            lab, ln = self.data.captions(p)
            labels.append(lab)
            lengths.append(ln)
            image.append(np.full(len(ln), row, dtype=np.int64))
        tokens, lens = encoder_inputs(np.concatenate(labels), np.concatenate(lengths))
        return tokens, lens, torch.from_numpy(np.concatenate(image))

    def batches(self, batch_size: int, seed: int, epoch: int) -> Iterator[dict[str, Tensor]]:
        """Training batches: B distinct images, a source caption and another target caption of each."""
        rng = np.random.default_rng((seed, epoch))
        order = rng.permutation(len(self.positions))
        for start in range(0, len(order), batch_size):
            rows = order[start : start + batch_size]
            src_lab, src_len, tgt_lab, tgt_len = [], [], [], []
            for r in rows:
                lab, ln = self.data.captions(self.positions[r])
                if len(ln) == 0:
                    raise PipelineError(f"image {self.keys[r]} has no caption in {self.data.directory}")
                i = int(rng.integers(len(ln)))
                j = (i + 1 + int(rng.integers(len(ln) - 1))) % len(ln) if len(ln) > 1 else i
                src_lab.append(lab[i])
                src_len.append(ln[i])
                tgt_lab.append(lab[j : j + 1])
                tgt_len.append(ln[j : j + 1])
            tokens, lengths = encoder_inputs(np.stack(src_lab), np.asarray(src_len))
            targets, _, _ = caption_tensor(tgt_lab, tgt_len)
            yield {
                "rows": torch.from_numpy(rows.astype(np.int64)),
                "tokens": tokens,
                "lengths": lengths,
                "targets": targets,
            }
