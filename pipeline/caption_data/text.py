"""Caption text normalisation, as the standard preprocessing does it.

Karpathy's ``prepro.py`` (neuraltalk2) and ruotianluo's ``prepro_labels.py`` lowercase the raw caption,
delete ASCII punctuation and split on whitespace; Karpathy's ``dataset_coco.json`` already carries such
``tokens`` (used as given, lowercased).
"""

from __future__ import annotations

import string
from collections.abc import Iterable, Sequence

_DELETE_PUNCT = str.maketrans("", "", string.punctuation)


def tokenize(raw: str) -> list[str]:
    """``"A Man, riding a horse."`` -> ``["a", "man", "riding", "a", "horse"]``."""
    return raw.lower().translate(_DELETE_PUNCT).split()


def normalise_tokens(tokens: Sequence[str]) -> list[str]:
    """Given tokens, lowercased, with empty and pure-punctuation tokens dropped."""
    out = []
    for t in tokens:
        t = str(t).lower().translate(_DELETE_PUNCT).strip()
        if t:
            out.append(t)
    return out


def ngrams(words: Sequence[str], n: int) -> Iterable[str]:
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            yield " ".join(words[i : i + k])
