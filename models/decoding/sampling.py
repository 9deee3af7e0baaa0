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
  their published numbers (:mod:`models.beam_official`).

With ``beam_size = 1`` the ``first_k`` rule, and the ``exact`` rule without length penalty, return exactly the
greedy caption (with a length penalty the exact rule may go on past the greedy ``<eos>`` and find a caption
that ranks higher).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, fields
from typing import Any

import torch

from models.base import Captioner, State, cat_states, index_state, state_device, state_rows
from models.row_dropout import dropout_rows, set_dropout_rows
from pipeline.core.config import CONFIG_DIR, Config, load_yaml_with_bases
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS, EOS, PAD, UNK

METHODS = ("beam", "greedy", "sample")
PENALTIES = ("wu", "avg")
STOP_RULES = ("exact", "first_k", "official_m2", "official_aoanet")
NEG_INF = float("-inf")


@dataclass(frozen=True)
class DecodeOptions:
    """Decoding settings; the defaults and schema live in ``configs/decoding.yaml``."""

    method: str = "beam"
    beam_size: int = 3
    max_len: int = 20
    n_best: int = 1
    length_penalty: float = 0.0
    length_penalty_kind: str = "wu"
    block_trigrams: bool = False
    suppress_unk: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    collapse_repeats: bool = False  # post-processing of the final words (applied by the caller)
    stop_rule: str = "exact"

    def __post_init__(self) -> None:
        problems = []
        if self.method not in METHODS:
            problems.append(f"method must be one of {METHODS}, got {self.method!r}")
        if self.length_penalty_kind not in PENALTIES:
            problems.append(f"length_penalty_kind must be one of {PENALTIES}, got {self.length_penalty_kind!r}")
        if self.beam_size < 1 or self.max_len < 1 or self.n_best < 1:
            problems.append("beam_size, max_len and n_best must be >= 1")
        if self.method == "beam" and self.n_best > self.beam_size:
            problems.append(f"n_best ({self.n_best}) cannot exceed beam_size ({self.beam_size})")
        if self.method == "greedy" and self.n_best != 1:
            problems.append("greedy decoding returns one caption per image (n_best must be 1)")
        if self.stop_rule not in STOP_RULES:
            problems.append(f"stop_rule must be one of {STOP_RULES}, got {self.stop_rule!r}")
        elif self.stop_rule == "official_m2" and (self.length_penalty != 0 or self.block_trigrams):
            problems.append("stop_rule official_m2 has no length penalty and no trigram blocking (M2's beam search)")
        elif self.stop_rule == "official_aoanet" and self.block_trigrams:
            problems.append("stop_rule official_aoanet has no trigram blocking (AoANet's beam search)")
        if self.temperature <= 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            problems.append("need temperature > 0, 0 < top_p <= 1 and top_k >= 0")
        odd = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name))
        ]
        if odd:
            problems.insert(0, f"{', '.join(odd)}: every number must be finite")
        if problems:
            raise ConfigError("decoding: " + "; ".join(problems))

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> "DecodeOptions":
        """Build from a (validated) ``decoding:`` mapping; unknown keys are a :class:`ConfigError`."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"decoding: unknown option(s) {unknown} (known: {sorted(known)})")
        return cls(**dict(data))


def check_max_len(options: DecodeOptions, model: Captioner, where: str = "max_len") -> None:
    """Refuse, before any decoding, a ``max_len`` past the model's position table (:meth:`Captioner.max_caption_len`)."""
    limit = model.max_caption_len()
    if limit is not None and options.max_len > limit:
        raise ConfigError(
            f"{where} {options.max_len} is longer than the {limit} positions this {model.name or 'captioner'} model's "
            f"position table holds: give {limit} or less"
        )


def decoding_config(model_name: str | None = None, overrides: Mapping[str, Any] | list[str] | None = None) -> Config:
    """The ``decoding:`` section of captioner ``model_name``'s card (:func:`models.model_card`) over
    ``configs/decoding.yaml``; only the defaults without a name."""
    if model_name is None:
        data = load_yaml_with_bases(CONFIG_DIR / "decoding.yaml")["decoding"]
    else:
        from models import model_card

        data = model_card(model_name).decoding.to_dict()
    return Config(data).with_overrides(overrides, source="decoding")


def decoding_options(
    model_name: str | None = None, overrides: Mapping[str, Any] | list[str] | None = None
) -> DecodeOptions:
    """:class:`DecodeOptions` for ``model_name`` (its paper's test-time setting) with ``overrides``."""
    return DecodeOptions.from_mapping(decoding_config(model_name, overrides).to_dict())


@dataclass
class Generated:
    """Decoded captions of ``B`` images, ``n`` per image, ``T <= max_len`` steps.

    ``tokens`` ``(B, n, T)`` without BOS, ``<eos>`` included, ``<pad>`` after it; ``lengths`` ``(B, n)``
    generated tokens including ``<eos>``; ``logprob`` ``(B, n)`` summed log-probability; ``scores``
    ``(B, n)`` the ranking score (length-penalised for beam search, else ``logprob``), best first for beam
    search; ``token_logprobs`` ``(B, n, T)`` per token (0 after the end; greedy and sampling only).
    """

    tokens: torch.Tensor
    lengths: torch.Tensor
    logprob: torch.Tensor
    scores: torch.Tensor
    token_logprobs: torch.Tensor | None = None


# --- shared pieces --------------------------------------------------------------------------------------


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

    ``banned`` (:func:`banned_tokens`) can be built once per decode; ``history`` is only read with ``block_trigrams``."""
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


# --- greedy and sampling ---------------------------------------------------------------------------------


def _first_rows(flags: torch.Tensor, n: int) -> torch.Tensor:
    """Positions of the ``n`` False entries of a 1-D bool tensor, in ascending order, without a host sync
    (``(~flags).nonzero()`` waits for the device to know the count; here the caller knows it)."""
    return torch.sort(flags.to(torch.uint8), stable=True).indices[:n]


def _rollout(
    model: Captioner,
    enc: State,
    options: DecodeOptions,
    choose: Callable[[torch.Tensor], torch.Tensor],
    head: int | None = None,
) -> Generated | tuple[Generated, Generated]:
    """Left-to-right generation of one caption per row of ``enc``; finished rows leave the batch.

    With ``head``: ``choose`` picks the words of the first ``head`` rows only, which alone take dropout
    (:func:`models.row_dropout.dropout_rows`); the other rows take the arg-max word, as a greedy decode in eval mode
    would; returns the two parts separately, each as long as its own longest caption.
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
                keep = _first_rows(done, alive)
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
    take no dropout (:mod:`models.row_dropout`) and draw no random number, so on CPU both parts equal the two
    separate decodes (the samples draw exactly the random numbers they would alone). Returns ``(samples (B, n, T),
    greedy (B, 1, T'))``."""
    rows = state_rows(enc)
    s, g = _rollout(
        model, cat_states(_repeat(enc, n), greedy_enc), options, _sampler(options, generator), head=rows * n
    )
    return _per_image(s, rows, n), g


# --- beam search -----------------------------------------------------------------------------------------


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


def beam_search(model: Captioner, enc: State, options: DecodeOptions) -> Generated:
    """Batched beam search; returns the ``options.n_best`` best hypotheses per image, best first (the ``exact`` and
    ``first_k`` rules: :func:`models.beam.search`; the released searches: :mod:`models.beam_official`)."""
    if options.stop_rule in ("official_m2", "official_aoanet"):
        from models.beam_official import official_search

        return official_search(model, enc, options)
    from models.beam import search

    return search(model, enc, options)


# --- entry point -----------------------------------------------------------------------------------------


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
