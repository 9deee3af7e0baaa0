"""Error types that the CLI turns into one-line messages and exit codes.

Exit-code convention (see docs/architecture.md):
    0  success
    1  runtime failure (:class:`PipelineError`)
    2  usage or validation error (:class:`UsageError` and its subclasses)
"""

from __future__ import annotations

import errno as errno_mod
import os
import re
from dataclasses import dataclass


class PipelineError(Exception):
    """A failure while doing the work (corrupt file, failed stage). Exit code 1."""

    exit_code = 1


class UsageError(PipelineError):
    """The user asked for something invalid (bad option, config key, missing file). Exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file or a ``--set`` override is invalid."""


def exception_line(exc: BaseException) -> str:
    """``Type: first line of the message`` (the type and a colon alone for an empty message): how a failure of
    one item (image, sentence, segment) is written into a one-line error or a failures file."""
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


#: Every reason an item (a photo, a sentence) can fail for, in every command's failures file and error rows;
#: one spelling each. Inputs and decoding: :mod:`extractors.inputs`, :mod:`extractors.preprocess`; the
#: detector's guard: :mod:`extractors.photos`; the store: ``extract``; the captioner: ``caption``; the
#: sentence encoder: ``embed``.
FAILURE_REASONS = {
    "unreadable": "missing, a dangling or looping link, no permission, or an I/O error",
    "not_a_file": "a folder, FIFO, socket or device named like an image",
    "empty": "a zero-byte file, or a sentence with no word",
    "not_an_image": "not a picture the allowed decoders recognise",
    "format_not_allowed": "an image format outside the allowlist",
    "too_large": "more pixels than the decompression-bomb cap (max_pixels)",
    "truncated": "the file ends before the picture does",
    "decode_error": "the picture or its detector input blob could not be built",
    "too_thin": "below the backbone's feature stride after the test-time resize",
    "no_boxes": "given-boxes mode and no box for this image",
    "detector_failed": "the detector raised on this image (alone)",
    "no_regions": "the detector returned no region",
    "invalid_output": "the detector's output was refused by the store (e.g. NaN features)",
    "captioner_failed": "the captioner raised on this image (alone)",
    "encoder_failed": "the sentence encoder raised on this sentence (alone)",
}


@dataclass(frozen=True)
class Failure:
    """Why one item failed: a ``reason`` of :data:`FAILURE_REASONS` and a one-line ``detail``."""

    reason: str
    detail: str

    def __post_init__(self) -> None:
        if self.reason not in FAILURE_REASONS:
            raise ValueError(f"unknown failure reason {self.reason!r} (known: {', '.join(FAILURE_REASONS)})")

    @property
    def line(self) -> str:
        """``reason: detail``, the error row of ``caption`` and ``embed``."""
        return f"{self.reason}: {self.detail}"


_ERRNO_IN_TEXT = None  # compiled lazily


def annotate_os_error(exc: OSError, action: str, path: object = None) -> OSError:
    """Record on ``exc`` what was being done (``action``, e.g. "write feature segment") and on which path.

    The innermost annotation wins (it is the most specific). h5py's OSErrors carry their errno only in the
    text (``errno = 28``); it is copied into ``exc.errno`` so the message can say "disk full". Returns ``exc``.
    """
    global _ERRNO_IN_TEXT
    if getattr(exc, "butd_text", None) is None:
        exc.butd_text = str(exc)  # type: ignore[attr-defined]  (before a filename changes what str() says)
    if getattr(exc, "butd_action", None) is None:
        exc.butd_action = action  # type: ignore[attr-defined]
    if exc.filename is None and path is not None:
        try:
            exc.filename = str(path)
        except (AttributeError, TypeError):
            pass
    if exc.errno is None:
        _ERRNO_IN_TEXT = _ERRNO_IN_TEXT or re.compile(r"errno = (\d+)")
        m = _ERRNO_IN_TEXT.search(exc.butd_text)  # type: ignore[attr-defined]
        if m:
            try:
                exc.errno = int(m.group(1))
            except (AttributeError, TypeError):
                pass
    return exc


def os_error_message(exc: OSError, action: str | None = None) -> str:
    """One line for an OSError: the action, the path, the system's reason, and what to do about it."""
    action = getattr(exc, "butd_action", None) or action or ("open" if exc.filename is not None else "access")
    path = exc.filename
    where = f" {os.fsdecode(path)!s}" if path is not None else ""
    if exc.filename2 is not None:
        where += f" -> {os.fsdecode(exc.filename2)}"
    code = exc.errno
    text = getattr(exc, "butd_text", None) or str(exc)
    reason = exc.strerror or (text.splitlines()[0] if text else type(exc).__name__)
    if code is not None and not exc.strerror:
        reason = os.strerror(code)
    hint = {
        errno_mod.ENOSPC: "disk full: free space and rerun (finished work is kept and resumes)",
        errno_mod.EDQUOT: "disk quota exceeded: free space and rerun (finished work is kept and resumes)",
        errno_mod.EACCES: "check the permissions or choose another path",
        errno_mod.EPERM: "check the permissions or choose another path",
        errno_mod.EROFS: "the file system is read-only: choose a writable path",
        errno_mod.ENOENT: "check the path",
        errno_mod.EFBIG: (
            "the file-size limit was reached (ulimit -f or the file system's): raise it or write elsewhere; "
            "finished work is kept"
        ),
    }.get(code or -1)
    from pipeline.core.keys import key_to_text  # noqa: PLC0415 -- import cycle: pipeline.core.keys raises UsageError

    line = f"cannot {action}{key_to_text(where)}: {reason}"
    return f"{line} ({hint})" if hint else line
