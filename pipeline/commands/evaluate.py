"""`cli evaluate`: Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present).

Two modes share the ``evaluate:`` config section (configs/evaluate.yaml):

* ``--predictions RESULTS.json --references CAPTIONS.json``: score an existing COCO results file (built).
* ``--model CKPT --store STORE --data PREPARED [--split test]``: decode a split with a trained captioner
  (its checkpoint's decoding settings), score it, write ``predictions_<split>.json`` (COCO results) and
  ``metrics_<split>.json`` next to the checkpoint (or into ``--output``'s folder), print the table.
* ``--retrieval ENCODER.pt --store FEATURES --data PREPARED [--split test]``: caption <-> image Recall@1/5/10 of
  the split's ground-truth captions with a trained sentence encoder (``cli train-encoder``); with
  ``--predictions`` or ``--model`` also of the generated captions (self-retrieval), printed next to the COCO metrics.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from pipeline.commands.options import CommandOptions, Everyday, command, output_option
from pipeline.core.console import get_logger, stdout_console
from pipeline.core.errors import UsageError

log = get_logger("evaluate")


EVALUATE_EVERYDAY = Everyday(device="evaluate.device", batch_size="evaluate.batch_size", precision="evaluate.precision",
                             num_workers="evaluate.num_workers")


def register(app: typer.Typer) -> None:
    @command(app, "evaluate", everyday=EVALUATE_EVERYDAY, decoding=True)
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
            Optional[str], typer.Option("--metrics", "-m", help="Comma-separated subset of bleu,meteor,rouge,cider,spice (evaluate.metrics).")
        ] = None,
        model: Annotated[Optional[Path], typer.Option("--model", help="Trained checkpoint (best.pt), or released M2/AoANet .pth, to decode a split with.")] = None,
        vocab: Annotated[Optional[Path], typer.Option("--vocab", help="Released model's vocabulary: M2 vocab.pkl or AoANet infos_*.pkl (with --model).")] = None,
        store: Annotated[Optional[Path], typer.Option("--store", help="Feature store of the images (with --model or --retrieval).")] = None,
        data: Annotated[Optional[Path], typer.Option("--data", help="Prepared captions folder: vocabulary, splits, references (with --model or --retrieval).")] = None,
        split: Annotated[Optional[str], typer.Option("--split", help="Split decoded with --model, or retrieved in (evaluate.split).")] = None,
        retrieval: Annotated[
            Optional[Path], typer.Option("--retrieval", help="Sentence-encoder checkpoint: also report caption<->image Recall@1/5/10.")
        ] = None,
    ) -> None:
        """Score captions with BLEU, METEOR, ROUGE-L, CIDEr-D (SPICE when present).

        Examples:

            butd-caption evaluate --predictions results.json --references captions_test.json

            butd-caption evaluate -p results.json -r captions_test.json --output metrics.json --metrics bleu,cider

            butd-caption evaluate --model runs/w/train-san/best.pt --store runs/w/features/store --data runs/w/data --split test

            butd-caption evaluate --model meshed_memory_transformer.pth --vocab vocab.pkl --store STORE --data DATA --split test

            butd-caption evaluate --model runs/w/train-san/best.pt --store runs/w/features/store --data runs/w/data --retrieval runs/w/encoder/best.pt
        """
        extra: list[str] = []
        if metrics is not None:
            names = [m.strip() for m in metrics.split(",") if m.strip()]
            extra.append(f"evaluate.metrics=[{','.join(names)}]")
        if split is not None:
            extra.append(f"evaluate.split={split}")
        cfg = opts.resolve("evaluate", extra, show=opts.verbose)
        if model is not None:
            if predictions is not None:
                raise UsageError("give either --model (decode and score a split) or --predictions, not both")
            if store is None or data is None:
                raise UsageError("--model needs --store STORE (features) and --data DIR (prepared captions)")
            decoding = cfg.decoding.to_dict()  # the decoding flags are decoding.* overrides, as in caption and serve
            from models.captions import command_decoding

            command_decoding(decoding)  # keys and types before any work, as caption checks them
            _score_checkpoint(model, store, data, output, cfg.evaluate, decoding, retrieval, vocab)
            return
        if retrieval is None and (store is not None or data is not None):
            raise UsageError("--store and --data are used with --model CKPT or --retrieval ENCODER.pt")
        if retrieval is not None and predictions is None and references is None:
            _retrieval_only(retrieval, store, data, output, cfg.evaluate)
            return
        if predictions is None or references is None:
            raise UsageError("give --predictions RESULTS.json and --references CAPTIONS.json (or --model CKPT, or --retrieval ENCODER.pt)")
        _score_files(predictions, references, output, cfg.evaluate, retrieval, store, data)


def _retrieval(encoder: Path, store: Path | None, data: Path | None, section: Any, predictions: Path | None = None) -> dict[str, Any]:
    from pipeline.embedding.retrieval import evaluate_retrieval_files

    return evaluate_retrieval_files(encoder, store, data, str(section.split), device=str(section.device), predictions=predictions,
                                    num_workers=int(section.num_workers), precision=str(section.precision))


def _retrieval_only(encoder: Path, store: Path | None, data: Path | None, output: Path | None, section: Any) -> None:
    from pipeline.core.fileio import atomic_write_json

    report = _retrieval(encoder, store, data, section)
    _print_retrieval(report)
    if output is not None:
        atomic_write_json(output, {"retrieval": report})
        log.info("metrics written to %s", output)


def _print_retrieval(report: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title=f"retrieval on {report['split']}: {report['split_images']} images (encoder {Path(report['checkpoint']).name})",
                  show_edge=False)
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
    con.print(f"chance caption-to-image R@1: {report['ground_truth']['c2i_chance_R@1']:.2f}", style="dim", highlight=False)


def _score_files(predictions: Path, references: Path, output: Path | None, section: Any, encoder: Path | None = None,
                 store: Path | None = None, data: Path | None = None) -> None:
    from pipeline.core.fileio import atomic_write_json
    from pipeline.metrics.coco import EvalOptions, evaluate_files

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


def _score_checkpoint(model: Path, store: Path, data: Path, output: Path | None, section: Any, decoding: dict[str, Any],
                      encoder: Path | None = None, vocab: Path | None = None) -> None:
    from types import SimpleNamespace

    from pipeline.core.fileio import atomic_write_json
    from pipeline.training.api import evaluate_checkpoint

    split = str(section.split)
    res = evaluate_checkpoint(model, store, data, split, out_dir=output.parent if output else None, eval_section=section, decoding=decoding,
                              device=str(section.device), batch_size=int(section.batch_size), precision=str(section.precision),
                              companion=vocab, num_workers=int(section.num_workers))
    report = _retrieval(encoder, store, data, section, Path(res["predictions"])) if encoder is not None else None
    if output is not None:
        payload = {k: v for k, v in res.items() if k not in ("predictions", "metrics_file")}
        atomic_write_json(output, {**payload, "retrieval": report} if report is not None else payload)
    table = SimpleNamespace(metrics=res["metrics"], image_ids=range(res["num_images"]), tokenizer=res["tokenizer"],
                            skipped=res["skipped"], notes=res["notes"])
    _print_table(table, Path(f"{model.name} on {split}"))
    if report is not None:
        _print_retrieval(report)
    log.info("predictions: %s, metrics: %s", res["predictions"], output or res["metrics_file"])


def _print_table(result: Any, predictions: Path) -> None:
    from rich.table import Table

    table = Table(title=f"{predictions.name}: {len(result.image_ids)} images, {result.tokenizer} tokenizer", show_edge=False)
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
