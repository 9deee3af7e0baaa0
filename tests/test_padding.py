"""One region padding (pipeline.data.dataset.pad_regions) for the collate, the preloaded bank and captioning."""

from __future__ import annotations

import numpy as np
import torch

from pipeline.captioning.engine import batch_tensors
from pipeline.data.dataset import pad_regions


def _images(seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for k in (3, 1, 5):
        f = rng.normal(size=(k, 6)).astype(np.float16)
        f.setflags(write=False)  # like the store's read-only buffers
        out.append((f, rng.uniform(0, 50, size=(k, 4)).astype(np.float32)))
    return out


def test_pad_regions_pads_with_zeros_and_masks_the_real_rows():
    imgs = _images()
    feats, boxes, mask = pad_regions([f for f, _ in imgs], [b for _, b in imgs])
    assert feats.shape == (3, 5, 6) and feats.dtype == torch.float16 and boxes.dtype == torch.float32
    assert mask.tolist() == [[True] * 3 + [False] * 2, [True] + [False] * 4, [True] * 5]
    for j, (f, b) in enumerate(imgs):
        k = len(f)
        np.testing.assert_array_equal(feats[j, :k].numpy(), f)
        np.testing.assert_array_equal(boxes[j, :k].numpy(), b)
        assert not feats[j, k:].any() and not boxes[j, k:].any()


def test_tensor_inputs_and_the_caption_batch_give_the_same_padding():
    imgs = _images(1)
    ref = pad_regions([f for f, _ in imgs], [b for _, b in imgs])
    flat_f = torch.from_numpy(np.concatenate([f for f, _ in imgs]))
    flat_b = torch.from_numpy(np.concatenate([b for _, b in imgs]))
    starts = np.cumsum([0] + [len(f) for f, _ in imgs])
    views = pad_regions(
        [flat_f[s:e] for s, e in zip(starts[:-1], starts[1:])], [flat_b[s:e] for s, e in zip(starts[:-1], starts[1:])]
    )
    for a, b in zip(ref, views):
        assert torch.equal(a, b)
    cap = batch_tensors(
        [{"features": f, "boxes": b, "image_w": 60, "image_h": 40} for f, b in imgs], torch.device("cpu")
    )
    assert cap["feats"].dtype == torch.float32 and torch.equal(cap["feats"], ref[0].float())
    assert (
        torch.equal(cap["mask"], ref[2])
        and torch.equal(cap["boxes"], ref[1])
        and cap["sizes"].tolist() == [[60, 40]] * 3
    )
