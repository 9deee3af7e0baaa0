"""Shared CLI plumbing: the error boundary, printing the resolved config and stage results (the common options
themselves are declared in :mod:`pipeline.commands.options`)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import typer

from pipeline.core.config import Config, load_config
from pipeline.core.console import get_logger, setup_logging, stderr_console, stdout_console
from pipeline.core.errors import PipelineError, UsageError, os_error_message
from pipeline.core.keys import markup_escape

F = TypeVar("F", bound=Callable[..., Any])


def fail(message: str, code: int = 2) -> None:
    """Print one line to stderr and exit with ``code`` (2 = usage error, 1 = runtime failure)."""
    message = "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else c for c in message)
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    stderr_console().print(f"[bold red]error:[/] {message}", highlight=False, markup=True)
    raise typer.Exit(code)


def guarded(fn: F) -> F:
    """Turn :class:`PipelineError` into one clear line and its exit code; Ctrl-C exits 130 without a traceback.

    An ``OSError`` (no permission, read-only or full disk, a file that vanished) becomes one line naming the
    action and the path, exit 1: the stores and stages commit atomically, so what was committed stays intact.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except typer.Exit:
            raise
        except PipelineError as exc:
            fail(_escape(_from_worker(str(exc))), exc.exit_code)
        except OSError as exc:
            if "\nOriginal Traceback" in str(exc):
                fail(_escape(_from_worker(str(exc))), 1)
            fail(_escape(os_error_message(exc, _action_from_traceback(exc))), 1)
        except MemoryError:
            fail("out of memory: use a smaller --batch-size or fewer --workers", 1)
        except KeyboardInterrupt:
            stderr_console().print("interrupted; finished work is kept and the stage resumes on the next run")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _escape(text: str) -> str:
    return markup_escape(text)


def _from_worker(text: str) -> str:
    """An error re-raised by a DataLoader worker carries the worker's whole traceback in its message
    ("Caught X in DataLoader worker process 0. Original Traceback ..."): keep only the original message."""
    if "\nOriginal Traceback" not in text:
        return text
    last = [line for line in text.splitlines() if line.strip()][-1]
    head, sep, message = last.partition(": ")
    return message if sep and "." in head and " " not in head else last


_ACTIONS = {
    "mkdir": "create folder",
    "makedirs": "create folder",
    "mkstemp": "write",
    "_mkstemp_inner": "write",
    "write_text": "write",
    "write_bytes": "write",
    "read_text": "read",
    "read_bytes": "read",
    "unlink": "delete",
    "rmtree": "delete",
    "rename": "rename",
    "replace": "rename",
    "iterdir": "list folder",
    "scandir": "list folder",
    "copyfile": "copy",
    "copy2": "copy",
    "save": "write",
    "imwrite": "write",
    "savefig": "write",
    "stat": "read",
    "touch": "create",
}


def _action_from_traceback(exc: BaseException) -> str | None:
    """Best guess of what failed from the innermost frame with a known file-system function name."""
    tb = exc.__traceback__
    names = []
    while tb is not None:
        names.append(tb.tb_frame.f_code.co_name)
        tb = tb.tb_next
    for name in reversed(names):
        if name in _ACTIONS:
            return _ACTIONS[name]
        if name in ("open", "_opener", "__init__") and getattr(exc, "filename", None) is not None:
            return "open"
    return None


def refuse_existing_output(output: Path, force: bool) -> None:
    """A command that writes one whole file (``--output``) never replaces a file already there unless ``--force``
    is given: a directory there, or a file without ``force``, is one usage line."""
    if output.is_dir():
        raise UsageError(f"--output {output} is a directory: name the file to write")
    if output.exists() and not force:
        raise UsageError(f"--output {output} exists: pass --force to overwrite it, or choose another path")


def resolve_config(stage: str, config: Path | None, overrides: list[str] | None, show: bool = True) -> Config:
    """Load ``configs/<stage>.yaml`` (or the user's file) with overrides; log where it came from (one line)
    and the whole resolved config at debug level (``--verbose``). Stages also keep it in their manifest."""
    cfg = load_config(stage, config, overrides or [])
    if show:
        log = get_logger("config")
        extra = f" + {len(overrides)} override(s)" if overrides else ""
        log.info(
            "config %s%s (resolved config: --verbose, and each stage's manifest.json)",
            config or f"configs/{stage}.yaml",
            extra,
        )
        log.debug("resolved config:\n%s", cfg.to_yaml().rstrip())
    return cfg


def init(verbose: bool = False, quiet: bool = False) -> None:
    """Set up logging: debug with ``verbose``, warnings only with ``quiet``."""
    setup_logging(verbose=verbose, quiet=quiet)


def print_stage_result(result: Any, best_format: str = ".4f", outputs: bool = True, summary: bool = False) -> None:
    """Print a finished (or skipped) stage on stdout: its folder, the best validation score, outputs or summary.

    ``result`` is a :class:`pipeline.core.stages.StageResult`; ``best_format`` formats ``summary['best']['value']``.
    """
    con = stdout_console()
    con.print(
        f"{result.name}: {result.directory}{' (already done, skipped)' if result.skipped else ''}", highlight=False
    )
    best = result.summary.get("best") or {}
    if best:
        where = f"{best['stage']} epoch {best.get('epoch')}" if best.get("stage") else f"epoch {best.get('epoch')}"
        con.print(f"best {best.get('metric')}: {format(best.get('value'), best_format)} ({where})", highlight=False)
    if outputs:
        for key, rel in result.outputs.items():
            con.print(f"{key}: {result.directory / rel}", highlight=False)
    if summary:
        for key, value in result.summary.items():
            con.print(f"{key}: {value}", highlight=False)
