"""The README starts with exactly two commands, and CI runs the second one verbatim."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def leading_commands() -> list[str]:
    text = (REPO / "README.md").read_text()
    head = text.split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", head, re.S)]


def test_readme_starts_with_two_commands() -> None:
    cmds = leading_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    setup, tests = cmds
    assert "cli.py demo" in setup and "pytest" in tests
    assert setup.startswith("python3 -m venv .venv") and tests.startswith("python3 -m venv .venv")


def test_ci_runs_the_readme_test_command() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert leading_commands()[1] in ci


def test_constraints_pin_every_runtime_dependency() -> None:
    import tomllib

    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = {
        line.split("==")[0].strip().lower()
        for line in (REPO / "constraints.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    }
    for dep in deps:
        name = re.split(r"[<>=!~ ]", dep, 1)[0].lower()
        assert name in pins, f"{name} is not pinned in constraints.txt"
