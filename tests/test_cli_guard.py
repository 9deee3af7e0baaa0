"""The CLI error boundary: OSError -> one line naming action and path (exit 1); worker tracebacks and
undecodable file names never reach the terminal raw."""

from __future__ import annotations

import errno
import os

import pytest
import torch
import typer
from typer.testing import CliRunner

from pipeline.commands.common import guarded
from pipeline.core.errors import PipelineError, annotate_os_error, os_error_message
from pipeline.core.fileio import atomic_write_text


def _run(fn) -> tuple[int, str]:
    app = typer.Typer()
    app.command()(guarded(fn))
    res = CliRunner().invoke(app, [])
    return res.exit_code, res.output


def test_os_errors_are_one_line_with_action_path_and_hint(tmp_path) -> None:
    def full() -> None:
        raise annotate_os_error(
            OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), "write feature segment", tmp_path / "s.h5"
        )

    code, out = _run(full)
    assert code == 1 and out.count("\n") == 1 and "Traceback" not in out
    assert f"cannot write feature segment {tmp_path / 's.h5'}: No space left on device (disk full" in out

    def denied() -> None:
        (tmp_path / "x").mkdir()
        (tmp_path / "x").mkdir()  # FileExistsError from mkdir: action from the traceback

    code, out = _run(denied)
    assert code == 1 and f"cannot create folder {tmp_path / 'x'}: File exists" in out

    def missing() -> None:
        open(tmp_path / "nope.txt").read()

    code, out = _run(missing)
    assert code == 1 and f"cannot open {tmp_path / 'nope.txt'}: No such file or directory (check the path)" in out


def test_h5py_style_errno_in_text_is_recognised() -> None:
    exc = OSError(
        "Can't write data (file write failed: time = x, filename = 'a.h5', errno = 28, error message = 'No space')"
    )
    assert "disk full" in os_error_message(annotate_os_error(exc, "write feature segment", "a.h5"))


def test_atomic_write_failure_names_the_final_path_and_leaves_no_temp(tmp_path, monkeypatch) -> None:
    def boom(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(OSError) as err:
        atomic_write_text(tmp_path / "out.json", "{}")
    assert err.value.filename == str(tmp_path / "out.json") and err.value.butd_action == "write"
    assert list(tmp_path.iterdir()) == []


def test_dataloader_worker_errors_keep_only_the_message() -> None:
    class Damaged(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 1

        def __getitem__(self, i: int):
            raise PipelineError("seg-000001.h5: stored rows of image k4 are damaged")

    def train() -> None:
        list(torch.utils.data.DataLoader(Damaged(), num_workers=1))

    code, out = _run(train)
    assert code == 1 and out.strip() == "error: seg-000001.h5: stored rows of image k4 are damaged"


def test_undecodable_names_and_markup_in_messages() -> None:
    def odd() -> None:
        raise PipelineError("image [/x]caf\udce9.jpg is odd")

    code, out = _run(odd)
    assert code == 1 and out.strip() == "error: image [/x]caf\\xe9.jpg is odd"
