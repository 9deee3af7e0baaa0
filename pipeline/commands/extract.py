"""`cli extract`: Extract bottom-up region features from images into a feature store."""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Optional

import torch.distributed as dist
import typer

from extractors.recipes import BOX_MODES
from pipeline.commands.grammar import DEFAULT_RUN
from pipeline.commands.options import CommandOptions, Everyday, command
from pipeline.core.console import get_logger, stdout_console
from pipeline.core.distributed import all_sum, env_context
from pipeline.core.environment import launcher_int
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.keys import key_to_text
from pipeline.core.precision import check_precision
from pipeline.store import merge_stores


def _parse_shard(text: str | None) -> tuple[int, int] | None:
    if text is None:
        world = launcher_int("WORLD_SIZE", 1, low=1)
        if world > 1:  # torchrun: one shard per rank
            return launcher_int("RANK", 0), world
        return None
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise UsageError(f"--shard must look like i/n (e.g. 0/4), not {text!r}") from None
    if n < 1 or not 0 <= i < n:
        raise UsageError(f"--shard {text}: need 0 <= i < n")
    return i, n


def shard_store_path(store: Path, shard: tuple[int, int] | None) -> Path:
    """Shard i of n writes ``STORE.shards/i-of-n`` (merge them with the store's merge tool)."""
    if shard is None:
        return store
    return store.parent / f"{store.name}.shards" / f"{shard[0]}-of-{shard[1]}"


def merge_shard_stores(store: Path) -> None:
    """Merge ``STORE.shards/i-of-n`` (all n present) into ``STORE``; each image must appear exactly once."""
    folder = store.parent / f"{store.name}.shards"
    shards = sorted(p for p in folder.glob("*-of-*") if p.is_dir()) if folder.is_dir() else []
    if not shards:
        raise UsageError(f"no shards found in {folder}")
    counts = {p.name.split("-of-")[1] for p in shards}
    if len(counts) != 1:
        raise UsageError(f"{folder} mixes shard counts ({', '.join(sorted(counts))})")
    n = int(counts.pop())
    have = sorted(int(p.name.split("-of-")[0]) for p in shards)
    if have != list(range(n)):
        missing = sorted(set(range(n)) - set(have))
        raise UsageError(f"{folder}: shards {missing} of {n} are missing; run them first")
    total = merge_stores(shards, store)
    stdout_console().print(f"merged {n} shards ({total} images) into {store}", markup=False, highlight=False)


#: --precision: pipeline/core/precision.py (the detector refuses fp16)
EXTRACT_EVERYDAY = Everyday.section("extract")


def register(app: typer.Typer) -> None:
    @command(app, "extract", everyday=EXTRACT_EVERYDAY, help_fields={"store": str(DEFAULT_RUN / "features" / "store")})
    def extract_command(
        opts: CommandOptions,
        paths: Annotated[
            Optional[list[Path]], typer.Argument(help="Image folders (recursive), files or globs.")
        ] = None,
        weights: Annotated[
            str,
            typer.Option(
                "--weights",
                "-w",
                show_default=False,
                help="Detector weights: a file (any layout of docs/extractor.md: MILVLG .pth, airsplay .pkl, HF .bin, "
                "VinVL, grid-feats), a catalogue name (cli fetch --list), hf:OWNER/NAME, or 'random'; required unless "
                "--merge-shards.",
            ),
        ] = "",
        store: Annotated[
            Path,
            typer.Option(
                "--store", help="Feature store directory (created or resumed); `train` reads RUN/features/store."
            ),
        ] = DEFAULT_RUN / "features" / "store",
        boxes: Annotated[
            Optional[str],
            typer.Option(
                "--boxes",
                help=f"{' | '.join(BOX_MODES)}: adaptive 10-100 per image, 36, given (needs --coco), grid (res5 map "
                "cells; docs/recipes.md#grid).",
            ),
        ] = None,
        coco: Annotated[
            Optional[Path],
            typer.Option(
                "--coco",
                help="COCO annotations file: its images (keys = image ids) and, with --boxes given, its boxes.",
            ),
        ] = None,
        image_root: Annotated[
            Optional[Path], typer.Option("--image-root", help="Folder of the COCO / file-list images.")
        ] = None,
        file_list: Annotated[
            Optional[Path], typer.Option("--file-list", help="Text file with one image path per line.")
        ] = None,
        preset: Annotated[
            Optional[str],
            typer.Option(
                "--preset",
                help="Detector architecture: auto (from the weights file) | a preset name (`butd-caption info "
                "--releases` lists them) (extract.preset).",
            ),
        ] = None,
        recipe: Annotated[
            Optional[str],
            typer.Option(
                "--recipe",
                help="Test-time recipe: auto (from the weights' layout) | a recipe name (`butd-caption info "
                "--releases` lists them; docs/recipes.md).",
            ),
        ] = None,
        shard: Annotated[
            Optional[str],
            typer.Option(
                "--shard",
                help="i/n: process every n-th image from i into STORE.shards/i-of-n (merge with --merge-shards). "
                "Under torchrun each rank takes every n-th batch and rank 0 merges the shards into STORE at the end.",
            ),
        ] = None,
        limit: Annotated[
            Optional[int], typer.Option("--limit", help="Only the first N images (after sharding).")
        ] = None,
        strict: Annotated[
            bool,
            typer.Option(
                "--strict", help="Exit 1 if any image failed or any input was missing, a dangling link or not a file."
            ),
        ] = False,
        merge_shards: Annotated[
            bool,
            typer.Option("--merge-shards", help="Merge the finished STORE.shards/i-of-n into STORE (no extraction)."),
        ] = False,
    ) -> None:
        """Extract bottom-up region features (boxes, 2048-d features, classes, attributes) from images into a
        feature store (default {store}, which `train` and `evaluate` read). Resumable: images already in the
        store are skipped. Bad images are listed in STORE/failures.jsonl and the run continues.

        Examples:

            butd-caption extract photos/ --weights bua-caffe-frcn-r101_with_attributes.pth

            butd-caption extract photos/ --weights bua-caffe-frcn-r101_with_attributes.pth --store runs/coco/features/store

            butd-caption extract photos/ --weights vinvl_vg_x152c4.pth --recipe vinvl --store runs/vinvl/features/store

            butd-caption extract --coco annotations/instances_val2014.json --image-root val2014 --boxes given --weights W --store S

            butd-caption extract photos/ --weights vinvl-x152c4 --store runs/vinvl   (a catalogue name: fetched on first use)

            butd-caption extract photos/ --weights random --store /tmp/smoke   (random weights: smoke tests only)
        """  # noqa: E501 -- each example is one shell line (tests/test_cli_grammar.py parses it)
        if limit is not None and limit < 0:
            raise UsageError(f"--limit must be 0 or more, not {limit}")
        # strings as JSON (= YAML) strings, so that `--boxes 36` stays the string "36"
        extra = [
            f"extract.{key}={json.dumps(val)}"
            for key, val in (("boxes", boxes), ("preset", preset), ("recipe", recipe))
            if val is not None
        ]
        cfg = opts.resolve("extract", extra).extract
        check_precision(cfg.precision, "extract.precision", fp16=False)
        if merge_shards:
            merge_shard_stores(store)
            return
        if not weights:
            raise UsageError(
                "--weights is required (a .pth/.pkl/.bin file, a catalogue name such as bua-r101, or 'random' for "
                "smoke tests)"
            )
        if not paths and coco is None and file_list is None:
            raise UsageError("give image folders/files, --file-list or --coco")
        from extractors.stage import ExtractJob, extract_features  # noqa: PLC0415 -- keeps cli --help fast

        parts = _parse_shard(shard)
        torchrun = shard is None and parts is not None
        job = ExtractJob(
            weights,
            tuple(str(p) for p in paths or ()),
            None if file_list is None else str(file_list),
            None if image_root is None else str(image_root),
            None if coco is None else str(coco),
            parts,
            limit,
            store=".",
            shard_block=int(cfg.batch_size) if torchrun else 1,
        )
        target = shard_store_path(store, parts)
        done = False
        try:
            _print_result(
                extract_features(target.parent, target.name, cfg, job, reopen=True, out_option="--store"), strict
            )
            done = True
        finally:
            if torchrun:
                merge_after_ranks(store, done)


def merge_after_ranks(store: Path, done: bool) -> None:
    """torchrun: wait for every rank (a gloo process group), then rank 0 merges ``STORE.shards/i-of-n`` into
    ``STORE``. Nothing is merged when a rank failed (its shard resumes on the next run) or when ``STORE`` already
    exists (it is never overwritten: merge the shards elsewhere with ``--merge-shards``)."""
    log = get_logger("extract")
    ctx = env_context()
    if not dist.is_initialized():
        dist.init_process_group(backend="gloo", timeout=timedelta(days=7))  # ranks finish at different times
    try:
        failed = int(all_sum(0 if done else 1, ctx))  # also waits for every rank
    finally:
        dist.destroy_process_group()
    if not ctx.main:
        return
    if failed:
        log.warning(
            "%d of %d ranks failed; the shards stay in %s.shards (rerun to resume them)", failed, ctx.world, store
        )
    elif store.exists():
        log.warning(
            "%s exists and is not overwritten; the shards are in %s.shards (merge them with "
            "--merge-shards --store OTHER)",
            store,
            store,
        )
    else:
        merge_shard_stores(store)


def _print_result(result: Any, strict: bool) -> None:
    """The stage's counts on stdout; with ``strict``, failures become exit 1."""
    s, store = result.summary, result.directory / result.outputs["store"]
    con = stdout_console()
    if result.skipped:
        con.print(
            f"already done with this config ({key_to_text(str(store))}); the last pass:", highlight=False, markup=False
        )
    con.print(
        f"extracted {s['extracted']}, skipped (already in store) {s['already_in_store']}, "
        f"failed {s['failed']} of {s['images']} images; {s['boxes']} boxes; {s['images_per_second']:.2f} images/s; "
        f"store {key_to_text(str(store))}",
        highlight=False,
        markup=False,
    )
    if s["failed"]:
        reasons = ", ".join(f"{k} {v}" for k, v in s["failure_reasons"].items())
        con.print(
            f"failures: {reasons} (see {key_to_text(str(result.directory / result.outputs['failures']))})",
            highlight=False,
            markup=False,
        )
        if strict:
            raise PipelineError(f"{s['failed']} images failed (--strict)")
