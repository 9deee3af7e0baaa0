"""Running ``cli serve``: load the models once, bind the socket, run uvicorn, drain on SIGTERM and exit 0.

The socket is bound here before the models load (``--port 0`` picks a free port; the line ``serving on
http://HOST:PORT`` on stdout names it once the models are loaded), so a port in use is one ``error:`` line at once.
SIGTERM or Ctrl-C: uvicorn stops accepting connections, closes idle ones, lets every request in flight finish (at most
``serve.drain_timeout_s``), then the lifespan's end closes the batcher (which has answered everything it admitted) and
the process exits 0; uvicorn's own re-raising of the signal after a graceful stop (which would make the exit status 143)
is not wanted here.
HTTP/1.1 is uvicorn's h11 protocol with a header timeout (:mod:`pipeline.serving.protocol`,
``serve.header_timeout_s``), whichever HTTP parsers are installed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import sys
from pathlib import Path
from typing import Any

import uvicorn

from pipeline import __version__
from pipeline.captioning.choose import find_checkpoint, find_detector
from pipeline.captioning.run import build_engine
from pipeline.core.config import Config
from pipeline.core.console import get_logger
from pipeline.core.errors import UsageError
from pipeline.serving.app import Service, create_app
from pipeline.serving.batcher import Batcher
from pipeline.serving.metrics import Metrics
from pipeline.serving.protocol import head_timeout_protocol
from pipeline.serving.settings import ServeSettings

log = get_logger("serve")


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (IPv6 when ``host`` has a colon)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def load_service(
    model: Path,
    weights: str | None,
    cfg: Config,
    settings: ServeSettings,
    captioner: str | None = None,
    vocab: Path | None = None,
    decoding: dict[str, Any] | None = None,
) -> tuple[Any, Any]:
    """The :class:`~pipeline.serving.app.Service` over ``caption``'s engine (models loaded once) and its batcher."""
    ckpt_path = find_checkpoint(model, captioner)
    det_weights = find_detector(model, ckpt_path, weights)
    engine, classes, attributes, info = build_engine(ckpt_path, det_weights, cfg, decoding, vocab)
    settings = within_position_table(settings, engine.model.max_caption_len())
    metrics = Metrics(settings.max_batch)
    batcher = Batcher(
        engine,
        settings.max_batch,
        settings.max_wait_ms / 1000.0,
        settings.queue_limit,
        metrics,
        settings.decode_threads,
    )
    about = {
        "version": __version__,
        "captioner": type(engine.model).__name__,
        "step": info.get("captioner_step"),
        "detector": (info.get("detector") or {}).get("name"),
        "device": str(engine.device),
        "beam_size": engine.options.beam_size,
        "max_batch": settings.max_batch,
    }
    return Service(batcher, settings, classes, attributes, metrics, about), batcher


def within_position_table(settings: ServeSettings, limit: int | None) -> ServeSettings:
    """``serve.max_len`` capped, up front and in one log line, at the captioner's position table (``limit`` tokens;
    None: no table), so that a request's ``max_len`` is refused as an option (400) rather than failing each image."""
    if limit is None or settings.max_len <= limit:
        return settings
    log.warning(
        "serve.max_len %d is longer than the %d positions this captioner's position table holds: requests may ask "
        "for %d at most",
        settings.max_len,
        limit,
        limit,
    )
    return dataclasses.replace(settings, max_len=limit)


def run_server(service: Any, batcher: Any, settings: ServeSettings, sock: socket.socket) -> int:
    """Serve on ``sock`` (from :func:`bind`) until SIGTERM/SIGINT; returns 0 once every admitted request was
    answered."""

    class _Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:  # SIGTERM/SIGINT: draining starts now
            service.draining = True
            batcher.flush()
            super().handle_exit(sig, frame)

        @contextlib.contextmanager
        def capture_signals(self):  # noqa: ANN202 - uvicorn's hook
            with super().capture_signals():
                yield
                self._captured_signals.clear()  # drained and stopped: exit 0 instead of re-raising the signal

    drained: list[bool] = []
    app = create_app(service, on_shutdown=lambda: drained.append(batcher.close(settings.drain_timeout_s)))
    host, port = sock.getsockname()[:2]
    config = uvicorn.Config(
        app,
        log_config=None,
        access_log=settings.log_requests,
        lifespan="on",
        timeout_graceful_shutdown=int(settings.drain_timeout_s),
        timeout_keep_alive=5,
        limit_concurrency=settings.max_connections,
        http=head_timeout_protocol(settings.header_timeout_s),
    )
    server = _Server(config)
    shown = f"[{host}]" if ":" in host else host
    print(f"serving on http://{shown}:{port}  (page /, API /v1/captions, docs /docs)", flush=True)
    if settings.host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(
            "listening on %s: reachable from other machines%s",
            settings.host,
            "" if settings.token else " and without a token (--token or $" + settings.token_env + ")",
        )
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if not drained:  # the lifespan did not run its end (a failed start): stop the model thread here
        drained.append(batcher.close(settings.drain_timeout_s))
    log.info("stopped%s", "" if drained[0] else " (the model thread was still busy)")
    sys.stdout.flush()
    return 0
