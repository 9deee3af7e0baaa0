"""The converted released models compute what the releases compute: teacher-forced log-probabilities of this
project's models (after conversion) equal a re-statement of each release's forward pass written here directly
on the release's own state dict (its key names, its token ids, its vocabulary rows), in float64.

The re-statements follow M2's ``models/transformer/{encoders,decoders,attention,utils}.py`` (Cornia et al. 2020:
input projection, memory-augmented encoder with the mask taken after the input LayerNorm, meshed decoder with
three gated levels / sqrt(3), position ids from 1, data field zero-padding to 50 rows) and AoANet's
``models/AoAModel.py`` (Huang et al. 2019: pre-norm refiner with AoA, mean-pooled refined features,
values = first half of ``ctx2att``, LSTM + multi-head attention + AoA decoder, index 0 = BOS/EOS).

Then the captions: the converted model under ``stop_rule: official_*`` gives the same captions and scores as the
re-stated release forward driven by the re-stated release search (tests/test_beam_stop_rules.py), in the
release's own ids.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from release_helpers import write_aoanet, write_m2_checkpoint, write_m2_vocab

from models.loading import load_captioner

WORDS = ["a", "man", "dog", "on", "the", "grass", "with", "ball", "red"]


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))


def _lin(s, prefix, x):
    return x @ s[prefix + "weight"].T + (s[prefix + "bias"] if prefix + "bias" in s else 0)


# ---------------------------------------------------------------------------------------------------- M2


def _m2_attention(s, p, q_in, kv_in, masked, heads, memory):
    b, nq, d = q_in.shape
    dk = d // heads
    q = _lin(s, p + "fc_q.", q_in).view(b, nq, heads, dk).transpose(1, 2)
    k, v = _lin(s, p + "fc_k.", kv_in), _lin(s, p + "fc_v.", kv_in)
    nk = k.shape[1]
    if memory:
        m = s[p + "m_k"].shape[1]
        k = torch.cat([k, math.sqrt(dk) * s[p + "m_k"].expand(b, -1, -1)], 1)
        v = torch.cat([v, math.sqrt(m) * s[p + "m_v"].expand(b, -1, -1)], 1)
    k = k.view(b, -1, heads, dk).transpose(1, 2)
    v = v.view(b, -1, heads, dk).transpose(1, 2)
    att = q @ k.transpose(-1, -2) / math.sqrt(dk)
    att[..., :nk] = att[..., :nk].masked_fill(masked, float("-inf"))
    out = (torch.softmax(att, -1) @ v).transpose(1, 2).reshape(b, nq, d)
    return _lin(s, p + "fc_o.", out)


def _ln(s, p, x):
    return F.layer_norm(x, x.shape[-1:], s[p + "weight"], s[p + "bias"])


def m2_release_logprobs(s, feats, caps, heads=8):
    """M2's Transformer.forward(images, seq) in eval mode; ``feats`` already zero-padded to 50 rows."""
    x = _ln(s, "encoder.layer_norm.", torch.relu(_lin(s, "encoder.fc.", feats)))
    mask_enc = (x.sum(-1) == 0)[:, None, None, :]
    levels = []
    for i in range(3):
        p = f"encoder.layers.{i}."
        x = _ln(s, p + "mhatt.layer_norm.", x + _m2_attention(s, p + "mhatt.attention.", x, x, mask_enc, heads, True))
        x = _ln(s, p + "pwff.layer_norm.", x + _lin(s, p + "pwff.fc2.", torch.relu(_lin(s, p + "pwff.fc1.", x))))
        levels.append(x)
    b, t = caps.shape
    keep = (caps != 1).unsqueeze(-1).to(feats.dtype)
    self_masked = (torch.triu(torch.ones(t, t), 1).bool()[None] | (caps == 1)[:, None, :])[:, None]
    pos = torch.arange(1, t + 1).expand(b, t).masked_fill(caps == 1, 0)
    h = s["decoder.word_emb.weight"][caps] + s["decoder.pos_emb.weight"][pos]
    for i in range(3):
        p = f"decoder.layers.{i}."
        sa = (
            _ln(
                s,
                p + "self_att.layer_norm.",
                h + _m2_attention(s, p + "self_att.attention.", h, h, self_masked, heads, False),
            )
            * keep
        )
        total = 0
        for j in range(3):
            c = (
                _ln(
                    s,
                    p + "enc_att.layer_norm.",
                    sa + _m2_attention(s, p + "enc_att.attention.", sa, levels[j], mask_enc, heads, False),
                )
                * keep
            )
            total = total + c * torch.sigmoid(_lin(s, p + f"fc_alpha{j + 1}.", torch.cat([sa, c], -1)))
        m = total / math.sqrt(3) * keep
        h = _ln(s, p + "pwff.layer_norm.", m + _lin(s, p + "pwff.fc2.", torch.relu(_lin(s, p + "pwff.fc1.", m)))) * keep
    return torch.log_softmax(h @ s["decoder.fc.weight"].T, -1)


def test_m2_conversion_reproduces_the_release_forward(tmp_path) -> None:
    write_m2_vocab(tmp_path / "vocab.pkl", WORDS)
    state = write_m2_checkpoint(tmp_path / "m2.pth", 4 + len(WORDS), d=16, d_ff=24, m=3, d_in=12, max_len=12)
    model, _ = load_captioner(tmp_path / "m2.pth", companion=tmp_path / "vocab.pkl")
    model = model.double().eval()
    s = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    g = torch.Generator().manual_seed(0)
    counts = (7, 12)
    feats = torch.rand(2, 12, 12, generator=g, dtype=torch.float64) * 3
    mask = torch.arange(12)[None] < torch.tensor(counts)[:, None]
    feats = feats * mask[..., None]
    # release ids: <unk>0 <pad>1 <bos>2 <eos>3, words from 4; a padded caption checks the masks
    caps_release = torch.tensor([[2, 4, 5, 0, 6, 3, 1, 1], [2, 7, 8, 9, 10, 11, 12, 3]])
    to_ours = torch.tensor([3, 0, 1, 2] + list(range(4, 4 + len(WORDS))))  # release id -> project id
    padded = torch.cat([feats, torch.zeros(2, 50 - 12, 12, dtype=torch.float64)], 1)  # the data field's 50 rows
    want = m2_release_logprobs(s, padded, caps_release)
    with torch.no_grad():
        got = model(feats, mask, torch.zeros(2, 12, 4), torch.ones(2, 2), to_ours[caps_release])
    got_release_order = got[..., to_ours]  # release column i is project column to_ours[i]
    real = caps_release != 1
    torch.testing.assert_close(got_release_order[real], want[real], atol=1e-10, rtol=0)


# ------------------------------------------------------------------------------------------------- AoANet


def _hln(s, p, x):
    return s[p + "a_2"] * (x - x.mean(-1, keepdim=True)) / (x.std(-1, keepdim=True) + 1e-6) + s[p + "b_2"]


def _heads(x, h):
    b, n, d = x.shape
    return x.view(b, n, h, d // h).transpose(1, 2)


def _aoa_mha(q, k, v, mask, h):
    qh, kh, vh = _heads(q, h), _heads(k, h), _heads(v, h)
    sc = qh @ kh.transpose(-1, -2) / math.sqrt(qh.shape[-1])
    sc = sc.masked_fill(mask[:, None, None, :] == 0, -1e9)
    out = torch.softmax(sc, -1) @ vh
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


def _glu(s, p, x):
    y = _lin(s, p, x)
    a, b = y.chunk(2, -1)
    return a * torch.sigmoid(b)


def aoanet_release_logprobs(s, feats, mask, seq, heads=8):
    """AoAModel._forward(fc, att, seq, masks) in eval mode (``seq`` starts with 0 = BOS)."""
    x = torch.relu(_lin(s, "att_embed.0.", feats)) * mask[..., None]
    for i in range(6):
        p = f"refiner.layers.{i}."
        xn = _hln(s, p + "sublayer.0.norm.", x)
        att = _aoa_mha(
            _lin(s, p + "self_attn.linears.0.", xn),
            _lin(s, p + "self_attn.linears.1.", xn),
            _lin(s, p + "self_attn.linears.2.", xn),
            mask,
            heads,
        )
        x = x + _glu(s, p + "self_attn.aoa_layer.0.", torch.cat([att, xn], -1))
    x = _hln(s, "refiner.norm.", x)
    mean = (x * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    pa = _lin(s, "ctx2att.", x)
    d = x.shape[-1]
    values, keys = pa[..., :d], pa[..., d:]
    b = feats.shape[0]
    h = c = ctx = torch.zeros(b, d, dtype=feats.dtype)
    out = []
    for t in range(seq.shape[1] - 1):
        xt = torch.relu(s["embed.0.weight"][seq[:, t]])
        inp = torch.cat([xt, mean + ctx], -1)
        gates = (
            inp @ s["core.att_lstm.weight_ih"].T
            + s["core.att_lstm.bias_ih"]
            + h @ s["core.att_lstm.weight_hh"].T
            + s["core.att_lstm.bias_hh"]
        )
        i_g, f_g, g_g, o_g = gates.chunk(4, -1)
        c = torch.sigmoid(f_g) * c + torch.sigmoid(i_g) * torch.tanh(g_g)
        h = torch.sigmoid(o_g) * torch.tanh(c)
        q = _lin(s, "core.attention.linears.0.", _hln(s, "core.attention.norm.", h))[:, None]
        att = _aoa_mha(q, keys, values, mask, heads)[:, 0]
        ctx = _glu(s, "core.att2ctx.0.", torch.cat([att, h], -1))
        out.append(torch.log_softmax(_lin(s, "logit.", ctx), -1))
    return torch.stack(out, 1)


def test_aoanet_conversion_reproduces_the_release_forward(tmp_path) -> None:
    words = WORDS + ["UNK"]
    state = write_aoanet(tmp_path, words, d=16, d_in=12)
    model, _ = load_captioner(tmp_path / "model-best.pth", companion=tmp_path / "infos_aoanet-best.pkl")
    model = model.double().eval()
    s = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    g = torch.Generator().manual_seed(1)
    feats = torch.rand(2, 9, 12, generator=g, dtype=torch.float64) * 3
    mask = (torch.arange(9)[None] < torch.tensor([5, 9])[:, None]).double()
    feats = feats * mask[..., None]
    v = len(words)
    seq_release = torch.tensor([[0, 1, 2, v, 3, 0], [0, 4, 5, 6, 7, 8]])  # 0 = BOS/EOS, v = UNK
    to_ours = torch.tensor([2] + list(range(4, 4 + v - 1)) + [3])  # release id -> project id (0 -> <eos>)
    want = aoanet_release_logprobs(s, feats, mask, seq_release)
    ours_in = to_ours[seq_release]
    ours_in[:, 0] = 1  # the project's <bos> row is the release's row 0
    with torch.no_grad():
        got = model(feats, mask.bool(), torch.zeros(2, 9, 4), torch.ones(2, 2), ours_in[:, :-1])
    torch.testing.assert_close(got[..., to_ours], want, atol=1e-10, rtol=0)
    assert float(got[..., :2].exp().max()) == 0.0  # <pad>, <bos>: never produced


# ----------------------------------------------------------------- captions: release forward + release search


class _ReleaseStepper:
    """A release's forward (re-stated above, release ids) as a step function for the re-stated searches of
    tests/test_beam_stop_rules.py: the state is the prefix, each step recomputes it and keeps the last row."""

    def __init__(self, logprobs_fn, num_images: int) -> None:
        self.fn, self.num_images = logprobs_fn, num_images

    def encode(self, *args):
        return {"img": torch.arange(self.num_images)[:, None]}

    def init_state(self, enc):
        return {"prefix": torch.zeros(enc["img"].shape[0], 0, dtype=torch.long)}

    def step(self, tokens, enc, state):
        prefix = torch.cat([state["prefix"], tokens[:, None]], 1)
        return self.fn(enc["img"][:, 0], prefix).float(), {"prefix": prefix}


def test_m2_captions_equal_the_release_forward_with_the_release_search(tmp_path) -> None:
    from test_beam_stop_rules import m2_reference

    from models.decoding import DecodeOptions, beam_search

    write_m2_vocab(tmp_path / "vocab.pkl", WORDS)
    state = write_m2_checkpoint(tmp_path / "m2.pth", 4 + len(WORDS), seed=3, d=16, d_ff=24, m=3, d_in=12, max_len=12)
    model, ckpt = load_captioner(tmp_path / "m2.pth", companion=tmp_path / "vocab.pkl")
    model = model.double().eval()
    s = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    g = torch.Generator().manual_seed(2)
    n = 4
    feats = torch.rand(n, 12, 12, generator=g, dtype=torch.float64) * 3
    mask = torch.arange(12)[None] < torch.tensor([3, 12, 7, 10])[:, None]
    feats = feats * mask[..., None]
    padded = torch.cat([feats, torch.zeros(n, 38, 12, dtype=torch.float64)], 1)
    release = _ReleaseStepper(lambda img, prefix: m2_release_logprobs(s, padded[img], prefix)[:, -1], n)
    to_ours = [3, 0, 1, 2] + list(range(4, 4 + len(WORDS)))
    opts = DecodeOptions.from_mapping({**ckpt.decoding, "beam_size": 3, "n_best": 3, "max_len": 8})
    with torch.no_grad():
        out = beam_search(model, model.encode(feats, mask, torch.zeros(n, 12, 4), torch.ones(n, 2)), opts)
        for i in range(n):
            caps, scores = m2_reference(release, i, 3, 8, bos=2, eos=3, carrier=0)
            for j in range(3):
                assert out.tokens[i, j, : int(out.lengths[i, j])].tolist() == [to_ours[w] for w in caps[j]], (i, j)
                assert abs(float(out.scores[i, j]) - scores[j]) < 1e-5
    lengths = out.lengths.flatten().tolist()
    assert len(set(lengths)) > 1 and min(lengths) < 8, lengths  # captions that end early and that run to max_len


def test_aoanet_captions_equal_the_release_forward_with_the_release_search(tmp_path) -> None:
    from test_beam_stop_rules import aoanet_reference

    from models.decoding import DecodeOptions, beam_search

    words = WORDS + ["UNK"]
    state = write_aoanet(tmp_path, words, seed=4, d=16, d_in=12)
    state["logit.bias"][0] += 2.5  # a likelier <eos>: some captions end before max_len
    torch.save(state, tmp_path / "model-best.pth")
    model, ckpt = load_captioner(tmp_path / "model-best.pth", companion=tmp_path / "infos_aoanet-best.pkl")
    model = model.double().eval()
    s = {k: v.double() if v.is_floating_point() else v for k, v in state.items()}
    g = torch.Generator().manual_seed(5)
    n = 4
    feats = torch.rand(n, 9, 12, generator=g, dtype=torch.float64) * 3
    mask = (torch.arange(9)[None] < torch.tensor([5, 9, 2, 7])[:, None]).double()
    feats = feats * mask[..., None]

    def release_fn(img, prefix):
        seq = torch.cat([prefix, torch.zeros(len(prefix), 1, dtype=torch.long)], 1)
        return aoanet_release_logprobs(s, feats[img], mask[img], seq)[:, -1]

    v = len(words)
    to_ours = [2] + list(range(4, 4 + v - 1)) + [3]
    opts = DecodeOptions.from_mapping({**ckpt.decoding, "n_best": 2, "max_len": 8})
    with torch.no_grad():
        out = beam_search(model, model.encode(feats, mask.bool(), torch.zeros(n, 9, 4), torch.ones(n, 2)), opts)
        for i in range(n):
            ref = aoanet_reference(_ReleaseStepper(release_fn, n), i, 2, 8, bos=0, eos=0, unk=v)
            for j in range(2):
                assert out.tokens[i, j, : int(out.lengths[i, j])].tolist() == [to_ours[w] for w in ref[j][0]], (i, j)
                assert abs(float(out.scores[i, j]) - ref[j][1]) < 1e-5
    lengths = out.lengths.flatten().tolist()
    assert len(set(lengths)) > 1, lengths
