"""Plain decoding loops that read the device back at every step (``nonzero``, ``multinomial``, per-hypothesis
lists): the reference the sync-free loops of models/decoding/ are tested against (same samples, captions,
log-probabilities and losses)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from models.captioners.base import Captioner, State, index_state
from models.captioners.base import state_device as _device
from models.captioners.base import state_rows as _rows
from models.decoding import (
    NEG_INF,
    DecodeOptions,
    Generated,
    filter_logits,
    length_penalty,
    reachable_bound,
    trigram_block_mask,
)
from pipeline.core.vocab import BOS, EOS, PAD, UNK


def constrain(logp: torch.Tensor, history: torch.Tensor, options: DecodeOptions) -> torch.Tensor:
    banned = torch.zeros(logp.shape[-1], dtype=torch.bool, device=logp.device)
    banned[PAD] = banned[BOS] = True
    if options.suppress_unk and logp.shape[-1] > UNK:
        banned[UNK] = True
    mask = banned.expand_as(logp)
    if options.block_trigrams:
        mask = mask | trigram_block_mask(history, logp.shape[-1])
    return logp.masked_fill(mask, NEG_INF)


def _rollout(
    model: Captioner, enc: State, options: DecodeOptions, choose: Callable[[torch.Tensor], torch.Tensor]
) -> Generated:
    """Left-to-right generation of one caption per row of ``enc``; finished rows leave the batch."""
    rows = _rows(enc)
    device = _device(enc)
    state = model.init_state(enc)
    tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
    out = torch.full((rows, options.max_len), PAD, dtype=torch.long, device=device)
    lengths = torch.full((rows,), options.max_len, dtype=torch.long, device=device)
    picked: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    active = torch.arange(rows, device=device)
    history = torch.zeros(rows, 0, dtype=torch.long, device=device)
    cur_enc = enc
    for t in range(options.max_len):
        logp, state = model.step(tokens, cur_enc, state)
        nxt = choose(constrain(logp, history, options))
        picked.append((active, t, logp.gather(1, nxt[:, None])[:, 0]))
        out[active, t] = nxt
        history = torch.cat([history, nxt[:, None]], 1)
        done = nxt == EOS
        if bool(done.any()):
            lengths[active[done]] = t + 1
            keep = (~done).nonzero()[:, 0]
            if keep.numel() == 0:
                break
            active, nxt, history = active[keep], nxt[keep], history[keep]
            cur_enc, state = index_state(cur_enc, keep), index_state(state, keep)
        tokens = nxt
    steps = int(lengths.max())
    token_lp = torch.zeros(rows, steps, device=device, dtype=picked[0][2].dtype)
    for idx, t, lp in picked:  # out-of-place so the log-probabilities keep their graph
        token_lp = token_lp.index_put((idx, torch.full_like(idx, t)), lp)
    total = token_lp.sum(1)
    return Generated(
        out[:, :steps, None].transpose(1, 2), lengths[:, None], total[:, None], total[:, None], token_lp[:, None]
    )


def greedy(model: Captioner, enc: State, options: DecodeOptions | None = None) -> Generated:
    """Arg-max decoding of one caption per row of ``enc``."""
    options = options or DecodeOptions(method="greedy")
    return _rollout(model, enc, options, lambda logp: logp.argmax(-1))


def sample(
    model: Captioner, enc: State, options: DecodeOptions, n: int | None = None, generator: torch.Generator | None = None
) -> Generated:
    """``n`` sampled captions per image (default ``options.n_best``): ``(B, n, T)`` outputs."""
    n = n or options.n_best
    rows = _rows(enc)
    if n > 1:
        enc = index_state(enc, torch.arange(rows, device=_device(enc)).repeat_interleave(n))

    def choose(logp: torch.Tensor) -> torch.Tensor:
        logits = filter_logits(logp / options.temperature, options.top_k, options.top_p)
        return torch.multinomial(logits.softmax(-1), 1, generator=generator)[:, 0]

    g = _rollout(model, enc, options, choose)
    return Generated(
        *(
            None if x is None else x.reshape(rows, n, *x.shape[2:])
            for x in (g.tokens, g.lengths, g.logprob, g.scores, g.token_logprobs)
        )
    )


def _image_done(
    found: list[tuple[float, torch.Tensor, int, torch.Tensor]], bound: float, options: DecodeOptions
) -> bool:
    """The stop rule for one image (see the module docstring)."""
    if options.stop_rule == "first_k":
        return len(found) >= options.beam_size
    if len(found) < options.n_best:
        return False
    nth = sorted((h[0] for h in found), reverse=True)[options.n_best - 1]
    return nth >= bound


def beam_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """Batched beam search; returns the ``options.n_best`` best hypotheses per image, best first."""
    k, n_best, max_len = options.beam_size, options.n_best, options.max_len
    num_images = _rows(enc)
    device = _device(enc)
    beam_offsets = torch.arange(k, device=device)
    cur_enc = index_state(enc, torch.arange(num_images, device=device).repeat_interleave(k))
    state = model.init_state(cur_enc)
    images = torch.arange(num_images, device=device)  # the images still being decoded
    scores = torch.full((num_images, k), NEG_INF, device=device)
    scores[:, 0] = 0.0  # one live hypothesis per image at the start
    tokens = torch.full((num_images * k,), BOS, dtype=torch.long, device=device)
    history = torch.zeros(num_images * k, 0, dtype=torch.long, device=device)
    finished: list[list[tuple[float, torch.Tensor, int, torch.Tensor]]] = [[] for _ in range(num_images)]
    for t in range(max_len):
        logp, state = model.step(tokens, cur_enc, state)
        vocab = logp.shape[-1]
        logp = constrain(logp.float(), history, options)
        alive = images.numel()
        cand = (scores[:, :, None] + logp.view(alive, k, vocab)).view(alive, k * vocab)
        top_scores, top_idx = cand.topk(min(2 * k, k * vocab), dim=-1)
        src_beam = top_idx // vocab  # integer division: the beam each candidate extends
        words = top_idx % vocab
        rank = torch.arange(top_idx.shape[1], device=device)[None]
        last = t == max_len - 1
        ends = (words == EOS) | last
        final = ends & (rank < k) & torch.isfinite(top_scores)
        src_rows = torch.arange(alive, device=device)[:, None] * k + src_beam  # rows of the current batch
        for a, c in final.nonzero().tolist():
            seq = torch.cat([history[src_rows[a, c]], words[a, c : c + 1]])
            raw = top_scores[a, c]  # a 0-d tensor: keeps its graph when autograd is on (beam-based SCST)
            norm = float(raw.detach()) / float(
                length_penalty(t + 1, options.length_penalty, options.length_penalty_kind)
            )
            finished[int(images[a])].append((norm, raw, t + 1, seq))
        if last:
            break
        # continue with the k best candidates that do not end (there are >= k: one EOS per beam at most)
        cont = ~ends
        take = cont & (cont.long().cumsum(-1) <= k)
        pick = take.nonzero()[:, 1].view(alive, k)
        new_scores = top_scores.gather(1, pick)
        new_rows = src_rows.gather(1, pick)  # (alive, k)
        new_words = words.gather(1, pick)
        bounds = reachable_bound(new_scores.detach().max(1).values, t + 1, options).tolist()
        done = torch.tensor(
            [_image_done(finished[int(i)], b, options) for i, b in zip(images.tolist(), bounds)], device=device
        )
        if bool(done.all()):
            break
        if bool(done.any()):
            keep = (~done).nonzero()[:, 0]
            images, new_scores, new_rows, new_words = images[keep], new_scores[keep], new_rows[keep], new_words[keep]
            cur_enc = index_state(cur_enc, (keep[:, None] * k + beam_offsets).flatten())
        flat_rows = new_rows.flatten()
        state = index_state(state, flat_rows)
        history = torch.cat([history[flat_rows], new_words.flatten()[:, None]], 1)
        scores, tokens = new_scores, new_words.flatten()
    return _collect(finished, n_best, options, device)


def _collect(
    finished: list[list[tuple[float, torch.Tensor, int, torch.Tensor]]],
    n_best: int,
    options: DecodeOptions,
    device: torch.device,
) -> Generated:
    """The ``n_best`` finished hypotheses of every image, best first (every image has >= n_best)."""
    num_images = len(finished)
    steps = max((h[2] for hyps in finished for h in hyps), default=1)
    tokens = torch.full((num_images, n_best, steps), PAD, dtype=torch.long, device=device)
    raws = []
    for i, hyps in enumerate(finished):
        hyps.sort(key=lambda h: -h[0])
        for j, (_, raw, length, seq) in enumerate(hyps[:n_best]):
            tokens[i, j, :length] = seq
            raws.append(raw)
    lengths = torch.tensor([[h[2] for h in hyps[:n_best]] for hyps in finished], dtype=torch.long, device=device)
    logprob = torch.stack(raws).view(num_images, n_best)
    scores = logprob / length_penalty(lengths, options.length_penalty, options.length_penalty_kind).to(device)
    return Generated(tokens, lengths, logprob, scores)
