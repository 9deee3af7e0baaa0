"""extractors.to_host: a batch's regions reach the host in one copy, with the arrays the per-field copies gave."""

from __future__ import annotations

import numpy as np
import torch


def test_one_copy_per_batch_gives_the_per_field_arrays(monkeypatch) -> None:
    from bench.proxies import count
    from extractors.to_host import records_to_host

    g = torch.Generator().manual_seed(0)
    images = []
    for n, attrs in ((5, True), (0, True), (3, True)):
        images.append(
            {
                "features": torch.rand(n, 6, generator=g, dtype=torch.float64).half(),
                "boxes": torch.rand(n, 4, generator=g) * 500,
                "class_ids": torch.randint(0, 1600, (n,), generator=g),
                "class_scores": torch.rand(n, generator=g),
                "attr_ids": torch.randint(-1, 400, (n,), generator=g) if attrs else None,
                "attr_scores": torch.rand(n, generator=g),
            }
        )
    images[2]["attr_ids"], images[2]["attr_scores"] = None, None
    sizes = [(640, 480), (10, 20), (333, 500)]
    recs = records_to_host(images, sizes)
    for rec, image, (w, h) in zip(recs, images, sizes):
        assert (rec.image_w, rec.image_h) == (w, h)
        for name, t in image.items():
            got = getattr(rec, name)
            if t is None:
                assert got is None
                continue
            want = t.cpu().numpy().astype(np.int64 if name.endswith("_ids") else np.float32)
            assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want), name
    assert count(lambda: records_to_host(images, sizes))["syncs"] == 2  # one .cpu() and its .numpy(), for the batch
