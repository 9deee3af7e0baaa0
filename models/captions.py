"""From decoder output to caption text, and a checkpoint's decoding settings with command-line overrides."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.decoding import DecodeOptions
from pipeline.core.console import get_logger
from pipeline.core.vocab import EOS

log = get_logger("decoding")


def merge_decoding(saved: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """A checkpoint's decoding settings with ``overrides``.

    An ``n_best`` larger than the checkpoint's own beam widens it, and says so in one log line; an ``n_best``
    larger than a beam size given alongside it is left for :class:`DecodeOptions` to refuse (never silently widened).
    """
    overrides = dict(overrides or {})
    out = {**dict(saved or {}), **overrides}
    if out.get("method", "beam") == "beam" and "n_best" in out and "beam_size" not in overrides:
        beam, n_best = int(out.get("beam_size", 3)), int(out["n_best"])
        if n_best > beam:
            log.info("n_best %d: the checkpoint's beam of %d is widened to %d (give a beam size to choose another)", n_best, beam, n_best)
            out["beam_size"] = n_best
    return out


def caption_words(vocab: Any, ids: list[int], options: DecodeOptions) -> list[str]:
    """The words of one generated caption (``vocab`` a :class:`~pipeline.core.vocab.Vocab`).

    Up to the first ``<eos>``, ``<pad>``/``<bos>`` skipped; under ``official_m2`` every generated token is a word,
    as M2's ``field.decode`` writes it (its search can emit ``<pad>``/``<bos>``). ``collapse_repeats`` then
    removes consecutive duplicates (M2's ``test.py``).
    """
    if options.stop_rule == "official_m2":
        end = ids.index(EOS) if EOS in ids else len(ids)
        words = [vocab.words[i] for i in ids[:end]]
    else:
        words = vocab.decode(ids)
    if options.collapse_repeats:
        words = [w for i, w in enumerate(words) if i == 0 or w != words[i - 1]]
    return words
