"""The Dockerfile, read without a Docker engine: what it copies exists, and the README's Docker commands use
only what the image has (paths, entry points, commands and their options, a writable mount)."""

from __future__ import annotations

import fnmatch
import re
import shlex
import tomllib
from pathlib import Path, PurePosixPath

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (REPO / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def env_of(instrs: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for word, rest in instrs:
        if word == "ENV":
            env.update(dict(tok.split("=", 1) for tok in shlex.split(rest)))
    return env


def image_paths(instrs: list[tuple[str, str]]) -> tuple[set[PurePosixPath], PurePosixPath]:
    """Paths COPY'd into the image (absolute) and the final WORKDIR."""
    workdir = PurePosixPath("/")
    paths = set()
    for word, rest in instrs:
        if word == "WORKDIR":
            workdir = workdir / rest
        elif word == "COPY":
            *srcs, dest = shlex.split(rest)
            base = workdir / dest
            for src in srcs:
                paths.add(base / src if dest.endswith("/") else base)
    return paths, workdir


def readme_docker_commands() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    section = text.split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [shlex.split(line) for b in blocks for line in b.strip().splitlines() if line.startswith("docker")]


def dockerignored(rel: str) -> bool:
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")]
    return any(fnmatch.fnmatch(rel, p) or fnmatch.fnmatch(rel, p.removeprefix("**/")) for p in patterns)


def test_dockerfile_copies_what_exists_and_is_slim():
    instrs = instructions()
    for word, rest in instrs:
        if word == "COPY":
            for src in shlex.split(rest)[:-1]:
                assert (REPO / src).exists(), f"COPY {src}: not in the repository"
                assert not dockerignored(src), f"COPY {src}: excluded by .dockerignore"
    args = dict(rest.split("=", 1) for word, rest in instrs if word == "ARG" and "=" in rest)
    base = next(rest for word, rest in instrs if word == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)
    assert "nvidia/cuda" not in base and base.startswith("python:")  # the torch wheels bring CUDA
    paths, workdir = image_paths(instrs)
    for needed in ("cli.py", "pipeline", "models", "extractors", "configs", "bench"):
        assert PurePosixPath("/opt/butd-caption") / needed in paths, needed
    assert workdir == PurePosixPath("/work")
    env = env_of(instrs)
    assert "BUTD_NO_PROGRESS" not in env  # bars show with `docker run -t`
    assert "/opt/butd-caption" in env["PYTHONPATH"].split(":")  # python -m bench
    for var in ("HOME", "XDG_CACHE_HOME", "TORCH_HOME"):
        assert env[var].startswith("/tmp/"), var  # writable for any --user uid
    entry = next(rest for word, rest in instrs if word == "ENTRYPOINT")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert eval(entry)[0] in scripts  # noqa: S307 - a JSON-style list literal from our own Dockerfile


def _options(tokens: list[str]) -> tuple[dict[str, list[str]], int]:
    """docker run options (name -> values) and the index of the image name."""
    takes_value = {"-v", "--volume", "--user", "-u", "--entrypoint", "--gpus", "--shm-size", "-e", "--env", "--cpus"}
    opts: dict[str, list[str]] = {}
    i = 2
    while tokens[i].startswith("-"):
        name, _, val = tokens[i].partition("=")
        if name in takes_value and not val:
            i += 1
            val = tokens[i]
        opts.setdefault(name, []).append(val)
        i += 1
    return opts, i


def test_readme_docker_commands_use_what_the_image_has():
    import cli
    from bench.__main__ import _parser

    instrs = instructions()
    paths, workdir = image_paths(instrs)
    cmds = readme_docker_commands()
    build = [c for c in cmds if c[1] == "build"]
    runs = [c for c in cmds if c[1] == "run"]
    assert len(build) == 1 and runs
    tag = build[0][build[0].index("-t") + 1]
    commands = {c.name or c.callback.__name__ for c in cli.app.registered_commands}
    for tokens in runs:
        opts, at = _options(tokens)
        assert tokens[at] == tag, "runs the image that was built"
        assert "-t" in opts and ("--ipc" in opts or "--shm-size" in opts) and "--user" in opts
        mounts = [PurePosixPath(v.split(":")[1]) for v in opts.get("-v", [])]
        assert mounts and all(m.is_relative_to(workdir) for m in mounts), "mounts land under the working folder"
        args = tokens[at + 1 :]
        outputs = [a for a in args if "/" in a and not a.startswith("-")]
        for rel in outputs:  # every path the command writes lies inside a mount, so it reaches the host
            assert any((workdir / rel).is_relative_to(m) for m in mounts), rel
        if opts.get("--entrypoint") == ["python"]:
            assert args[:2] == ["-m", "bench"] and PurePosixPath("/opt/butd-caption/bench") in paths
            _parser().parse_args(args[2:])  # the options exist
            continue
        assert args[0] in commands, f"{args[0]} is not a CLI command"
        helptext = CliRunner().invoke(cli.app, [args[0], "--help"], terminal_width=200).output
        for opt in (a for a in args[1:] if a.startswith("--")):
            assert opt in helptext, f"{args[0]} has no option {opt}"


def test_readme_documents_shm_and_user():
    section = (REPO / "README.md").read_text().split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    for needle in ("--shm-size", "--ipc=host", '--user "$(id -u):$(id -g)"', "BUTD_NO_PROGRESS"):
        assert needle in section, needle


@pytest.mark.parametrize("rel,ignored", [("runs", True), (".venv", True), ("bench", False), ("configs", False)])
def test_dockerignore(rel, ignored):
    assert dockerignored(rel) is ignored
