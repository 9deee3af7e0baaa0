"""`cli demo`: the whole staged pipeline on the embedded synthetic world, each stage resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, command, out_option
from pipeline.core.config import load_config
from pipeline.core.console import get_logger, stdout_console
from pipeline.core.errors import UsageError
from pipeline.core.stages import run_stage
from pipeline.world.generate import generate_world, world_stage_config

log = get_logger("demo")

METRIC_COLUMNS = ("Bleu_4", "METEOR", "ROUGE_L", "CIDEr")
#: grounding columns (pipeline/world/grounding.py): share of true noun phrases / relations in the test captions
GROUNDING_COLUMNS = (("objects", "object_accuracy", "phrases"), ("relations", "relation_accuracy", "relations"))


def register(app: typer.Typer) -> None:
    @command(app, "demo", force=True)
    def demo_command(
        opts: CommandOptions,
        out: out_option("Run directory (created if missing); with --generate-only, the world folder.") = DEFAULT_RUN,
        models: Annotated[
            Optional[str], typer.Option("--models", help="Comma-separated captioners (default ngsan).")
        ] = None,
        generate_only: Annotated[
            bool, typer.Option("--generate-only", help="Only write the synthetic world to --out.")
        ] = False,
        num_images: Annotated[
            Optional[int], typer.Option("--num-images", help="Images in the world (world.num_images).")
        ] = None,
        seed: Annotated[Optional[int], typer.Option("--seed", help="World seed (world.seed).")] = None,
        quick: Annotated[bool, typer.Option("--quick", help="Reduced sizes (what CI uses), same code path.")] = False,
        features: Annotated[
            Optional[str],
            typer.Option(
                "--features",
                help="Comma-separated feature kinds: region, grid, oracle, clip (default demo.features).",
            ),
        ] = None,
        seeds: Annotated[
            Optional[int],
            typer.Option("--seeds", help="Training seeds per captioner (demo.seeds); the table shows mean ± sd."),
        ] = None,
    ) -> None:
        """Run the whole pipeline on the embedded synthetic world (no download): generate the world, train the
        demo detector, extract features, prepare captions, train a captioner (XE then SCST), evaluate on the
        test split, caption a few test images with pictures. Finished stages are skipped on a second run; an
        interrupted stage resumes.

        Examples:

            butd-caption demo --out runs/demo

            butd-caption demo --quick --out runs/ci

            butd-caption demo --models san,ngsan,m2,aoa,ban --out runs/compare

            butd-caption demo --models san,m2 --features region,grid --out runs/grid

            butd-caption demo --generate-only --out world --num-images 2000 --seed 1

            butd-caption demo --config configs/demo_relations.yaml --models san,ngsan,ngsan-signed --seeds 3 --out runs/relations
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        first = list(load_config("demo", opts.config).demo.quick_overrides) if quick else []
        extra = [
            f"world.{key}={value}" for key, value in (("num_images", num_images), ("seed", seed)) if value is not None
        ]
        extra += [f"demo.seeds={seeds}"] if seeds is not None else []
        cfg = opts.resolve("demo", extra, first=first)
        names = [m.strip() for m in (models.split(",") if models else cfg.demo.models) if m.strip()]
        if not names:
            raise UsageError("--models needs at least one captioner name")
        if len(set(names)) != len(names):
            raise UsageError("--models lists a captioner twice")

        if generate_only:
            result = run_stage(
                out.parent if out.name else out,
                out.name,
                world_stage_config(cfg.world),
                generate_world,
                force=opts.force,
            )
            stdout_console().print(f"world: {result.summary} in {out.resolve()}")
            return

        from pipeline.demo import run_demo  # noqa: PLC0415 -- keeps cli --help fast

        kinds = [k.strip() for k in features.split(",") if k.strip()] if features else None
        report = run_demo(out, cfg, names, force=opts.force, features=kinds)
        _print_report(report)


def _print_report(report) -> None:
    con = stdout_console()
    stages = Table(title="butd-caption demo: stages", show_edge=False)
    for col in ("stage", "status", "seconds", "result"):
        stages.add_column(col, justify="right" if col == "seconds" else "left")
    for r in report.stages:
        summary = {
            k: v for k, v in r.summary.items() if k not in ("history", "losses", "metrics", "notes", "pictures", "eval")
        }
        stages.add_row(r.name, "skipped (done)" if r.skipped else "ran", f"{r.seconds:.1f}", _short(summary))
    con.print(stages)
    if report.detector:
        d = report.detector
        con.print(
            "detector (test split): "
            + ", ".join(
                f"{k}={d[k]:.3f}"
                for k in ("recall", "class_accuracy", "attribute_accuracy", "colour_accuracy")
                if isinstance(d.get(k), (int, float))
            )
        )
    if report.metrics:
        if not con.is_terminal:  # a pipe or file gets the whole table, not rich's 80-column default that wraps cells
            con.width = max(con.width, 160)
        con.print(comparison_table(report))
        if report.grounding:
            con.print(
                "true objects / relations: noun phrases and spatial relations of the test captions that hold in the "
                "image; "
                "guess: what a random relation word between the same phrases would score"
            )
        if report.checkpoint:
            con.print(f"checkpoint evaluated: {report.checkpoint}")
    for name, pics in report.pictures.items():
        if pics:
            con.print(f"pictures ({name}): {Path(pics[0]).parent}")
            gallery = Path(pics[0]).parent.parent / "gallery" / "index.html"
            if gallery.is_file():
                con.print(f"gallery ({name}): {gallery} (open it in a browser)")
    con.print(f"total {report.seconds:.1f} s; everything is in {report.out.resolve()} (summary.json)")


def _cell(mean: float | None, sd: float | None, seeds: int, percent: bool) -> str:
    if mean is None:
        return "-"
    text = f"{mean:.0%}" if percent else f"{mean:.3f}"
    if seeds > 1 and sd is not None:
        text += f" ± {sd * 100:.0f}" if percent else f" ± {sd:.3f}"
    return text


def comparison_table(report):
    """The captioners' metrics (mean ± sample sd over the seeds when there are several) and grounding columns."""
    seeds = max((len(r) for r in report.runs.values()), default=1)
    title = "captioning metrics (synthetic test split" + (f", mean ± sd over {seeds} seeds)" if seeds > 1 else ")")
    table = Table(title=title, show_edge=False)
    table.add_column("model", no_wrap=True)
    for m in METRIC_COLUMNS:
        table.add_column(m, justify="right")
    for title, _, _ in GROUNDING_COLUMNS:
        table.add_column(f"true {title}", justify="right")
    table.add_column("guess", justify="right")
    table.add_column("train s", justify="right")
    for name, metrics in report.metrics.items():
        ground, sd = report.grounding.get(name, {}), report.spread.get(name, {})
        cells = [_cell(metrics.get(m), sd.get(m), seeds, False) for m in METRIC_COLUMNS]
        for _, key, count in GROUNDING_COLUMNS:
            cell = _cell(ground.get(key), sd.get(key), seeds, True)
            cells.append(f"{cell} of {ground[count]:.0f}" if ground.get(key) is not None else cell)
        cells.append(_cell(ground.get("relation_chance"), None, 1, True))
        runs = report.runs.get(name, [])
        cells.append(f"{sum(r['train_seconds'] for r in runs) / len(runs):.0f}" if runs else "-")
        table.add_row(name, *cells)
    return table


def _short(summary: dict) -> str:
    text = ", ".join(f"{k}={v}" for k, v in summary.items())
    return text if len(text) <= 90 else text[:87] + "..."
