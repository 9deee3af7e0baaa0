"""Decoding (models/decoding/): greedy, sampling, beam search, on real captioners and on a bigram model.

The bigram model is a tiny real :class:`Captioner` whose next-word distribution depends only on the previous
word (a learnable table), so exact answers (exhaustive search, penalised ranking) can be computed by hand.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import models
from models.captioners.base import Captioner
from models.decoding import (
    DecodeOptions,
    beam_search,
    decoding_options,
    generate,
    greedy,
    length_penalty,
    sample,
    trigram_block_mask,
)
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS, EOS, PAD, UNK

V = 23
FAMILY = ["san", "nsan", "gsan", "ngsan"]


class BigramCaptioner(Captioner):
    """p(w_t | w_{t-1}) from a table ``(V, V)`` of logits, plus a per-image offset row (so images differ)."""

    def __init__(self, table: torch.Tensor, image_bias: torch.Tensor | None = None) -> None:
        super().__init__(table.shape[0])
        self.table = torch.nn.Parameter(table.clone())
        self.image_bias = image_bias
        self.rows_seen: list[int] = []

    def encode(self, feats, mask, boxes, sizes):
        bias = feats[:, 0, : self.vocab_size] if self.image_bias is None else self.image_bias
        return {"bias": bias}

    def init_state(self, enc):
        return {"prev": torch.full((enc["bias"].shape[0],), BOS, dtype=torch.long)}

    def step(self, tokens, enc, state):
        self.rows_seen.append(int(tokens.shape[0]))
        return torch.log_softmax(self.table[tokens] + enc["bias"], -1), {"prev": tokens}

    def decode_teacher_forced(self, enc, captions):
        return torch.log_softmax(self.table[captions] + enc["bias"][:, None], -1)


def small(name: str) -> Captioner:
    torch.manual_seed(0)
    model = models.build_captioner(name, V, d_model=64, num_heads=4, d_ff=128, num_layers=2, feat_dim=32)
    return model.eval()


def batch(b: int = 4, n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.rand(b, n, 32, generator=g) * 3
    xy = torch.rand(b, n, 2, generator=g) * 100
    boxes = torch.cat([xy, xy + 10 + torch.rand(b, n, 2, generator=g) * 50], -1)
    mask = torch.ones(b, n, dtype=torch.bool)
    mask[0, 4:] = False
    return feats, mask, boxes, torch.full((b, 2), 200.0)


def seq_logprob(model: BigramCaptioner, img: int, seq: list[int]) -> float:
    logp = torch.log_softmax(model.table.detach() + model.image_bias[img], -1)
    prev, total = BOS, 0.0
    for w in seq:
        total += float(logp[prev, w])
        prev = w
    return total


def words(tokens: torch.Tensor) -> list[int]:
    out = []
    for w in tokens.tolist():
        out.append(w)
        if w == EOS:
            break
    return [w for w in out if w != PAD]


@pytest.mark.parametrize("name", FAMILY)
def test_beam_one_equals_greedy(name: str) -> None:
    model = small(name)
    with torch.no_grad():
        enc = model.encode(*batch())
        g = greedy(model, enc, DecodeOptions(method="greedy", max_len=15))
        b = beam_search(model, enc, DecodeOptions(beam_size=1, max_len=15, length_penalty=0.7, stop_rule="first_k"))
        e = beam_search(model, enc, DecodeOptions(beam_size=1, max_len=15))
    for out in (b, e):  # first_k with any penalty, and the exact rule without one, are greedy at beam 1
        t = min(g.tokens.shape[-1], out.tokens.shape[-1])
        assert torch.equal(g.tokens[..., :t], out.tokens[..., :t]) and torch.equal(g.lengths, out.lengths)
    torch.testing.assert_close(g.logprob, b.logprob, atol=1e-4, rtol=0)
    assert (g.lengths > 1).any()  # not trivially ending at once


@pytest.mark.parametrize("name", ["san", "ngsan"])
def test_top_k_one_sampling_equals_greedy(name: str) -> None:
    model = small(name)
    with torch.no_grad():
        enc = model.encode(*batch())
        g = greedy(model, enc, DecodeOptions(method="greedy", max_len=12))
        s = sample(
            model,
            enc,
            DecodeOptions(method="sample", top_k=1, temperature=0.7, max_len=12, n_best=2),
            generator=torch.Generator().manual_seed(3),
        )
    assert s.tokens.shape[:2] == (4, 2)
    for j in range(2):
        assert torch.equal(s.tokens[:, j], g.tokens[:, 0])
    torch.testing.assert_close(s.logprob[:, 0], g.logprob[:, 0])


def test_beam_nbest_sorted_and_scores_consistent() -> None:
    model = small("san")
    opts = DecodeOptions(beam_size=5, n_best=5, max_len=10, length_penalty=0.6)
    with torch.no_grad():
        enc = model.encode(*batch())
        out = beam_search(model, enc, opts)
        # re-score every hypothesis with teacher forcing: its summed log-prob must match
        for i in range(4):
            for j in range(5):
                seq = words(out.tokens[i, j])
                assert len(seq) == int(out.lengths[i, j])
                caps = torch.tensor([[BOS] + seq])
                lp = model.decode_teacher_forced(models.index_state(enc, torch.tensor([i])), caps[:, :-1])
                total = lp[0].gather(1, caps[0, 1:, None]).sum()
                assert abs(float(total) - float(out.logprob[i, j])) < 1e-3
                expect = float(out.logprob[i, j]) / ((5 + len(seq)) / 6) ** 0.6
                assert abs(expect - float(out.scores[i, j])) < 1e-4
    assert torch.all(out.scores[:, :-1] >= out.scores[:, 1:])
    assert len({tuple(words(out.tokens[0, j])) for j in range(5)}) == 5  # distinct hypotheses


def _bigram(seed: int = 0, vocab: int = 7, images: int = 3) -> BigramCaptioner:
    g = torch.Generator().manual_seed(seed)
    return BigramCaptioner(torch.randn(vocab, vocab, generator=g) * 2, torch.randn(images, vocab, generator=g))


def _all_captions(vocab: int, max_len: int) -> list[list[int]]:
    allowed = [w for w in range(vocab) if w not in (PAD, BOS)]
    words_ = [w for w in allowed if w != EOS]
    out = []
    for length in range(1, max_len + 1):
        for body in itertools.product(words_, repeat=length - 1):
            out.append([*body, EOS])
        if length == max_len:
            out.extend(list(body) for body in itertools.product(words_, repeat=length))
    return out


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_wide_beam_equals_exhaustive_search(alpha: float) -> None:
    model = _bigram()
    max_len = 3
    opts = DecodeOptions(beam_size=80, n_best=4, max_len=max_len, length_penalty=alpha)
    with torch.no_grad():
        out = beam_search(model, model.encode(torch.zeros(3, 1, 7), None, None, None), opts)
    for img in range(3):
        ranked = sorted(
            ((seq_logprob(model, img, c) / ((5 + len(c)) / 6) ** alpha, c) for c in _all_captions(7, max_len)),
            key=lambda x: -x[0],
        )
        for j in range(4):
            assert words(out.tokens[img, j])[: int(out.lengths[img, j])] == ranked[j][1]
            assert abs(float(out.scores[img, j]) - ranked[j][0]) < 1e-5


def test_length_penalty_changes_ranking_as_its_formula_says() -> None:
    # from BOS: EOS at once (log p = log .5) or word 4 (log p = log .5), after 4: EOS almost surely
    table = torch.full((6, 6), -30.0)
    table[BOS, EOS] = 0.0
    table[BOS, 4] = math.log(0.9)
    table[4, EOS] = 0.0
    model = BigramCaptioner(table, torch.zeros(1, 6))
    enc = model.encode(None, None, None, None)
    short = seq_logprob(model, 0, [EOS])  # length 1
    long_ = seq_logprob(model, 0, [4, EOS])  # length 2
    assert short > long_
    for alpha in (0.0, 0.5, 2.0, 8.0):
        with torch.no_grad():
            out = beam_search(model, enc, DecodeOptions(beam_size=2, n_best=2, max_len=4, length_penalty=alpha))
        s_short = short / float(length_penalty(1, alpha))
        s_long = long_ / float(length_penalty(2, alpha))
        best = [EOS] if s_short >= s_long else [4, EOS]
        assert words(out.tokens[0, 0]) == best
        assert abs(float(out.scores[0, 0]) - max(s_short, s_long)) < 1e-5
    # the formula flips the ranking somewhere between alpha = 0 and 8
    assert short / float(length_penalty(1, 8.0)) < long_ / float(length_penalty(2, 8.0))
    avg = beam_search(
        model, enc, DecodeOptions(beam_size=2, n_best=2, max_len=4, length_penalty=1.0, length_penalty_kind="avg")
    )
    assert abs(float(avg.scores[0, 0].detach()) - max(short / 1, long_ / 2)) < 1e-5
    avg.logprob[0, 0].backward()  # beam scores keep their graph (beam-based SCST)
    assert model.table.grad is not None and float(model.table.grad[BOS].abs().sum()) > 0.1


def test_trigram_blocking() -> None:
    table = torch.full((7, 7), -5.0)
    table[BOS, 4] = 5.0
    table[4, 5] = 5.0
    table[5, 4] = 5.0
    table[5, 6] = 3.0
    table[6, 4] = 4.0
    table[4, EOS] = 1.0
    table[5, EOS] = 1.0
    model = BigramCaptioner(table, torch.zeros(2, 7))
    enc = model.encode(None, None, None, None)
    free = greedy(model, enc, DecodeOptions(method="greedy", max_len=8))
    assert words(free.tokens[0, 0]) == [4, 5, 4, 5, 4, 5, 4, 5]  # the loop without blocking
    blocked = greedy(model, enc, DecodeOptions(method="greedy", max_len=8, block_trigrams=True))
    seq = words(blocked.tokens[0, 0])
    assert seq[:3] == [4, 5, 4] and seq != words(free.tokens[0, 0])
    trigrams = [tuple(seq[i : i + 3]) for i in range(len(seq) - 2)]
    assert len(trigrams) == len(set(trigrams)), seq
    beams = beam_search(model, enc, DecodeOptions(beam_size=3, n_best=3, max_len=8, block_trigrams=True))
    for j in range(3):
        s = words(beams.tokens[0, j])
        tri = [tuple(s[i : i + 3]) for i in range(len(s) - 2)]
        assert len(tri) == len(set(tri)), s


def test_trigram_block_mask_direct() -> None:
    hist = torch.tensor([[4, 5, 6, 4, 5], [4, 5, 6, 7, 8]])
    mask = trigram_block_mask(hist, 10)
    assert mask[0].nonzero().flatten().tolist() == [6]
    assert not mask[1].any()


def test_specials_never_generated_and_unk_suppression() -> None:
    table = torch.zeros(6, 6)
    table[:, PAD] = 9.0
    table[:, BOS] = 8.0
    table[:, UNK] = 7.0
    model = BigramCaptioner(table, torch.zeros(1, 6))
    enc = model.encode(None, None, None, None)
    out = greedy(model, enc, DecodeOptions(method="greedy", max_len=5))
    assert words(out.tokens[0, 0])[0] == UNK
    out = greedy(model, enc, DecodeOptions(method="greedy", max_len=5, suppress_unk=True))
    assert set(words(out.tokens[0, 0])) <= {EOS, 4, 5}


def test_finished_rows_stop_costing_compute() -> None:
    table = torch.full((6, 6), -9.0)
    table[BOS, 4] = 9.0
    table[4, 4] = 9.0
    table[4, EOS] = 0.0
    bias = torch.zeros(4, 6)
    bias[:2, EOS] = 30.0  # images 0, 1 end at once, images 2, 3 run to max_len
    model = BigramCaptioner(table, bias)
    enc = model.encode(None, None, None, None)
    greedy(model, enc, DecodeOptions(method="greedy", max_len=6))
    assert model.rows_seen == [4] + [2] * 5
    model.rows_seen.clear()
    beam_search(model, enc, DecodeOptions(beam_size=2, max_len=6))
    assert model.rows_seen[0] == 8 and model.rows_seen[-1] == 4


def test_sampling_filters_and_gradients() -> None:
    model = _bigram(seed=1, vocab=9)
    enc = model.encode(None, None, None, None)
    g = torch.Generator().manual_seed(0)
    out = sample(model, enc, DecodeOptions(method="sample", top_k=2, max_len=6, n_best=50), generator=g)
    assert out.tokens.shape[:2] == (3, 50)
    # with top-k = 2 the first word is one of the 2 most likely allowed first words of each image
    for img in range(3):
        logits = (model.table[BOS] + model.image_bias[img]).detach().clone()
        logits[[PAD, BOS]] = -1e9
        top2 = set(logits.topk(2).indices.tolist())
        assert set(out.tokens[img, :, 0].tolist()) <= top2
        assert len(set(out.tokens[img, :, 0].tolist())) == 2  # both do occur in 50 samples
    # token log-probs are the model's and carry gradients (for SCST)
    out.logprob.sum().backward()
    assert model.table.grad is not None and model.table.grad.abs().sum() > 0
    nucleus = sample(model, enc, DecodeOptions(method="sample", top_p=1e-6, max_len=6), generator=g)
    assert torch.equal(nucleus.tokens, greedy(model, enc, DecodeOptions(method="greedy", max_len=6)).tokens)


def test_decoding_options_from_model_yaml() -> None:
    opts = decoding_options("ngsan")
    assert opts.method == "beam" and opts.beam_size == 3  # the paper's beam width
    assert decoding_options("san", ["beam_size=5", "n_best=2"]).beam_size == 5
    with pytest.raises(ConfigError):
        decoding_options("san", ["beam_sise=5"])
    with pytest.raises(ConfigError):
        DecodeOptions(beam_size=2, n_best=3)


def test_generate_entry_point() -> None:
    model = small("nsan")
    with torch.no_grad():
        out = generate(model, *batch(), DecodeOptions(beam_size=3, n_best=2, max_len=8))
    assert out.tokens.shape[:2] == (4, 2) and out.tokens.shape[2] <= 8
    assert torch.all(out.lengths >= 1)
