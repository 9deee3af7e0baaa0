"""Caption <-> image retrieval recall (Recall@K) from a similarity matrix.

``sim`` is (C, N): C captions against N images; ``caption_image[c]`` is the column of caption c's image.

* caption-to-image R@K: the fraction of captions whose own image is among the K most similar images.
* image-to-caption R@K: the fraction of images for which at least one of their own captions is among the
  K most similar captions (the usual COCO convention with 5 captions per image). Images without any caption
  are left out.

Ties count against the query (an equal score of a wrong item ranks before the right one), so a constant
matrix scores chance or worse, never better.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

DEFAULT_KS = (1, 5, 10)


def caption_to_image_ranks(sim: np.ndarray, caption_image: np.ndarray, chunk: int = 4096) -> np.ndarray:
    """0-based rank of each caption's own image (number of images scoring >= it, itself excluded).
    Rows are processed in chunks, so a COCO-sized (25k x 5k) matrix needs no extra full-size copy."""
    sim = np.asarray(sim)
    own = sim[np.arange(len(sim)), caption_image]
    out = np.empty(len(sim), dtype=np.int64)
    for s in range(0, len(sim), chunk):
        out[s : s + chunk] = (sim[s : s + chunk] >= own[s : s + chunk, None]).sum(1) - 1
    return out


def image_to_caption_ranks(sim: np.ndarray, caption_image: np.ndarray) -> np.ndarray:
    """0-based rank of the best-ranked own caption of each image that has captions (image order)."""
    sim = np.asarray(sim)
    caption_image = np.asarray(caption_image)
    ranks = []
    for j in np.unique(caption_image):
        col = sim[:, j]
        own = caption_image == j
        best = col[own].max()
        # wrong captions scoring >= the best own caption rank before it
        ranks.append(int((col[~own] >= best).sum()))
    return np.asarray(ranks, dtype=np.int64)


def recall_at(ranks: np.ndarray, ks: Sequence[int] = DEFAULT_KS) -> dict[int, float]:
    """{K: fraction of ranks < K} (as percentages 0-100)."""
    ranks = np.asarray(ranks)
    return {int(k): float(100.0 * (ranks < k).mean()) if len(ranks) else 0.0 for k in ks}


def retrieval_metrics(
    sim: np.ndarray, caption_image: np.ndarray, ks: Sequence[int] = DEFAULT_KS, prefix: str = ""
) -> dict[str, float]:
    """``{prefix}c2i_R@K`` and ``{prefix}i2c_R@K`` for each K, plus the median ranks (1-based) and chance R@1."""
    sim = np.asarray(sim)
    caption_image = np.asarray(caption_image, dtype=np.int64)
    if sim.ndim != 2 or len(caption_image) != sim.shape[0]:
        raise ValueError(f"similarity matrix {sim.shape} does not match {len(caption_image)} caption image ids")
    if len(caption_image) and (caption_image.min() < 0 or caption_image.max() >= sim.shape[1]):
        raise ValueError("caption image ids fall outside the similarity matrix's columns")
    c2i = caption_to_image_ranks(sim, caption_image)
    i2c = image_to_caption_ranks(sim, caption_image)
    out: dict[str, float] = {}
    for k, v in recall_at(c2i, ks).items():
        out[f"{prefix}c2i_R@{k}"] = v
    for k, v in recall_at(i2c, ks).items():
        out[f"{prefix}i2c_R@{k}"] = v
    out[f"{prefix}c2i_medr"] = float(np.median(c2i) + 1) if len(c2i) else 0.0
    out[f"{prefix}i2c_medr"] = float(np.median(i2c) + 1) if len(i2c) else 0.0
    out[f"{prefix}c2i_chance_R@1"] = 100.0 / sim.shape[1] if sim.shape[1] else 0.0
    return out
