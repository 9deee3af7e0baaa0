"""Shared pytest fixtures and settings."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from caption_helpers import tiny_run
from forked_cli import ForkedCli
from typer.testing import CliRunner

from cli import app as cli_app

os.environ.setdefault("BUTD_NO_PROGRESS", "1")

REPO = Path(__file__).resolve().parent.parent
#: the fixtures folder: ``../shared`` beside the checkout, else ``./shared`` inside it (a copy carried to another
#: machine, e.g. by ``.ci/gpu``); ``BUTD_SHARED`` names another one
SHARED_CANDIDATES = [Path(p) for p in (os.environ.get("BUTD_SHARED"),) if p] + [REPO.parent / "shared", REPO / "shared"]
SHARED = next((p for p in SHARED_CANDIDATES if (p / "data").is_dir()), SHARED_CANDIDATES[0])


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """``shared/data`` (real photos and Caffe feature rows) beside or inside the checkout; skip if absent."""
    path = SHARED / "data"
    if not path.is_dir():
        pytest.skip(f"shared data not found at {' or '.join(str(p / 'data') for p in SHARED_CANDIDATES)}")
    return path


class CliRunnerFixture:
    """``cli.py`` for the tests, two ways.

    ``cli(*args)`` runs it in a child process, as a user does: its own interpreter, environment variables read at
    start-up, exit code, stdout and stderr apart (a ``subprocess.CompletedProcess``). ``cli.invoke(*args)`` runs the
    same Typer app in this process through ``typer.testing.CliRunner`` (a ``click.testing.Result``), which skips the
    two seconds of interpreter and torch start-up; it suits the tests of a command's own checks and output.

    The child's environment is this process's, without the names in ``unset``, with ``BUTD_NO_PROGRESS=1``,
    ``COLUMNS=200`` and the checkout on ``PYTHONPATH`` (plugins and ``-c`` children import from it), then ``env``.
    """

    def __call__(
        self,
        *args: str,
        env: dict[str, str] | None = None,
        unset: Iterable[str] = (),
        cwd: Path = REPO,
        timeout: float = 300,
        **popen: Any,
    ) -> subprocess.CompletedProcess:
        try:
            return subprocess.run(
                [sys.executable, str(REPO / "cli.py"), *args],
                cwd=cwd,
                env=self.environment(env, unset),
                capture_output=True,
                text=True,
                timeout=timeout,
                **popen,
            )
        except subprocess.TimeoutExpired:
            pytest.fail(f"`cli.py {' '.join(args[:2])}` still ran after {timeout} s")

    def environment(self, env: dict[str, str] | None = None, unset: Iterable[str] = ()) -> dict[str, str]:
        """The child's environment (see the class docstring)."""
        drop = set(unset)
        base = {k: v for k, v in os.environ.items() if k not in drop}
        base["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), base.get("PYTHONPATH", "")) if p)
        defaults = {k: v for k, v in (("BUTD_NO_PROGRESS", "1"), ("COLUMNS", "200")) if k not in drop}
        return {**base, **defaults, **(env or {})}

    def invoke(self, *args: str, env: dict[str, str] | None = None, **kw: Any) -> Any:
        """``cli.app`` with ``args`` in this process; ``env`` is set for the call only."""
        return CliRunner().invoke(cli_app, list(args), env=env, **kw)


@pytest.fixture(scope="session")
def cli() -> CliRunnerFixture:
    """The one way the tests run ``cli.py``: ``cli(*args)`` in a child process, ``cli.invoke(*args)`` in this one."""
    return CliRunnerFixture()


@pytest.fixture(scope="session")
def forked_cli(tmp_path_factory) -> Iterator[ForkedCli]:
    """Child processes forked from one interpreter that has imported ``cli`` (:mod:`forked_cli`), for the tests that
    start many short ``cli.py`` runs (SIGKILLed runs and their resumes, peak RSS) in this environment; the server
    loads torch with one OpenMP thread (``OMP_NUM_THREADS=1``). A test that needs the server to start with another
    environment (plugins, a bounded one) makes its own ``ForkedCli`` and closes it."""
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "BUTD_NO_PROGRESS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p),
    }
    with ForkedCli(env, tmp_path_factory.mktemp("forked") / "server.log") as server:
        yield server


@pytest.fixture(scope="session")
def tiny_captioners(tmp_path_factory) -> Path:
    """A run (:func:`caption_helpers.tiny_run`) with two tiny captioners, ``train-a`` (seed 1, one XE epoch) and
    ``train-b`` (seed 2, eight XE epochs), built once and read by the caption tests; none writes into it."""
    return tiny_run(
        tmp_path_factory.mktemp("captioners"),
        {
            "a": ["train.seed=1"],
            "b": ["train.seed=2", "train.xe={epochs: 8, batch_size: 8, lr: 3.0e-3, warmup_iters: 0}"],
        },
    )


@pytest.fixture(scope="session")
def tiny_captioner(tmp_path_factory) -> Path:
    """A run with one tiny captioner ``train-a`` (six XE epochs: its captions are words of the world), built once
    and read by the serve and gallery tests; none writes into it."""
    return tiny_run(
        tmp_path_factory.mktemp("captioner"),
        {"a": ["train.xe={epochs: 6, batch_size: 8, lr: 3.0e-3, warmup_iters: 0}"]},
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``gpu`` skip, with the reason, where torch sees no CUDA device."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False here)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
