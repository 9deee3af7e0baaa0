"""The thread policy (pipeline/core/threads.py): resolved numbers, explicit counts, the CLI's --threads."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from typer.testing import CliRunner

from pipeline.core import threads
from pipeline.core.errors import UsageError


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    """No inherited thread settings; torch's thread count restored afterwards."""
    for name in ("BUTD_THREADS", "OMP_NUM_THREADS", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    "cores,workers,processes,expected",
    [
        (2, 0, 1, (2, 0)),  # the whole machine for torch
        (2, 2, 1, (1, 1)),  # 2 cores, 2 workers asked: one decodes, one computes
        (1, 2, 1, (1, 0)),  # one core: no workers, one thread
        (16, 2, 1, (14, 2)),
        (16, 4, 4, (1, 3)),  # 4 torchrun ranks share 16 cores: 4 each
        (16, 0, 8, (2, 0)),
        (8, 0, 16, (1, 0)),  # more processes than cores: the floor is one thread each
        (64, 8, 2, (24, 8)),
    ],
)
def test_resolved_numbers(cores, workers, processes, expected):
    plan = threads.plan(workers=workers, processes=processes, cores=cores)
    assert (plan.threads, plan.workers) == expected
    assert not plan.explicit


def test_never_oversubscribed_when_there_are_enough_cores():
    for cores, workers, processes in itertools.product(range(1, 33), range(0, 9), range(1, 9)):
        plan = threads.plan(workers=workers, processes=processes, cores=cores)
        assert plan.threads >= 1 and 0 <= plan.workers <= workers
        if cores >= processes:
            assert plan.busy <= cores, plan
        else:
            assert plan.busy == processes  # one thread each, no workers


def test_explicit_threads_win_and_workers_take_the_rest(monkeypatch):
    assert threads.plan(workers=4, threads=3, processes=1, cores=8) == threads.ThreadPlan(8, 1, 3, 4, explicit=True)
    assert threads.plan(workers=4, threads=6, processes=1, cores=8).workers == 2
    assert threads.plan(workers=4, threads=8, processes=1, cores=8).workers == 0
    monkeypatch.setenv("OMP_NUM_THREADS", "3,1")  # OpenMP's nested list form: the first level counts
    assert threads.plan(workers=2, processes=1, cores=8).threads == 3
    monkeypatch.setenv("BUTD_THREADS", "2")  # --threads beats OMP_NUM_THREADS
    assert threads.plan(workers=2, processes=1, cores=8) == threads.ThreadPlan(8, 1, 2, 2, explicit=True)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.delenv("BUTD_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    assert threads.plan(workers=1, cores=8) == threads.ThreadPlan(8, 4, 1, 1)


def test_bad_values_are_usage_errors(monkeypatch):
    with pytest.raises(UsageError, match="workers"):
        threads.plan(workers=-1)
    with pytest.raises(UsageError, match="threads"):
        threads.plan(threads=0)
    monkeypatch.setenv("BUTD_THREADS", "many")  # an odd environment value is warned about and ignored
    assert threads.explicit_threads() is None
    monkeypatch.setenv("BUTD_THREADS", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "garbage")  # not ours: ignored, not an error
    assert threads.explicit_threads() == 1


def test_cores_come_from_the_affinity_mask_and_the_cgroup_quota(tmp_path, monkeypatch):
    quota = threads.cgroup_cpu_limit()
    expected = len(os.sched_getaffinity(0)) if quota is None else min(len(os.sched_getaffinity(0)), quota)
    assert threads.available_cores() == expected
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # docker run --cpus 1.5: 2 cores' worth of threads
    assert threads.cgroup_cpu_limit(tmp_path) == 2
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert threads.cgroup_cpu_limit(tmp_path) is None
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("400000")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000")
    assert threads.cgroup_cpu_limit(v1) == 4
    assert threads.cgroup_cpu_limit(tmp_path / "missing") is None
    monkeypatch.setattr(threads, "cgroup_cpu_limit", lambda: 1)
    assert threads.available_cores() == 1


def test_loader_workers_sets_torch_threads_to_match(monkeypatch):
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    torch.set_num_threads(8)
    assert threads.loader_workers(2) == 2
    assert torch.get_num_threads() == 6
    torch.set_num_threads(1)  # a lower count set earlier (a config's num_threads) is kept
    assert threads.loader_workers(2) == 2 and torch.get_num_threads() == 1
    monkeypatch.setenv("BUTD_THREADS", "7")
    assert threads.loader_workers(3) == 1 and torch.get_num_threads() == 7
    assert threads.pool_size(20) == 8 and threads.pool_size(3) == 3


def test_loader_threads_gives_the_threads_back_when_the_workers_are_done(monkeypatch):
    """Inside the block torch runs the policy's threads next to the workers; after it (also after an error) the
    count it had before, so work after a loader (training after the encoder's image table) keeps every thread."""
    monkeypatch.setattr(threads, "available_cores", lambda: 8)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        with threads.loader_threads(3) as n:
            assert n == 3 and torch.get_num_threads() == 5
        assert torch.get_num_threads() == 8
        with pytest.raises(RuntimeError), threads.loader_threads(2):
            assert torch.get_num_threads() == 6
            raise RuntimeError("a failing batch")
        assert torch.get_num_threads() == 8
    finally:
        torch.set_num_threads(before)


def test_cli_threads_option(monkeypatch):
    import cli

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    runner = CliRunner()
    res = runner.invoke(cli.app, ["--threads", "0", "info"])
    assert res.exit_code == 2 and "error: --threads must be at least 1" in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(cli.app, ["--threads", "two", "info"])
    assert res.exit_code == 2 and "whole number" in res.output
    res = runner.invoke(cli.app, ["--threads", "1", "info", "--help"])
    assert res.exit_code == 0
    assert os.environ["BUTD_THREADS"] == "1" and torch.get_num_threads() == 1
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"


def test_every_command_offers_threads(monkeypatch):
    import cli

    runner = CliRunner()
    for cmd in cli.app.registered_commands:
        name = cmd.name or cmd.callback.__name__
        assert "--threads" in runner.invoke(cli.app, [name, "--help"], terminal_width=200).output, name
    res = runner.invoke(cli.app, ["demo", "--threads", "0"])
    assert res.exit_code == 2 and "error: --threads must be at least 1" in res.output
    res = runner.invoke(cli.app, ["info", "--threads", "1"])
    assert res.exit_code == 0, res.output
    assert os.environ["BUTD_THREADS"] == "1" and torch.get_num_threads() == 1


def test_a_command_applies_the_policy_before_its_body(monkeypatch):
    """torch's default thread count ignores cgroup quotas: every command sets the policy's count first."""
    import cli

    monkeypatch.setattr(threads, "available_cores", lambda: 1)
    torch.set_num_threads(2)
    res = CliRunner().invoke(cli.app, ["info"])
    assert res.exit_code == 0, res.output
    assert torch.get_num_threads() == 1 and "BUTD_THREADS" not in os.environ


def test_openmp_wait_policy_is_set_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, when torch loads: `import cli` must set it before that import."""
    import subprocess
    import sys

    spy = (
        "import os, sys\n"
        "class Spy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'torch':\n"
        "            print('policy at torch import:', os.environ.get('OMP_WAIT_POLICY'))\n"
        "            sys.meta_path.remove(self)\n"
        "        return None\n"
        "sys.meta_path.insert(0, Spy())\n"
        "import cli\n"
        "import torch\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run(
        [sys.executable, "-c", spy],
        cwd=str(threads.Path(__file__).resolve().parent.parent),
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "policy at torch import: PASSIVE" in out.stdout, out.stdout + out.stderr
