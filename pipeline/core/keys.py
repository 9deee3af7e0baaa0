"""Bytes-safe image keys: the one rule for turning any file name into a key and back.

**The rule.** A key is a Python ``str``. A file name the operating system gives (``bytes`` on Linux, possibly
not valid UTF-8, e.g. ``b"caf\\xe9.jpg"`` written by a Latin-1 tool) becomes a key with :func:`key_from_name`
(``os.fsdecode``: UTF-8 with *surrogate escapes*, PEP 383), so every undecodable byte ``0xHH`` is kept as the
lone surrogate ``U+DCHH``; :func:`key_to_bytes` gives the exact original bytes back. Nothing is lost.

Where a key goes:

* **HDF5** (feature-store segments): the key's exact bytes (:func:`key_to_bytes`) in the UTF-8 string
  dataset; read back with :func:`key_from_bytes`. Valid UTF-8 keys are stored as their plain UTF-8
  bytes, so stores written without escapes read unchanged.
* **Text files** (JSON, JSON lines, CSV, TSV) and **the terminal**: the key's *text form*
  (:func:`key_to_text`), which is valid UTF-8, holds no control character, tab or line break, and maps back
  with :func:`key_from_text`. The text form escapes with a backslash:

  ==================================================  ===============
  in the key                                          text form
  ==================================================  ===============
  a backslash ``\\``                                   ``\\\\``
  an undecodable byte ``0xHH`` (surrogate ``U+DCHH``)  ``\\xHH``
  a control character, line or paragraph separator,   ``\\uHHHH``
  or any other lone surrogate (code point ``HHHH``)
  ==================================================  ===============

  Every other character is written as itself, so ordinary keys (``"397133"``, ``"photos/dog.jpg"``,
  ``"café.jpg"``) have a text form identical to the key.
* **rich** output: :func:`markup_escape` on every user string (file names, captions, messages), and
  :func:`display_key` (the text form, markup-escaped) for keys.

A key the store accepts (:func:`check_key`) is a non-empty string without NUL whose characters all have a
byte form (no lone surrogate outside ``U+DC80..U+DCFF``); everything else is refused up front, so a round
trip through any of the formats above is lossless.
"""

from __future__ import annotations

import os
import unicodedata

from rich.markup import escape

from pipeline.core.errors import UsageError

_ESCAPED_CATEGORIES = frozenset({"Cc", "Cs", "Zl", "Zp"})
_HEX = frozenset("0123456789abcdefABCDEF")


def key_from_name(name: str | bytes | os.PathLike) -> str:
    """The key for a file name as the OS gives it (``bytes`` or ``str``): ``os.fsdecode`` (surrogate escapes)."""
    return os.fsdecode(name)


def key_to_bytes(key: str) -> bytes:
    """The exact bytes of ``key`` (UTF-8, undecodable bytes restored from their surrogate escapes)."""
    try:
        return key.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as exc:
        raise UsageError(f"key {key_to_text(key)!r} holds a character with no byte form ({exc.reason})") from None


def key_from_bytes(data: bytes | str) -> str:
    """Inverse of :func:`key_to_bytes` (a ``str`` is returned unchanged)."""
    return data if isinstance(data, str) else data.decode("utf-8", "surrogateescape")


def _escape_char(ch: str) -> str:
    code = ord(ch)
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return f"\\u{code:04x}"


def key_to_text(key: str) -> str:
    """The text form of ``key``: valid UTF-8, one line, no control characters; see the module docstring."""
    if key.isprintable() and "\\" not in key:
        return key
    out = []
    for ch in key:
        if ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            out.append(_escape_char(ch))
        else:
            out.append(ch)
    return "".join(out)


def key_from_text(text: str) -> str:
    """Inverse of :func:`key_to_text`; a malformed escape raises :class:`UsageError` naming the text."""
    if "\\" not in text:
        return text
    out = []
    i = 0
    n = len(text)
    while i < n:
        ch = text[i]
        if ch != "\\":
            out.append(ch)
            i += 1
            continue
        kind = text[i + 1] if i + 1 < n else ""
        if kind == "\\":
            out.append("\\")
            i += 2
            continue
        width = 2 if kind == "x" else 4 if kind == "u" else 0
        digits = text[i + 2 : i + 2 + width]
        if not width or len(digits) != width or not set(digits) <= _HEX:
            raise UsageError(f"key text {text!r} has a malformed escape at character {i} (see pipeline.core.keys)")
        code = int(digits, 16)
        out.append(chr(0xDC00 + code) if kind == "x" else chr(code))
        i += 2 + width
    return "".join(out)


def check_key(key: object, source: str = "key") -> str:
    """Return ``key`` if the store accepts it (a non-empty ``str``, no NUL, a byte form); else a UsageError."""
    if not isinstance(key, str) or not key:
        raise UsageError(f"{source}: image keys must be non-empty strings, got {key!r}")
    if "\x00" in key:
        raise UsageError(f"{source}: key {key_to_text(key)!r} contains a NUL character")
    key_to_bytes(key)
    return key


def markup_escape(text: object) -> str:
    """``str(text)`` made safe for rich markup (``[/x]`` in a file name prints as itself, never as a tag)."""
    return escape(str(text))


def display_key(key: str) -> str:
    """A key for a rich table or message: its text form, markup-escaped."""
    return markup_escape(key_to_text(key))
