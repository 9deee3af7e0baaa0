"""What a ``POST /v1/captions`` request asks for and what it gets back.

Options (query parameters or multipart text fields): ``beam_size``, ``n_best``, ``max_len`` (within the server's
``serve.max_*`` limits; HTTP 422 beyond them), ``regions`` (``true``/``false``) and ``timeout_s`` (a shorter
time limit than ``serve.request_timeout_s``). They override the decoding of
the served checkpoint the way ``caption --beam-size/--n-best/--max-len`` do (:func:`models.decoding.captions.merge_decoding`),
so a request gets the captions ``caption`` writes with the same flags.

One entry per image, in upload order: the caption, its score, the n-best with scores, the image size and the
regions the caption's words depend on (:func:`pipeline.captioning.pictures.attended_regions`: boxes in pixels,
labels, words); or ``error`` (``reason: detail``), ``reason`` and ``detail`` with the reason codes of ``caption``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from pydantic import BaseModel, Field

from models.decoding.captions import merge_decoding
from models.decoding import DecodeOptions
from pipeline.captioning.pictures import attended_regions, region_labels
from pipeline.core.errors import FAILURE_REASONS, ConfigError
from pipeline.core.keys import key_to_text
from pipeline.serving.settings import ServeSettings

OPTION_NAMES = ("beam_size", "n_best", "max_len", "regions", "timeout_s")


class BadOptions(Exception):
    """An option the server does not accept (HTTP 422); the message names it."""


class Hypothesis(BaseModel):
    caption: str
    score: float


class Region(BaseModel):
    box: list[float] = Field(description="x1, y1, x2, y2 in the image's pixels")
    label: str = Field(description="attribute and class of the detection")
    words: list[str] = Field(description="caption words whose log-probability drops most without this region")
    weight: float


class ImageAnswer(BaseModel):
    index: int
    name: str = Field(description="the client's file name (a label only)")
    caption: str | None = None
    score: float | None = None
    nbest: list[Hypothesis] | None = None
    width: int | None = None
    height: int | None = None
    regions: list[Region] | None = None
    error: str | None = Field(None, description="reason: detail, as `caption` writes it")
    reason: str | None = Field(
        None, description="one of pipeline.core.errors.FAILURE_REASONS: " + ", ".join(FAILURE_REASONS)
    )
    detail: str | None = None


class CaptionsAnswer(BaseModel):
    images: list[ImageAnswer]
    options: dict[str, Any]
    seconds: float


class ErrorAnswer(BaseModel):
    error: str


def _int(fields: Mapping[str, str], name: str, limit: int) -> int | None:
    raw = fields.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise BadOptions(f"{name} must be an integer, not {raw!r}") from None
    if not 1 <= value <= limit:
        raise BadOptions(f"{name} must be between 1 and {limit} on this server, not {value}")
    return value


def request_options(
    fields: Mapping[str, str], base: DecodeOptions, limits: ServeSettings
) -> tuple[DecodeOptions, bool, float]:
    """The request's decoding options (over the served ones), whether it wants regions, and its time limit."""
    unknown = sorted(set(fields) - set(OPTION_NAMES))
    if unknown:
        raise BadOptions(f"unknown option(s) {', '.join(unknown)} (known: {', '.join(OPTION_NAMES)})")
    given = {
        "beam_size": _int(fields, "beam_size", limits.max_beam_size),
        "n_best": _int(fields, "n_best", limits.max_n_best),
        "max_len": _int(fields, "max_len", limits.max_len),
    }
    overrides: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
    if "beam_size" in overrides or "n_best" in overrides:
        overrides.setdefault("method", "beam")  # as caption's --beam-size / --n-best
    regions = fields.get("regions", "").strip().lower()
    if regions not in ("", "true", "false", "1", "0", "yes", "no"):
        raise BadOptions(f"regions must be true or false, not {regions!r}")
    want_regions = limits.regions if regions == "" else regions in ("true", "1", "yes")
    timeout = limits.request_timeout_s
    if fields.get("timeout_s", "") != "":
        try:
            timeout = float(fields["timeout_s"])
        except ValueError:
            raise BadOptions(f"timeout_s must be a number, not {fields['timeout_s']!r}") from None
        if not 0 < timeout <= limits.request_timeout_s:
            raise BadOptions(
                f"timeout_s must be above 0 and at most {limits.request_timeout_s:g} on this server, not {timeout:g}"
            )
    try:
        options = DecodeOptions.from_mapping(merge_decoding(asdict(base), overrides)) if overrides else base
    except ConfigError as exc:
        raise BadOptions(str(exc)) from None
    if options.method == "beam" and options.beam_size > limits.max_beam_size:
        raise BadOptions(
            f"n_best {options.n_best} widens the beam to {options.beam_size}, beyond this server's {limits.max_beam_size}"
        )
    return options, want_regions, timeout


def image_answer(
    index: int, res: Any, classes: Sequence[str], attributes: Sequence[str], regions: bool, max_regions: int
) -> dict[str, Any]:
    """The JSON entry of one image's :class:`pipeline.captioning.engine.CaptionResult`."""
    out: dict[str, Any] = {"index": index, "name": key_to_text(str(res.path))}
    if res.error:
        reason, _, detail = res.error.partition(": ")
        return {**out, "error": res.error, "reason": reason, "detail": detail}
    out.update(
        caption=res.caption,
        score=round(float(res.score), 5),
        nbest=[{"caption": c, "score": round(float(s), 5)} for c, s in res.nbest],
    )
    if res.regions is not None:
        out.update(width=int(res.regions["image_w"]), height=int(res.regions["image_h"]))
        if regions:
            labels = region_labels(res.regions, classes, attributes)
            out["regions"] = [
                {
                    "box": [round(float(v), 1) for v in reg.box],
                    "label": reg.label,
                    "words": reg.words,
                    "weight": round(reg.weight, 4),
                }
                for reg in attended_regions(res, labels, max_regions)
            ]
    return out


def options_answer(options: DecodeOptions, regions: bool) -> dict[str, Any]:
    return {
        "method": options.method,
        "beam_size": options.beam_size,
        "n_best": options.n_best,
        "max_len": options.max_len,
        "regions": regions,
    }
