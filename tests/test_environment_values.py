"""Odd environment values never hide output or stop a command: ``COLUMNS``/``LINES`` outside their range, an absurd
``BUTD_THREADS`` or ``OMP_NUM_THREADS``, a ``BUTD_WORKER_WAIT`` that is no number fall back to the default with one
warning naming the variable; torchrun's variables (which no default can replace) are one error line."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.errors import UsageError

SETTINGS = ("COLUMNS", "LINES", "BUTD_THREADS", "OMP_NUM_THREADS", "BUTD_WORKER_WAIT", "BUTD_NO_PROGRESS")


def warnings_about(stderr: str, name: str) -> list[str]:
    return [line for line in stderr.splitlines() if name in line and "environment variable" in line]


@pytest.mark.parametrize("columns", ["0", "-3", "abc", "100000"])
def test_odd_columns_keep_the_error_line(cli, columns: str, tmp_path: Path) -> None:
    res = cli(
        "caption",
        str(tmp_path / "missing.jpg"),
        "--model",
        str(tmp_path / "x.pt"),
        env={"COLUMNS": columns},
        unset=SETTINGS,
    )
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "missing.jpg" in errors[0], res.stderr[:3000]
    assert len(warnings_about(res.stderr, "COLUMNS")) == 1, res.stderr[:3000]
    assert max(len(line) for line in res.stderr.splitlines()) <= 1000  # no line laid out 100000 columns wide
    assert "Traceback" not in res.stderr


def test_odd_columns_keep_a_usage_error_of_the_command_line(cli) -> None:
    res = cli("caption", "--no-such-option", env={"COLUMNS": "0"}, unset=SETTINGS)
    assert res.returncode == 2 and "--no-such-option" in res.stderr, res.stderr


@pytest.mark.parametrize("value", [str(10**30), "-5", "abc", "0", "100000"])
def test_odd_butd_threads_warn_and_the_command_works(cli, value: str) -> None:
    res = cli("info", env={"BUTD_THREADS": value, "COLUMNS": "200"}, unset=SETTINGS)
    assert res.returncode == 0 and "butd-caption environment" in res.stdout, res.stderr[-3000:]
    assert len(warnings_about(res.stderr, "BUTD_THREADS")) == 1, res.stderr[-3000:]
    assert "Traceback" not in res.stderr


def test_an_absurd_openmp_thread_count_warns_and_the_command_works(cli) -> None:
    res = cli("info", env={"OMP_NUM_THREADS": str(10**30), "COLUMNS": "200"}, unset=SETTINGS)
    assert res.returncode == 0 and "butd-caption environment" in res.stdout, res.stderr[-3000:]
    assert len(warnings_about(res.stderr, "OMP_NUM_THREADS")) == 1, res.stderr[-3000:]


def test_the_threads_option_itself_is_still_checked(cli) -> None:
    """``--threads`` is typed on the command line: an odd value there is the user's mistake, one error line."""
    res = cli("--threads", "100000", "info", env={"COLUMNS": "200"}, unset=SETTINGS)
    errors = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert res.returncode == 2 and len(errors) == 1 and "--threads" in errors[0], res.stderr


def test_the_thread_policy_falls_back_to_its_default(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from pipeline.core import environment, threads

    monkeypatch.setattr(environment, "_warned", set())
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for value in (str(10**30), "-5", "abc", "0", "2.5"):
        monkeypatch.setenv("BUTD_THREADS", value)
        assert threads.explicit_threads() is None
        assert threads.plan(workers=1, processes=1, cores=4) == threads.ThreadPlan(4, 1, 3, 1)
    assert sum("BUTD_THREADS" in r.getMessage() for r in caplog.records) == 5  # one per value, not one per read
    monkeypatch.setenv("BUTD_THREADS", "3")
    assert threads.explicit_threads() == 3


def test_worker_wait_and_progress_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.core import environment
    from pipeline.core.loaders import WORKER_WAIT, worker_wait

    monkeypatch.setattr(environment, "_warned", set())
    for value in ("soon", "-1", "nan", "inf", "0"):
        monkeypatch.setenv("BUTD_WORKER_WAIT", value)
        assert worker_wait() == WORKER_WAIT
    monkeypatch.setenv("BUTD_WORKER_WAIT", "2.5")
    assert worker_wait() == 2.5
    for value, on in (("1", True), ("yes", True), ("0", False), ("false", False), ("", False), ("sometimes", True)):
        monkeypatch.setenv("BUTD_NO_PROGRESS", value)
        assert environment.setting_flag("BUTD_NO_PROGRESS") is on, value


def test_odd_lines_give_a_console_of_sane_height(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.core import environment
    from pipeline.core.console import stderr_console

    monkeypatch.setattr(environment, "_warned", set())
    for value in ("0", "100000", "abc"):
        monkeypatch.setenv("LINES", value)
        monkeypatch.setenv("COLUMNS", "0")
        con = stderr_console()
        assert 5 <= con.size.height <= 1000 and 20 <= con.size.width <= 1000, (value, con.size)


def test_torchrun_variables_are_one_error_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.core.distributed import env_context, local_processes

    for name, value in (("WORLD_SIZE", "two"), ("RANK", "-1"), ("LOCAL_RANK", "x"), ("LOCAL_WORLD_SIZE", "0")):
        monkeypatch.setenv(name, value)
        with pytest.raises(UsageError, match=f"{name}={value!r}") as info:
            env_context() if name != "LOCAL_WORLD_SIZE" else local_processes()
        assert "\n" not in str(info.value) and "torchrun" in str(info.value)
        monkeypatch.delenv(name)
