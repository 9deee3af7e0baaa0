"""Error types that the CLI turns into one-line messages and exit codes.

Exit-code convention (see docs/architecture.md):
    0  success
    1  runtime failure (:class:`PipelineError`)
    2  usage or validation error (:class:`UsageError` and its subclasses)
"""

from __future__ import annotations


class PipelineError(Exception):
    """A failure while doing the work (corrupt file, failed stage). Exit code 1."""

    exit_code = 1


class UsageError(PipelineError):
    """The user asked for something invalid (bad option, config key, missing file). Exit code 2."""

    exit_code = 2


class ConfigError(UsageError):
    """A config file or a ``--set`` override is invalid."""
