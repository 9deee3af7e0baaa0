"""Fetching a public file into the one cache, ``$BUTD_CACHE`` (default ``~/.cache/butd-caption``).

A download goes to ``<stem>.part<suffix>`` beside its final path and is resumed with an HTTP ``Range`` request
after an interruption (within the run, and by the next run from what the ``.part`` file holds). A complete file
is checked by the caller's strict reader (``verify``) and only then renamed to its final name, with its
SHA-256 recorded beside it (``<file>.sha256``); a refused file is deleted, so the cache never holds a file
under its final name that was not read successfully. Later uses compare the file with that record. One lock
per file (:func:`pipeline.core.locks.acquire_lock`): a second process waits for the first and then uses its
file. Every failure is one line naming the URL and the path where the file can be put by hand.

``BUTD_DOWNLOAD_MIRROR=http://host:port`` fetches ``http(s)://HOST/PATH?QUERY`` from
``http://host:port/HOST/PATH?QUERY``; Hugging Face hub URLs follow ``HF_ENDPOINT`` instead, and
``HF_HUB_OFFLINE=1`` keeps them to the cache.
"""

from __future__ import annotations

import hashlib
import http.client
import os
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline import __version__
from pipeline.core.console import get_logger, make_download_progress
from pipeline.core.errors import PipelineError, UsageError
from pipeline.core.fileio import atomic_write_json, read_json
from pipeline.core.locks import acquire_lock

log = get_logger("download")

CACHE_ENV = "BUTD_CACHE"
MIRROR_ENV = "BUTD_DOWNLOAD_MIRROR"
HF_HOST = "huggingface.co"
#: attempts per URL when a transfer breaks off (each resumes where the last stopped)
ATTEMPTS = 4
#: seconds a socket may stay silent before the attempt counts as interrupted
TIMEOUT = 60.0
CHUNK = 1 << 20
#: a file checked against its record (path, size, mtime) in this process is not hashed again
_CHECKED: set[tuple[str, int, int]] = set()

Verify = Callable[[Path], None]


def cache_root() -> Path:
    """``$BUTD_CACHE``, else ``~/.cache/butd-caption``: downloads, converted releases, locks."""
    root = os.environ.get(CACHE_ENV)
    return Path(root) if root else Path.home() / ".cache" / "butd-caption"


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def hub_endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or f"https://{HF_HOST}").rstrip("/")


def is_hub_url(url: str) -> bool:
    return urllib.parse.urlsplit(url).netloc == HF_HOST


def source_url(url: str) -> str:
    """Where ``url`` is fetched from: the hub through ``HF_ENDPOINT``, anything else through the mirror if set."""
    parts = urllib.parse.urlsplit(url)
    if parts.netloc == HF_HOST:
        return hub_endpoint() + parts.path + (f"?{parts.query}" if parts.query else "")
    mirror = os.environ.get(MIRROR_ENV)
    if mirror:
        return f"{mirror.rstrip('/')}/{parts.netloc}{parts.path}" + (f"?{parts.query}" if parts.query else "")
    return url


@dataclass(frozen=True)
class Download:
    """One file to fetch: ``name`` (for messages), ``urls`` (as published; tried in order), ``dest`` (its path in
    the cache), ``sha256`` / ``size`` when published, ``manual`` (the steps when no URL reaches it)."""

    name: str
    urls: tuple[str, ...]
    dest: Path
    sha256: str | None = None
    size: int | None = None
    manual: str = ""

    @property
    def part(self) -> Path:
        return self.dest.with_name(f"{self.dest.stem}.part{self.dest.suffix}")

    @property
    def record(self) -> Path:
        return self.dest.with_name(self.dest.name + ".sha256")

    @property
    def lock(self) -> Path:
        root = downloads_dir()
        rel = self.dest.relative_to(root) if self.dest.is_relative_to(root) else Path(self.dest.name)
        return cache_root() / "locks" / (str(rel).replace(os.sep, "--") + ".lock")

    def by_hand(self) -> str:
        return f"put the file there by hand: {self.dest}"


class DownloadError(PipelineError):
    """A file that could not be fetched or was refused (one line: the URL and where to put the file by hand)."""


class _Interrupted(Exception):
    """The transfer broke off; the ``.part`` file holds what arrived."""


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(CHUNK * 4), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(item: Download, verify: Verify, offline: bool = False) -> Path:
    """The checked local copy of ``item``: from the cache, else downloaded, verified and recorded."""
    if item.dest.is_file():
        return _checked(item, verify)
    if not item.urls:
        raise DownloadError(f"{item.name} cannot be fetched automatically: {item.manual}; {item.by_hand()}")
    if offline:
        raise DownloadError(
            f"{item.name} is not in the cache and downloads are off (HF_HUB_OFFLINE): {item.urls[0]}; {item.by_hand()}"
        )
    with _wait_for_lock(item):
        if item.dest.is_file():  # another process fetched it while this one waited
            return _checked(item, verify)
        url = _download(item)
        _accept(item, url, verify)
    return item.dest


def _wait_for_lock(item: Download):
    """The file's lock; while another process holds it (it is downloading the file), wait for it."""
    told = False
    while True:
        try:
            return acquire_lock(item.lock, f"download of {item.name}")
        except UsageError as exc:
            if not told:
                log.info("waiting for another process downloading %s (%s)", item.name, exc)
                told = True
            time.sleep(0.2)


def _checked(item: Download, verify: Verify) -> Path:
    """A cached file: compared with its SHA-256 record, or (placed by hand, no record) read once and recorded."""
    path = item.dest
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key in _CHECKED:
        return path
    if item.record.is_file():
        record = read_json(item.record, "download record")
        digest = sha256_of(path)
        if digest != record.get("sha256"):
            raise DownloadError(
                f"cached file {path} does not match the SHA-256 recorded when it was fetched "
                f"({digest[:12]} != {str(record.get('sha256'))[:12]}): delete it to fetch it again"
            )
    else:
        digest = sha256_of(path)
        if item.sha256 and digest != item.sha256:
            raise DownloadError(f"{path}: SHA-256 {digest[:12]} is not the published {item.sha256[:12]} of {item.name}")
        try:
            verify(path)
        except PipelineError as exc:
            raise DownloadError(f"{path} (placed by hand for {item.name}) is refused: {exc}") from None
        atomic_write_json(item.record, {"name": item.name, "sha256": digest, "size": stat.st_size, "url": None})
    _CHECKED.add(key)
    return path


def _download(item: Download) -> str:
    """Fetch into the ``.part`` file from the first URL that answers; -> the URL used."""
    item.dest.parent.mkdir(parents=True, exist_ok=True)
    failures = []
    for published in item.urls:
        url = source_url(published)
        try:
            _transfer_with_retries(item, url)
            return url
        except urllib.error.HTTPError as exc:
            _discard(item.part)
            failures.append(f"HTTP {exc.code} {exc.reason} from {url}")
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            _discard(item.part)
            reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
            failures.append(f"cannot reach {url} ({reason}; offline?)")
        except _Interrupted as exc:
            raise DownloadError(
                f"download of {item.name} from {url} broke off {ATTEMPTS} times ({exc}); run again to "
                f"resume from {item.part}, or {item.by_hand()}"
            ) from None
    raise DownloadError(f"cannot fetch {item.name}: {'; '.join(failures)}; {item.by_hand()}")


def _transfer_with_retries(item: Download, url: str) -> None:
    last: _Interrupted | None = None
    for attempt in range(ATTEMPTS):
        try:
            _transfer(item, url)
            return
        except _Interrupted as exc:
            last = exc
            log.info(
                "download of %s broke off (%s); resuming (attempt %d of %d)", item.name, exc, attempt + 2, ATTEMPTS
            )
    raise last  # type: ignore[misc]


def _transfer(item: Download, url: str) -> None:
    """One HTTP GET into the ``.part`` file, continuing what it holds with ``Range``."""
    have = item.part.stat().st_size if item.part.is_file() else 0
    request = urllib.request.Request(url, headers={"User-Agent": f"butd-caption/{__version__}"})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = urllib.request.urlopen(request, timeout=TIMEOUT)
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the .part file does not fit the file served: start over
            _discard(item.part)
            raise _Interrupted("the server refused the range of the partial file; starting over") from None
        raise
    with response:
        total = _length(response.headers.get("Content-Length"))
        if have and response.status == 206:
            start, full = _content_range(response.headers.get("Content-Range"))
            if start != have:
                _discard(item.part)
                raise _Interrupted(f"the server resumed at byte {start}, not {have}; starting over")
            total = full
            mode = "ab"
        else:
            have, mode = 0, "wb"  # a full answer (the server ignored Range or there was nothing to resume)
        if have:
            log.info("resuming %s at %d of %s bytes", item.name, have, total if total is not None else "?")
        else:
            log.info("fetching %s from %s", item.name, url)
        done = have
        with item.part.open(mode) as out, make_download_progress() as progress:
            task = progress.add_task(item.name, total=total, completed=have)
            try:
                while True:
                    block = response.read(CHUNK)
                    if not block:
                        break
                    out.write(block)
                    done += len(block)
                    progress.update(task, completed=done)
            except (OSError, http.client.HTTPException) as exc:  # reset, timeout, incomplete read
                raise _Interrupted(f"{type(exc).__name__} at {done} bytes") from None
            finally:
                out.flush()
                os.fsync(out.fileno())
        if total is not None and done < total:
            raise _Interrupted(f"{done} of {total} bytes arrived")


def _length(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _content_range(value: str | None) -> tuple[int, int | None]:
    """``bytes START-END/TOTAL`` -> (START, TOTAL or None)."""
    try:
        unit, spec = (value or "").split(" ", 1)
        span, full = spec.split("/", 1)
        return int(span.split("-", 1)[0]), (None if full.strip() == "*" else int(full))
    except ValueError:
        return -1, None


def _accept(item: Download, url: str, verify: Verify) -> None:
    """Check the complete ``.part`` file (size, published SHA-256, the strict reader), then give it its name."""
    part = item.part
    size = part.stat().st_size
    digest = sha256_of(part)
    problem = None
    if item.size is not None and size != item.size:
        problem = f"{size} bytes, not the published {item.size}"
    elif item.sha256 and digest != item.sha256:
        problem = f"SHA-256 {digest[:12]}, not the published {item.sha256[:12]}"
    else:
        try:
            verify(part)
        except PipelineError as exc:
            problem = str(exc)
        except Exception as exc:  # noqa: BLE001 - any reader failure on a foreign file is a refusal
            problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        _discard(part)
        line = " ".join(problem.split())
        raise DownloadError(f"{item.name} from {url} is refused and was deleted ({line}); {item.by_hand()}")
    os.replace(part, item.dest)
    atomic_write_json(item.record, {"name": item.name, "sha256": digest, "size": size, "url": url})
    stat = item.dest.stat()
    _CHECKED.add((str(item.dest), stat.st_size, stat.st_mtime_ns))
    log.info("fetched %s (%d bytes, sha256 %s) -> %s", item.name, size, digest[:12], item.dest)


def _discard(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
