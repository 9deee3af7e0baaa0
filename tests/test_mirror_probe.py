"""The mirror probe of the relations comparison (pipeline/relations_probe.py) on tiny random models."""

from __future__ import annotations

import torch

from models.captioners.san import NGSAN, SAN
from pipeline.relations_probe import (
    BOX_OFFSET,
    encoder_probe,
    mirror_batch,
    mirror_box_features,
    mirror_boxes,
    output_probe,
)
from pipeline.world.oracle_features import oracle_dim

LEFT, RIGHT = 4, 5
TINY = {"vocab_size": 10, "d_model": 16, "num_heads": 2, "d_ff": 32, "num_layers": 2, "dropout": 0.0}


def two_region_batch(box_features: bool) -> dict:
    """Three images of 100 x 80 pixels with two objects each (integer pixel boxes, so mirroring is exact)."""
    gen = torch.Generator().manual_seed(0)
    boxes = torch.tensor(
        [
            [[10.0, 20.0, 30.0, 40.0], [60.0, 25.0, 85.0, 45.0]],
            [[70.0, 5.0, 90.0, 30.0], [15.0, 40.0, 40.0, 70.0]],
            [[5.0, 10.0, 25.0, 28.0], [40.0, 12.0, 62.0, 35.0]],
        ]
    )
    sizes = torch.tensor([[100.0, 80.0]] * 3)
    feats = torch.randn(3, 2, oracle_dim(0, box_features), generator=gen) * 0.05
    feats[:, 0, 0] += 1.0
    feats[:, 1, 3] += 1.0
    if box_features:
        w, h = sizes[:, None, 0], sizes[:, None, 1]
        feats[..., BOX_OFFSET] = boxes[..., 0] / w
        feats[..., BOX_OFFSET + 1] = boxes[..., 1] / h
        feats[..., BOX_OFFSET + 2] = boxes[..., 2] / w
        feats[..., BOX_OFFSET + 3] = boxes[..., 3] / h
    captions = torch.tensor([[1, 6, 7, 8, LEFT, 9, 2], [1, 6, 7, 8, RIGHT, 9, 2], [1, 7, 8, LEFT, 9, 3, 2]])
    return {
        "feats": feats,
        "mask": torch.ones(3, 2, dtype=torch.bool),
        "boxes": boxes,
        "sizes": sizes,
        "captions": captions,
        "caption_image": torch.tensor([0, 1, 2]),
    }


def probe(model: torch.nn.Module, box_features: bool) -> tuple[dict, dict]:
    torch.manual_seed(0)
    model.eval()
    batch = two_region_batch(box_features)
    mirrored = mirror_batch(batch, box_features)
    with torch.no_grad():
        return encoder_probe(model, batch, mirrored), output_probe(model, batch, mirrored, LEFT, RIGHT)


def test_mirroring_is_an_involution_and_flips_the_centres():
    batch = two_region_batch(True)
    m = mirror_boxes(batch["boxes"], batch["sizes"], batch["mask"])
    assert torch.equal(mirror_boxes(m, batch["sizes"], batch["mask"]), batch["boxes"])
    cx = (batch["boxes"][..., 0] + batch["boxes"][..., 2]) / 2
    assert torch.equal((m[..., 0] + m[..., 2]) / 2, 100.0 - cx)
    assert torch.equal(m[..., 2] - m[..., 0], batch["boxes"][..., 2] - batch["boxes"][..., 0])
    f = mirror_box_features(batch["feats"], batch["mask"])
    assert torch.allclose(f[..., BOX_OFFSET], m[..., 0] / 100.0, atol=1e-6)
    assert torch.allclose(f[..., BOX_OFFSET + 2], m[..., 2] / 100.0, atol=1e-6)
    assert torch.allclose(mirror_box_features(f, batch["mask"]), batch["feats"], atol=1e-6)


def test_eq8_geometry_is_mirror_invariant_and_the_signed_switch_is_not():
    torch.manual_seed(1)
    plain = NGSAN(feat_dim=oracle_dim(0, False), **TINY)
    torch.manual_seed(1)
    signed = NGSAN(feat_dim=oracle_dim(0, False), geometry_signed=True, **TINY)
    enc, out = probe(plain, False)
    assert len(enc["rel_change"]) == 3  # two layers and the memory
    assert max(enc["rel_change"]) < 1e-6
    assert max(enc["att_change"]) < 1e-6 and max(enc["logit_change"]) < 1e-5
    assert abs(out["change"]) < 1e-5 and out["acc"] == 0.5 and out["captions"] == 3
    enc, out = probe(signed, False)
    assert min(enc["rel_change"]) > 1e-3
    assert min(enc["att_change"]) > 1e-4
    assert abs(out["change"]) > 1e-5


def test_box_features_carry_the_mirror_and_position_free_san_does_not():
    torch.manual_seed(2)
    boxed = SAN(feat_dim=oracle_dim(0, True), **TINY)
    enc, _ = probe(boxed, True)
    assert min(enc["rel_change"]) > 1e-3
    torch.manual_seed(2)
    free = SAN(feat_dim=oracle_dim(0, False), **TINY)
    enc, out = probe(free, False)
    assert max(enc["rel_change"]) < 1e-6 and abs(out["change"]) < 1e-6
