"""Greedy decoding and sampling (:mod:`models.decoding`): one left-to-right rollout where finished rows leave the
batch, SCST's samples and greedy baseline in one loop."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import torch

from models.captioners.base import Captioner, State, cat_states, index_state, state_device, state_rows
from models.decoding.constraints import banned_tokens, constrain, filter_logits, first_rows
from models.decoding.options import DecodeOptions, Generated
from models.layers.row_dropout import dropout_rows, set_dropout_rows
from pipeline.core.vocab import BOS, EOS, PAD


def _rollout(
    model: Captioner,
    enc: State,
    options: DecodeOptions,
    choose: Callable[[torch.Tensor], torch.Tensor],
    head: int | None = None,
) -> Generated | tuple[Generated, Generated]:
    """Left-to-right generation of one caption per row of ``enc``; finished rows leave the batch.

    With ``head``: ``choose`` picks the words of the first ``head`` rows only, which alone take dropout
    (:func:`models.layers.row_dropout.dropout_rows`); the other rows take the arg-max word, as a greedy decode in eval
    mode would; returns the two parts separately, each as long as its own longest caption.
    One host sync per step (the number of rows that just ended, which the batch shape depends on)."""
    rows = state_rows(enc)
    device = state_device(enc)
    state = model.init_state(enc)
    tokens = torch.full((rows,), BOS, dtype=torch.long, device=device)
    out = torch.full((rows, options.max_len), PAD, dtype=torch.long, device=device)
    lengths = torch.full((rows,), options.max_len, dtype=torch.long, device=device)
    picked: list[tuple[torch.Tensor, int, torch.Tensor]] = []
    active = torch.arange(rows, device=device)
    history = torch.zeros(rows, 0, dtype=torch.long, device=device) if options.block_trigrams else None
    banned: torch.Tensor | None = None
    cur_enc, alive = enc, rows
    lead = rows if head is None else head  # rows still running among the first `head` (they stay first)
    steps = [options.max_len, options.max_len]  # where the leading / the other rows all ended
    with dropout_rows(lead, rows) if head is not None else nullcontext():
        for t in range(options.max_len):
            if head is not None:
                set_dropout_rows(lead, alive)
            logp, state = model.step(tokens, cur_enc, state)
            if banned is None:
                banned = banned_tokens(logp.shape[-1], options, device)
            allowed = constrain(logp, history, options, banned)
            if lead == alive:
                nxt = choose(allowed)
            elif lead == 0:
                nxt = allowed.argmax(-1)
            else:
                nxt = torch.cat([choose(allowed[:lead]), allowed[lead:].argmax(-1)])
            picked.append((active, t, logp.gather(1, nxt[:, None])[:, 0]))
            out[active, t] = nxt
            if history is not None:
                history = torch.cat([history, nxt[:, None]], 1)
            done = nxt == EOS
            if head is None:
                ended = ended_lead = int(done.sum())  # the step's one host sync
            else:
                ended, ended_lead = torch.stack([done.sum(), done[:lead].sum()]).tolist()  # the same, one read
            if ended:
                lengths.index_put_((active,), torch.where(done, t + 1, lengths[active]))
                if lead and ended_lead == lead:
                    steps[0] = t + 1
                if alive - lead and ended - ended_lead == alive - lead:
                    steps[1] = t + 1
                if ended == alive:
                    break  # the last rows ended now: none is longer
                alive, lead = alive - ended, lead - ended_lead
                keep = first_rows(done, alive)
                active, nxt = active[keep], nxt[keep]
                history = history[keep] if history is not None else None
                cur_enc, state = index_state(cur_enc, keep), index_state(state, keep)
            tokens = nxt
    width = max(steps) if head is not None and head < rows else steps[0]
    token_lp = torch.zeros(rows, width, device=device, dtype=picked[0][2].dtype)
    where = (torch.cat([idx for idx, _, _ in picked]), torch.cat([torch.full_like(idx, t) for idx, t, _ in picked]))
    token_lp = token_lp.index_put(where, torch.cat([lp for _, _, lp in picked]))  # out-of-place: keeps the graph
    if head is None:
        return _generated(out[:, :width], lengths, token_lp)
    cut = (slice(0, head), slice(head, rows))
    first, second = (_generated(out[c, :w], lengths[c], token_lp[c, :w]) for c, w in zip(cut, steps))
    return first, second


def _generated(tokens: torch.Tensor, lengths: torch.Tensor, token_lp: torch.Tensor) -> Generated:
    total = token_lp.sum(1)
    return Generated(tokens[:, None], lengths[:, None], total[:, None], total[:, None], token_lp[:, None])


def greedy(model: Captioner, enc: State, options: DecodeOptions | None = None) -> Generated:
    """Arg-max decoding of one caption per row of ``enc``."""
    options = options or DecodeOptions(method="greedy")
    return _rollout(model, enc, options, lambda logp: logp.argmax(-1))


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One word per row drawn from ``probs`` ``(R, V)``: ``argmax(p / q)`` with ``q ~ Exp(1)``, the exponential race
    ``torch.multinomial(probs, 1)`` itself runs (same random numbers, same words) minus its validity check,
    which reads a value back to the host on every call."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q).argmax(-1)


def _sampler(options: DecodeOptions, generator: torch.Generator | None) -> Callable[[torch.Tensor], torch.Tensor]:
    def choose(logp: torch.Tensor) -> torch.Tensor:
        return draw(filter_logits(logp / options.temperature, options.top_k, options.top_p).softmax(-1), generator)

    return choose


def _repeat(enc: State, n: int) -> State:
    """Every image's rows ``n`` times in a row (the samples of one image are adjacent)."""
    return (
        index_state(enc, torch.arange(state_rows(enc), device=state_device(enc)).repeat_interleave(n)) if n > 1 else enc
    )


def _per_image(g: Generated, images: int, n: int) -> Generated:
    return Generated(
        *(
            None if x is None else x.reshape(images, n, *x.shape[2:])
            for x in (g.tokens, g.lengths, g.logprob, g.scores, g.token_logprobs)
        )
    )


def sample(
    model: Captioner, enc: State, options: DecodeOptions, n: int | None = None, generator: torch.Generator | None = None
) -> Generated:
    """``n`` sampled captions per image (default ``options.n_best``): ``(B, n, T)`` outputs."""
    n = n or options.n_best
    return _per_image(_rollout(model, _repeat(enc, n), options, _sampler(options, generator)), state_rows(enc), n)


def sample_with_greedy(
    model: Captioner,
    enc: State,
    greedy_enc: State,
    options: DecodeOptions,
    n: int,
    generator: torch.Generator | None = None,
) -> tuple[Generated, Generated]:
    """SCST's two decodes in one loop: ``n`` samples per image of ``enc`` (as :func:`sample`, dropout on) and the
    greedy caption of every image of ``greedy_enc`` (as :func:`greedy` of a model in eval mode), each token step one
    forward over the samples' rows followed by the greedy rows. The model must be in train mode; the greedy rows
    take no dropout (:mod:`models.layers.row_dropout`) and draw no random number, so on CPU both parts equal the two
    separate decodes (the samples draw exactly the random numbers they would alone). Returns ``(samples (B, n, T),
    greedy (B, 1, T'))``."""
    rows = state_rows(enc)
    s, g = _rollout(
        model, cat_states(_repeat(enc, n), greedy_enc), options, _sampler(options, generator), head=rows * n
    )
    return _per_image(s, rows, n), g
