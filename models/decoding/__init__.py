"""Model-agnostic caption decoding over the :class:`~models.base.Captioner` interface.

Every function here only calls ``model.encode / init_state / step`` and :func:`~models.base.index_state`,
so it works for any registered captioner.

* :func:`greedy`: the arg-max word at every step.
* :func:`sample`: ancestral sampling with temperature, top-k and nucleus (top-p) filtering, ``n`` samples
  per image; the returned token log-probabilities are the **model's** (temperature 1, unfiltered) and keep
  their gradient when autograd is on (SCST).
* :func:`beam_search`: batched beam search over all images at once (rows = images x beams), with a length
  penalty, hard blocking of repeated trigrams, and the ``n_best`` hypotheses per image with their scores.

Common rules: ``<pad>`` and ``<bos>`` are never generated (nor ``<unk>`` with ``suppress_unk``); a caption
ends at ``<eos>`` (kept in the output and counted in its length) or after ``max_len`` tokens. Rows (greedy,
sampling) or images (beam search) that have finished are dropped from the batch, so they stop costing
compute. Beam indices are computed with integer division (``//``), never ``/``.

Length penalty (ranking of finished hypotheses): ``score = sum log p / lp(len)`` where ``len`` counts the
generated tokens including ``<eos>`` and ``lp = ((5 + len) / 6) ** alpha`` (``wu``, Wu et al. 2016) or
``len ** alpha`` (``avg``); ``alpha = 0`` ranks by the plain summed log-probability.

Stop rule of beam search (``stop_rule``):

* ``exact`` (default): every step keeps the ``beam_size`` best unfinished hypotheses; an image stops only when
  its ``n_best``-th best finished score is at least the best score any unfinished hypothesis could still reach
  (log-probabilities are <= 0, so a hypothesis of summed log-probability ``s`` can reach at most
  ``s / max(lp(len + 1), lp(max_len))`` under the active length penalty), or at ``max_len``. So the search never
  returns a caption that scores below one it would still have found.
* ``first_k``: stop once ``beam_size`` hypotheses have ended (the fairseq rule; kept for comparison).
* ``official_m2`` / ``official_aoanet``: the searches of the two released implementations, to reproduce
  their published numbers (:mod:`models.decoding.beam_official`).

With ``beam_size = 1`` the ``first_k`` rule, and the ``exact`` rule without length penalty, return exactly the
greedy caption (with a length penalty the exact rule may go on past the greedy ``<eos>`` and find a caption
that ranks higher).

Modules: :mod:`~models.decoding.options` (settings, the decoded record), :mod:`~models.decoding.constraints` (what
every search shares), :mod:`~models.decoding.sampling` (greedy, sampling), :mod:`~models.decoding.beam` and
:mod:`~models.decoding.beam_official` (beam searches), :mod:`~models.decoding.captions` (words and the layering of
settings). They import each other in that order only; this package module adds the two dispatchers.
"""

from __future__ import annotations

import torch

from models.captioners.base import Captioner, State
from models.decoding.beam import search
from models.decoding.beam_official import official_search
from models.decoding.constraints import (
    NEG_INF,
    banned_tokens,
    constrain,
    filter_logits,
    first_rows,
    length_penalty,
    reachable_bound,
    trigram_block_mask,
)
from models.decoding.options import (
    METHODS,
    PENALTIES,
    STOP_RULES,
    DecodeOptions,
    Generated,
    check_max_len,
    decoding_config,
    decoding_options,
)
from models.decoding.sampling import draw, greedy, sample, sample_with_greedy


def beam_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """Batched beam search; returns the ``options.n_best`` best hypotheses per image, best first (the ``exact`` and
    ``first_k`` rules: :func:`models.decoding.beam.search`; the released searches:
    :mod:`models.decoding.beam_official`)."""
    if options.stop_rule in ("official_m2", "official_aoanet"):
        return official_search(model, enc, options)
    return search(model, enc, options)


def generate(
    model: Captioner,
    feats: torch.Tensor,
    mask: torch.Tensor,
    boxes: torch.Tensor,
    sizes: torch.Tensor,
    options: DecodeOptions,
    generator: torch.Generator | None = None,
) -> Generated:
    """Encode a batch of images and decode it with ``options.method``."""
    enc = model.encode(feats, mask, boxes, sizes)
    if options.method == "greedy":
        return greedy(model, enc, options)
    if options.method == "sample":
        return sample(model, enc, options, generator=generator)
    return beam_search(model, enc, options)


__all__ = [
    "METHODS",
    "NEG_INF",
    "PENALTIES",
    "STOP_RULES",
    "DecodeOptions",
    "Generated",
    "banned_tokens",
    "beam_search",
    "check_max_len",
    "constrain",
    "decoding_config",
    "decoding_options",
    "draw",
    "filter_logits",
    "first_rows",
    "generate",
    "greedy",
    "length_penalty",
    "reachable_bound",
    "sample",
    "sample_with_greedy",
    "trigram_block_mask",
]
