"""`cli train-detector` and `cli eval-detector`: train the bottom-up detector on COCO instances, score it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command, out_option
from pipeline.core.console import stdout_console
from pipeline.core.distributed import check_gpu_per_process, env_context
from pipeline.core.errors import UsageError
from pipeline.core.precision import check_precision
from pipeline.core.stages import run_stage

#: images per batch is the detector's batch size; ``--num-workers`` decodes images
DETECTOR_EVERYDAY = Everyday(
    device="detector_train.device",
    batch_size="detector_train.images_per_batch",
    precision="detector_train.precision",
    num_workers="data.num_workers",
)


#: eval-detector runs as `extract` does: eval.batch_size images per forward, decoded in eval.num_workers processes
EVAL_EVERYDAY = Everyday.section("eval")


#: the stage folder inside the run directory, where the demo keeps its detector too (`caption` looks there)
DETECTOR_STAGE = "detector"


def register(app: typer.Typer) -> None:
    @command(app, "train-detector", force=True, everyday=DETECTOR_EVERYDAY, help_fields={"run": str(DEFAULT_RUN)})
    def train_detector_command(
        opts: CommandOptions,
        out: out_option(
            "Run directory; the stage writes OUT/detector (checkpoints, detector.pth, manifest.json)."
        ) = DEFAULT_RUN,
        world: Annotated[
            Optional[Path],
            typer.Option(
                "--world", help="A synthetic world folder: train on its train split, evaluate on its test split."
            ),
        ] = None,
        reinit_heads: Annotated[
            bool,
            typer.Option(
                "--reinit-heads",
                help="Fine-tune model.init_weights on another label set: new class and attribute heads; backbone, RPN "
                "and res5 kept.",
            ),
        ] = False,
    ) -> None:
        """Train or fine-tune the bottom-up Faster R-CNN on COCO-format instances with attribute ids (RPN, box
        and attribute losses; SGD with warm-up and steps) into OUT/detector (OUT defaults to {run}). Resumable: a
        killed run continues from OUT/detector/checkpoints/last.pt. Writes OUT/detector/detector.pth, which
        `extract --weights` loads like a public checkpoint and `caption --model OUT` finds by itself.
        Multi-GPU/CPU: torchrun.

        Examples:

            butd-caption demo --generate-only --out world --num-images 2000

            butd-caption train-detector --config configs/detector/demo.yaml --world world --out runs/world

            butd-caption train-detector -c configs/detector/vg_r101.yaml --set data.train_annotations=vg/train.json --set data.train_images=vg/images --set model.init_weights=bua-caffe-frcn-r101_with_attributes.pth --out runs/vg

            butd-caption train-detector -c configs/detector/vg_r101.yaml --set data.train_annotations=mine.json --set model.init_weights=bua-caffe-frcn-r101_with_attributes.pth --reinit-heads --out runs/mine   (your own categories)
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        first: list[str] = []
        if world is not None:
            if not (world / "annotations" / "instances_train.json").is_file():
                raise UsageError(
                    f"--world {world}: no annotations/instances_train.json (write one with `demo --generate-only`)"
                )
            first = [
                f"data.train_annotations={world / 'annotations' / 'instances_train.json'}",
                f"data.train_images={world / 'images'}",
                f"data.eval_annotations={world / 'annotations' / 'instances_test.json'}",
                f"data.eval_images={world / 'images'}",
            ]
        if reinit_heads:
            first.append("model.reinit_heads=true")

        from extractors.training.stage import train_detector  # noqa: PLC0415 -- keeps cli --help fast

        rank = env_context().rank
        cfg = opts.resolve("train_detector", first=first, show=rank == 0)
        check_gpu_per_process(
            str(cfg.detector_train.device), "detector_train.device"
        )  # torchrun: before any work, on every rank
        if rank > 0:  # torchrun: rank 0 keeps the stage bookkeeping, the others only train
            (out / DETECTOR_STAGE).mkdir(parents=True, exist_ok=True)
            train_detector(out / DETECTOR_STAGE, cfg)
            return
        result = run_stage(out, DETECTOR_STAGE, cfg, train_detector, force=opts.force)
        con = stdout_console()
        s = result.summary
        con.print(f"detector weights: {result.directory / result.outputs['weights']}", highlight=False)
        con.print(
            f"iterations {s.get('iterations')}, {s.get('train_seconds')} s, {s.get('images_per_second')} images/s, "
            f"losses {s.get('losses')}",
            highlight=False,
        )
        if "eval" in s:
            from extractors.training.evaluate import summary_line  # noqa: PLC0415 -- keeps cli --help fast

            con.print("evaluation: " + summary_line(s["eval"]), highlight=False)

    @command(app, "eval-detector", everyday=EVAL_EVERYDAY)
    def eval_detector_command(
        opts: CommandOptions,
        weights: Annotated[Path, typer.Argument(help="A detector.pth written by train-detector.")],
        annotations: Annotated[Path, typer.Option("--annotations", "-a", help="COCO instances json of the split.")],
        images: Annotated[
            Optional[Path], typer.Option("--images", help="Image folder (default: the annotations' folder).")
        ] = None,
        json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
    ) -> None:
        """Score a trained detector (a butd detector.pth) on a COCO instances split with the extractor's own box
        selection: recall at IoU 0.5, class accuracy and attribute (e.g. colour) accuracy of the matched
        boxes. Runs as `extract` does: --batch-size images per forward, decoded in --num-workers processes, at
        --precision (config: the eval section of configs/train_detector.yaml); none of them changes the scores
        beyond float rounding.

        Example:

            butd-caption eval-detector runs/detector/detector.pth --annotations world/annotations/instances_test.json --images world/images

            butd-caption eval-detector runs/detector/detector.pth -a world/annotations/instances_test.json --batch-size 8 --num-workers 2 --precision bf16
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        from extractors.training.evaluate import summary_line  # noqa: PLC0415 -- keeps cli --help fast
        from extractors.training.stage import evaluate_detector  # noqa: PLC0415 -- keeps cli --help fast

        cfg = opts.resolve("train_detector", show=False)
        check_precision(cfg.eval.precision, "eval.precision", fp16=False)
        result = evaluate_detector(weights, annotations, images, cfg)
        con = stdout_console()
        con.print(json.dumps(result, indent=1) if json_out else summary_line(result), highlight=False)
