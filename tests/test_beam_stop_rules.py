"""Beam-search stop rules (models/decoding/, models/decoding/beam_official.py).

* ``exact`` never returns a caption scoring below one the search would still have found; a hand-built
  language model shows ``first_k`` (stop at beam_size finished) returning the worse caption.
* ``official_m2`` / ``official_aoanet`` equal direct re-statements of the two releases' searches (written
  below, loop by loop, as the release code reads) on random history-dependent language models.
"""

from __future__ import annotations

import math

import pytest
import torch

from models.captioners.base import Captioner
from models.decoding import DecodeOptions, beam_search
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS, EOS, PAD, UNK


class PrefixLM(Captioner):
    """Next-word log-probabilities from a table over the whole prefix (unknown prefixes: ``fallback``)."""

    def __init__(self, table: dict[tuple[int, ...], dict[int, float]], vocab: int, fallback: float = -20.0) -> None:
        super().__init__(vocab)
        self.table, self.fallback = table, fallback

    def encode(self, feats, mask, boxes, sizes):
        return {"img": torch.zeros(1, 1)}

    def init_state(self, enc):
        return {"prefix": torch.zeros(enc["img"].shape[0], 0, dtype=torch.long)}

    def step(self, tokens, enc, state):
        prefix = torch.cat([state["prefix"], tokens[:, None]], 1)
        logits = torch.full((tokens.shape[0], self.vocab_size), self.fallback)
        for r, row in enumerate(prefix.tolist()):
            for w, v in self.table.get(tuple(row[1:]), {}).items():
                logits[r, w] = v
        return torch.log_softmax(logits, -1), {"prefix": prefix}

    def decode_teacher_forced(self, enc, captions):
        raise NotImplementedError


class RandomLM(Captioner):
    """A random language model whose next word depends on the last two words, the step and the image."""

    def __init__(self, vocab: int, images: int, seed: int, sharp: float = 3.0) -> None:
        super().__init__(vocab)
        g = torch.Generator().manual_seed(seed)
        self.a = torch.randn(vocab, vocab, generator=g) * sharp
        self.b = torch.randn(vocab, vocab, generator=g) * sharp / 2
        self.c = torch.randn(32, vocab, generator=g)
        self.img = torch.randn(images, vocab, generator=g) * sharp
        self.a[:, EOS] += 1.0

    def encode(self, feats, mask, boxes, sizes):
        return {"img": self.img}

    def init_state(self, enc):
        n = enc["img"].shape[0]
        return {"prev": torch.full((n,), BOS), "t": torch.zeros(n, dtype=torch.long)}

    def step(self, tokens, enc, state):
        logits = self.a[tokens] + self.b[state["prev"]] + self.c[state["t"]] + enc["img"]
        return torch.log_softmax(logits, -1), {"prev": tokens, "t": state["t"] + 1}

    def decode_teacher_forced(self, enc, captions):
        raise NotImplementedError


def words(row: torch.Tensor) -> list[int]:
    return [int(w) for w in row if int(w) != PAD]


def caption(out, i: int, j: int) -> list[int]:
    """Hypothesis ``j`` of image ``i`` up to its length (official M2 may generate <pad> as a word)."""
    return out.tokens[i, j, : int(out.lengths[i, j])].tolist()


# ------------------------------------------------------------------------------------------ exact rule


def test_exact_rule_finds_the_better_caption_that_stopping_at_k_misses() -> None:
    """k = 2. Step 1: <eos> (log .35 = -1.05) ends; step 2: A <eos> (-2.63) ends as the 2nd finished caption
    while A C (-0.73) is still live; A C <eos> (-0.79) beats both. first_k stops at 2 finished captions."""
    a, b, c = 4, 5, 6
    table = {
        (): {EOS: math.log(0.35), a: math.log(0.6), b: math.log(0.05)},
        (a,): {EOS: math.log(0.12), c: math.log(0.8), b: math.log(0.08)},
        (b,): {EOS: math.log(0.5), c: math.log(0.5)},
        (a, c): {EOS: math.log(0.95), b: math.log(0.05)},
    }
    model = PrefixLM(table, 8)
    enc = model.encode(None, None, None, None)
    with torch.no_grad():
        first_k = beam_search(model, enc, DecodeOptions(beam_size=2, max_len=6, stop_rule="first_k"))
        exact = beam_search(model, enc, DecodeOptions(beam_size=2, max_len=6))
    assert words(first_k.tokens[0, 0]) == [EOS]
    assert words(exact.tokens[0, 0]) == [a, c, EOS]
    want = math.log(0.6) + math.log(0.8) + math.log(0.95)
    assert abs(float(exact.scores[0, 0]) - want) < 1e-5
    assert float(exact.scores[0, 0]) > float(first_k.scores[0, 0]) + 0.25


@pytest.mark.parametrize("alpha", [0.0, 1.0])
def test_exact_rule_never_worse_than_first_k_and_stops_early(alpha: float) -> None:
    better = 0
    for seed in range(30):
        model = RandomLM(12, 3, seed)
        enc = model.encode(None, None, None, None)
        with torch.no_grad():
            fk = beam_search(
                model, enc, DecodeOptions(beam_size=3, max_len=12, length_penalty=alpha, stop_rule="first_k")
            )
            ex = beam_search(model, enc, DecodeOptions(beam_size=3, max_len=12, length_penalty=alpha))
            full = beam_search(model, enc, DecodeOptions(beam_size=3, max_len=12, length_penalty=alpha, n_best=3))
        assert torch.all(ex.scores[:, 0] >= fk.scores[:, 0] - 1e-6)
        better += int((ex.scores[:, 0] > fk.scores[:, 0] + 1e-6).sum())
        assert torch.equal(full.scores[:, 0], ex.scores[:, 0])  # n_best does not change the best caption
    assert better > 0  # the rules differ on random models, too


def test_reachable_bound_under_length_penalty() -> None:
    from models.decoding import length_penalty, reachable_bound

    opts = DecodeOptions(max_len=10, length_penalty=1.0)
    got = reachable_bound(torch.tensor([-3.0]), 4, opts)
    assert abs(float(got) - (-3.0 / float(length_penalty(10, 1.0)))) < 1e-6
    neg = DecodeOptions(max_len=10, length_penalty=-0.5)  # lp decreasing: the nearest end is the best
    assert abs(float(reachable_bound(torch.tensor([-3.0]), 4, neg)) - (-3.0 / float(length_penalty(5, -0.5)))) < 1e-6


def test_official_rules_refuse_options_their_searches_lack() -> None:
    with pytest.raises(ConfigError, match="official_m2"):
        DecodeOptions(stop_rule="official_m2", length_penalty=0.5)
    with pytest.raises(ConfigError, match="official_aoanet"):
        DecodeOptions(stop_rule="official_aoanet", block_trigrams=True)
    with pytest.raises(ConfigError, match="stop_rule"):
        DecodeOptions(stop_rule="sometimes")


# ------------------------------------------------------------------------------ official re-statements


def m2_reference(
    model: Captioner, img: int, beam: int, max_len: int, bos: int = BOS, eos: int = EOS, carrier: int = UNK
) -> tuple[list[list[int]], list[float]]:
    """BeamSearch.apply/iter of meshed-memory-transformer, one image, written as the release reads.

    The release's index 0 (<unk>) carries finished beams; in this project's ids that word is UNK.
    """
    enc = {"img": model.encode(None, None, None, None)["img"][img : img + 1]}
    state = model.init_state(enc)
    seq_mask = torch.ones(1, beam, 1)
    seq_logprob = torch.zeros(1, 1, 1)
    outputs: list[torch.Tensor] = []
    selected_words = None
    for t in range(max_len):
        cur_beam = 1 if t == 0 else beam
        tokens = torch.full((1,), bos) if t == 0 else selected_words.view(-1)
        word_logprob, state = model.step(tokens, enc, state)
        word_logprob = word_logprob.view(1, cur_beam, -1)
        candidate = seq_logprob + word_logprob
        if t > 0:
            mask = (selected_words.view(1, cur_beam) != eos).float().unsqueeze(-1)
            seq_mask = seq_mask * mask
            old = seq_logprob.expand_as(candidate).contiguous()
            kept = old[:, :, carrier].clone()
            old[:, :, :] = -999
            old[:, :, carrier] = kept
            candidate = seq_mask * candidate + old * (1 - seq_mask)
        vals, idx = torch.sort(candidate.view(1, -1), -1, descending=True)
        vals, idx = vals[:, :beam], idx[:, :beam]
        sel_beam = idx // candidate.shape[-1]
        selected_words = idx - sel_beam * candidate.shape[-1]
        rows = sel_beam.view(-1)
        state = {k: v.index_select(0, rows) for k, v in state.items()}
        if t == 0:
            enc = {"img": enc["img"].expand(beam, -1)}
        seq_logprob = vals.unsqueeze(-1)
        seq_mask = torch.gather(seq_mask, 1, sel_beam.unsqueeze(-1))
        outputs = [torch.gather(o, 1, sel_beam.unsqueeze(-1)) for o in outputs]
        outputs.append(selected_words.unsqueeze(-1))
    order = torch.sort(seq_logprob, 1, descending=True)[1]
    out = torch.gather(torch.cat(outputs, -1), 1, order.expand(1, beam, max_len))[0]
    caps = []
    for row in out.tolist():
        caps.append(row[: row.index(eos) + 1] if eos in row else row)
    return caps, torch.sort(seq_logprob, 1, descending=True)[0].view(-1).tolist()


def aoanet_reference(
    model: Captioner,
    img: int,
    beam: int,
    max_len: int,
    alpha: float = 0.0,
    bos: int = BOS,
    eos: int = EOS,
    unk: int = UNK,
) -> list[tuple[list[int], float]]:
    """CaptionModel.beam_search / beam_step of AoANet (group_size 1), one image, as the release reads
    (the release's ids: ``bos = eos = 0``, ``unk`` its last index)."""
    enc = {"img": model.encode(None, None, None, None)["img"][img : img + 1].expand(beam, -1)}
    state = model.init_state(enc)
    logprobs, state = model.step(torch.full((beam,), bos), enc, state)
    beam_seq = torch.zeros(max_len, beam, dtype=torch.long)
    beam_logprobs_sum = torch.zeros(beam)
    done = []
    for t in range(max_len):
        logprobsf = logprobs.data.float().clone()
        logprobsf[:, unk] = logprobsf[:, unk] - 1000  # the release's last index is its UNK word
        ys, ix = torch.sort(logprobsf, 1, True)
        candidates = []
        rows = 1 if t == 0 else beam
        for c in range(min(beam, ys.size(1))):
            for q in range(rows):
                candidates.append({"c": ix[q, c], "q": q, "p": beam_logprobs_sum[q] + ys[q, c].item()})
        candidates = sorted(candidates, key=lambda x: -x["p"])
        prev = beam_seq[:t].clone()
        new_state = {k: v.clone() for k, v in state.items()}
        for vix in range(beam):
            v = candidates[vix]
            if t >= 1:
                beam_seq[:t, vix] = prev[:, v["q"]]
            for key in new_state:
                new_state[key][vix] = state[key][v["q"]]
            beam_seq[t, vix] = v["c"]
            beam_logprobs_sum[vix] = v["p"]
        state = new_state
        for vix in range(beam):
            if beam_seq[t, vix] == eos or t == max_len - 1:
                p = beam_logprobs_sum[vix].item()
                if alpha:
                    p = p / (((5 + t + 1) / 6) ** alpha)
                done.append((beam_seq[: t + 1, vix].tolist(), p))
                beam_logprobs_sum[vix] = -1000
        logprobs, state = model.step(beam_seq[t].clone(), enc, state)  # the release feeds a copy (it.cuda())
        logprobs = torch.log_softmax(logprobs / 1.0, dim=-1)
    return sorted(done, key=lambda x: -x[1])[:beam]


@pytest.mark.parametrize("beam", [2, 3, 5])
def test_official_m2_equals_the_release_search(beam: int) -> None:
    for seed in range(12):
        model = RandomLM(9, 3, seed, sharp=2.0)
        enc = model.encode(None, None, None, None)
        with torch.no_grad():
            out = beam_search(
                model, enc, DecodeOptions(beam_size=beam, n_best=beam, max_len=7, stop_rule="official_m2")
            )
            for img in range(3):
                caps, scores = m2_reference(model, img, beam, 7)
                for j in range(beam):
                    assert caption(out, img, j) == caps[j], (seed, img, j)
                    assert float(out.scores[img, j]) == pytest.approx(scores[j], abs=1e-6)
                    assert int(out.lengths[img, j]) == len(caps[j])


def test_official_m2_generates_specials_and_keeps_finished_beams() -> None:
    """The release bans nothing; a finished caption stays in the beam (first_k/exact would drop it)."""
    model = RandomLM(6, 2, 0, sharp=0.1)  # nearly uniform: specials are picked
    enc = model.encode(None, None, None, None)
    with torch.no_grad():
        out = beam_search(model, enc, DecodeOptions(beam_size=5, n_best=5, max_len=6, stop_rule="official_m2"))
    seen = {w for i in range(2) for j in range(5) for w in caption(out, i, j)}
    assert {PAD, BOS, UNK} & seen


@pytest.mark.parametrize(("beam", "alpha"), [(2, 0.0), (3, 0.0), (2, 1.0)])
def test_official_aoanet_equals_the_release_search(beam: int, alpha: float) -> None:
    for seed in range(12):
        model = RandomLM(9, 3, seed, sharp=2.0)
        enc = model.encode(None, None, None, None)
        opts = DecodeOptions(beam_size=beam, n_best=beam, max_len=7, stop_rule="official_aoanet", length_penalty=alpha)
        with torch.no_grad():
            out = beam_search(model, enc, opts)
            for img in range(3):
                ref = aoanet_reference(model, img, beam, 7, alpha)
                for j in range(beam):
                    assert caption(out, img, j) == ref[j][0], (seed, img, j)
                    assert float(out.scores[img, j]) == pytest.approx(ref[j][1], abs=1e-6)


def test_official_rules_differ_from_the_exact_rule_somewhere() -> None:
    differ = {"official_m2": 0, "official_aoanet": 0}
    for seed in range(20):
        model = RandomLM(9, 3, seed, sharp=2.0)
        enc = model.encode(None, None, None, None)
        with torch.no_grad():
            ex = beam_search(model, enc, DecodeOptions(beam_size=2, max_len=7))
            for rule in differ:
                off = beam_search(model, enc, DecodeOptions(beam_size=2, max_len=7, stop_rule=rule))
                differ[rule] += sum(caption(ex, i, 0) != caption(off, i, 0) for i in range(3))
    assert all(v > 0 for v in differ.values()), differ
