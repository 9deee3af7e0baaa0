"""The ASGI application of ``cli serve`` (FastAPI): routes, the bearer token, the HTTP bounds.

``POST /v1/captions`` (images in, one entry per image out, :mod:`pipeline.serving.answers`), ``GET /`` (the page
to try it), ``GET /healthz``, ``GET /metrics`` (Prometheus text), ``GET /openapi.json`` and ``GET /docs`` (the
OpenAPI description, rendered without any script or stylesheet from a network). ``POST /v1/captions`` and
``GET /metrics`` need ``Authorization: Bearer TOKEN`` when the server has a token (401 otherwise); the page, the
health check and the API description are open (they hold nothing about the model's inputs or outputs).

Status codes of ``POST /v1/captions``: 200 (also when some images failed: their entries carry the error), 400
(unreadable body), 401, 408 (the body did not arrive within ``serve.request_timeout_s``), 413 (body or image
count beyond the limits), 415, 422 (options), 503 + Retry-After (queue full, or draining), 504 (not answered
within ``serve.request_timeout_s`` or the request's ``timeout_s``). A failure of the model thread on a
whole batch (a project error such as a feature-size mismatch) is a 500 naming it. A client that closes its
connection before its body is complete gets no answer: it is one log line and counted as 499 (nginx's "client
closed request"), never a server error.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, Response

from pipeline.core.console import get_logger
from pipeline.core.errors import exception_line
from pipeline.serving.answers import (
    BadOptions,
    CaptionsAnswer,
    ErrorAnswer,
    image_answer,
    options_answer,
    request_options,
)
from pipeline.serving.batcher import Batcher, Closed, QueueFull
from pipeline.serving.metrics import Metrics
from pipeline.serving.page import docs_html, page_html
from pipeline.serving.settings import ServeSettings
from pipeline.serving.uploads import MAX_FIELD_BYTES, BadRequest, BodyTooLarge, ClientGone, images_and_fields, read_body

log = get_logger("serve")

#: the status counted for a request whose client closed its connection before its body was complete (never sent)
CLIENT_CLOSED = 499


def option_schemas(s: ServeSettings) -> dict[str, dict[str, Any]]:
    """The JSON schema of each request option with the bounds :func:`pipeline.serving.answers.request_options`
    enforces on this server (HTTP 422 beyond them): a client built from the OpenAPI document stays within them."""
    return {
        "beam_size": {"type": "integer", "minimum": 1, "maximum": s.max_beam_size, "description": "beam size"},
        # n_best widens the beam to n_best, which stays within max_beam_size
        "n_best": {
            "type": "integer",
            "minimum": 1,
            "maximum": min(s.max_n_best, s.max_beam_size),
            "description": "captions per image (beam search; at most beam_size when both are given)",
        },
        "max_len": {"type": "integer", "minimum": 1, "maximum": s.max_len, "description": "most generated tokens"},
        "regions": {"type": "boolean", "description": "include the attended regions (true | false)"},
        "timeout_s": {
            "type": "number",
            "exclusiveMinimum": 0,
            "maximum": s.request_timeout_s,
            "description": "time limit of this request in seconds",
        },
    }


def body_doc(s: ServeSettings) -> dict[str, Any]:
    """The request body and query parameters of ``POST /v1/captions`` with this server's limits
    (:mod:`pipeline.serving.uploads`, :mod:`pipeline.serving.answers`): 1 to ``serve.max_images`` images, a
    body of at most ``serve.max_body_bytes`` bytes (413 beyond), option fields of at most
    :data:`MAX_FIELD_BYTES` bytes, no other fields."""
    options = option_schemas(s)
    limits = (
        f"At most {s.max_images} images and {s.max_body_bytes} bytes per request (413 beyond); option "
        f"fields of at most {MAX_FIELD_BYTES} bytes; an option given both as a query parameter and a field "
        "takes the field's value."
    )
    return {
        "requestBody": {
            "required": True,
            "description": "Images as multipart files (field name files; option fields beside them), or one raw image "
            "body. " + limits,
            "content": {
                "multipart/form-data": {
                    "schema": {
                        "type": "object",
                        "required": ["files"],
                        "additionalProperties": False,
                        "properties": {
                            "files": {
                                "type": "array",
                                "minItems": 1,
                                "maxItems": s.max_images,
                                "items": {"type": "string", "format": "binary"},
                            },
                            **options,
                        },
                    }
                },
                "image/*": {
                    "schema": {"type": "string", "format": "binary", "minLength": 1, "maxLength": s.max_body_bytes}
                },
            },
        },
        "parameters": [
            {"name": name, "in": "query", "required": False, "schema": schema} for name, schema in options.items()
        ]
        + [
            {
                "name": "name",
                "in": "query",
                "required": False,
                "schema": {"type": "string"},
                "description": "file name of a raw image body (a label only)",
            }
        ],
    }


_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorAnswer, "description": text}
    for code, text in (
        (400, "unreadable body"),
        (401, "missing or wrong bearer token"),
        (408, "the body arrived too slowly"),
        (413, "body or image count beyond the limits"),
        (415, "not images"),
        (422, "options beyond the server's limits"),
        (503, "queue full or draining (Retry-After)"),
        (504, "not answered in time"),
    )
}


class Service:
    """What the routes share: the engine's batcher, settings, label names, counters, the draining flag."""

    def __init__(
        self,
        batcher: Batcher,
        settings: ServeSettings,
        classes: Sequence[str],
        attributes: Sequence[str],
        metrics: Metrics,
        about: dict[str, Any],
    ) -> None:
        self.batcher, self.settings, self.classes, self.attributes = batcher, settings, list(classes), list(attributes)
        self.metrics, self.about, self.draining = metrics, about, False

    def authorized(self, request: Request) -> bool:
        if self.settings.token is None:
            return True
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), self.settings.token.encode())


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def _unauthorized() -> JSONResponse:
    return _error(
        401, "this server needs Authorization: Bearer TOKEN", {"WWW-Authenticate": 'Bearer realm="butd-caption"'}
    )


def create_app(service: Service, on_shutdown: Any = None) -> FastAPI:
    """The FastAPI application over a running :class:`Service` (``on_shutdown``: called by the lifespan's end)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):  # noqa: ANN202
        yield
        service.draining = True
        if on_shutdown is not None:
            await asyncio.get_running_loop().run_in_executor(None, on_shutdown)

    app = FastAPI(
        title="butd-caption",
        version=str(service.about.get("version", "")),
        docs_url=None,
        redoc_url=None,
        lifespan=lifespan,
        description="Captions for photos: bottom-up regions and an attention captioner (docs/serving.md).",
    )
    s = service.settings

    @app.post(
        "/v1/captions",
        response_model=CaptionsAnswer,
        responses=_ERRORS,
        openapi_extra=body_doc(s),
        summary="Caption one or more images",
    )
    async def captions(request: Request) -> Response:
        start = time.perf_counter()
        response = await _captions(service, request)
        gone = response.status_code == CLIENT_CLOSED  # not a latency of an answer
        service.metrics.request(response.status_code, None if gone else time.perf_counter() - start)
        return response

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(page_html(s, service.about))

    @app.get("/healthz", summary="Liveness and readiness")
    async def healthz() -> JSONResponse:
        body = {
            "status": "draining" if service.draining else "ok",
            "queue_depth": service.batcher.depth,
            **service.about,
        }
        return JSONResponse(body, status_code=503 if service.draining else 200)

    @app.get("/metrics", response_class=PlainTextResponse, summary="Prometheus metrics")
    async def metrics(request: Request) -> Response:
        if not service.authorized(request):
            return _unauthorized()
        service.metrics.set_queue_depth(service.batcher.depth)
        return PlainTextResponse(service.metrics.text(), media_type="text/plain; version=0.0.4")

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_html(app.openapi()))

    return app


async def _captions(service: Service, request: Request) -> Response:
    s = service.settings
    if not service.authorized(request):
        return _unauthorized()
    if service.draining:
        return _error(503, "the server is shutting down", {"Retry-After": str(s.retry_after_s)})
    try:
        body = await asyncio.wait_for(
            read_body(request.stream(), request.headers.get("content-length"), s.max_body_bytes), s.request_timeout_s
        )
        items, fields = images_and_fields(
            request.headers.get("content-type"), body, request.query_params.get("name"), s.max_images
        )
        query = {k: v for k, v in request.query_params.items() if k != "name"}
        options, regions, timeout = request_options({**query, **fields}, service.batcher.engine.options, s)
    except ClientGone as exc:  # nobody to answer: one line, no traceback
        client = f"{request.client.host}:{request.client.port}" if request.client else "a client"
        log.info("POST /v1/captions from %s: %s", client, exc)
        return _error(CLIENT_CLOSED, str(exc))
    except BodyTooLarge as exc:
        return _error(413, str(exc))
    except asyncio.TimeoutError:  # a body trickling in (slow client): the connection is not held for ever
        return _error(408, f"the body did not arrive within {s.request_timeout_s:g} s")
    except BadRequest as exc:
        return _error(exc.status, str(exc))
    except BadOptions as exc:
        return _error(422, str(exc))
    del body
    start = time.perf_counter()
    jobs: list[Any] = []

    async def answered() -> list[Any]:  # admitted, decoded in the decoding threads, queued, captioned
        jobs.extend(await service.batcher.submit(items, options, regions))
        return await asyncio.gather(*(j.future for j in jobs))

    try:
        results = await asyncio.wait_for(answered(), timeout)
    except (QueueFull, Closed) as exc:
        return _error(503, str(exc), {"Retry-After": str(s.retry_after_s)})
    except asyncio.TimeoutError:
        service.batcher.drop(jobs)
        return _error(504, f"not answered within {timeout:g} s (the server is busy; try again later)")
    except asyncio.CancelledError:  # the client went away
        service.batcher.drop(jobs)
        raise
    except Exception as exc:  # noqa: BLE001 - the model thread failed the whole batch (a project error)
        return _error(500, f"captioning failed: {exception_line(exc)}")
    images = [
        image_answer(i, r, service.classes, service.attributes, regions, s.max_regions) for i, r in enumerate(results)
    ]
    return JSONResponse(
        {
            "images": images,
            "options": options_answer(options, regions),
            "seconds": round(time.perf_counter() - start, 4),
        }
    )
