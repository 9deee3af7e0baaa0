"""The COCO caption metrics: BLEU-1..4, METEOR, ROUGE-L, CIDEr-D and (when installed) SPICE.

Same numbers as pycocoevalcap's ``COCOEvalCap.evaluate`` (PTB tokenisation, then each scorer on the
tokenised captions; JSON keys as it names them: ``Bleu_1..4``, ``METEOR``, ``ROUGE_L``, ``CIDEr``,
``SPICE``), with these differences in robustness, all reported in :attr:`CaptionScores.notes` / ``skipped``:

* BLEU and ROUGE-L are pycocoevalcap's own scorers; CIDEr-D is :class:`pipeline.metrics.cider.CiderD`
  (equal to pycocoevalcap's to 1e-9; document frequencies from the scored images' references, as there).
* METEOR, SPICE and the PTB tokenizer run on pycocoevalcap's jars through our runners (no files written
  into site-packages, English locale, timeouts, clear errors). A failing METEOR or SPICE is reported as
  skipped with the reason; the other metrics are still computed.
* SPICE runs only when its CoreNLP jars are already present; nothing is ever downloaded.
* Java missing: with ``java_missing: fallback`` (default) the captions are tokenised by a pure-Python
  PTB approximation (flagged: ``tokenizer = "simple"``, scores not guaranteed comparable with published
  numbers), METEOR and SPICE are skipped, BLEU/ROUGE-L/CIDEr-D are computed. With ``java_missing: error``
  evaluation stops with one line.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pycocoevalcap.bleu.bleu import Bleu
from pycocoevalcap.rouge.rouge import Rouge

from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.metrics.cider import CiderD
from pipeline.metrics.coco_files import load_predictions, load_references, match_predictions
from pipeline.metrics.java import JavaMissing, JavaRun, find_java
from pipeline.metrics.meteor import meteor_scores
from pipeline.metrics.spice import spice_available, spice_scores
from pipeline.metrics.tokenize import ptb_tokenize, simple_tokenize

log = get_logger("metrics")

METRICS = ("bleu", "meteor", "rouge", "cider", "spice")
METRIC_KEYS = {
    "bleu": ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4"),
    "meteor": ("METEOR",),
    "rouge": ("ROUGE_L",),
    "cider": ("CIDEr",),
    "spice": ("SPICE",),
}
NEEDS_JAVA = ("meteor", "spice")


@dataclass(frozen=True)
class EvalOptions:
    """How to score; built from the ``evaluate:`` config section by :meth:`from_config`."""

    metrics: tuple[str, ...] = METRICS
    tokenizer: str = "ptb"  # ptb | simple
    java: str | None = None
    java_missing: str = "fallback"  # fallback | error
    timeout_s: float = 600.0
    meteor_max_memory: str = "2G"
    spice_max_memory: str = "8G"

    def __post_init__(self) -> None:
        unknown = [m for m in self.metrics if m not in METRICS]
        if unknown or not self.metrics:
            raise UsageError(
                f"evaluate.metrics: unknown metric(s) {unknown or '(none given)'} (known: {', '.join(METRICS)})"
            )
        if self.tokenizer not in ("ptb", "simple"):
            raise UsageError(f"evaluate.tokenizer must be ptb or simple, got {self.tokenizer!r}")
        if self.java_missing not in ("fallback", "error"):
            raise UsageError(f"evaluate.java_missing must be fallback or error, got {self.java_missing!r}")

    @classmethod
    def from_config(cls, section: Mapping[str, Any]) -> "EvalOptions":
        return cls(
            metrics=tuple(section["metrics"]),
            tokenizer=section["tokenizer"],
            java=section["java"],
            java_missing=section["java_missing"],
            timeout_s=float(section["timeout_s"]),
            meteor_max_memory=str(section["meteor_max_memory"]),
            spice_max_memory=str(section["spice_max_memory"]),
        )


@dataclass
class CaptionScores:
    """Corpus metrics, per-image scores (aligned with ``image_ids``) and what was skipped or changed."""

    metrics: dict[str, float]
    per_image: dict[str, list[float]]
    image_ids: list[Hashable]
    tokenizer: str
    skipped: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self, per_image: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "metrics": self.metrics,
            "num_images": len(self.image_ids),
            "tokenizer": self.tokenizer,
            "skipped": self.skipped,
            "notes": self.notes,
        }
        if per_image:
            out["per_image"] = [
                {"image_id": i, **{k: v[n] for k, v in self.per_image.items()}} for n, i in enumerate(self.image_ids)
            ]
        return out


def _resolve_java(options: EvalOptions, notes: list[str]) -> str | None:
    needs = options.tokenizer == "ptb" or any(m in NEEDS_JAVA for m in options.metrics)
    if not needs:
        return None
    try:
        return find_java(options.java)
    except JavaMissing as exc:
        if options.java_missing == "error":
            raise
        note = f"{exc}: tokenised without PTB (pure-Python approximation), METEOR and SPICE skipped"
        log.warning(note)
        notes.append(note)
        return None


def score_captions(
    references: Mapping[Hashable, Sequence[str]],
    predictions: Mapping[Hashable, str],
    options: EvalOptions | None = None,
) -> CaptionScores:
    """Score raw ``predictions`` (one caption per image) against raw ``references`` (same image ids)."""
    options = options or EvalOptions()
    if set(predictions) - set(references):
        raise UsageError("every predicted image needs references")
    if not predictions:
        raise UsageError("no predictions to score")
    notes: list[str] = []
    skipped: dict[str, str] = {}
    java = _resolve_java(options, notes)
    image_ids = list(predictions)

    # ---- tokenisation: references and predictions in one pass
    ref_lists = [list(references[i]) for i in image_ids]
    flat = [c for refs in ref_lists for c in refs] + [predictions[i] for i in image_ids]
    tokenizer = "ptb" if options.tokenizer == "ptb" and java else "simple"
    log.info("tokenising %d captions (%s)", len(flat), "PTB, Java" if tokenizer == "ptb" else "pure Python")
    tokens = ptb_tokenize(flat, java, options.timeout_s) if tokenizer == "ptb" else simple_tokenize(flat)  # type: ignore[arg-type]
    gts: dict[Hashable, list[str]] = {}
    pos = 0
    for i, refs in zip(image_ids, ref_lists):
        gts[i] = tokens[pos : pos + len(refs)]
        pos += len(refs)
    res = {i: [tokens[pos + k]] for k, i in enumerate(image_ids)}

    metrics: dict[str, float] = {}
    per_image: dict[str, list[float]] = {}
    for name in options.metrics:
        if name in NEEDS_JAVA and java is None:
            skipped[name] = "Java not found"
            continue
        log.info("computing %s", name)
        if name == "bleu":
            score, scores = Bleu(4).compute_score(gts, res, verbose=0)
            for k, key in enumerate(METRIC_KEYS["bleu"]):
                metrics[key], per_image[key] = float(score[k]), [float(s) for s in scores[k]]
        elif name == "rouge":
            score, scores = Rouge().compute_score(gts, res)
            metrics["ROUGE_L"], per_image["ROUGE_L"] = float(score), [float(s) for s in scores]
        elif name == "cider":
            scores = CiderD(gts, df_mode="corpus").scores([res[i][0] for i in image_ids], image_ids)
            metrics["CIDEr"], per_image["CIDEr"] = float(scores.mean()), scores.tolist()
        elif name == "meteor":
            try:
                score, scores = meteor_scores(
                    [res[i][0] for i in image_ids],
                    [gts[i] for i in image_ids],
                    JavaRun(java, options.timeout_s, options.meteor_max_memory),  # type: ignore[arg-type]
                )
            except PipelineError as exc:
                skipped[name] = str(exc)
                log.warning("%s", exc)
                continue
            metrics["METEOR"], per_image["METEOR"] = score, scores
        elif name == "spice":
            available, reason = spice_available()
            if not available:
                skipped[name] = reason
                log.warning("SPICE skipped: %s", reason)
                continue
            try:
                score, scores = spice_scores(
                    image_ids,
                    [res[i][0] for i in image_ids],
                    [gts[i] for i in image_ids],
                    JavaRun(java, max(options.timeout_s, 1800.0), options.spice_max_memory),  # type: ignore[arg-type]
                )
            except PipelineError as exc:
                skipped[name] = str(exc)
                log.warning("%s; the other metrics are still reported", exc)
                continue
            metrics["SPICE"], per_image["SPICE"] = score, scores
    if tokenizer != options.tokenizer:
        notes.append(
            "tokenizer: pure-Python PTB approximation (Java not found); scores may differ slightly from published "
            "PTB-tokenised numbers"
        )
    return CaptionScores(metrics, per_image, image_ids, tokenizer, skipped, notes)


def evaluate_files(
    predictions_path: str | Path,
    references_path: str | Path,
    options: EvalOptions | None = None,
    duplicates: str = "error",
    unknown_images: str = "error",
    empty_captions: str = "keep",
) -> CaptionScores:
    """Validate a COCO results file against a COCO captions file and score it."""
    references, ref_notes = load_references(references_path)
    matched = match_predictions(
        load_predictions(predictions_path), references, predictions_path, duplicates, unknown_images, empty_captions
    )
    for note in ref_notes + matched.notes:
        log.warning("%s", note)
    result = score_captions(matched.references, matched.predictions, options)
    result.notes[:0] = ref_notes + matched.notes
    return result
