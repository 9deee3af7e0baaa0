"""The self-attentive grounded sentence encoder (pipeline/embedding/sentence_encoder.py) and its losses: shapes,
masking, the equations of Yoo et al. 2017 §3.1-3.3, the ablation and objective switches, Eq. 1 on hand-built batches."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.core.errors import ConfigError
from pipeline.embedding.losses import caption_loss, cosine_matrix, ranking_loss
from pipeline.embedding.sentence_encoder import SentenceEncoder, build_sentence_encoder, sentence_tensor

SMALL = dict(word_dim=6, hidden_size=5, attn_hidden=7, attn_rows=4, image_head_hidden=9, decoder_hidden=8)


def make(**kw) -> SentenceEncoder:
    torch.manual_seed(0)
    return build_sentence_encoder(30, 11, **{**SMALL, **kw}).eval()


SENTENCES = [[4, 5, 6], [7], [8, 9, 10, 11, 12, 13], [14, 15]]


def test_shapes_masking_and_rows_sum_to_one() -> None:
    m = make()
    tokens, lengths = sentence_tensor(SENTENCES)
    out = m.encode(tokens, lengths)
    b, t = tokens.shape
    assert out["attention"].shape == (b, 4, t) and out["h_S"].shape == (b, 5) and out["h_A"].shape == (b, 5)
    assert out["h"].shape == (b, 10) == (b, m.rep_dim)
    att = out["attention"]
    for i, n in enumerate(lengths.tolist()):
        assert torch.all(att[i, :, n:] == 0), "padding words must receive exactly zero attention"
        assert torch.all(att[i, :, :n] > 0)
    torch.testing.assert_close(att.sum(-1), torch.ones(b, 4))
    assert m.predict_image(out["h"]).shape == (b, 11)
    targets = torch.tensor([[1, 4, 5, 2, 0], [1, 6, 2, 0, 0], [1, 7, 8, 9, 2], [1, 3, 2, 0, 0]])
    assert m.decode_teacher_forced(out["h"], targets).shape == (b, 4, 30)


def test_padding_does_not_change_a_sentence() -> None:
    m = make()
    alone = m.encode(*sentence_tensor([SENTENCES[1]]))
    batch = m.encode(*sentence_tensor(SENTENCES))
    torch.testing.assert_close(batch["h"][1], alone["h"][0])
    torch.testing.assert_close(batch["attention"][1, :, :2], alone["attention"][0])


@pytest.mark.parametrize("merge", ["max", "concat"])
def test_equations_by_hand(merge: str) -> None:
    """h_S = max(h→_T, h←_1); A = softmax_T(W_a2 tanh(W_a1 H)); h_A = max_rows(A Hᵀ); h = [h_A; h_S]."""
    m = make(state_merge=merge)
    tokens, lengths = sentence_tensor([SENTENCES[2]])
    out = m.encode(tokens, lengths)
    states, (h_n, _) = m.lstm(m.embed(tokens))  # one unpadded sentence: no packing needed
    d = m.hidden_size
    fwd_final, bwd_final = states[0, -1, :d], states[0, 0, d:]
    torch.testing.assert_close(h_n[0, 0], fwd_final)
    h_s = torch.maximum(fwd_final, bwd_final)
    torch.testing.assert_close(out["h_S"][0], h_s)
    H = states[0] if merge == "concat" else torch.maximum(states[0, :, :d], states[0, :, d:])  # (T, d)
    w1, w2 = m.attention.w_a1.weight, m.attention.w_a2.weight
    A = torch.softmax(w2 @ torch.tanh(w1 @ H.T), dim=1)  # (n_a, T), softmax over T
    C = A @ H
    torch.testing.assert_close(out["attention"][0], A)
    torch.testing.assert_close(out["h"][0], torch.cat([C.max(0).values, h_s]))
    assert m.rep_dim == (2 * d if merge == "max" else 3 * d)


def test_ablation_switch() -> None:
    m = make(self_attention=False)
    out = m.encode(*sentence_tensor(SENTENCES))
    assert "attention" not in out and m.attention is None and m.rep_dim == 5
    torch.testing.assert_close(out["h"], out["h_S"])
    assert not any("w_a" in n for n, _ in m.named_parameters())
    assert make().rep_dim == 10


def test_objective_switch_builds_the_heads() -> None:
    img, cap, both = make(objective="cap2img"), make(objective="cap2cap"), make(objective="cap2all")
    assert img.image_head is not None and img.decoder is None
    assert cap.image_head is None and cap.decoder is not None
    assert both.image_head is not None and both.decoder is not None
    assert len(img.image_head) == 3 * 3 + 1  # 4 layers: (Linear, ReLU, Dropout) x 3 + Linear
    with pytest.raises(ConfigError, match="no image head"):
        cap.predict_image(torch.zeros(1, cap.rep_dim))
    with pytest.raises(ConfigError, match="objective must be one of"):
        make(objective="img2cap")
    with pytest.raises(ConfigError):
        make(state_merge="mean")


def test_initialisation_is_orthogonal_for_recurrent_weights() -> None:
    m = make()
    for chunk in m.lstm.weight_hh_l0.data.chunk(4, 0):
        torch.testing.assert_close(chunk @ chunk.T, torch.eye(chunk.shape[0]), atol=1e-5, rtol=0)
    assert torch.all(m.embed.weight[0] == 0)


def test_ranking_loss_equals_eq1_on_a_hand_built_batch() -> None:
    sim = torch.tensor([[0.9, 0.1, -0.3], [0.2, 0.5, 0.4], [-0.1, 0.6, 0.3]])
    own = torch.arange(3)
    total = 0.0
    for i in range(3):  # Σ over positives (i, i), Σ over every negative pair (j, k), j != k, of the batch
        for j in range(3):
            for k in range(3):
                if j != k:
                    total += math.exp(sim[j, k] - sim[i, i])
    assert ranking_loss(sim, own, "batch").item() == pytest.approx(math.log(1 + total), rel=1e-6)
    per = [math.log(1 + sum(math.exp(sim[i, k] - sim[i, i]) for k in range(3) if k != i)) for i in range(3)]
    assert ranking_loss(sim, own, "sample").item() == pytest.approx(sum(per) / 3, rel=1e-6)


def test_ranking_loss_with_captions_sharing_an_image() -> None:
    """Two captions of image 0: neither is the other's negative (negatives = other images' columns)."""
    sim = torch.tensor([[0.8, 0.1, 0.0], [0.6, 0.7, -0.2], [0.3, 0.9, 0.1], [0.0, 0.2, 0.5]])
    own = torch.tensor([0, 0, 1, 2])
    negs = [(c, j) for c in range(4) for j in range(3) if j != own[c]]
    total = sum(math.exp(sim[c2, j] - sim[c, own[c]]) for c in range(4) for c2, j in negs)
    assert ranking_loss(sim, own, "batch").item() == pytest.approx(math.log(1 + total), rel=1e-6)
    assert ranking_loss(sim[:1, :1], torch.tensor([0])).item() == 0.0
    with pytest.raises(ConfigError):
        ranking_loss(sim, own, "hinge")


def test_ranking_loss_prefers_matched_pairs_and_trains() -> None:
    good = torch.eye(4) * 2 - 1
    bad = -good
    assert ranking_loss(good, torch.arange(4)) < ranking_loss(bad, torch.arange(4))
    pred, img = torch.randn(4, 3), torch.randn(4, 3)
    expect = torch.tensor([[torch.nn.functional.cosine_similarity(p, q, dim=0).item() for q in img] for p in pred])
    torch.testing.assert_close(cosine_matrix(pred, img), expect)


def test_caption_loss_ignores_padding() -> None:
    logits = torch.randn(2, 3, 7)
    targets = torch.tensor([[1, 4, 2, 0], [1, 5, 6, 2]])
    nll = -torch.log_softmax(logits, -1)
    expect = (nll[0, 0, 4] + nll[0, 1, 2] + nll[1, 0, 5] + nll[1, 1, 6] + nll[1, 2, 2]) / 5
    torch.testing.assert_close(caption_loss(logits, targets), expect)
