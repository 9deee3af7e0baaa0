"""The beam searches of the two released captioners, restated over the :class:`~models.captioners.base.Captioner`
interface.

``decoding.stop_rule: official_m2 | official_aoanet`` selects them, to reproduce the published numbers of
a released checkpoint (``models/released/``) caption for caption. Both differ from the project's own search
(:func:`models.decoding.beam_search`) in which hypotheses stay in the beam and when they stop; both rank by
the summed log-probability in float32, added step by step exactly as the releases do.

``official_m2``: the ``BeamSearch`` class of aimagelab/meshed-memory-transformer
(``models/beam_search/beam_search.py``; Cornia et al. 2020, evaluated with beam 5 and 20 steps):

* step 0 expands the single ``<bos>`` hypothesis; later steps run the decoder on all ``beam_size`` slots;
* the candidates of a live slot ``q`` are ``s_q + log p(w)`` for every word; a slot whose last word was
  ``<eos>`` is finished and offers one candidate that keeps ``s_q`` (carried by the release's index 0,
  ``<unk>``), every other word of it scoring -999;
* the ``beam_size`` best candidates of a descending sort over slots x words become the new slots: finished
  captions stay in the beam until better live candidates push them out;
* no word is banned (``<pad>``, ``<bos>`` and ``<unk>`` can be generated) and there is no length penalty;
* the release always runs ``max_len`` steps; here the loop ends once every slot has finished, after which the
  release only re-sorts the same slots; the slots are finally ranked by ``s``.

``official_aoanet``: ``CaptionModel.beam_search`` / ``beam_step`` of husthuaan/AoANet (Huang et al. 2019,
evaluated with beam 2; ``group_size`` 1, so no diversity term):

* the log-probability of ``<unk>`` (the release's last index) is lowered by 1000 before ranking;
* step 0 expands slot 0 only; every slot ``q`` proposes its ``beam_size`` best words ``c``; the candidates,
  listed word rank first (``c`` outer, ``q`` inner), are ranked by ``s_q + log p`` with a stable sort, and the
  first ``beam_size`` become the slots;
* a slot whose word is ``<eos>``, or any slot at step ``max_len``, is copied to the finished list with score
  ``s / lp(t + 1)`` (the ``length_penalty`` option; none by default) and its running score is set to -1000, so
  it is not extended (it still proposes words, which lose against live candidates);
* the log-probabilities of steps >= 1 pass through ``log_softmax`` a second time, as the release does;
* all ``max_len`` steps run; the finished captions are ranked by score (stable: earlier first). They are kept in
  per-image tensors (slot ``t * beam_size + q``) and ranked by a stable sort on the device, so the search reads
  nothing back before the end.
"""

from __future__ import annotations

import torch

from models.captioners.base import Captioner, State, index_state, state_device, state_rows
from models.decoding.options import DecodeOptions, Generated
from pipeline.core.vocab import BOS, EOS, PAD, UNK

M2_FROZEN = -999.0  # the score M2's search gives every other word of a finished slot
AOA_DEAD = -1000.0  # the running score AoANet's search gives a finished slot
AOA_UNK_PENALTY = 1000.0


def official_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """Dispatch on ``options.stop_rule`` (``official_m2`` or ``official_aoanet``)."""
    if options.stop_rule == "official_m2":
        return m2_search(model, enc, options)
    if options.stop_rule == "official_aoanet":
        return aoanet_search(model, enc, options)
    raise ValueError(f"not an official stop rule: {options.stop_rule!r}")


def _lengths(tokens: torch.Tensor) -> torch.Tensor:
    """Generated tokens up to and including the first ``<eos>`` (all of them if none)."""
    is_eos = tokens == EOS
    first = torch.where(
        is_eos.any(-1), is_eos.float().argmax(-1) + 1, torch.full_like(tokens[..., 0], tokens.shape[-1])
    )
    return first


def _pack(tokens: torch.Tensor, logprob: torch.Tensor, scores: torch.Tensor) -> Generated:
    """``tokens`` ``(B, n, T)`` -> :class:`Generated` with ``<pad>`` after each caption's end."""
    lengths = _lengths(tokens)
    steps = int(lengths.max()) if lengths.numel() else 1
    pos = torch.arange(tokens.shape[-1], device=tokens.device)
    tokens = tokens.masked_fill(pos >= lengths[..., None], PAD)[..., :steps]
    return Generated(tokens, lengths, logprob, scores)


def m2_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """M2's beam search (see the module docstring); ``n_best`` slots per image, best first."""
    k, max_len = options.beam_size, options.max_len
    num_images, device = state_rows(enc), state_device(enc)
    image_rows = torch.arange(num_images, device=device)
    state = model.init_state(enc)
    logp, state = model.step(torch.full((num_images,), BOS, dtype=torch.long, device=device), enc, state)
    vocab = logp.shape[-1]
    scores, idx = torch.sort(logp.float().view(num_images, vocab), -1, descending=True)
    scores, idx = scores[:, :k], idx[:, :k]
    words = idx % vocab  # step 0 has one slot per image: idx // vocab == 0
    rows = image_rows.repeat_interleave(k)
    enc, state = index_state(enc, rows), index_state(state, rows)
    history = words[:, :, None]
    alive = torch.ones(num_images, k, dtype=torch.bool, device=device)
    for _ in range(1, max_len):
        alive = alive & (words != EOS)
        if not bool(alive.any()):
            break
        logp, state = model.step(words.flatten(), enc, state)
        cand = scores[:, :, None] + logp.float().view(num_images, k, vocab)
        frozen = torch.full_like(cand, M2_FROZEN)
        frozen[:, :, UNK] = scores  # the release carries a finished slot on its index 0 (<unk>)
        cand = torch.where(alive[:, :, None], cand, frozen).view(num_images, k * vocab)
        scores, idx = torch.sort(cand, -1, descending=True)
        scores, idx = scores[:, :k], idx[:, :k]
        beam, words = idx // vocab, idx % vocab
        state = index_state(state, (image_rows[:, None] * k + beam).flatten())
        alive = alive.gather(1, beam)
        history = torch.cat([history.gather(1, beam[:, :, None].expand_as(history)), words[:, :, None]], 2)
    order = torch.sort(scores, 1, descending=True).indices[:, : options.n_best]
    best = scores.gather(1, order)
    tokens = history.gather(1, order[:, :, None].expand(-1, -1, history.shape[-1]))
    return _pack(tokens, best, best)


def _aoanet_penalty(length: int, score: torch.Tensor, options: DecodeOptions) -> torch.Tensor:
    """The release's ``penalty_builder`` on float64 scores: ``wu``/``avg`` with the divisor a Python float (the
    release's arithmetic in doubles), identity when alpha is 0 ('')."""
    alpha = options.length_penalty
    if alpha == 0:
        return score
    if options.length_penalty_kind == "wu":
        return score / (((5 + length) / 6) ** alpha)
    return score / (length**alpha)


def aoanet_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """AoANet's beam search (see the module docstring); ``n_best`` finished captions per image, best first."""
    k, max_len = options.beam_size, options.max_len
    num_images, device = state_rows(enc), state_device(enc)
    image_rows = torch.arange(num_images, device=device)
    enc = index_state(enc, image_rows.repeat_interleave(k))
    state = model.init_state(enc)
    logp, state = model.step(torch.full((num_images * k,), BOS, dtype=torch.long, device=device), enc, state)
    vocab = logp.shape[-1]
    logp = logp.float().view(num_images, k, vocab)
    sums = torch.zeros(num_images, k, device=device)
    history = torch.zeros(num_images, k, 0, dtype=torch.long, device=device)
    # finished captions: slot t * k + v holds slot v's caption if it ends at step t (score -inf otherwise), so the
    # search reads nothing back from the device; insertion order (t, then v) is the release's list order
    fin_score = torch.full((num_images, max_len * k), float("-inf"), dtype=torch.float64, device=device)
    fin_raw = torch.zeros(num_images, max_len * k, device=device)
    fin_tokens = torch.full((num_images, max_len * k, max_len), PAD, dtype=torch.long, device=device)
    for t in range(max_len):
        rows = 1 if t == 0 else k
        ranked = logp[:, :rows].clone()
        ranked[:, :, UNK] = ranked[:, :, UNK] - AOA_UNK_PENALTY
        ys, ix = torch.sort(ranked, -1, descending=True)
        ys, ix = ys[:, :, :k], ix[:, :, :k]  # (B, rows, cols)
        cand = (sums[:, :rows, None] + ys).transpose(1, 2).reshape(num_images, k * rows)  # word rank outer
        pick = torch.sort(-cand, dim=1, stable=True).indices[:, :k]
        src = pick % rows
        words = ix.transpose(1, 2).reshape(num_images, k * rows).gather(1, pick)
        sums = cand.gather(1, pick)
        history = torch.cat(
            [history.gather(1, src[:, :, None].expand(-1, -1, history.shape[-1])), words[:, :, None]], 2
        )
        state = index_state(state, (image_rows[:, None] * k + src).flatten())
        ended = (words == EOS) | (t == max_len - 1)
        slots = slice(t * k, (t + 1) * k)
        fin_score[:, slots] = torch.where(ended, _aoanet_penalty(t + 1, sums.double(), options), float("-inf"))
        fin_raw[:, slots] = sums
        fin_tokens[:, slots, : t + 1] = history
        sums = sums.masked_fill(ended, AOA_DEAD)
        if t == max_len - 1:
            break
        logp, state = model.step(words.flatten(), enc, state)
        logp = torch.log_softmax(logp.float().view(num_images, k, vocab), -1)  # the release normalises twice
    order = torch.sort(fin_score, dim=1, descending=True, stable=True).indices[
        :, : options.n_best
    ]  # ties: listed first
    tokens = fin_tokens.gather(1, order[:, :, None].expand(-1, -1, max_len))
    return _pack(tokens, fin_raw.gather(1, order), fin_score.gather(1, order).float())
