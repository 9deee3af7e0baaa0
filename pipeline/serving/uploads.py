"""Request bodies: read under the size cap, then parsed in memory into images and option fields.

Nothing touches the disk: the body is read chunk by chunk and refused (:class:`BodyTooLarge`, HTTP 413) as
soon as it passes ``serve.max_body_bytes`` (the ``Content-Length`` is checked first), and a client that closes
its connection before the body is complete is :class:`ClientGone`; multipart bodies are parsed with
python-multipart's streaming parser into byte strings (Starlette's own form parser would spool files over 1 MB
to temporary files), and whatever the parser refuses (a boundary beyond RFC 2046's 70 characters included) is
one :class:`BadRequest` (HTTP 400). A client's file name is a label only: each image is decoded from the
bytes it carries (:attr:`UploadItem.data`), so no request can make the server open a path.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect

#: multipart fields that carry option values (everything else with a file name, or named like these, is an image)
IMAGE_FIELDS = ("file", "files", "image", "images", "photo", "photos")
MAX_NAME = 200
MAX_BOUNDARY = 70  # RFC 2046, section 5.1.1: a boundary has 1 to 70 characters
#: the longest text field of a multipart body (an option value); a longer part needs a file name (an image)
MAX_FIELD_BYTES = 100


class BodyTooLarge(Exception):
    """The body passed the cap (HTTP 413)."""


class ClientGone(Exception):
    """The client closed its connection before its body was complete (no answer can reach it)."""


class BadRequest(Exception):
    """The body cannot be read as images (HTTP 400 or 415); the message is the client's answer."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class UploadItem:
    """One uploaded image, shaped like :class:`extractors.run.ImageItem` for the captioning engine: ``path`` is
    the client's file name as a label (never opened), ``data`` the bytes that are decoded."""

    key: str
    path: PurePosixPath
    data: bytes
    problem: tuple[str, str] | None = None


def label(name: str | None, index: int) -> str:
    """A display name for an upload: the last component of the client's name (or ``image-N``), printable, short."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    base = "".join(ch for ch in base if ch.isprintable())[:MAX_NAME].strip()
    return base if base not in ("", ".", "..") else f"image-{index + 1}"


async def read_body(chunks: AsyncIterator[bytes], content_length: str | None, limit: int) -> bytes:
    """The whole body, refused as soon as it is known to exceed ``limit`` bytes."""
    declared = None
    if content_length is not None:
        try:
            declared = int(content_length)
        except ValueError:
            raise BadRequest("Content-Length is not a number") from None
        if declared > limit:
            raise BodyTooLarge(f"the body has {declared} bytes; the limit is {limit}")
    parts, size = [], 0
    try:
        async for chunk in chunks:
            size += len(chunk)
            if size > limit:
                raise BodyTooLarge(f"the body exceeds the limit of {limit} bytes")
            parts.append(chunk)
    except ClientDisconnect:
        of = "" if declared is None else f" of {declared}"
        raise ClientGone(f"the client closed the connection after {size}{of} body bytes") from None
    return b"".join(parts)


def parse_multipart(body: bytes, boundary: bytes) -> list[tuple[str, str | None, bytes]]:
    """``(field name, file name or None, bytes)`` of every part, in order (python-multipart, in memory)."""
    parts: list[tuple[str, str | None, bytes]] = []
    state: dict[str, Any] = {}

    def on_part_begin() -> None:
        state.update(headers={}, data=[], field=b"", value=b"")

    def on_header_field(data: bytes, start: int, end: int) -> None:
        state["field"] += data[start:end]

    def on_header_value(data: bytes, start: int, end: int) -> None:
        state["value"] += data[start:end]

    def on_header_end() -> None:
        state["headers"][state["field"].decode("latin-1").lower()] = state["value"]
        state["field"], state["value"] = b"", b""

    def on_part_data(data: bytes, start: int, end: int) -> None:
        state["data"].append(data[start:end])

    def on_part_end() -> None:
        _, params = parse_options_header(state["headers"].get("content-disposition", b""))
        name = params.get(b"name", b"").decode("utf-8", "replace")
        filename = params.get(b"filename")
        parts.append(
            (name, filename.decode("utf-8", "replace") if filename is not None else None, b"".join(state["data"]))
        )

    callbacks = {
        "on_part_begin": on_part_begin,
        "on_header_field": on_header_field,
        "on_header_value": on_header_value,
        "on_header_end": on_header_end,
        "on_part_data": on_part_data,
        "on_part_end": on_part_end,
    }
    try:  # every refusal of the parser, from its construction to its end, is the client's 400
        if len(boundary) > MAX_BOUNDARY:
            raise FormParserError(f"the boundary has {len(boundary)} characters (RFC 2046: at most {MAX_BOUNDARY})")
        parser = MultipartParser(boundary, callbacks)
        parser.write(body)
        parser.finalize()
    except ValueError as exc:  # FormParserError and its subclasses are ValueErrors, as are the parser's other refusals
        raise BadRequest(f"malformed multipart body: {' '.join(str(exc).split()) or type(exc).__name__}") from None
    return parts


def images_and_fields(
    content_type: str | None, body: bytes, raw_name: str | None, max_images: int
) -> tuple[list[UploadItem], dict[str, str]]:
    """The images of a request and its text fields: multipart (files, plus option fields) or one raw image body."""
    ctype, params = parse_options_header(content_type or "")
    fields: dict[str, str] = {}
    named: list[tuple[str | None, bytes]] = []
    if ctype == b"multipart/form-data":
        boundary = params.get(b"boundary")
        if not boundary:
            raise BadRequest("multipart/form-data without a boundary")
        for name, filename, data in parse_multipart(body, boundary):
            if filename is not None or name in IMAGE_FIELDS:
                named.append((filename, data))
            elif len(data) <= MAX_FIELD_BYTES:
                fields[name] = data.decode("utf-8", "replace")
            else:
                raise BadRequest(f"form field {name!r}: an option value of {len(data)} bytes (files need a file name)")
    elif ctype in (b"application/x-www-form-urlencoded", b"application/json", b"text/plain"):
        raise BadRequest(
            "send images as multipart/form-data files or as one raw image body (e.g. Content-Type: image/jpeg)", 415
        )
    else:
        named.append((raw_name, body))
    if not named:
        raise BadRequest("no image in the request (multipart files named file/files/image/images, or a raw image body)")
    if len(named) > max_images:
        raise BodyTooLarge(f"{len(named)} images in one request; the limit is {max_images}")
    items = [UploadItem(str(i), PurePosixPath(label(name, i)), data) for i, (name, data) in enumerate(named)]
    return items, fields
