"""`cli info`: the environment, the detector releases, or what a run directory, store, checkpoint or weights file
holds."""

from __future__ import annotations

import importlib.metadata as md
import json
import platform
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Optional

import torch
import typer
from rich.table import Table

import models
from extractors import available_extractors
from extractors.recipes import describe_recipe, recipe_from_config, recipe_names, resolve_recipe
from extractors.releases import available_releases
from extractors.weights import describe_with_spec
from models.released import describe_captioner
from pipeline import __version__
from pipeline.commands.options import CommandOptions, command
from pipeline.core.catalogue import CATALOGUE
from pipeline.core.config import load_config
from pipeline.core.console import stdout_console
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.stages import RUNNING, read_manifest
from pipeline.embedding.checkpoint import read_encoder_checkpoint
from pipeline.hub import resolve_file
from pipeline.hub.resolve import HUB_PREFIX
from pipeline.store.report import print_store_info, print_verify_report


def register(app: typer.Typer) -> None:
    @command(app, "info", config=False)
    def info_command(
        opts: CommandOptions,
        target: Annotated[
            Optional[Path],
            typer.Argument(help="Run directory, store, checkpoint or weights file (or its catalogue name)."),
        ] = None,
        model: Annotated[
            Optional[str],
            typer.Option(
                "--model",
                "-m",
                help=f"Build captioner architecture NAME ({' | '.join(models.available_captioners())}) and print its "
                "parameter count.",
            ),
        ] = None,
        verify: Annotated[
            bool,
            typer.Option(
                "--verify",
                help="With a feature store: read every row, check its checksums and list damaged images by key (exit "
                "1 if any).",
            ),
        ] = False,
        releases: Annotated[
            bool,
            typer.Option(
                "--releases",
                help="List the detector releases (one line each: weights layouts, default recipe, preset, selectors, "
                "catalogue names, the import-features formats of the public files it made, source), the presets and "
                "the recipes, plugins' included.",
            ),
        ] = False,
    ) -> None:
        """Show the environment (versions, devices, Java), list the detector releases, presets and recipes
        (--releases), or inspect TARGET: a run directory (stages and their status), a feature store, a captioner or
        sentence-encoder checkpoint, or detector weights.

        Examples:

            butd-caption info

            butd-caption info --releases

            butd-caption info runs/demo

            butd-caption info --model ngsan --set num_layers=6
        """
        if releases:
            given = [name for name, value in (("TARGET", target), ("--model", model), ("--verify", verify)) if value]
            if given:
                raise UsageError(f"--releases lists the registries and takes no {' or '.join(given)}")
            _releases()
            return
        if target is not None and not target.exists() and _is_catalogue_name(str(target)):
            target = Path(resolve_file(target, "file", "detector"))  # fetched on first use, then the cached file
        overrides = list(opts.overrides)
        if overrides and model is None:
            _refuse_unused_set(target, verify)
        if model is not None:
            _model_info(model, overrides)
        elif target is None:
            _environment()
        elif not target.exists():
            raise UsageError(f"no such file or directory: {target}")
        elif verify:
            if not _is_feature_store(target):
                raise UsageError(
                    f"--verify needs a feature store (a folder with store.json or an .h5 file), not {target}"
                )

            if not print_verify_report(target):
                raise PipelineError(f"feature store {target} is damaged (see the lines above)")
        elif _is_feature_store(target):
            print_store_info(target)
        elif target.is_dir():
            _run_dir(target)
        elif target.suffix in (".pt", ".pth", ".pkl") and _captioner_info(target, overrides):
            pass
        elif target.suffix == ".pt" and _encoder_info(target):
            pass
        elif target.suffix in (".pth", ".pkl", ".bin"):
            _weights_info(target, overrides)
        else:
            raise UsageError(
                f"cannot inspect {target}: not a run directory, feature store, checkpoint (.pt/.pth/.pkl) or detector "
                "weights (.pth/.pkl/.bin)"
            )


_SET_APPLIES = "--set applies to --model NAME (its architecture config) or detector weights (the extract recipe)"


def _refuse_unused_set(target: Path | None, verify: bool) -> None:
    """``--set`` with nothing it configures (the environment, a run directory, a store, a checkpoint) is a usage
    error, not silently ignored; detector weights (.pth/.pkl/.bin) are told apart from captioners later."""
    if target is None:
        raise UsageError(f"{_SET_APPLIES}; without either, info has nothing it configures")
    if target.exists() and (verify or target.is_dir() or target.suffix not in (".pth", ".pkl", ".bin")):
        raise UsageError(f"{_SET_APPLIES}, not to {target}")


def _is_catalogue_name(text: str) -> bool:
    """A catalogue name (``cli fetch --list``) or a hub id ``hf:OWNER/NAME``."""
    return text in CATALOGUE or text.startswith(HUB_PREFIX)


def _is_feature_store(target: Path) -> bool:
    """A store directory (``store.json``) or an HDF5 file (``.h5``/``.hdf5``) to open as a store."""
    if target.is_dir():
        return (target / "store.json").is_file()
    return target.suffix.lower() in (".h5", ".hdf5")


def _java_version() -> str:
    java = shutil.which("java")
    if not java:
        return "not found (METEOR and SPICE need Java 8+)"
    try:
        proc = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return f"{java} (did not answer)"
    first = (proc.stderr or proc.stdout).strip().splitlines()
    return first[0] if first else java


def _environment() -> None:
    table = Table(title="butd-caption environment", show_header=False, show_edge=False)
    table.add_row("butd-caption", __version__)
    table.add_row("python", platform.python_version())
    for pkg in (
        "torch",
        "torchvision",
        "numpy",
        "h5py",
        "opencv-python-headless",
        "pillow",
        "pycocotools",
        "pycocoevalcap",
        "typer",
        "rich",
    ):
        try:
            table.add_row(pkg, md.version(pkg))
        except md.PackageNotFoundError:
            table.add_row(pkg, "not installed")
    table.add_row("cuda available", str(torch.cuda.is_available()))
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            table.add_row(f"cuda:{i}", torch.cuda.get_device_name(i))
        table.add_row("cuda (torch build)", str(torch.version.cuda))
    table.add_row("cpu threads", str(torch.get_num_threads()))
    try:
        from torchvision.ops import nms  # noqa: PLC0415 -- the check itself: a broken torchvision build fails here

        nms(torch.zeros(1, 4), torch.zeros(1), 0.5)
        ops = "ok"
    except Exception as exc:  # torchvision ops failing to load is what we need to report
        ops = f"broken ({type(exc).__name__}): install the regular PyPI torch/torchvision builds"
    table.add_row("torchvision ops", ops)
    table.add_row("java", _java_version())
    stdout_console().print(table)


def _releases() -> None:
    """One line per registered release (:func:`extractors.releases.available_releases`, plugins' included), then
    the presets and the recipe names. Listing them imports the extractor modules (torchvision), which is why
    command help points here instead of naming them."""
    con = stdout_console()
    for r in available_releases():
        con.print(
            f"release {r.name}: layouts {_names(r.weights_layouts)}; recipe {r.recipes[0]}{_others(r.recipes[1:])}; "
            f"preset {r.preset or '-'}; selectors {_names(r.selectors)}; catalogue {_names(_catalogue_names(r))}; "
            f"formats {_names(r.import_formats)}; source {r.source}",
            highlight=False,
            markup=False,
        )
    con.print(f"presets: {_names(available_extractors())}", highlight=False, markup=False)
    con.print(f"recipes: {_names(recipe_names())}", highlight=False, markup=False)


def _catalogue_names(release: Any) -> tuple[str, ...]:
    """The catalogue names of a release's files: its record's, and for a release with its own extraction every
    entry of its catalogue kind (``OwnExtraction.kind``)."""
    kind = release.own.kind if release.own is not None else None
    return tuple(release.catalogue) + tuple(name for name, e in CATALOGUE.items() if kind and e.kind == kind)


def _names(values: Any) -> str:
    return ", ".join(values) if values else "-"


def _others(recipes: tuple[str, ...]) -> str:
    return f" (or {', '.join(recipes)})" if recipes else ""


def _run_dir(path: Path) -> None:
    stages = sorted(
        p for p in path.iterdir() if p.is_dir() and ((p / "manifest.json").exists() or (p / RUNNING).exists())
    )
    if (path / "manifest.json").exists():
        stages = [path]
    if not stages:
        raise UsageError(f"{path} holds no pipeline stages (no manifest.json found)")
    table = Table(title=f"run directory {path}", show_edge=False)
    for col in ("stage", "status", "finished", "seconds", "config", "summary"):
        table.add_column(col)
    for st in stages:
        m = read_manifest(st)
        if m is None:
            table.add_row(st.name, "interrupted / running", "-", "-", "-", "")
        else:
            summary = ", ".join(f"{k}={v}" for k, v in m.get("summary", {}).items())
            table.add_row(
                st.name, "done", m.get("finished", "?"), str(m.get("seconds", "?")), m["config_digest"][:12], summary
            )
    stdout_console().print(table)


def _model_info(name: str, overrides: list[str]) -> None:
    cfg = models.model_config(name, overrides)
    vocab_size = 10000
    model = models.build_captioner(name, vocab_size, **cfg.to_dict())
    n = sum(p.numel() for p in model.parameters())
    con = stdout_console()
    con.print(f"model: {name}")
    con.print(f"parameters: {n} ({n / 1e6:.2f}M) at vocabulary size {vocab_size}")
    con.print(cfg.to_yaml().rstrip())


def _captioner_info(path: Path, overrides: Sequence[str] = ()) -> bool:
    """A native captioner checkpoint or a released M2 / AoANet file (models.released); False if neither."""
    described = describe_captioner(path)
    if described is None:
        return False
    if overrides:
        raise UsageError(f"{_SET_APPLIES}, not to the captioner {path}")
    con = stdout_console()
    for key, value in described.items():
        con.print(f"{key}: {value}", highlight=False, markup=False)
    return True


def _encoder_info(path: Path) -> bool:
    """A sentence-encoder checkpoint (``cli train-encoder``: RUN/encoder/*.pt); False if it is not one."""
    try:
        ckpt = read_encoder_checkpoint(path)
    except (PipelineError, UsageError):
        return False
    con = stdout_console()
    for key, value in (
        ("file", str(path)),
        ("format", f"butd-caption checkpoint ({ckpt.kind})"),
        ("model", "sentence_encoder"),
        ("vocabulary", f"{len(ckpt.vocab):,} words"),
    ):
        con.print(f"{key}: {value}", highlight=False, markup=False)
    return True


def _weights_info(path: Path, overrides: list[str]) -> None:
    """Detector weights: which public layout (MILVLG / airsplay / HF), architecture, SHA-256 (strict check), and
    the test-time recipe ``cli extract`` would use with them (``configs/extract.yaml`` + ``--set extract.*``)."""
    con = stdout_console()
    facts, spec = describe_with_spec(path)
    for key, value in facts.items():
        con.print(f"{key}: {value}", highlight=False)
    section = load_config("extract", None, overrides).extract
    recipe = resolve_recipe(recipe_from_config(section, facts["layout"], spec.flavor), spec)
    for key, value in describe_recipe(recipe):
        con.print(f"{key}: {value}", highlight=False)
    con.print(f"recipe values: {json.dumps(recipe.to_dict())}", highlight=False)
