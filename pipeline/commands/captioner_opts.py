"""The options that name the captioner a command loads, shared by the commands that caption (``caption``, ``serve``,
``evaluate --model``), and the detector that ``caption`` and ``serve`` run on photos.

One declaration each, so an option reads the same in every command that offers it (its short flag and meaning:
:data:`pipeline.commands.grammar.MEANINGS`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

#: ``--model`` of the commands that caption photos (default: the run directory, :data:`grammar.DEFAULT_RUN`)
CaptionerModelOpt = Annotated[
    Path,
    typer.Option(
        "--model",
        "-m",
        help="Captioner checkpoint (.pt), run directory (the best captioner in it), released M2/AoANet .pth, "
        "or a catalogue name (m2-coco).",
    ),
]
CaptionerOpt = Annotated[
    Optional[str],
    typer.Option(
        "--captioner",
        help="Which captioner of a run directory --model (e.g. san); default: the best validation CIDEr-D.",
    ),
]
VocabOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--vocab",
        help="Released model's vocabulary: M2 vocab.pkl or AoANet infos_*.pkl, file or catalogue name "
        "(default: found next to --model).",
    ),
]
DetectorWeightsOpt = Annotated[
    Optional[str],
    typer.Option(
        "--weights",
        "-w",
        help="Detector weights: a file or catalogue name (bua-r101; cli fetch --list), or `random` (smoke tests).",
    ),
]
