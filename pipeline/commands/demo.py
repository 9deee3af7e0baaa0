"""`cli demo`: the whole staged pipeline on the embedded synthetic world, each stage resumable."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from pipeline.commands.common import ConfigOpt, ForceOpt, QuietOpt, SetOpt, VerboseOpt, guarded, init, resolve_config
from pipeline.console import get_logger, stdout_console

log = get_logger("demo")

#: stages of the full demo in order; those without an implementation are reported, not faked
PLANNED_STAGES = (
    ("world", "generate the synthetic world"),
    ("detector", "train the demo detector (issue 7)"),
    ("features", "extract region features to a store (issue 6)"),
    ("data", "prepare captions and vocabulary (issue 4)"),
    ("train", "train the captioner, XE then SCST (issue 5)"),
    ("evaluate", "evaluate on the test split (issue 5)"),
    ("caption", "caption test images and draw pictures (issue 8)"),
)


def register(app: typer.Typer) -> None:
    @app.command(
        "demo",
        help=(
            "Run the staged pipeline on the embedded synthetic world (no download needed).\n\n"
            "Stages that finished are skipped on a second run; an interrupted stage resumes.\n\n"
            "Examples:\n\n"
            "    butd-caption demo --out runs/demo\n\n"
            "    butd-caption demo --generate-only --out world --num-images 2000 --seed 1\n\n"
            "    butd-caption demo --quick --out runs/ci"
        ),
    )
    @guarded
    def demo_command(
        out: Annotated[Path, typer.Option("--out", "-o", help="Run directory (created if missing).")] = Path("runs/demo"),
        generate_only: Annotated[bool, typer.Option("--generate-only", help="Only write the synthetic world to --out.")] = False,
        num_images: Annotated[Optional[int], typer.Option("--num-images", min=1, help="Images in the world (world.num_images).")] = None,
        seed: Annotated[Optional[int], typer.Option("--seed", help="World seed (world.seed).")] = None,
        quick: Annotated[bool, typer.Option("--quick", help="Reduced sizes (what CI uses).")] = False,
        config: ConfigOpt = None,
        set_: SetOpt = None,
        force: ForceOpt = False,
        verbose: VerboseOpt = False,
        quiet: QuietOpt = False,
    ) -> None:
        init(verbose, quiet)
        from pipeline.config import load_config
        from pipeline.stages import run_stage
        from pipeline.world.generate import generate_world

        overrides: list[str] = []
        if quick:
            overrides += list(load_config("demo", config).demo.quick_overrides)
        overrides += list(set_ or [])
        if num_images is not None:
            overrides.append(f"world.num_images={num_images}")
        if seed is not None:
            overrides.append(f"world.seed={seed}")
        cfg = resolve_config("demo", config, overrides)

        if generate_only:
            result = run_stage(out.parent if out.name else out, out.name, cfg.world, generate_world, force=force)
            _report([("world", result)], None, out)
            return
        results = [("world", run_stage(out, "world", cfg.world, generate_world, force=force))]
        missing = [(name, what) for name, what in PLANNED_STAGES if name not in dict(results)]
        _report(results, missing, out)


def _report(results, missing, out: Path) -> None:
    from rich.table import Table

    table = Table(title="butd-caption demo", show_edge=False)
    table.add_column("stage")
    table.add_column("status")
    table.add_column("time (s)", justify="right")
    table.add_column("result")
    for name, r in results:
        summary = ", ".join(f"{k}={v}" for k, v in r.summary.items())
        table.add_row(name, "skipped (done)" if r.skipped else "ran", f"{r.seconds:.1f}", summary)
    for name, what in missing or []:
        table.add_row(name, "not built yet", "-", what)
    con = stdout_console()
    con.print(table)
    con.print(f"outputs in {out.resolve()}")
