"""``cli.py`` commands in forked children, optionally under an address-space limit.

:class:`ForkedCli` starts one interpreter (this file run as a script) that imports ``cli.py`` (its commands, the
plugins that ``BUTD_PLUGINS`` names, and the extractor modules with their release records, as ``info`` and ``extract``
import them) and then waits for requests. Each request forks a child of that interpreter; the child takes the
request's environment, points its stdin at ``/dev/null`` and its stdout and stderr at files, sets ``RLIMIT_AS`` to
the requested limit (if any), runs ``cli.main()`` with the request's arguments and exits with the command's exit code
(a traceback and exit 1 for an uncaught exception, as the interpreter does). The answer is a
``subprocess.CompletedProcess`` like the ``cli`` fixture's: a child killed by a signal has a negative return code.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


class ForkedCli:
    """``cli.py`` run in children forked from one interpreter that has imported it (see the module docstring)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.server = subprocess.Popen(
            [sys.executable, __file__],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        ready = self.server.stdout.readline()
        if ready.strip() != "ready":
            self.close()
            raise RuntimeError(f"the cli server did not start (exit code {self.server.returncode})")

    def __call__(
        self, *args: str, env: dict[str, str], address_space: int | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess:
        """``cli.py ARGS`` in a forked child with environment ``env`` and ``RLIMIT_AS`` = ``address_space`` bytes
        (None: the limit the server has);
        a child still running after ``timeout`` seconds is killed and raises ``subprocess.TimeoutExpired``."""
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            request = {
                "args": list(args),
                "env": env,
                "address_space": address_space,
                "timeout": timeout,
                "stdout": str(out),
                "stderr": str(err),
            }
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            line = self.server.stdout.readline()
            if not line:
                raise RuntimeError(f"the cli server ended (exit code {self.server.wait()})")
            answer = json.loads(line)
            if answer["timed_out"]:
                raise subprocess.TimeoutExpired(["cli.py", *args], timeout)
            return subprocess.CompletedProcess(
                ["cli.py", *args],
                answer["returncode"],
                out.read_text(errors="replace"),
                err.read_text(errors="replace"),
            )

    def close(self) -> None:
        if self.server.stdin:
            self.server.stdin.close()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()


def _child(request: dict[str, Any], cli: Any) -> None:
    """The forked child: the request's environment, files and limit, then ``cli.main()``; never returns."""
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, name in ((1, "stdout"), (2, "stderr")):
            target = os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(target, fd)
            os.close(target)
        if request["address_space"] is not None:
            limit = int(request["address_space"])
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        sys.argv = [str(REPO / "cli.py"), *request["args"]]
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                sys.stderr.write(f"{exc.code}\n")
        except BaseException:
            traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pid: int, timeout: float) -> dict[str, Any]:
    """The child's return code (negative: the signal that ended it), or ``timed_out`` once it is killed."""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status), "timed_out": False}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"returncode": None, "timed_out": True}
        time.sleep(0.005)


def _serve() -> None:
    """Import ``cli.py`` and the extractor modules, then answer one request per line of stdin until it closes."""
    answers = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    sys.argv = [str(REPO / "cli.py")]
    import cli
    from extractors import available_extractors

    available_extractors()
    answers.write("ready\n")
    answers.flush()
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, cli)
        answers.write(json.dumps(_wait(pid, float(request["timeout"]))) + "\n")
        answers.flush()
    answers.close()
    os._exit(0)  # stdin closed: nothing of this interpreter is left to save


if __name__ == "__main__":
    _serve()
