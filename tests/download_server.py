"""A local HTTP server standing in for the release hosts (tests never touch the network).

It serves byte strings by path (``/HOST/PATH`` as ``BUTD_DOWNLOAD_MIRROR`` asks for them, ``/REPO/resolve/REV/FILE``
as ``HF_ENDPOINT`` does), honours ``Range: bytes=N-`` with 206 answers, answers 404 for anything else, and logs
every request (path, Range). ``drop_after[path] = n`` closes the connection after n bytes of the next full answer
for that path (an interrupted download); ``gate[path]`` (a threading.Event) holds the body of that path until set.
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FileServer:
    def __init__(self) -> None:
        self.files: dict[str, bytes] = {}
        self.requests: list[tuple[str, str | None]] = []
        self.drop_after: dict[str, int] = {}
        self.gate: dict[str, threading.Event] = {}
        self.seen = threading.Condition()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                path = self.path
                rng = self.headers.get("Range")
                with server.seen:
                    server.requests.append((path, rng))
                    server.seen.notify_all()
                body = server.files.get(path)
                if body is None:
                    self.send_error(404, "Not Found")
                    return
                start = 0
                if rng and rng.startswith("bytes=") and rng.endswith("-"):
                    start = int(rng[len("bytes=") : -1])
                    if start >= len(body):
                        self.send_error(416, "Range Not Satisfiable")
                        return
                    self.send_response(206)
                    self.send_header("Content-Range", f"bytes {start}-{len(body) - 1}/{len(body)}")
                else:
                    self.send_response(200)
                self.send_header("Content-Length", str(len(body) - start))
                self.send_header("ETag", f'"{len(body)}"')
                self.end_headers()
                payload = body[start:]
                cut = server.drop_after.pop(path, None) if start == 0 else None
                if path in server.gate:
                    self.wfile.write(payload[: len(payload) // 2])
                    self.wfile.flush()
                    server.gate[path].wait(timeout=60)
                    payload = payload[len(payload) // 2 :]
                if cut is not None:
                    self.wfile.write(payload[:cut])
                    self.wfile.flush()
                    self.close_connection = True
                    return
                self.wfile.write(payload)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def publish(self, url: str, body: bytes) -> str:
        """Serve ``body`` where the mirror form of the published ``url`` points (a hub URL: where ``HF_ENDPOINT``
        points); -> the server path."""
        path = "/" + url.split("://", 1)[1]
        if path.startswith("/huggingface.co/"):
            path = path[len("/huggingface.co") :]
        self.files[path] = body
        return path

    def gets(self, path: str) -> list[str | None]:
        """The Range header of every request for ``path`` (None: a full GET)."""
        return [rng for p, rng in self.requests if p == path]

    def wait_for_request(self, path: str, timeout: float = 60) -> None:
        with self.seen:
            self.seen.wait_for(lambda: any(p == path for p, _ in self.requests), timeout=timeout)

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
