"""The pieces every search shares: the length penalty, the words never generated, trigram blocking, top-k /
nucleus filtering, the reachable-score bound of the ``exact`` stop rule and the sync-free row selection."""

from __future__ import annotations

import torch

from models.decoding.options import DecodeOptions
from pipeline.core.vocab import BOS, PAD, UNK

NEG_INF = float("-inf")


def length_penalty(lengths: torch.Tensor | int | float, alpha: float, kind: str = "wu") -> torch.Tensor:
    """``((5 + len) / 6) ** alpha`` (``wu``) or ``len ** alpha`` (``avg``)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if kind == "wu":
        return ((5.0 + lengths) / 6.0) ** alpha
    if kind == "avg":
        return lengths**alpha
    raise ValueError(f"unknown length penalty {kind!r}")


def trigram_block_mask(history: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``(R, V)`` bool: True for tokens that would complete a trigram already present in ``history`` ``(R, t)``."""
    rows, t = history.shape
    blocked = torch.zeros(rows, vocab_size, dtype=torch.bool, device=history.device)
    if t < 3:
        return blocked
    a, b = history[:, -2:, None].unbind(1)  # the last bigram of every row: (R, 1) each
    match = (history[:, :-2] == a) & (history[:, 1:-1] == b)  # positions j with (h_j, h_j+1) == (a, b)
    hits = torch.zeros(rows, vocab_size, device=history.device).scatter_add_(1, history[:, 2:], match.float())
    return hits > 0


def banned_tokens(vocab_size: int, options: DecodeOptions, device: torch.device) -> torch.Tensor:
    """``(V,)`` bool: ``<pad>``, ``<bos>`` (and ``<unk>`` with ``suppress_unk``), never generated."""
    banned = torch.zeros(vocab_size, dtype=torch.bool, device=device)
    banned[PAD] = banned[BOS] = True
    if options.suppress_unk and vocab_size > UNK:
        banned[UNK] = True
    return banned


def constrain(
    logp: torch.Tensor, history: torch.Tensor | None, options: DecodeOptions, banned: torch.Tensor | None = None
) -> torch.Tensor:
    """Forbid ``<pad>``, ``<bos>`` (``<unk>`` with ``suppress_unk``) and, if asked, repeated trigrams.

    ``banned`` (:func:`banned_tokens`) can be built once per decode; ``history`` is only read with
    ``block_trigrams``."""
    if banned is None:
        banned = banned_tokens(logp.shape[-1], options, logp.device)
    mask = banned.expand_as(logp)
    if options.block_trigrams:
        mask = mask | trigram_block_mask(history, logp.shape[-1])
    return logp.masked_fill(mask, NEG_INF)


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Keep the ``top_k`` largest logits and/or the smallest set whose probability reaches ``top_p``."""
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability mass strictly before each token
        drop_sorted = before >= top_p  # never drops the first (most probable) token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, NEG_INF)
    return logits


def first_rows(flags: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the ``n`` False entries of a 1-D bool tensor, in ascending order, without a host sync
    (``(~flags).nonzero()`` waits for the device to know the count; here the caller knows it)."""
    return torch.sort(flags.to(torch.uint8), stable=True).indices[:n]


def reachable_bound(scores: torch.Tensor, generated: int, options: DecodeOptions) -> torch.Tensor:
    """The best ranking score unfinished hypotheses of summed log-probability ``scores`` can still reach.

    Log-probabilities are <= 0, so every continuation keeps the sum at most ``s``; the hypothesis can end at any
    length in ``generated + 1 .. max_len``, where ``s / lp(len)`` is largest for the largest ``lp`` (``lp`` is
    monotone in ``len``).
    """
    lp = length_penalty(
        torch.tensor([generated + 1, options.max_len]), options.length_penalty, options.length_penalty_kind
    )
    return scores / lp.max()  # a 0-d host tensor: no read-back of a device value
