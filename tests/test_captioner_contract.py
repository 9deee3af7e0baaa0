"""The contract every registered captioner must honour (models/captioners/base.py), checked for each of them.

* causality: changing a later token never changes earlier log-probabilities;
* incremental decoding (encode/init_state/step) equals the teacher-forced pass to 1e-5;
* padded regions (mask off) never change any output;
* a tiny batch can be over-fitted on CPU.
"""

from __future__ import annotations

import pytest
import torch

import models
from pipeline.core.vocab import BOS

V = 23
SMALL = {  # small sizes so the contract runs fast; each model reads its own keys
    "san": {"num_layers": 2, "d_model": 64, "num_heads": 4, "d_ff": 128},
    "ban": {"glimpses": 2, "word_dim": 32},
}


def small_model(name: str) -> models.Captioner:
    cfg = models.model_config(name).to_dict()
    shrink = {k: v for k, v in SMALL.get(name, {}).items() if k in cfg}
    for key, value in (("d_model", 64), ("num_heads", 4), ("d_ff", 128), ("num_layers", 2), ("feat_dim", 32)):
        if key in cfg and key not in shrink:
            shrink[key] = value
    torch.manual_seed(0)
    model = models.build_captioner(name, V, **shrink)
    model.eval()
    return model


def make_batch(feat_dim: int, b: int = 3, n: int = 7, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(b, n, feat_dim, generator=g)
    xy = torch.rand(b, n, 2, generator=g) * 100
    wh = torch.rand(b, n, 2, generator=g) * 60 + 5
    boxes = torch.cat([xy, xy + wh], dim=-1)
    sizes = torch.full((b, 2), 200.0)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[1, 5:] = False
    if b > 2:  # make_batch(b=2) is used by the overfit test
        mask[2, 3:] = False
    feats = feats * mask[..., None]
    boxes = boxes * mask[..., None]
    return feats, mask, boxes, sizes


def feat_dim_of(model: models.Captioner) -> int:
    return int(getattr(model, "feat_dim", 2048))


NAMES = models.available_captioners()


@pytest.mark.parametrize("name", NAMES)
def test_causality(name: str) -> None:
    model = small_model(name)
    feats, mask, boxes, sizes = make_batch(feat_dim_of(model))
    caps = torch.randint(4, V, (3, 9), generator=torch.Generator().manual_seed(1))
    caps[:, 0] = BOS
    with torch.no_grad():
        a = model(feats, mask, boxes, sizes, caps)
        caps2 = caps.clone()
        caps2[:, 6:] = torch.randint(4, V, (3, 3), generator=torch.Generator().manual_seed(2))
        b = model(feats, mask, boxes, sizes, caps2)
    assert a.shape == (3, 9, V)
    torch.testing.assert_close(a[:, :6], b[:, :6], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("name", NAMES)
def test_incremental_equals_teacher_forced(name: str) -> None:
    model = small_model(name)
    feats, mask, boxes, sizes = make_batch(feat_dim_of(model))
    caps = torch.randint(4, V, (3, 8), generator=torch.Generator().manual_seed(3))
    caps[:, 0] = BOS
    with torch.no_grad():
        full = model(feats, mask, boxes, sizes, caps)
        enc = model.encode(feats, mask, boxes, sizes)
        state = model.init_state(enc)
        steps = []
        for t in range(caps.shape[1]):
            logp, state = model.step(caps[:, t], enc, state)
            steps.append(logp)
    torch.testing.assert_close(torch.stack(steps, 1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_padding_regions_change_nothing(name: str) -> None:
    model = small_model(name)
    d = feat_dim_of(model)
    feats, mask, boxes, sizes = make_batch(d)
    caps = torch.randint(4, V, (3, 6), generator=torch.Generator().manual_seed(4))
    caps[:, 0] = BOS
    extra = 4
    feats2 = torch.cat([feats, torch.randn(3, extra, d) * 5], 1)
    boxes2 = torch.cat([boxes, torch.rand(3, extra, 4) * 50], 1)
    mask2 = torch.cat([mask, torch.zeros(3, extra, dtype=torch.bool)], 1)
    with torch.no_grad():
        a = model(feats, mask, boxes, sizes, caps)
        b = model(feats2, mask2, boxes2, sizes, caps)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_overfits_tiny_batch(name: str) -> None:
    model = small_model(name)
    model.train()
    for m in model.modules():  # dropout off: we test capacity and gradients, not regularisation
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    feats, mask, boxes, sizes = make_batch(feat_dim_of(model), b=2)
    caps = torch.randint(4, V, (2, 7), generator=torch.Generator().manual_seed(5))
    caps[:, 0] = BOS
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    first = None
    for _ in range(150):
        logp = model(feats, mask, boxes, sizes, caps[:, :-1])
        loss = torch.nn.functional.nll_loss(logp.reshape(-1, V), caps[:, 1:].reshape(-1))
        first = loss.item() if first is None else first
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 0.05:
            break
    assert first > 2.0 and loss.item() < 0.05, f"{name}: loss {first:.3f} -> {loss.item():.3f}"


def test_unknown_captioner_is_a_usage_error() -> None:
    from pipeline.core.errors import UsageError

    with pytest.raises(UsageError, match="unknown captioner"):
        models.build_captioner("nope", 10)
