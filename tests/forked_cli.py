"""``cli.py`` runs in child processes forked from one interpreter that has already imported ``cli`` (torch,
torchvision, every command module, the plugins ``BUTD_PLUGINS`` names and the extractor modules with their release
records): the tests that start many short ``cli.py`` runs pay those imports once, and every run starts from the
same memory.

``python tests/forked_cli.py`` is the server: with the environment it was started with (the one torch and OpenMP
read while they load, and ``BUTD_PLUGINS``), it imports ``cli`` and the extractors, then reads one JSON request per
line on stdin and forks a child for it. The child takes the request's working folder, environment (it replaces the
server's), ``sys.argv``, standard files (stdin ``/dev/null``, stdout and stderr the named files) and, if the
request sets one, an ``RLIMIT_AS`` address-space limit; it runs the script (a file, as ``python FILE`` does, or
code, as ``python -c CODE`` does) as ``__main__`` and exits as a ``multiprocessing`` child does: the script's exit
code (``SystemExit`` as the interpreter reads it; a traceback and 1 for an uncaught exception), non-daemon threads
joined, ``atexit`` handlers run, stdout and stderr flushed, then ``os._exit`` (the interpreter's teardown of every
module, which in a forked child copies most of the parent's memory page by page, is skipped). The server answers
``{"pid": PID}`` once the child runs and ``{"returncode": RC}`` when it has ended (``-N``: killed by signal N, as
:attr:`subprocess.Popen.returncode`). One child runs at a time; the server ends when its stdin closes.

:class:`ForkedCli` is the tests' side, two ways: ``start(argv, ...)`` returns a :class:`ForkedChild` at once, with
the child's pid (a real process: it can be signalled, its own children listed in /proc), ``poll``/``wait``/``kill``
and the files it writes; ``server(*args, env=...)`` runs ``cli.py ARGS`` to its end and returns a
``subprocess.CompletedProcess`` like the ``cli`` fixture's.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
#: seconds the server may take to fork a child, its imports included when the child is its first
START_TIMEOUT = 300


class ForkedChild:
    """One child of the server: ``pid``, ``stdout``/``stderr`` (the files it writes) and its exit status."""

    def __init__(self, server: ForkedCli, argv: list[str], pid: int, stdout: Path, stderr: Path) -> None:
        self.server, self.argv, self.pid, self.stdout, self.stderr = server, argv, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status if the child has ended, else None."""
        if self.returncode is None:
            reply = self.server.reply(timeout=0)
            if reply is not None:
                self.returncode = int(reply["returncode"])
        return self.returncode

    def wait(self, timeout: float = 600) -> int:
        """Wait for the child to end; past ``timeout`` seconds it is killed and ``subprocess.TimeoutExpired``
        raised."""
        if self.returncode is None:
            reply = self.server.reply(timeout=timeout)
            if reply is None:
                os.kill(self.pid, signal.SIGKILL)
                reply = self.server.reply(timeout=60)
                if reply is not None:
                    self.returncode = int(reply["returncode"])
                raise subprocess.TimeoutExpired(self.argv, timeout)
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
    """The client of one server process, started here with ``env`` (the environment the server imports ``cli``
    with); its stderr goes to ``log`` (None: this process's stderr). :meth:`close` (or the end of a ``with``
    block) ends it."""

    def __init__(self, env: dict[str, str], log: Path | None = None) -> None:
        self.env, self.log = env, log
        self.proc: subprocess.Popen | None = None
        self.pending = b""
        self.running: ForkedChild | None = None
        self.open()

    def __enter__(self) -> ForkedCli:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(
        self,
        *args: str,
        env: dict[str, str],
        address_space: int | None = None,
        timeout: float = 300,
        cwd: Path = REPO,
    ) -> subprocess.CompletedProcess:
        """``cli.py ARGS`` run to its end in a forked child (see :meth:`start`); its stdout and stderr as text.
        A child still running after ``timeout`` seconds is killed and raises ``subprocess.TimeoutExpired``."""
        with tempfile.TemporaryDirectory() as tmp:
            argv = [str(REPO / "cli.py"), *args]
            child = self.start(
                argv, stdout=Path(tmp) / "stdout", stderr=Path(tmp) / "stderr", env=env,
                address_space=address_space, cwd=cwd,
            )  # fmt: skip
            child.wait(timeout=timeout)
            return subprocess.CompletedProcess(argv, child.returncode, *child.output())

    def start(
        self,
        argv: list[str],
        *,
        stdout: Path,
        stderr: Path,
        env: dict[str, str],
        code: str | None = None,
        address_space: int | None = None,
        cwd: Path = REPO,
    ) -> ForkedChild:
        """Run ``argv[0]`` (a script file) with ``sys.argv = argv``, or ``code`` with ``sys.argv = ["-c", *argv]``,
        in a forked child with exactly the environment ``env``, in ``cwd``, its ``RLIMIT_AS`` set to
        ``address_space`` bytes (None: the server's limit); returns without waiting for it."""
        self.open()
        if self.running is not None and self.running.poll() is None:  # one a test left running (a failed test's)
            self.running.kill()
            self.running.wait(timeout=60)
        argv = ["-c", *argv] if code is not None else [str(a) for a in argv]
        request = {"argv": argv, "code": code, "env": env, "cwd": str(cwd), "address_space": address_space}
        request.update(stdout=str(stdout), stderr=str(stderr))
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        reply = self.reply(timeout=START_TIMEOUT)
        if reply is None or "pid" not in reply:
            raise RuntimeError(f"the fork server started no child ({reply}){self._where()}")
        self.running = ForkedChild(self, argv, int(reply["pid"]), Path(stdout), Path(stderr))
        return self.running

    def open(self) -> None:
        """Start the server unless it runs (it imports ``cli`` while the caller goes on)."""
        if self.proc is None or self.proc.poll() is not None:
            log = open(self.log, "ab") if self.log is not None else None
            try:
                self.proc = subprocess.Popen(
                    [sys.executable, __file__], cwd=REPO, env=self.env, stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=log,
                )  # fmt: skip
            finally:
                if log is not None:
                    log.close()
            self.pending, self.running = b"", None

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
                raise RuntimeError(f"the fork server ended (exit code {self.proc.wait()}){self._where()}")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def close(self) -> None:
        """End the server (a child still running is killed first)."""
        if self.proc is None:
            return
        try:
            if self.running is not None and self.proc.poll() is None and self.running.poll() is None:
                self.running.kill()
                self.running.wait(timeout=60)
        finally:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.proc, self.running = None, None

    def _where(self) -> str:
        return f"; its log: {self.log}" if self.log is not None else "; its stderr is this process's"


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
    import resource
    import runpy

    try:
        if request["address_space"] is not None:
            limit = int(request["address_space"])
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
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
    sys.argv = [str(REPO / "cli.py")]
    import cli  # noqa: F401 - the imports every child shares (and the plugins BUTD_PLUGINS names)
    from extractors import available_extractors

    available_extractors()  # every extractor module and its release records, as `info` and `extract` import them
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
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _exit(_child(request, source, replies))
            os.write(replies, json.dumps({"pid": pid}).encode() + b"\n")
            _, status = os.waitpid(pid, 0)
            os.write(replies, json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode() + b"\n")


if __name__ == "__main__":
    code = serve()
    os._exit(code)  # the server has nothing to finish: its teardown would only free what it imported
