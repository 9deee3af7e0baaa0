"""The OpenAPI document of `serve` states every limit the server enforces on ``POST /v1/captions``: a value at a
stated bound is accepted by the code that checks requests, one step beyond it is refused (docs/serving.md)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import urllib.request
from collections.abc import Iterator
from dataclasses import replace

import pytest

from models.decoding import DecodeOptions
from pipeline.serving.answers import OPTION_NAMES, BadOptions, request_options
from pipeline.serving.app import Service, create_app
from pipeline.serving.metrics import Metrics
from pipeline.serving.settings import ServeSettings
from pipeline.serving.uploads import MAX_FIELD_BYTES, BadRequest, BodyTooLarge, images_and_fields, read_body

#: limits unlike the defaults, n_best's above the beam's: the document must follow the server, not the defaults
SETTINGS = ServeSettings(
    max_beam_size=4, max_n_best=7, max_len=25, max_images=3, max_body_bytes=5000, request_timeout_s=12.5
)


@pytest.fixture(scope="module")
def spec() -> Iterator[dict]:
    """``GET /openapi.json`` from the application served by uvicorn on a loopback port."""
    import uvicorn

    app = create_app(Service(None, SETTINGS, [], [], Metrics(SETTINGS.max_batch), {"version": "test"}))  # type: ignore[arg-type]
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}/openapi.json"
    try:
        for _ in range(500):
            if server.started:
                break
            thread.join(0.01)
        with urllib.request.urlopen(url, timeout=30) as answer:
            yield json.loads(answer.read())
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def _operation(spec: dict) -> dict:
    return spec["paths"]["/v1/captions"]["post"]


def _multipart(spec: dict) -> dict:
    return _operation(spec)["requestBody"]["content"]["multipart/form-data"]["schema"]


def _accepts(name: str, value: float, settings: ServeSettings = SETTINGS) -> bool:
    text = str(int(value)) if float(value).is_integer() and name != "timeout_s" else repr(float(value))
    try:
        request_options({name: text}, DecodeOptions(), settings)
    except BadOptions:
        return False
    return True


def test_each_option_is_declared_with_the_bounds_the_server_enforces(spec: dict) -> None:
    fields = _multipart(spec)["properties"]
    query = {p["name"]: p["schema"] for p in _operation(spec)["parameters"]}
    assert set(OPTION_NAMES) <= set(fields) and set(OPTION_NAMES) <= set(query)
    for name in OPTION_NAMES:
        schema = fields[name]
        assert query[name] == schema, name
        if schema["type"] == "boolean":
            assert not _accepts("regions", 2)  # "2" is not a boolean; "true"/"false" are
            continue
        low, high = schema.get("minimum"), schema["maximum"]
        step = 1 if schema["type"] == "integer" else 0.001
        assert _accepts(name, high) and not _accepts(name, high + step), (name, high)
        if low is not None:
            assert _accepts(name, low) and not _accepts(name, low - step), (name, low)
        else:
            assert schema["exclusiveMinimum"] == 0 and not _accepts(name, 0) and _accepts(name, step)
    assert fields["n_best"]["maximum"] == SETTINGS.max_beam_size  # beyond it the beam would pass max_beam_size


def test_the_images_and_the_body_are_declared_with_their_limits(spec: dict) -> None:
    body = _operation(spec)["requestBody"]
    multipart = _multipart(spec)
    files = multipart["properties"]["files"]
    assert body["required"] and multipart["required"] == ["files"] and multipart["additionalProperties"] is False
    assert (files["minItems"], files["maxItems"]) == (1, SETTINGS.max_images)
    assert body["content"]["image/*"]["schema"]["maxLength"] == SETTINGS.max_body_bytes
    assert (
        f"{SETTINGS.max_body_bytes} bytes" in body["description"] and f"{MAX_FIELD_BYTES} bytes" in body["description"]
    )

    def parts(n_images: int, field: str = "3") -> bytes:
        rows = [
            f'--b\r\nContent-Disposition: form-data; name="files"; filename="{i}.jpg"\r\n\r\nx\r\n'
            for i in range(n_images)
        ]
        rows.append(f'--b\r\nContent-Disposition: form-data; name="beam_size"\r\n\r\n{field}\r\n--b--\r\n')
        return "".join(rows).encode()

    kind = "multipart/form-data; boundary=b"
    assert len(images_and_fields(kind, parts(files["maxItems"]), None, SETTINGS.max_images)[0]) == files["maxItems"]
    with pytest.raises(BodyTooLarge):
        images_and_fields(kind, parts(files["maxItems"] + 1), None, SETTINGS.max_images)
    with pytest.raises(BadRequest):
        images_and_fields(kind, parts(0), None, SETTINGS.max_images)  # minItems 1
    with pytest.raises(BadRequest):
        images_and_fields(kind, parts(1, "9" * (MAX_FIELD_BYTES + 1)), None, SETTINGS.max_images)

    async def chunks(n: int):  # noqa: ANN202
        yield b"x" * n

    assert (
        len(asyncio.run(read_body(chunks(SETTINGS.max_body_bytes), None, SETTINGS.max_body_bytes)))
        == SETTINGS.max_body_bytes
    )
    with pytest.raises(BodyTooLarge):
        asyncio.run(read_body(chunks(SETTINGS.max_body_bytes + 1), None, SETTINGS.max_body_bytes))


def test_the_bounds_follow_the_server_settings() -> None:
    from pipeline.serving.app import body_doc

    other = replace(SETTINGS, max_beam_size=9, max_n_best=2, max_images=11)
    doc = body_doc(other)["requestBody"]["content"]["multipart/form-data"]["schema"]["properties"]
    assert (doc["beam_size"]["maximum"], doc["n_best"]["maximum"], doc["files"]["maxItems"]) == (9, 2, 11)
    assert _accepts("n_best", 2, other) and not _accepts("n_best", 3, other)
