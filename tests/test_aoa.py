"""AoANet (docs/models.md#aoa): exact parameter counts, the custom LayerNorm, the AoA gate, the refiner layer and the
decoder step against their equations on hand-built examples."""

from __future__ import annotations

import math

import pytest
import torch

import models
from models.captioners.aoa import AoANet, AoARefinerLayer
from models.layers.aoa_layers import AttentionOnAttention, BesselLayerNorm


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    ("vocab_size", "overrides", "expected"),
    [
        (10370, {}, 87_369_858),  # paper vocabulary: 10,369 words + the shared BOS/EOS/PAD index
        (9488, {}, 85_562_640),  # script default vocabulary 9,487 words
        (10370, {"use_ff": True}, 112_566_402),  # opts default use_ff=1
        (10370, {"num_layers": 0}, 43_284_610),  # train-wo-refining.sh
    ],
)
def test_parameter_count_matches_reference_exactly(vocab_size: int, overrides: dict, expected: int) -> None:
    """docs/models.md#aoa-parameter-count: 2049 * (V + 1) + 66,121,728 for the paper configuration."""
    with torch.device("meta"):
        model = models.build_captioner("aoa", vocab_size, **overrides)
    print(f"aoa vocab_size={vocab_size} {overrides}: {count(model):,} parameters")
    assert count(model) == expected
    if not overrides:
        assert expected == 2049 * vocab_size + 66_121_728


def test_bessel_layer_norm_formula() -> None:
    torch.manual_seed(0)
    ln = BesselLayerNorm(5)
    with torch.no_grad():
        ln.a.copy_(torch.tensor([1.0, 2.0, 0.5, 1.0, -1.0]))
        ln.b.copy_(torch.tensor([0.0, 0.1, 0.2, 0.3, 0.4]))
    x = torch.tensor([[1.0, 2.0, 4.0, 8.0, 16.0]])
    mean = x.mean()
    std = math.sqrt(((x - mean) ** 2).sum().item() / 4)  # Bessel: divide by n - 1
    want = ln.a * (x - mean) / (std + 1e-6) + ln.b
    torch.testing.assert_close(ln(x), want)
    plain = torch.nn.functional.layer_norm(x, (5,), ln.a, ln.b)
    assert (ln(x) - plain).abs().max() > 1e-2  # not nn.LayerNorm


def test_aoa_gate_equation() -> None:
    """i_hat = sigmoid(W_g [v; q] + b_g) * (W_i [v; q] + b_i); the first output half is the information."""
    torch.manual_seed(1)
    d = 3
    aoa = AttentionOnAttention(d)
    v, q = torch.randn(2, d), torch.randn(2, d)
    w, b = aoa.linear.weight, aoa.linear.bias
    vq = torch.cat([v, q], -1)
    info = vq @ w[:d].T + b[:d]
    gate = torch.sigmoid(vq @ w[d:].T + b[d:])
    torch.testing.assert_close(aoa(v, q), gate * info)
    assert not torch.allclose(aoa(v, q), aoa(q, v))  # order [attended; query] matters


def _heads_attend(q, k, v, allowed, h):
    dk = q.shape[-1] // h
    outs = []
    for j in range(h):
        sl = slice(j * dk, (j + 1) * dk)
        s = q[:, sl] @ k[:, sl].T / math.sqrt(dk)
        s[:, ~allowed] = -1e9
        outs.append(torch.softmax(s, -1) @ v[:, sl])
    return torch.cat(outs, -1)


def test_refiner_layer_equation() -> None:
    """A + AoA(MHA(LN(A)), LN(A)): no output projection, heads over channel blocks, padded keys masked."""
    torch.manual_seed(2)
    d, h, n = 8, 2, 5
    layer = AoARefinerLayer(d, h, 16, use_ff=False, dropout=0.0, attn_dropout=0.0, dropout_aoa=0.0)
    x = torch.randn(1, n, d)
    allowed = torch.tensor([True, True, False, True, True])
    xn = layer.norm(x[0])
    att = _heads_attend(layer.q(xn), layer.k(xn), layer.v(xn), allowed, h)
    want = x[0] + layer.aoa(att, xn)
    torch.testing.assert_close(layer(x, allowed[None])[0], want, atol=1e-6, rtol=0)
    assert layer.ff is None and not any("fc_o" in name or "out" in name for name, _ in layer.named_parameters())


def test_refiner_layer_with_ff_adds_a_pre_norm_sublayer() -> None:
    """use_ff (the opts default, not the paper): x + FF(LN'(x)) after the AoA sub-layer."""
    torch.manual_seed(5)
    layer = AoARefinerLayer(8, 2, 16, use_ff=True, dropout=0.0, attn_dropout=0.0, dropout_aoa=0.0)
    x = torch.randn(1, 4, 8)
    allowed = torch.ones(1, 4, dtype=torch.bool)
    xn = layer.norm(x[0])
    mid = x[0] + layer.aoa(_heads_attend(layer.q(xn), layer.k(xn), layer.v(xn), allowed[0], 2), xn)
    ff = layer.ff_norm(mid)
    want = mid + (
        torch.relu(ff @ layer.ff.w_1.weight.T + layer.ff.w_1.bias) @ layer.ff.w_2.weight.T + layer.ff.w_2.bias
    )
    torch.testing.assert_close(layer(x, allowed)[0], want, atol=1e-6, rtol=0)


def small(**kw) -> AoANet:
    torch.manual_seed(3)
    args = dict(vocab_size=11, feat_dim=6, d_model=8, num_heads=2, num_layers=2)
    args.update(kw)
    return AoANet(**args).eval()


def test_decoder_step_equation_and_value_key_order() -> None:
    """LSTM([x_t; a_bar + c_{t-1}]), a^ = MHA(W_q LN(h), K, V) with V = first half of ctx2att, c = AoA(a^, h)."""
    model = small()
    g = torch.Generator().manual_seed(4)
    feats = torch.rand(1, 4, 6, generator=g)
    mask = torch.tensor([[True, True, True, False]])
    feats[:, 3] = 0
    with torch.no_grad():
        enc = model.encode(feats, mask, torch.zeros(1, 4, 4), torch.ones(1, 2))
        refined = model.att_embed(feats) * mask[..., None]
        for layer in model.refiner:
            refined = layer(refined, mask)
        refined = model.refiner_norm(refined)[0]
        torch.testing.assert_close(enc["mean"][0], refined[:3].mean(0))  # mean over real regions only
        proj = model.ctx2att(refined)
        values, keys = proj[:, :8], proj[:, 8:]

        state = model.init_state(enc)
        ctx_prev = torch.randn(1, 8, generator=g)
        state = {"h": torch.randn(1, 8, generator=g), "c": torch.randn(1, 8, generator=g), "ctx": ctx_prev}
        tok = torch.tensor([5])
        logp, new = model.step(tok, enc, state)

        x = torch.cat([torch.relu(model.embed[0](tok)), enc["mean"] + ctx_prev], -1)
        h, c = model.lstm(x, (state["h"], state["c"]))
        q = model.query_proj(model.query_norm(h))
        att = _heads_attend(q, keys, values, mask[0], 2)
        ctx = model.att2ctx(att, h)
        torch.testing.assert_close(new["ctx"], ctx, atol=1e-6, rtol=0)
        torch.testing.assert_close(logp, torch.log_softmax(model.logit(ctx), -1), atol=1e-6, rtol=0)
        swapped = model.att2ctx(_heads_attend(q, values, keys, mask[0], 2), h)
        assert (swapped - ctx).abs().max() > 1e-4  # the halves are not interchangeable


def test_refiner_layers_identical_at_init_like_the_official_code() -> None:
    model = small(num_layers=3)
    first = model.refiner[0].state_dict()
    for layer in model.refiner[1:]:
        for key, value in layer.state_dict().items():
            assert torch.equal(value, first[key])
    assert model.refiner[1].q.weight is not model.refiner[0].q.weight  # copies, not shared weights
    other = small(num_layers=3, identical_refiner_init=False)
    assert not torch.equal(other.refiner[0].q.weight, other.refiner[1].q.weight)


def test_docstrings_cite_paper_sections() -> None:
    import models.captioners.aoa as aoa

    assert "Encoder with AoA" in aoa.__doc__ and "Decoder with AoA" in aoa.__doc__
    assert "Attention on Attention" in AttentionOnAttention.__doc__ and "docs/models.md#aoa" in aoa.__doc__
