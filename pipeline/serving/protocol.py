"""uvicorn's h11 HTTP/1.1 protocol with a time limit on each request's head (request line and headers).

uvicorn bounds the idle time between requests (``timeout_keep_alive``) and this application bounds the body
(``serve.request_timeout_s``), but nothing bounds how long a client may take to send its headers: one header
byte a second would hold a connection for ever. :class:`HeadTimeoutProtocol` arms a timer when a connection
opens, and again when an answer leaves a kept-alive connection waiting for its next request, and cancels it as
soon as h11 has parsed the head. When it fires first, a client that sent part of a head gets ``408 Request
Timeout`` with a one-line JSON error; a silent one is closed without a word (as an idle kept-alive connection
is); either way the connection is closed. Timeouts are logged at debug level only, so a flood of them cannot
flood the log.

A connection whose first head is incomplete is left out of uvicorn's connection set, the count that
``limit_concurrency`` (``serve.max_connections``) compares against, so connections that trickle their headers
cannot turn every other request (``/healthz`` included) into a 503; what bounds them instead is the header
timeout and h11's limit on an incomplete head (16 KiB). The connection is counted from the moment its head is
complete, before uvicorn's own check, so the cap means what it means in uvicorn.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.core.console import get_logger

log = get_logger("serve")


def _timeout_answer(seconds: float) -> bytes:
    body = json.dumps({"error": f"the request headers did not arrive within {seconds:g} s"}).encode()
    return (
        b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"content-length: %d\r\n\r\n" % len(body)
    ) + body


class HeadTimeoutProtocol(H11Protocol):
    """:class:`H11Protocol` whose request heads must arrive within :attr:`head_timeout_s` seconds."""

    head_timeout_s: float = 10.0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False  # in uvicorn's connection set (from its first complete head on)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.connections.discard(self)
        self._watch_head()

    def data_received(self, data: bytes) -> None:
        if not self._counted:  # counted while h11 parses, so that uvicorn's cap check sees this connection
            self.connections.add(self)
        super().data_received(data)
        if not self._counted:
            if self._awaiting_head():
                self.connections.discard(self)
            else:
                self._counted = True
        self._watch_head()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        super().connection_lost(exc)

    def _awaiting_head(self) -> bool:
        """h11 waits for the (rest of the) next request's head on an open connection."""
        return self.conn.their_state is h11.IDLE and not self.transport.is_closing()

    def _watch_head(self) -> None:
        if not self._awaiting_head():
            self._stop_timer()
        elif self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _stop_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.transport.is_closing():
            return
        partial = bool(self.conn.trailing_data[0])  # bytes of a head h11 holds, not yet a request
        if partial:
            self.transport.write(_timeout_answer(self.head_timeout_s))
        self.transport.close()
        client = "%s:%d" % self.client if self.client else "a client"
        log.debug(
            "%s: no complete request head within %g s (%s); closed",
            client,
            self.head_timeout_s,
            "408" if partial else "silent",
        )


def head_timeout_protocol(seconds: float) -> type[HeadTimeoutProtocol]:
    """The protocol class to give ``uvicorn.Config(http=...)``: request heads within ``seconds``."""
    return type("HeadTimeoutProtocol", (HeadTimeoutProtocol,), {"head_timeout_s": float(seconds)})
