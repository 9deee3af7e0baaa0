"""`cli evaluate`: Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present).

Two modes share the ``evaluate:`` config section (configs/evaluate.yaml):

* ``--predictions RESULTS.json --references CAPTIONS.json``: score an existing COCO results file (built).
* ``--model CKPT --store STORE --data PREPARED [--split test]``: decode a split with a trained captioner
  (its checkpoint's decoding settings), score it, write ``predictions_<split>.json`` (COCO results) and
  ``metrics_<split>.json`` next to the checkpoint (or into ``--output``'s folder), print the table. ``--model``
  may name a run directory (default: the default run directory, so ``evaluate`` alone scores what ``train``
  wrote): its best captioner, with ``--store`` and ``--data`` defaulting to ``RUN/features/store`` and ``RUN/data``.
* ``--retrieval ENCODER.pt --store FEATURES --data PREPARED [--split test]``: caption <-> image Recall@1/5/10 of
  the split's ground-truth captions with a trained sentence encoder (``cli train-encoder``); with
  ``--predictions`` or ``--model`` also of the generated captions (self-retrieval), printed next to the COCO metrics.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Annotated, Any, Optional

import typer
from rich.table import Table

from models.decoding.captions import command_decoding
from pipeline.caption_data.prepare import KNOWN_SPLITS
from pipeline.captioning.choose import find_checkpoint
from pipeline.commands.captioner_opts import CaptionerOpt, VocabOpt
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command, output_option
from pipeline.core.console import get_logger, stdout_console
from pipeline.core.errors import UsageError
from pipeline.core.fileio import atomic_write_json
from pipeline.embedding.retrieval import evaluate_retrieval_files
from pipeline.hub import resolve_file
from pipeline.metrics.coco import METRICS, EvalOptions, evaluate_files
from pipeline.training.api import evaluate_checkpoint

log = get_logger("evaluate")


EVALUATE_EVERYDAY = Everyday.section("evaluate")


def register(app: typer.Typer) -> None:
    @command(app, "evaluate", everyday=EVALUATE_EVERYDAY, decoding=True, help_fields={"run": str(DEFAULT_RUN)})
    def evaluate_command(
        opts: CommandOptions,
        predictions: Annotated[
            Optional[Path], typer.Option("--predictions", "-p", help="COCO results file: [{image_id, caption}, ...].")
        ] = None,
        references: Annotated[
            Optional[Path], typer.Option("--references", "-r", help="COCO captions file with the reference captions.")
        ] = None,
        output: output_option("Write the metrics as JSON here.") = None,
        metrics: Annotated[
            Optional[str],
            typer.Option("--metrics", "-e", help=f"Comma-separated subset of {','.join(METRICS)} (evaluate.metrics)."),
        ] = None,
        model: Annotated[
            Optional[Path],
            typer.Option(
                "--model",
                "-m",
                help="Captioner to decode a split with: a checkpoint (best.pt), a run directory (its best "
                f"captioner), or a released M2/AoANet .pth; default {DEFAULT_RUN} when neither --predictions nor "
                "--retrieval is given.",
            ),
        ] = None,
        captioner: CaptionerOpt = None,
        vocab: VocabOpt = None,
        store: Annotated[
            Optional[Path],
            typer.Option(
                "--store",
                help="Feature store of the images (with --model or --retrieval; default RUN/features/store of a run "
                "directory --model).",
            ),
        ] = None,
        data: Annotated[
            Optional[Path],
            typer.Option(
                "--data",
                help="Prepared captions folder: vocabulary, splits, references (with --model or --retrieval; default "
                "RUN/data of a run directory --model).",
            ),
        ] = None,
        split: Annotated[
            Optional[str], typer.Option("--split", help="Split decoded with --model, or retrieved in (evaluate.split).")
        ] = None,
        retrieval: Annotated[
            Optional[Path],
            typer.Option("--retrieval", help="Sentence-encoder checkpoint: also report caption<->image Recall@1/5/10."),
        ] = None,
    ) -> None:
        """Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present): a COCO results file
        (--predictions, --references), or a captioner that decodes a split first (--model: a checkpoint or a run
        directory; with no option at all, the best captioner of {run} on its test split, with its features and
        prepared captions).

        Examples:

            butd-caption evaluate

            butd-caption evaluate --model runs/coco --split val

            butd-caption evaluate --predictions results.json --references captions_test.json

            butd-caption evaluate -p results.json -r captions_test.json --output metrics.json -e bleu,cider

            butd-caption evaluate --model runs/w/train-san/best.pt --store runs/w/features/store --data runs/w/data --split test

            butd-caption evaluate --model meshed_memory_transformer.pth --vocab vocab.pkl --store STORE --data DATA --split test

            butd-caption evaluate --model runs/w/train-san/best.pt --store runs/w/features/store --data runs/w/data --retrieval runs/w/encoder/best.pt
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        extra: list[str] = []
        if metrics is not None:
            names = [m.strip() for m in metrics.split(",") if m.strip()]
            extra.append(f"evaluate.metrics=[{','.join(names)}]")
        if split is not None:
            extra.append(f"evaluate.split={split}")
        cfg = opts.resolve("evaluate", extra, show=opts.verbose)
        if str(cfg.evaluate.split) not in KNOWN_SPLITS:
            raise UsageError(
                f"--split (evaluate.split) must be a split of the prepared captions ({', '.join(KNOWN_SPLITS)}), "
                f"not {cfg.evaluate.split!r}"
            )
        if model is None and predictions is None and references is None and retrieval is None:
            model = DEFAULT_RUN  # the stage chain: evaluate what `train` wrote into the default run directory
        if model is not None:
            if predictions is not None:
                raise UsageError("give either --model (decode and score a split) or --predictions, not both")
            decoding = cfg.decoding.to_dict()  # the decoding flags are decoding.* overrides, as in caption and serve

            command_decoding(decoding)  # keys and types before any work (and any download), as caption checks them
            model, store, data = _run_inputs(model, captioner, store, data)
            if vocab is not None:
                vocab = Path(resolve_file(vocab, "vocabulary file", "vocab"))
            _score_checkpoint(model, store, data, output, cfg.evaluate, decoding, retrieval, vocab)
            return
        if retrieval is None and (store is not None or data is not None):
            raise UsageError("--store and --data are used with --model CKPT or --retrieval ENCODER.pt")
        if retrieval is not None and predictions is None and references is None:
            _retrieval_only(retrieval, store, data, output, cfg.evaluate)
            return
        if predictions is None or references is None:
            raise UsageError(
                "give --predictions RESULTS.json and --references CAPTIONS.json (or --model CKPT, or --retrieval "
                "ENCODER.pt)"
            )
        _score_files(predictions, references, output, cfg.evaluate, retrieval, store, data)


def _run_inputs(model: Path, captioner: str | None, store: Path | None, data: Path | None) -> tuple[Path, Path, Path]:
    """The checkpoint, store and prepared captions of ``--model``: a run directory gives its best captioner (or
    ``--captioner``'s) and defaults ``--store``/``--data`` to ``RUN/features/store``/``RUN/data``."""
    if not model.exists() and all(name.strip() in METRICS for name in str(model).split(",")):
        raise UsageError(
            f"-m is --model (the captioner), not a metric list: give the metrics with --metrics/-e {model}"
        )
    if model.is_dir():
        store = store if store is not None else model / "features" / "store"
        data = data if data is not None else model / "data"
        for what, path, made_by in (("--store", store, "extract --store"), ("--data", data, "prepare --out")):
            if not path.exists():
                raise UsageError(
                    f"{what} {path} not found (the run directory {model} has none; run `{made_by} {model}` "
                    f"or pass {what})"
                )
    checkpoint = find_checkpoint(model, captioner)
    if store is None or data is None:
        raise UsageError("--model CHECKPOINT needs --store STORE (features) and --data DIR (prepared captions)")
    return checkpoint, store, data


def _retrieval(
    encoder: Path, store: Path | None, data: Path | None, section: Any, predictions: Path | None = None
) -> dict[str, Any]:
    return evaluate_retrieval_files(
        encoder,
        store,
        data,
        str(section.split),
        device=str(section.device),
        predictions=predictions,
        num_workers=int(section.num_workers),
        precision=str(section.precision),
    )


def _retrieval_only(encoder: Path, store: Path | None, data: Path | None, output: Path | None, section: Any) -> None:
    report = _retrieval(encoder, store, data, section)
    _print_retrieval(report)
    if output is not None:
        atomic_write_json(output, {"retrieval": report})
        log.info("metrics written to %s", output)


def _print_retrieval(report: dict[str, Any]) -> None:
    table = Table(
        title=f"retrieval on {report['split']}: {report['split_images']} images (encoder "
        f"{Path(report['checkpoint']).name})",
        show_edge=False,
    )
    table.add_column("retrieval")
    cols = [("ground truth", report["ground_truth"])]
    if "generated" in report:
        cols.append((f"generated ({report['generated_captions']})", report["generated"]))
    for label, _ in cols:
        table.add_column(label, justify="right")
    names = [k for k in report["ground_truth"] if "_R@" in k and "chance" not in k] + ["c2i_medr", "i2c_medr"]
    for name in names:
        table.add_row(name, *(f"{values[name]:.2f}" for _, values in cols))
    con = stdout_console()
    con.print(table)
    con.print(
        f"chance caption-to-image R@1: {report['ground_truth']['c2i_chance_R@1']:.2f}", style="dim", highlight=False
    )


def _score_files(
    predictions: Path,
    references: Path,
    output: Path | None,
    section: Any,
    encoder: Path | None = None,
    store: Path | None = None,
    data: Path | None = None,
) -> None:
    options = EvalOptions.from_config(section)
    result = evaluate_files(
        predictions,
        references,
        options,
        duplicates=section.duplicates,
        unknown_images=section.unknown_images,
        empty_captions=section.empty_captions,
    )
    report = _retrieval(encoder, store, data, section, predictions) if encoder is not None else None
    _print_table(result, predictions)
    if report is not None:
        _print_retrieval(report)
    if output is not None:
        payload = {"predictions": str(predictions), "references": str(references), **result.to_json(section.per_image)}
        if report is not None:
            payload["retrieval"] = report
        atomic_write_json(output, payload)
        log.info("metrics written to %s", output)


def _score_checkpoint(
    model: Path,
    store: Path,
    data: Path,
    output: Path | None,
    section: Any,
    decoding: dict[str, Any],
    encoder: Path | None = None,
    vocab: Path | None = None,
) -> None:
    split = str(section.split)
    res = evaluate_checkpoint(
        model,
        store,
        data,
        split,
        out_dir=output.parent if output else None,
        eval_section=section,
        decoding=decoding,
        device=str(section.device),
        batch_size=int(section.batch_size),
        precision=str(section.precision),
        companion=vocab,
        num_workers=int(section.num_workers),
    )
    report = _retrieval(encoder, store, data, section, Path(res["predictions"])) if encoder is not None else None
    if output is not None:
        payload = {k: v for k, v in res.items() if k not in ("predictions", "metrics_file")}
        atomic_write_json(output, {**payload, "retrieval": report} if report is not None else payload)
    table = SimpleNamespace(
        metrics=res["metrics"],
        image_ids=range(res["num_images"]),
        tokenizer=res["tokenizer"],
        skipped=res["skipped"],
        notes=res["notes"],
    )
    _print_table(table, Path(f"{model.name} on {split}"))
    if report is not None:
        _print_retrieval(report)
    log.info("predictions: %s, metrics: %s", res["predictions"], output or res["metrics_file"])


def _print_table(result: Any, predictions: Path) -> None:
    table = Table(
        title=f"{predictions.name}: {len(result.image_ids)} images, {result.tokenizer} tokenizer", show_edge=False
    )
    table.add_column("metric")
    table.add_column("score", justify="right")
    for key, value in result.metrics.items():
        table.add_row(key, f"{value:.4f}")
    for name in result.skipped:
        table.add_row(name.upper(), "skipped")
    con = stdout_console()
    con.print(table)
    for name, reason in result.skipped.items():
        con.print(f"{name.upper()}: {reason}", style="dim", highlight=False, markup=False)
    for note in result.notes:
        con.print(f"note: {note}", style="dim", highlight=False, markup=False)
