"""The server's settings: the ``serve:`` section of ``configs/serve.yaml`` as one checked dataclass."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from pipeline.core.config import CONFIG_DIR, defaults_from
from pipeline.core.errors import UsageError


@dataclass(frozen=True)
@defaults_from(CONFIG_DIR / "serve.yaml", "serve")
class ServeSettings:
    """What bounds the server: the defaults (one per field, each key's meaning beside it) are ``configs/serve.yaml``'s
    ``serve:`` section (:func:`~pipeline.core.config.defaults_from`); ``token`` is never part of the file."""

    host: str
    port: int
    max_batch: int
    max_wait_ms: float
    decode_threads: int
    queue_limit: int
    retry_after_s: int
    max_body_bytes: int
    max_images: int
    request_timeout_s: float
    max_beam_size: int
    max_n_best: int
    max_len: int
    regions: bool
    max_regions: int
    token_env: str
    drain_timeout_s: float
    max_connections: int
    header_timeout_s: float
    log_requests: bool
    token: str | None = None  # the bearer token (from --token or ``token_env``); never part of the config file

    def __post_init__(self) -> None:
        positive = (
            "max_batch",
            "decode_threads",
            "queue_limit",
            "max_body_bytes",
            "max_images",
            "max_beam_size",
            "max_n_best",
            "max_len",
            "request_timeout_s",
            "drain_timeout_s",
            "max_regions",
            "max_connections",
            "header_timeout_s",
        )
        bad = [f"serve.{name}={getattr(self, name)}" for name in positive if not getattr(self, name) > 0]
        bad += [
            f"serve.{name}={getattr(self, name)}"
            for name in ("max_wait_ms", "retry_after_s")
            if getattr(self, name) < 0
        ]
        if bad:
            raise UsageError(f"{', '.join(bad)}: must be positive")
        if not 0 <= self.port <= 65535:
            raise UsageError(f"serve.port={self.port}: not a TCP port (0: a free one)")
        if self.token is not None and not self.token.strip():
            raise UsageError("the bearer token is empty (--token or the token environment variable)")


def settings_from(section: Any, token: str | None = None, **overrides: Any) -> ServeSettings:
    """:class:`ServeSettings` from the resolved ``serve`` config section; ``token`` (``--token``) wins over the
    environment variable named by ``serve.token_env``; ``overrides`` (``--host``, ``--port``) win over the file."""
    names = {f.name for f in fields(ServeSettings)} - {"token"}
    values = {k: section[k] for k in section if k in names}
    values.update({k: v for k, v in overrides.items() if v is not None})
    env = str(values.get("token_env") or "")
    if token is None and env:
        token = os.environ.get(env) or None
    return ServeSettings(**values, token=token)
