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
    patterns = [
        p.strip() for p in (REPO / ".dockerignore").read_text().splitlines() if p.strip() and not p.startswith("#")
    ]
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
    takes_value = {
        "-v",
        "--volume",
        "--user",
        "-u",
        "--entrypoint",
        "--gpus",
        "--shm-size",
        "-e",
        "--env",
        "--cpus",
        "-p",
        "--publish",
    }
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
        args = tokens[at + 1 :]
        assert "-t" in opts and "--user" in opts
        if args[0] != "serve":  # serve decodes uploads in its model thread: no DataLoader workers, no /dev/shm
            assert "--ipc" in opts or "--shm-size" in opts
        mounts = [PurePosixPath(v.split(":")[1]) for v in opts.get("-v", [])]
        assert mounts and all(m.is_relative_to(workdir) for m in mounts), "mounts land under the working folder"
        assert all(v.startswith("$PWD/runs") for v in opts["-v"]), (
            "host folders lie under ./runs (made by mkdir -p runs)"
        )
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


def test_readme_makes_the_mounted_folder_before_running_and_serves_as_the_image_allows():
    """On a fresh clone ./runs does not exist (rootful Docker would create it root-owned): the README makes it
    before the first run; the serve line publishes the port the server listens on, on all addresses, with the
    model mounted read-only."""
    import yaml

    section = (REPO / "README.md").read_text().split("\n## Docker\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for b in re.findall(r"```bash\n(.*?)```", section, re.S) for line in b.strip().splitlines()]
    first_run = next(i for i, line in enumerate(lines) if line.startswith("docker run"))
    assert "mkdir -p runs" in lines[:first_run]
    assert "without `--user`" in section.lower() and "10001" in section  # what a run without --user needs
    serve = [c for c in readme_docker_commands() if c[1] == "run" and "serve" in c]
    assert len(serve) == 1
    opts, at = _options(serve[0])
    args = serve[0][at + 1 :]
    port = yaml.safe_load((REPO / "configs/serve.yaml").read_text())["serve"]["port"]
    assert opts["-p"] == [f"{port}:{port}"] and args[args.index("--host") + 1] == "0.0.0.0"
    expose = [rest for word, rest in instructions() if word == "EXPOSE"]
    assert expose == [str(port)]
    model = PurePosixPath("/work") / args[args.index("--model") + 1]
    ro = [PurePosixPath(v.split(":")[1]) for v in opts["-v"] if v.endswith(":ro")]
    assert any(model.is_relative_to(m) for m in ro), "the model is mounted read-only"
    assert "BUTD_SERVE_TOKEN" in opts.get("-e", [])


def test_dependency_layer_depends_on_the_lock_alone_and_code_layers_are_cheap():
    """The first pip install sees only constraints.txt (a README, docs or code edit keeps the big layer); the
    pycocoevalcap chmod runs in that layer (not as a 100 MB copy after every code edit); code is byte-compiled; the
    editable install builds with the pinned setuptools (no build isolation downloading unpinned ones)."""
    instrs = instructions()
    runs = [i for i, (word, rest) in enumerate(instrs) if word == "RUN"]
    dep = next(i for i in runs if "pip install" in instrs[i][1])
    copied = [src for word, rest in instrs[:dep] if word == "COPY" for src in shlex.split(rest)[:-1]]
    assert copied == ["constraints.txt"], copied
    assert "--no-deps -r" in instrs[dep][1] and "constraints.txt" in instrs[dep][1] and "pip check" in instrs[dep][1]
    chmods = [i for i in runs if "chmod -R" in instrs[i][1]]
    assert chmods == [dep], "the site-packages chmod belongs to the dependency layer"
    code = max(i for i, (word, _) in enumerate(instrs) if word == "COPY")
    after = " ".join(instrs[i][1] for i in runs if i > code)
    assert "compileall" in after and "--no-build-isolation" in after


def _pins() -> dict[str, str]:
    out = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not pinned with =="
            out[_norm(name)] = version
    return out


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_constraints_pin_what_the_image_installs_and_the_tests_run_on():
    """constraints.txt is the lock of the image: every distribution the project needs (transitively, with its
    dev extra and the build requirements) is pinned, at the version installed where these tests run; the image's
    Python is the Python of these tests."""
    import importlib.metadata as md
    import sys

    from packaging.requirements import Requirement

    instrs = instructions()
    args = dict(rest.split("=", 1) for word, rest in instrs if word == "ARG" and "=" in rest)
    image_python = re.match(r"python:(\d+\.\d+)", args["PYTHON_IMAGE"]).group(1)
    assert image_python in (REPO / "constraints.txt").read_text().split("\n", 2)[0]  # the header names it
    pins = _pins()
    for build in tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]:
        assert _norm(Requirement(build).name) in pins, build
    try:
        md.distribution("butd-caption")
    except md.PackageNotFoundError:
        pytest.skip("butd-caption is not installed here (pip install -e .)")
    if f"{sys.version_info.major}.{sys.version_info.minor}" != image_python:
        pytest.skip(
            f"these tests run on Python {sys.version_info.major}.{sys.version_info.minor}; "
            f"the image uses {image_python}"
        )
    seen, todo = set(), [("butd-caption", {"dev"})]
    while todo:
        name, extras = todo.pop()
        if _norm(name) in seen:
            continue
        seen.add(_norm(name))
        dist = md.distribution(name)
        if name != "butd-caption":
            assert _norm(name) in pins, f"{name} (needed, installed {dist.version}) is not pinned in constraints.txt"
            assert pins[_norm(name)] == dist.version, (
                f"{name}: constraints.txt pins {pins[_norm(name)]}, the tests run on {dist.version}"
            )
        for text in dist.requires or []:
            req = Requirement(text)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                todo.append((req.name, set(req.extras)))
    assert len(seen) > 40  # torch's CUDA libraries, FastAPI's and Typer's dependencies were walked


def test_image_check_builds_the_dockerfile_s_base_and_stays_out_of_ci() -> None:
    """`.ci/image-check` (the real build, slow) stands in for the Dockerfile's own FROM image, runs the README's
    commands as a non-root uid, and is not part of `.ci/run` (CI must stay fast)."""
    script = (REPO / ".ci" / "image-check").read_text()
    default = next(
        rest.split("=", 1)[1] for word, rest in instructions() if word == "ARG" and rest.startswith("PYTHON_IMAGE=")
    )
    assert f'FROM_IMAGE="${{FROM_IMAGE:-docker.io/library/{default}}}"' in script
    py = re.search(r"python:(\d+\.\d+)-slim-(\w+)", default)
    assert py and py.group(2) == "bookworm" and "debootstrap" in script and f"Python {py.group(1)}" in script
    assert "--user 1000:1000" in script and "/work/runs" in script and "demo --quick" in script and " serve " in script
    assert "image-check" not in (REPO / ".ci" / "run").read_text()
