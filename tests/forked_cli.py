"""Child processes forked from one interpreter that has already imported ``cli`` (torch, torchvision and every
command module): the tests that start many short ``cli.py`` runs pay the imports once.

``python tests/forked_cli.py`` is the server: it imports ``cli``, then reads one JSON request per line on stdin
and forks a child for it. The child takes the request's working folder, environment, ``sys.argv`` and
standard files (stdin ``/dev/null``, stdout and stderr the named files), runs the script (a file, as
``python FILE`` does, or code, as ``python -c CODE`` does) as ``__main__`` and exits as a ``multiprocessing``
child does: the script's exit code (``SystemExit`` as the interpreter reads it), non-daemon threads joined,
``atexit`` handlers run, stdout and stderr flushed, then ``os._exit`` (the interpreter's teardown of every module,
which in a forked child copies most of the parent's memory page by page, is skipped). The server answers
``{"pid": PID}`` once the child runs and ``{"returncode": RC}`` when it has ended (``-N``: killed by signal N,
as :attr:`subprocess.Popen.returncode`). One child runs at a time; the server ends when its stdin closes.

:class:`ForkedCli` is the tests' side: ``start(...)`` returns a :class:`ForkedChild` with the child's pid
(a real process: it can be signalled, its own children listed in /proc) and ``poll``/``wait`` for its exit status.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


class ForkedChild:
    """One child of the server: ``pid``, ``stdout``/``stderr`` (the files it writes) and its exit status."""

    def __init__(self, server: ForkedCli, pid: int, stdout: Path, stderr: Path) -> None:
        self.server, self.pid, self.stdout, self.stderr = server, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None."""
        if self.returncode is None:
            reply = self.server.reply(timeout=0)
            if reply is not None:
                self.returncode = int(reply["returncode"])
        return self.returncode

    def wait(self, timeout: float = 600) -> int:
        """Wait for the child to end; past ``timeout`` seconds it is killed and ``TimeoutError`` raised."""
        if self.returncode is None:
            reply = self.server.reply(timeout=timeout)
            if reply is None:
                os.kill(self.pid, signal.SIGKILL)
                self.server.reply(timeout=60)
                raise TimeoutError(f"the forked child {self.pid} still ran after {timeout} s")
            self.returncode = int(reply["returncode"])
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the child, unless it has already ended."""
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def output(self) -> tuple[str, str]:
        """What the child wrote to stdout and stderr (UTF-8, undecodable bytes replaced)."""
        return tuple(p.read_bytes().decode("utf-8", errors="replace") for p in (self.stdout, self.stderr))


class ForkedCli:
    """The client of one server process (started by :meth:`open` or the first :meth:`start`, with ``env``: the
    environment torch and OpenMP read while they load); :meth:`close` ends it."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self.running: ForkedChild | None = None

    def start(
        self,
        argv: list[str],
        *,
        stdout: Path,
        stderr: Path,
        env: dict[str, str],
        code: str | None = None,
        cwd: Path = REPO,
    ) -> ForkedChild:
        """Run ``argv[0]`` (a script file) with ``sys.argv = argv``, or ``code`` with ``sys.argv = ["-c", *argv]``,
        in a forked child with exactly the environment ``env``."""
        self.open()
        if self.running is not None and self.running.poll() is None:  # one a test left running (a failed test's)
            self.running.kill()
            self.running.wait(timeout=60)
        argv = ["-c", *argv] if code is not None else [str(a) for a in argv]
        request = {"argv": argv, "code": code, "env": env, "cwd": str(cwd)}
        request.update(stdout=str(stdout), stderr=str(stderr))
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        reply = self.reply(timeout=120)
        if reply is None or "pid" not in reply:
            raise RuntimeError(f"the fork server started no child ({reply}); its log: {self.log}")
        self.running = ForkedChild(self, int(reply["pid"]), Path(stdout), Path(stderr))
        return self.running

    def open(self) -> None:
        """Start the server unless it runs (it imports ``cli`` while the caller goes on)."""
        if self.proc is None or self.proc.poll() is not None:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, __file__], cwd=REPO, env=self.env, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log,
                )  # fmt: skip
            self.pending = b""

    def reply(self, timeout: float) -> dict[str, Any] | None:
        """The server's next answer, or None if none comes within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the fork server ended; its log: {self.log}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """End the server (after the child that runs, if one does)."""
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)
            self.proc.stdout.close()
            self.proc = None


def _child(request: dict[str, Any], source: Any, replies: int) -> int:
    """In the forked child: set up the process as the request says, run its script; returns the exit code."""
    source.close()
    os.close(replies)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.argv = list(request["argv"])
    import runpy

    try:
        if request["code"] is not None:
            sys.path[0] = ""
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        else:
            sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
            runpy.run_path(sys.argv[0], run_name="__main__")
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - reported as the interpreter reports an uncaught exception
        import traceback

        traceback.print_exc()
        return 1
    return 0


def _exit(code: int) -> None:
    """End a forked child: non-daemon threads joined, ``atexit`` handlers run, stdout and stderr flushed."""
    import atexit
    import threading

    try:
        for thread in threading.enumerate():
            if thread is not threading.main_thread() and not thread.daemon:
                thread.join()
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)


def serve() -> int:
    """The server loop (see the module docstring); the server's exit code (forked children never return)."""
    import cli  # noqa: F401 - the imports every child shares

    requests, replies = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    with os.fdopen(requests, "rb", buffering=0) as source:
        pending = b""
        while True:
            while b"\n" not in pending:
                chunk = source.read(65536)
                if not chunk:
                    return 0
                pending += chunk
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _exit(_child(request, source, replies))
            os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            os.write(replies, json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    code = serve()
    os._exit(code)  # the server has nothing to finish: its teardown would only free what it imported
