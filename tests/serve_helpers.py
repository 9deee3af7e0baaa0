"""Helpers for the `serve` tests: the real server in a child process on a free loopback port, HTTP requests to
it (127.0.0.1 only, every wait bounded), and headless Chromium driven over its DevTools pipe."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Server:
    proc: subprocess.Popen
    port: int
    tmp: Path | None = None  # the server's TMPDIR, when a test gives it one

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> tuple[int, dict[str, str], bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            res = conn.getresponse()
            return res.status, {k.lower(): v for k, v in res.getheaders()}, res.read()
        finally:
            conn.close()

    def post_images(
        self,
        files: Sequence[tuple[str, bytes]],
        fields: dict[str, Any] | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> tuple[int, dict[str, str], Any]:
        body, ctype = multipart(files, fields or {})
        status, head, raw = self.request(
            "POST", "/v1/captions", body, {"Content-Type": ctype, **(headers or {})}, timeout
        )
        return status, head, json.loads(raw) if raw else None

    def metrics(self, headers: dict[str, str] | None = None) -> str:
        return self.request("GET", "/metrics", headers=headers)[2].decode()

    def new_log(self) -> str:
        """What the server wrote to stderr since the last call (read without blocking)."""
        fd = self.proc.stderr.fileno()
        os.set_blocking(fd, False)
        chunks = []
        while True:
            try:
                chunk = os.read(fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode("utf-8", "replace")

    def log_until(self, done: Any, timeout: float = 20) -> str:
        """The server's new stderr text, read until ``done(text)`` holds or ``timeout`` seconds pass."""
        text, deadline = "", time.monotonic() + timeout
        while not done(text) and time.monotonic() < deadline:
            text += self.new_log()
            time.sleep(0.05)
        return text


def multipart(files: Sequence[tuple[str, bytes]], fields: dict[str, Any]) -> tuple[bytes, str]:
    """A multipart/form-data body: ``files`` as ``files`` parts (name, bytes), ``fields`` as text parts."""
    boundary = uuid.uuid4().hex
    out = []
    for name, value in fields.items():
        out.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode())
    for name, data in files:
        out.append(
            f'--{boundary}\r\nContent-Disposition: form-data; name="files"; filename="{name}"\r\n'
            f"Content-Type: application/octet-stream\r\n\r\n".encode()
            + data
            + b"\r\n"
        )
    out.append(f"--{boundary}--\r\n".encode())
    return b"".join(out), f"multipart/form-data; boundary={boundary}"


def start_server(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``cli.py serve --port 0 ARGS`` started (not yet waited for: several servers may boot at once)."""
    penv = dict(
        os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", BUTD_NO_PROGRESS="1", COLUMNS="200", **(env or {})
    )
    return subprocess.Popen(
        [sys.executable, str(REPO / "cli.py"), "serve", "--port", "0", *args],
        cwd=REPO,
        env=penv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@contextmanager
def serving(proc: subprocess.Popen, start_timeout: float = 180) -> Iterator[Server]:
    """A started server once it answers, until the block ends (then SIGTERM, and SIGKILL by pid if it hangs)."""
    try:
        port = _wait_for_port(proc, start_timeout)
        yield Server(proc, port)
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@contextmanager
def running_server(*args: str, env: dict[str, str] | None = None, start_timeout: float = 180) -> Iterator[Server]:
    """``cli.py serve --port 0 ARGS`` until the block ends."""
    with serving(start_server(*args, env=env), start_timeout) as server:
        yield server


def _wait_for_port(proc: subprocess.Popen, timeout: float) -> int:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if sel.select(timeout=1.0):
            line = proc.stdout.readline()
            if line.startswith("serving on http://127.0.0.1:"):
                port = int(line.split("127.0.0.1:", 1)[1].split()[0])
                _wait_healthy(port, deadline)
                return port
            if not line and proc.poll() is not None:
                break
    proc.kill()
    raise AssertionError(f"the server did not start: {proc.stderr.read()[-3000:] if proc.stderr else ''}")


def _wait_healthy(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            conn.request("GET", "/healthz")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.2)
        finally:
            conn.close()
    raise AssertionError("the server never answered /healthz")


class Chromium:
    """Headless Chromium driven through ``--remote-debugging-pipe`` (DevTools protocol, no extra package)."""

    def __init__(self, binary: str, profile: Path) -> None:
        r_cmd, w_cmd = os.pipe()  # we write commands -> chromium reads fd 3
        r_res, w_res = os.pipe()  # chromium writes results on fd 4 -> we read
        args = [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "--no-first-run",
            "--window-size=1000,800",
            "about:blank",
        ]

        def fds() -> None:
            import fcntl

            a, b = fcntl.fcntl(r_cmd, fcntl.F_DUPFD, 10), fcntl.fcntl(w_res, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            args, preexec_fn=fds, pass_fds=(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=False
        )
        os.close(r_cmd)
        os.close(w_res)
        self.out, self.inp = os.fdopen(w_cmd, "wb", buffering=0), os.fdopen(r_res, "rb", buffering=0)
        self._id, self._buf, self.session = 0, b"", None

    def send(self, method: str, params: dict[str, Any] | None = None, timeout: float = 60) -> dict[str, Any]:
        import select

        self._id += 1
        msg: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if self.session and not method.startswith("Target."):
            msg["sessionId"] = self.session
        self.out.write(json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._id:
                    if "error" in reply:
                        raise AssertionError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            if select.select([self.inp], [], [], 1.0)[0]:
                chunk = self.inp.read(1 << 16)
                if not chunk:
                    raise AssertionError("chromium closed its DevTools pipe")
                self._buf += chunk
        raise AssertionError(f"{method}: no answer in {timeout} s")

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        self.send("Page.enable")
        self.send("Page.navigate", {"url": url})

    def evaluate(self, expression: str) -> Any:
        return self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 90) -> Any:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.25)
        raise AssertionError(f"the page never satisfied {expression}")

    def close(self) -> None:
        try:
            self.out.close()
            self.proc.wait(10)
        except Exception:  # noqa: BLE001
            self.proc.kill()
            self.proc.wait(10)
