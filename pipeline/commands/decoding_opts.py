"""The decoding options shared by the commands that decode captions (``caption``, ``evaluate --model``).

Values are checked before any work: here (whole numbers >= 1, finite numbers), then against the checkpoint's
settings and the model's limits (:class:`models.decoding.DecodeOptions`, :func:`models.decoding.check_max_len`):
one ``error:`` line, exit 2.

Each option is a ``decoding.*`` config override applied last (``--beam-size 5`` is ``--set decoding.beam_size=5``),
over the command's ``decoding:`` section and the checkpoint's own (the paper's test-time setting for released
models, ``configs/models/<name>.yaml`` for trained ones): one order, :func:`models.decoding.captions.layered_decoding`.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Optional

import typer

from models.decoding import STOP_RULES
from pipeline.core.errors import UsageError

BeamSizeOpt = Annotated[Optional[int], typer.Option("--beam-size", help="Beam size (default: the checkpoint's).")]
NBestOpt = Annotated[Optional[int], typer.Option("--n-best", help="Hypotheses returned per image (beam search).")]
MaxLenOpt = Annotated[Optional[int], typer.Option("--max-len", help="Most generated tokens, <eos> included.")]
LengthPenaltyOpt = Annotated[
    Optional[float], typer.Option("--length-penalty", help="Alpha of the length penalty ((5+len)/6)^alpha; 0 = none.")
]
TrigramOpt = Annotated[
    Optional[bool],
    typer.Option("--block-trigrams/--no-block-trigrams", help="Forbid repeating a trigram within a caption."),
]
StopRuleOpt = Annotated[
    Optional[str],
    typer.Option(
        "--stop-rule", help=f"Beam-search stop rule: {' | '.join(STOP_RULES)} (official_*: the releases' own searches)."
    ),
]


def decoding_overrides(
    beam_size: int | None = None,
    n_best: int | None = None,
    max_len: int | None = None,
    length_penalty: float | None = None,
    block_trigrams: bool | None = None,
    stop_rule: str | None = None,
) -> dict[str, Any]:
    """The given options as ``decoding:`` keys (unset ones are left to the lower layers; a beam size or n_best
    given implies beam search there, :func:`models.decoding.captions.layered_decoding`)."""
    if stop_rule is not None and stop_rule not in STOP_RULES:
        raise UsageError(f"--stop-rule must be one of {', '.join(STOP_RULES)}, not {stop_rule!r}")
    for flag, value in (("--beam-size", beam_size), ("--n-best", n_best), ("--max-len", max_len)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be 1 or more, not {value}")
    if beam_size is not None and n_best is not None and n_best > beam_size:
        raise UsageError(
            f"--n-best {n_best} cannot exceed --beam-size {beam_size} (a beam keeps that many hypotheses): "
            f"give --beam-size {n_best} or more, or a smaller --n-best"
        )
    if length_penalty is not None and not math.isfinite(length_penalty):
        raise UsageError(f"--length-penalty must be a finite number, not {length_penalty}")
    given = {
        "beam_size": beam_size,
        "n_best": n_best,
        "max_len": max_len,
        "length_penalty": length_penalty,
        "block_trigrams": block_trigrams,
        "stop_rule": stop_rule,
    }
    return {k: v for k, v in given.items() if v is not None}
