"""`cli train-detector` and `cli eval-detector`: train the bottom-up detector on COCO instances, score it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import ConfigOpt, ForceOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, resolve_config
from pipeline.core.errors import UsageError


def register(app: typer.Typer) -> None:
    @app.command(
        "train-detector",
        help=(
            "Train or fine-tune the bottom-up Faster R-CNN on COCO-format instances with attribute ids (RPN, box and "
            "attribute losses; SGD with warm-up and steps). Resumable: a killed run continues from OUT/checkpoints/last.pt. "
            "Writes OUT/detector.pth, which `extract --weights` loads like a public checkpoint. Multi-GPU/CPU: torchrun.\n\n"
            "Examples:\n\n"
            "    butd-caption demo --generate-only --out world --num-images 2000\n\n"
            "    butd-caption train-detector --config configs/detector/demo.yaml --world world --out runs/detector\n\n"
            "    butd-caption train-detector -c configs/detector/vg_r101.yaml --set data.train_annotations=vg/train.json "
            "--set data.train_images=vg/images --set model.init_weights=bua-caffe-frcn-r101_with_attributes.pth --out runs/vg"
        ),
    )
    @guarded
    def train_detector_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Stage directory (checkpoints, detector.pth, manifest.json).")] = Path("runs/detector"),
        world: Annotated[Optional[Path], typer.Option("--world", help="A synthetic world folder: train on its train split, evaluate on its test split.")] = None,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        force: ForceOpt = False,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from pipeline.core.console import stdout_console
        from pipeline.core.stages import run_stage

        overrides = list(set_ or [])
        if world is not None:
            if not (world / "annotations" / "instances_train.json").is_file():
                raise UsageError(f"--world {world}: no annotations/instances_train.json (write one with `demo --generate-only`)")
            overrides = [f"data.train_annotations={world / 'annotations' / 'instances_train.json'}", f"data.train_images={world / 'images'}",
                         f"data.eval_annotations={world / 'annotations' / 'instances_test.json'}", f"data.eval_images={world / 'images'}"] + overrides
        from extractors.training.loop import dist_info
        from extractors.training.stage import train_detector

        rank = dist_info().rank
        cfg = resolve_config("train_detector", config, overrides, show=rank == 0)
        if rank > 0:  # torchrun: rank 0 keeps the stage bookkeeping, the others only train
            out.mkdir(parents=True, exist_ok=True)
            train_detector(out, cfg)
            return
        result = run_stage(out.parent if out.name else out, out.name, cfg, train_detector, force=force)
        con = stdout_console()
        s = result.summary
        con.print(f"detector weights: {result.directory / result.outputs['weights']}", highlight=False)
        con.print(f"iterations {s.get('iterations')}, {s.get('train_seconds')} s, {s.get('images_per_second')} images/s, losses {s.get('losses')}", highlight=False)
        if "eval" in s:
            from extractors.training.evaluate import summary_line

            con.print("evaluation: " + summary_line(s["eval"]), highlight=False)

    @app.command(
        "eval-detector",
        help=(
            "Score a trained detector (a butd detector.pth) on a COCO instances split with the extractor's own box "
            "selection: recall at IoU 0.5, class accuracy and attribute (e.g. colour) accuracy of the matched boxes.\n\n"
            "Example:\n\n"
            "    butd-caption eval-detector runs/detector/detector.pth --annotations world/annotations/instances_test.json --images world/images"
        ),
    )
    @guarded
    def eval_detector_command(
        weights: Annotated[Path, typer.Argument(help="A detector.pth written by train-detector.")],
        annotations: Annotated[Path, typer.Option("--annotations", "-a", help="COCO instances json of the split.")],
        images: Annotated[Optional[Path], typer.Option("--images", help="Image folder (default: the annotations' folder).")] = None,
        device: Annotated[str, typer.Option("--device", help="cpu | cuda | auto")] = "cpu",
        json_out: Annotated[bool, typer.Option("--json", help="Print the result as JSON.")] = False,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from extractors.factory import resolve_device
        from extractors.training.evaluate import summary_line
        from extractors.training.stage import evaluate_detector
        from pipeline.core.console import stdout_console

        cfg = resolve_config("train_detector", config, list(set_ or []), show=False)
        result = evaluate_detector(weights, annotations, images, cfg, device=str(resolve_device(device)))
        con = stdout_console()
        con.print(json.dumps(result, indent=1) if json_out else summary_line(result), highlight=False)
