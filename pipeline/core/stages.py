"""Run directories and stage bookkeeping: how a stage records that it finished, and how it is skipped.

Layout of a run directory (``--out DIR``)::

    DIR/
      <stage>/                 one folder per stage (world, detector, features, data, train-<model>, ...)
        manifest.json          written atomically when the stage finishes: config digest, outputs, timings
        running.json           present while the stage runs (or after it was killed)
        .stage.lock            the lock of the process running the stage (pipeline.core.locks)
        ...                    the stage's own files (checkpoints, stores), each written crash-safely

One process at a time per stage folder: ``run_stage`` holds ``DIR/<stage>/.stage.lock`` (:mod:`pipeline.core.locks`)
for the whole stage, so a second run on the same folder is refused in one line naming the holder, before it
reads, resumes or clears anything.

A stage whose ``manifest.json`` matches the resolved config digest is *done* and is skipped; a stage with
a manifest from a different config is refused unless ``--force`` is given; an interrupted stage (only
``running.json``: killed, stopped or failed) is re-entered under the same config and its function resumes
from what it finds in its folder. Under a different config it is refused with a message naming the one
option that clears it (``--force``), unless the folder holds nothing but ``running.json`` (the stage failed
before writing anything, e.g. on a config error): then it simply starts again. ``--force`` always clears
the stage folder (finished or interrupted) and says so in one log line.
"""

from __future__ import annotations

import platform
import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pipeline import __version__
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_json, read_json
from pipeline.core.locks import acquire_lock
from pipeline.core.renamed import upgrade_recorded_config

log = get_logger("stages")

MANIFEST = "manifest.json"
RUNNING = "running.json"
STAGE_LOCK = ".stage.lock"  # one process per stage folder (pipeline.core.locks)
MANIFEST_VERSION = 1


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True)
class StageResult:
    """What a stage run produced: its folder, outputs (name -> path relative to the folder) and timing."""

    name: str
    directory: Path
    outputs: dict[str, Any]
    seconds: float
    skipped: bool
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunTally:
    """The counts a resumable run over items reports: items given, already done by an earlier run (found in its
    output and left alone), done now, failed now (listed, not raised). Extraction and captioning extend it."""

    total: int = 0
    already_done: int = 0
    done: int = 0
    failed: int = 0


def read_manifest(stage_dir: Path) -> dict[str, Any] | None:
    """The stage's manifest, or None if it never finished; a corrupt manifest is an error naming the file."""
    path = stage_dir / MANIFEST
    if not path.exists():
        return None
    data = read_json(path, what="stage manifest")
    for key in ("stage", "config_digest", "outputs"):
        if key not in data:
            raise PipelineError(f"stage manifest {path} lacks '{key}'; delete the folder to redo the stage")
    if data.get("manifest_version") != MANIFEST_VERSION:
        raise PipelineError(f"stage manifest {path} has unknown version {data.get('manifest_version')!r}")
    return data


def _same_config(record: Mapping[str, Any], digest: str) -> bool:
    """The recorded stage (a manifest or a running marker) ran under this config: the same digest, or its recorded
    config reads as this one under the current key names (:func:`pipeline.core.renamed.upgrade_recorded_config`)."""
    if record.get("config_digest") == digest:
        return True
    recorded = record.get("config")
    if not isinstance(recorded, Mapping):
        return False

    return Config(upgrade_recorded_config(recorded)).digest() == digest


def _check_interrupted(name: str, stage_dir: Path, digest: str) -> None:
    """An interrupted stage: resume under the same config; restart when it wrote nothing; else refuse, naming
    ``--force``."""
    previous = read_json(stage_dir / RUNNING, what="stage marker")
    if previous.get("config_digest") is None or _same_config(previous, digest):
        log.info("stage %s: resuming an interrupted run from %s", name, stage_dir)
        return
    if all(p.name in (RUNNING, STAGE_LOCK) for p in stage_dir.iterdir()):
        log.info(
            "stage %s: the interrupted run in %s wrote nothing; starting again under the new config", name, stage_dir
        )
        return
    failed = f" (it failed: {previous['error']})" if previous.get("error") else ""
    raise UsageError(
        f"stage {name} in {stage_dir} was interrupted under a different config{failed}; rerun this command with "
        "--force to clear it and start again (or use another --out)"
    )


def _record_failure(running: Path, exc: BaseException) -> None:
    """Note the error in ``running.json`` (the next run under another config names it); never masks ``exc``."""
    try:
        marker = read_json(running, what="stage marker")
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        atomic_write_json(running, {**marker, "error": first[:300], "failed": _now()})
    except Exception:  # noqa: BLE001
        log.debug("could not record the failure in %s", running)


def run_stage(
    run_dir: str | Path,
    name: str,
    cfg: Config,
    work: Callable[[Path, Config], Mapping[str, Any] | tuple[Mapping[str, Any], Mapping[str, Any]]],
    force: bool = False,
    out_option: str = "--out",
    reopen: Callable[[Path], None] | None = None,
) -> StageResult:
    """Run ``work(stage_dir, cfg)`` once per config; skip it when already done with the same config.

    ``work`` returns ``outputs`` (name -> relative path or value) or ``(outputs, summary)``; it must be
    resumable on its own (it is called again after a kill, with the partial files still in ``stage_dir``).
    ``out_option`` is the command's option that chose the folder (``extract``'s is ``--store``), named when a
    second process is refused. ``reopen(stage_dir)``, run once the lock is held and before the stage's state is
    read, may rewrite that state (a stage whose output accumulates lets a finished stage run again).
    """
    stage_dir = Path(run_dir) / name
    digest = cfg.digest()
    # one process per stage folder: a second one is refused (naming the holder) before it reads or clears anything
    with acquire_lock(
        stage_lock(stage_dir), f"stage {name} in {stage_dir}", f"wait for it to finish or use another {out_option}"
    ):
        if reopen is not None:
            reopen(stage_dir)
        return _run_locked(stage_dir, name, cfg, digest, work, force)


def stage_lock(stage_dir: Path) -> Path:
    """The lock file of a stage folder, inside it (``--force`` clears everything else)."""
    return stage_dir / STAGE_LOCK


def _clear(stage_dir: Path) -> None:
    """``--force``: remove everything in the stage folder but the lock this process holds."""
    for p in stage_dir.iterdir():
        if p.name == STAGE_LOCK:
            continue
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def _run_locked(
    stage_dir: Path, name: str, cfg: Config, digest: str, work: Callable[..., Any], force: bool
) -> StageResult:
    manifest = read_manifest(stage_dir)
    if manifest is not None and not force:
        if _same_config(manifest, digest):
            log.info("stage %s: already done in %s (config %s), skipping", name, stage_dir, digest[:12])
            return StageResult(name, stage_dir, dict(manifest["outputs"]), 0.0, True, dict(manifest.get("summary", {})))
        raise UsageError(
            f"stage {name} in {stage_dir} was finished with a different config "
            f"({manifest['config_digest'][:12]} != {digest[:12]}); pass --force to redo it or use another --out"
        )
    running = stage_dir / RUNNING
    if force and (manifest is not None or running.exists()):
        state = "finished" if manifest is not None else "interrupted"
        log.info(
            "stage %s: --force given, clearing the %s stage in %s and starting it from scratch", name, state, stage_dir
        )
        _clear(stage_dir)
    elif running.exists():
        _check_interrupted(name, stage_dir, digest)
    stage_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(running, {"stage": name, "config_digest": digest, "started": _now(), "config": cfg.to_dict()})
    t0 = time.perf_counter()
    try:
        result = work(stage_dir, cfg)
    except Exception as exc:  # noqa: BLE001 - recorded for the next run's message, then re-raised
        _record_failure(running, exc)
        raise
    seconds = time.perf_counter() - t0
    outputs, summary = result if isinstance(result, tuple) else (result, {})
    atomic_write_json(
        stage_dir / MANIFEST,
        {
            "manifest_version": MANIFEST_VERSION,
            "stage": name,
            "config_digest": digest,
            "config": cfg.to_dict(),
            "outputs": dict(outputs),
            "summary": dict(summary),
            "finished": _now(),
            "seconds": round(seconds, 3),
            "versions": {"butd_caption": __version__, "python": platform.python_version()},
        },
    )
    running.unlink(missing_ok=True)
    log.info("stage %s: done in %.1f s -> %s", name, seconds, stage_dir)
    return StageResult(name, stage_dir, dict(outputs), seconds, False, dict(summary))
