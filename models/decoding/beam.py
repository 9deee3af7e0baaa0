"""The project's batched beam search (:func:`models.decoding.beam_search` with ``stop_rule: exact | first_k``; the
rules, the length penalty and the ranking are described in :mod:`models.decoding`).

Rows are images x beams; every step keeps the ``beam_size`` best unfinished hypotheses of each image. Finished
hypotheses live in per-image tensors (slot ``t * beam_size + rank`` for the candidate of rank ``rank`` that ends at
step ``t``) and are ranked by a stable sort (ties: the earlier first), so the bookkeeping and the stop rule run on
the device; a step's one host read is the number of images that stop (and the longest finished hypothesis).
"""

from __future__ import annotations

import torch

from models.captioners.base import Captioner, State, index_state, state_device, state_rows
from models.decoding.constraints import NEG_INF, banned_tokens, constrain, first_rows, length_penalty, reachable_bound
from models.decoding.options import DecodeOptions, Generated
from pipeline.core.vocab import BOS, EOS, PAD


def search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """Batched beam search (``exact`` or ``first_k`` stop rule); the ``options.n_best`` best hypotheses per image, best
    first.

    Finished hypotheses are kept in per-image tensors (slot ``t * k + rank`` for the candidate of rank ``rank`` that
    ends at step ``t``), ranked by a stable sort, so the stop rule and the bookkeeping need no host sync: the
    step's one sync is the number of images that stop (the batch shape depends on it)."""
    k, n_best, max_len = options.beam_size, options.n_best, options.max_len
    num_images = state_rows(enc)
    device = state_device(enc)
    beam_offsets = torch.arange(k, device=device)
    cur_enc = index_state(enc, torch.arange(num_images, device=device).repeat_interleave(k))
    state = model.init_state(cur_enc)
    images = torch.arange(num_images, device=device)  # the images still being decoded
    scores = torch.full((num_images, k), NEG_INF, device=device)
    scores[:, 0] = 0.0  # one live hypothesis per image at the start
    tokens = torch.full((num_images * k,), BOS, dtype=torch.long, device=device)
    history = torch.zeros(num_images * k, 0, dtype=torch.long, device=device)
    slots = max_len * k
    fin_norm = torch.full(
        (num_images, slots), NEG_INF, dtype=torch.float64, device=device
    )  # ranking score (float64: the rounding of a Python-float ranking)
    fin_raw: torch.Tensor | None = (
        None  # summed log-probabilities; keeps the graph when autograd is on (beam-based SCST)
    )
    fin_tokens = torch.full((num_images, slots, max_len), PAD, dtype=torch.long, device=device)
    fin_count = torch.zeros(num_images, dtype=torch.long, device=device)
    # lp(t + 1) as 0-d float32 values, divided by in float64 (the reference loops' rounding)
    penalties = [
        length_penalty(n, options.length_penalty, options.length_penalty_kind).double() for n in range(1, max_len + 1)
    ]
    width = torch.zeros((), dtype=torch.long, device=device)  # the longest finished hypothesis so far
    banned: torch.Tensor | None = None
    alive = num_images
    for t in range(max_len):
        logp, state = model.step(tokens, cur_enc, state)
        vocab = logp.shape[-1]
        if banned is None:
            banned = banned_tokens(vocab, options, device)
        logp = constrain(logp.float(), history, options, banned)
        cand = (scores[:, :, None] + logp.view(alive, k, vocab)).view(alive, k * vocab)
        top_scores, top_idx = cand.topk(min(2 * k, k * vocab), dim=-1)
        src_beam = top_idx // vocab  # integer division: the beam each candidate extends
        words = top_idx % vocab
        last = t == max_len - 1
        ends = (words == EOS) | last
        src_rows = torch.arange(alive, device=device)[:, None] * k + src_beam  # rows of the current batch
        # the first k candidates that end are finished hypotheses (slots t*k .. t*k+k-1 of their image)
        final = ends[:, :k] & torch.isfinite(top_scores[:, :k])
        raw = top_scores[:, :k]
        norm = torch.where(final, raw.detach().double() / penalties[t], NEG_INF)
        cols = torch.arange(t * k, (t + 1) * k, device=device)
        fin_norm[images[:, None], cols] = norm
        if fin_raw is None:
            fin_raw = torch.zeros(num_images, slots, dtype=raw.dtype, device=device)
        fin_raw = fin_raw.index_put((images[:, None], cols[None]), raw)  # out-of-place: keeps the graph
        seqs = torch.cat([history[src_rows[:, :k]], words[:, :k, None]], -1)  # (alive, k, t + 1)
        fin_tokens[images[:, None, None], cols[None, :, None], torch.arange(t + 1, device=device)] = seqs
        fin_count.index_add_(0, images, final.sum(1))
        width = torch.where(final.any(), t + 1, width)
        if last:
            steps = int(width)
            break
        # continue with the k best candidates that do not end (there are >= k: one EOS per beam at most)
        cont = ~ends
        take = cont & (cont.long().cumsum(-1) <= k)
        pick = torch.sort((~take).to(torch.uint8), dim=1, stable=True).indices[:, :k]  # the k taken columns, in order
        new_scores = top_scores.gather(1, pick)
        new_rows = src_rows.gather(1, pick)  # (alive, k)
        new_words = words.gather(1, pick)
        done = _images_done(fin_norm[images], fin_count[images], new_scores.detach().max(1).values, t, options)
        stopping, steps = torch.stack([done.sum(), width]).tolist()  # the step's one host sync
        if stopping == alive:
            break
        if stopping:
            alive -= stopping
            keep = first_rows(done, alive)
            images, new_scores, new_rows, new_words = images[keep], new_scores[keep], new_rows[keep], new_words[keep]
            cur_enc = index_state(cur_enc, (keep[:, None] * k + beam_offsets).flatten())
        flat_rows = new_rows.flatten()
        state = index_state(state, flat_rows)
        history = torch.cat([history[flat_rows], new_words.flatten()[:, None]], 1)
        scores, tokens = new_scores, new_words.flatten()
    return _collect(fin_norm, fin_raw, fin_tokens, n_best, steps, options)


def _images_done(
    norms: torch.Tensor, counts: torch.Tensor, best_live: torch.Tensor, t: int, options: DecodeOptions
) -> torch.Tensor:
    """The stop rule of every live image (see the module docstring), on the device."""
    if options.stop_rule == "first_k":
        return counts >= options.beam_size
    bound = reachable_bound(best_live, t + 1, options).double()
    nth = norms.topk(options.n_best, dim=1).values[:, -1]
    return (counts >= options.n_best) & (nth >= bound)


def _collect(
    fin_norm: torch.Tensor,
    fin_raw: torch.Tensor,
    fin_tokens: torch.Tensor,
    n_best: int,
    steps: int,
    options: DecodeOptions,
) -> Generated:
    """The ``n_best`` finished hypotheses of every image, best first (ties: the earlier first; every image
    has >= n_best); ``steps``: the longest finished hypothesis of the batch (the width of ``tokens``)."""
    order = torch.sort(fin_norm, dim=1, descending=True, stable=True).indices[:, :n_best]
    tokens = fin_tokens.gather(1, order[:, :, None].expand(-1, -1, fin_tokens.shape[-1]))
    lengths = (order // options.beam_size) + 1
    logprob = fin_raw.gather(1, order)
    scores = logprob / length_penalty(lengths, options.length_penalty, options.length_penalty_kind).to(logprob.device)
    return Generated(tokens[:, :, :steps].contiguous(), lengths, logprob, scores)
