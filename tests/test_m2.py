"""M2 (docs/models.md#m2): exact parameter count, memory attention and meshed gating on hand-built examples,
the official-parity switches."""

from __future__ import annotations

import math

import pytest
import torch

import models
from models.captioners.m2 import M2Transformer, MeshedDecoderLayer, sinusoid_table
from models.layers.m2_attention import M2Attention
from pipeline.core.vocab import BOS


def count(model: torch.nn.Module, trainable: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable)


def small(**kw) -> M2Transformer:
    torch.manual_seed(0)
    args = dict(vocab_size=17, feat_dim=12, d_model=16, num_heads=2, d_ff=24, num_layers=2, num_memory=3)
    args.update(kw)
    return M2Transformer(**args).eval()


def batch(feat_dim: int = 12, n: int = 6):
    g = torch.Generator().manual_seed(0)
    feats = torch.rand(2, n, feat_dim, generator=g)
    mask = torch.ones(2, n, dtype=torch.bool)
    mask[1, 4:] = False
    feats = feats * mask[..., None]
    boxes = torch.zeros(2, n, 4)
    sizes = torch.full((2, 2), 100.0)
    caps = torch.randint(4, 17, (2, 5), generator=g)
    caps[:, 0] = BOS
    return feats, mask, boxes, sizes, caps


def test_parameter_count_matches_reference_exactly() -> None:
    """The official model at V = 10201: 38,439,424 parameters, 38,411,264 trainable (the frozen position table)."""
    with torch.device("meta"):
        model = models.build_captioner("m2", 10201)
    print(f"m2 V=10201: {count(model):,} parameters, {count(model, True):,} trainable")
    assert count(model.encoder) == 10_630_144
    assert count(model) == 38_439_424
    assert count(model, trainable=True) == 38_411_264 == 1024 * 10201 + 27_965_440


def test_memory_attention_matches_equation() -> None:
    """Eq. 2: softmax(Q [K; sqrt(d_k) M_k]^T / sqrt(d_k)) [V; sqrt(m) M_v], per head, memory never masked."""
    torch.manual_seed(1)
    d, h, m, n = 6, 2, 3, 4
    att = M2Attention(d, h, num_memory=m)
    torch.nn.init.normal_(att.m_k)
    torch.nn.init.normal_(att.m_v)
    x = torch.randn(1, n, d)
    allowed = torch.tensor([[True, True, False, True]])
    got = att(x, x, allowed[:, None, None, :])[0]

    dk = d // h
    q, k, v = att.fc_q(x[0]), att.fc_k(x[0]), att.fc_v(x[0])
    k = torch.cat([k, math.sqrt(dk) * att.m_k[0]])
    v = torch.cat([v, math.sqrt(m) * att.m_v[0]])
    heads = []
    for j in range(h):
        sl = slice(j * dk, (j + 1) * dk)
        s = q[:, sl] @ k[:, sl].T / math.sqrt(dk)
        s[:, 2] = float("-inf")  # the masked region; the m memory columns stay
        heads.append(torch.softmax(s, -1) @ v[:, sl])
    want = att.fc_o(torch.cat(heads, -1))
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)

    # with every region masked the output is attention over the memory slots alone
    none = torch.zeros(1, 1, 1, n, dtype=torch.bool)
    only_memory = att(x, x, none)[0]
    outs = []
    for j in range(h):
        sl = slice(j * dk, (j + 1) * dk)
        s = q[:, sl] @ (math.sqrt(dk) * att.m_k[0][:, sl]).T / math.sqrt(dk)
        outs.append(torch.softmax(s, -1) @ (math.sqrt(m) * att.m_v[0][:, sl]))
    torch.testing.assert_close(only_memory, att.fc_o(torch.cat(outs, -1)), atol=1e-6, rtol=0)


@pytest.mark.parametrize("levels", [1, 3, 4])
def test_meshed_gating_matches_equation(levels: int) -> None:
    """Eq. 6-8 for any number of levels: sum_i sigmoid(W_i [S; C_i] + b_i) * C_i / sqrt(L), shared cross-attention."""
    torch.manual_seed(2)
    d, n, t = 8, 5, 3
    layer = MeshedDecoderLayer(d, 2, 16, levels, dropout=0.0).eval()
    for gate in layer.gates:
        torch.nn.init.normal_(gate.bias)
    s = torch.randn(1, t, d)
    enc = torch.randn(1, levels, n, d)
    allowed = torch.tensor([[True, True, True, False, True]])
    keep = torch.ones(1, t, 1)
    k, v = layer.cross_attn.attention.project_kv(enc)
    got = layer.meshed(s, k, v, allowed, keep)

    want = torch.zeros(1, t, d)
    for i in range(levels):
        c_i = layer.cross_attn(s, enc[:, i], allowed[:, None, None, :])  # LN(S + Attn(S, Y_i)), one module
        alpha = torch.sigmoid(torch.cat([s, c_i], -1) @ layer.gates[i].weight.T + layer.gates[i].bias)
        want = want + alpha * c_i
    torch.testing.assert_close(got, want / math.sqrt(levels), atol=1e-6, rtol=0)
    assert len({id(g.weight) for g in layer.gates}) == levels  # one gate per level, element-wise (d outputs)
    assert layer.gates[0].weight.shape == (d, 2 * d)


def test_any_number_of_layers_meshes_all_levels() -> None:
    model = small(num_layers=5, num_dec_layers=2)
    feats, mask, boxes, sizes, caps = batch()
    enc = model.encode(feats, mask, boxes, sizes)
    assert enc["cross_k"].shape[:3] == (2, 2, 5)  # (B, decoder layers, encoder levels)
    assert all(len(layer.gates) == 5 for layer in model.layers)
    out = model(feats, mask, boxes, sizes, caps)
    assert out.shape == (2, 5, 17) and torch.isfinite(out).all()
    # the last encoder level is really used: perturbing only the last encoder layer (after its LN) matters
    with torch.no_grad():
        model.encoder.ff[-1].norm.bias.add_(torch.linspace(-1, 1, 16))
    assert not torch.allclose(out, model(feats, mask, boxes, sizes, caps))


def test_official_mask_reproduces_the_unmasked_official_behaviour() -> None:
    """official_mask=true: the mask is taken after the input LN, so zero-padded regions are NOT masked."""
    feats, mask, boxes, sizes, caps = batch()
    official, proper = small(official_mask=True), small()
    proper.load_state_dict(official.state_dict())
    with torch.no_grad():
        enc = official.encode(feats, mask, boxes, sizes)
        assert enc["allowed"].all()  # padded rows after LayerNorm never sum to exactly 0
        a = official(feats, mask, boxes, sizes, caps)
        # identical to the masked model told that every (zero) padded row is a real region
        b = proper(feats, torch.ones_like(mask), boxes, sizes, caps)
        c = proper(feats, mask, boxes, sizes, caps)
    torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert (a[1] - c[1]).abs().max() > 1e-4  # the padded image differs from proper masking
    torch.testing.assert_close(a[0], c[0], atol=1e-6, rtol=0)  # the unpadded image does not


def test_init_switch_position_table_and_memory() -> None:
    """official_init reproduces the global xavier override (docs/models.md#m2-choices); the default keeps sinusoids."""
    paper, official = small(), small(official_init=True)
    table = sinusoid_table(55, 16)
    torch.testing.assert_close(paper.pos_emb.weight, table)
    assert paper.pos_emb.weight[0].abs().sum() == 0 and not paper.pos_emb.weight.requires_grad
    assert not torch.allclose(official.pos_emb.weight, table) and not official.pos_emb.weight.requires_grad
    assert official.pos_emb.weight.abs().max() <= math.sqrt(6 / (55 + 16))
    wide = dict(d_model=64, num_heads=1, num_memory=40, num_layers=1)  # d_k = 64, m = 40
    mk = small(official_init=True, **wide).encoder.attn[0].attention.m_k
    bound = math.sqrt(6 / (40 * 64 + 64))  # xavier on (1, m, d): fan_in = m*d, fan_out = d
    assert bound * 0.97 < mk.abs().max() <= bound
    mk = small(**wide).encoder.attn[0].attention.m_k
    assert abs(mk.std().item() - 1 / 64) < 1e-3  # N(0, std = 1/d_k)


def test_position_limit_is_a_clear_error() -> None:
    model = small(max_len=4)
    feats, mask, boxes, sizes, caps = batch()
    with pytest.raises(ValueError, match="max_len=4"):
        model(feats, mask, boxes, sizes, caps)


def test_docstrings_cite_equations() -> None:
    import models.captioners.m2 as m2
    import models.layers.m2_attention as m2a

    assert "Eq. 2" in M2Attention.__doc__ and "Eq. 4" in m2a.PositionWiseFF.__doc__
    assert "Eq. 6-8" in MeshedDecoderLayer.meshed.__doc__ and "Eq. 5" in m2.__doc__
