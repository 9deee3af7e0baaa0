"""Vectorised n-gram extraction: every n-gram of a batch of token-id sequences as one packed integer.

An n-gram of order k (1 <= k <= n) over token ids t_1..t_k is packed into one ``uint64`` key
``sum_j (t_j + 1) << (bits * (j - 1))`` with ``bits = 64 // n``. Because every field holds ``id + 1 >= 1``,
n-grams of different orders never collide and the packing is exact (no hashing): two n-grams have the
same key iff they are the same token sequence. Token ids must therefore be below ``2**bits - 1``
(65,535 for n = 4).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np


def field_bits(n: int) -> int:
    """Bits per token in a packed key of n-grams up to order ``n``."""
    if n < 1:
        raise ValueError(f"n-gram order must be >= 1, got {n}")
    return 64 // n


def max_token_id(n: int) -> int:
    """Largest token id that can be packed for n-grams up to order ``n``."""
    return (1 << field_bits(n)) - 2


def flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate integer sequences: (flat int64 tokens, int64 lengths)."""
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int64, count=len(seqs))
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    return flat, lengths


def ngram_keys(flat: np.ndarray, lengths: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """All n-grams (orders 1..n) of the sequences laid out in ``flat`` with ``lengths``.

    Returns ``(keys uint64, order int64 in 0..n-1, seq int64)``, one entry per n-gram occurrence.
    """
    bits = field_bits(n)
    total = flat.shape[0]
    if total and (flat.min() < 0 or flat.max() > max_token_id(n)):
        raise ValueError(f"token ids must lie in [0, {max_token_id(n)}] for {n}-grams")
    seq = np.repeat(np.arange(lengths.shape[0], dtype=np.int64), lengths)
    ends = np.cumsum(lengths)
    remaining = ends[seq] - np.arange(total, dtype=np.int64)  # tokens left in the sequence from here
    padded = np.zeros(total + n, dtype=np.uint64)
    padded[:total] = flat.astype(np.uint64) + np.uint64(1)
    key = np.zeros(total, dtype=np.uint64)
    out_keys, out_order, out_seq = [], [], []
    for k in range(n):
        key = key | (padded[k : k + total] << np.uint64(bits * k))
        valid = remaining > k
        out_keys.append(key[valid])
        out_order.append(np.full(int(valid.sum()), k, dtype=np.int64))
        out_seq.append(seq[valid])
    return np.concatenate(out_keys), np.concatenate(out_order), np.concatenate(out_seq)


def key_order(keys: np.ndarray, n: int) -> np.ndarray:
    """Order index (0 for unigrams .. n-1) of packed keys: the number of non-empty fields minus one."""
    bits = field_bits(n)
    order = np.zeros(keys.shape[0], dtype=np.int64)
    for k in range(1, n):
        order += (keys >> np.uint64(bits * k)) != 0
    return order


def ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(starts[i], stops[i])`` for all i, without a Python loop."""
    counts = stops - starts
    total = int(counts.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.repeat(starts - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
    return offsets + np.arange(total, dtype=np.int64)
