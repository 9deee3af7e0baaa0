"""The one resolver of file options: a path, a catalogue name or a hub id -> a checked local file.

``extract --weights``, ``caption``/``serve`` ``--model``, ``--weights`` and ``--vocab`` and ``fetch`` go
through :func:`resolve_file`. A catalogue name is fetched with its companions into
``$BUTD_CACHE/downloads/<folder>/`` (pipeline.core.download); ``hf:REPO[/FILE][@REVISION]`` is fetched from
``{HF_ENDPOINT or https://huggingface.co}/REPO/resolve/REVISION/FILE`` (FILE defaults to ``pytorch_model.bin``,
REVISION to ``main``) into ``$BUTD_CACHE/downloads/hf/``, with ``HF_HUB_OFFLINE=1`` keeping it to the cache.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.core.catalogue import CATALOGUE, CatalogueEntry, close_names, entry_with_companions
from pipeline.core.download import Download, downloads_dir, fetch, hub_endpoint, is_hub_url, truthy
from pipeline.core.errors import UsageError

HUB_PREFIX = "hf:"
HUB_DEFAULT_FILE = "pytorch_model.bin"
_REPO = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
#: one component of a hub file's path or of a revision (``refs/pr/1`` has three): no URL syntax, no separator
_COMPONENT = re.compile(r"^[^/\\?#%\x00-\x1f\x7f]+$")
#: the reader a hub file is checked with, by the option that names it
ROLE_KINDS = {"detector": "detector", "vocab": "m2-vocab", "captioner": "m2-weights", "labelmap": "labelmap"}


@dataclass(frozen=True)
class HubFile:
    """A file of a Hugging Face hub repository: ``hf:REPO[/FILE][@REVISION]``."""

    repo: str
    filename: str = HUB_DEFAULT_FILE
    revision: str = "main"

    @property
    def url(self) -> str:
        """Its published address (fetched through ``HF_ENDPOINT`` when set)."""
        return f"https://huggingface.co/{self.repo}/resolve/{self.revision}/{self.filename}"

    def download(self) -> Download:
        folder = downloads_dir() / "hf" / self.repo.replace("/", "--") / self.revision
        return Download(f"{HUB_PREFIX}{self.repo}/{self.filename}@{self.revision}", (self.url,), folder / self.filename)


def parse_hub_id(text: str) -> HubFile:
    """``hf:owner/name[/path/file][@revision]`` -> :class:`HubFile`; anything else is a one-line usage error."""
    body = text[len(HUB_PREFIX) :]
    body, _, revision = body.partition("@")
    parts = body.split("/")
    repo, filename = "/".join(parts[:2]), "/".join(parts[2:]) or HUB_DEFAULT_FILE
    if not _REPO.match(repo) or (_ and not revision):
        raise UsageError(f"{text}: a hub id looks like hf:OWNER/NAME[/FILE][@REVISION]")
    # the file and the revision become folders under the cache: each component a plain name, so that neither an
    # empty one (``OWNER/NAME//etc/x``, an absolute path) nor ``..`` can place the download outside it
    for what, value in (("file", filename), ("revision", revision or "main")):
        bad = [c for c in value.split("/") if c in ("", ".", "..") or not _COMPONENT.match(c)]
        if bad:
            raise UsageError(
                f"{text}: the hub {what} {value!r} has a component {bad[0]!r} that is not a plain name "
                "(empty, '.', '..', or one of \\ ? # %); a hub id looks like hf:OWNER/NAME[/FILE][@REVISION]"
            )
    return HubFile(repo, filename, revision or "main")


def entry_download(entry: CatalogueEntry) -> Download:
    return Download(
        entry.name, entry.urls, downloads_dir() / entry.folder / entry.filename, entry.sha256, entry.size, entry.manual
    )


def _offline(urls: tuple[str, ...]) -> bool:
    return bool(urls) and all(is_hub_url(u) for u in urls) and truthy(os.environ.get("HF_HUB_OFFLINE"))


def fetch_entry(entry: CatalogueEntry) -> Path:
    """``entry``'s checked file in the cache (downloaded on first use)."""
    return fetch(entry_download(entry), _verifier(entry.kind), offline=_offline(entry.urls))


def fetch_names(names: list[str]) -> list[Path]:
    """Each named entry's file, its companions fetched beside it."""
    out = []
    for name in names:
        entries = entry_with_companions(name)
        paths = [fetch_entry(e) for e in entries]
        out.append(paths[0])
    return out


def fetch_hub(text: str, role: str) -> Path:
    """A hub file: the catalogue entry with that address when there is one (and its companions), else the file
    alone, checked by the reader of the option's ``role``."""
    hub = parse_hub_id(text)
    for entry in CATALOGUE.values():
        if hub.url in entry.urls:
            return fetch_names([entry.name])[0]
    kind = "hf-config" if hub.filename.endswith((".yaml", ".yml")) else ROLE_KINDS[role]
    return fetch(hub.download(), _verifier(kind), offline=truthy(os.environ.get("HF_HUB_OFFLINE")))


def resolve_file(value: str | Path, what: str, role: str = "detector") -> str:
    """The local file an option names: an existing path as given; a catalogue name or ``hf:`` id fetched (or
    found in the cache); a path that does not exist is passed on for its reader to report. A bare word that is
    neither a file nor a catalogue name is a one-line :class:`UsageError` naming the close catalogue names.
    ``what`` names the option's file in that message ("weights file"), ``role`` picks the reader of a hub file
    (detector, captioner, vocab)."""
    text = str(value)
    if text.startswith(HUB_PREFIX):
        return str(fetch_hub(text, role))
    if Path(text).exists():
        return text
    if text in CATALOGUE:
        return str(fetch_names([text])[0])
    if "/" in text or os.sep in text:
        return text
    close = close_names(text)
    hint = f" (close: {', '.join(close)})" if close else ""
    raise UsageError(
        f"{what} not found: {text!r} is neither a file nor a catalogue name{hint}; "
        f"`cli fetch --list` lists the names, {hub_endpoint()} ids are written hf:OWNER/NAME"
    )


def _verifier(kind: str) -> Callable[[Path], None]:
    """The strict reader that checks a download of ``kind`` (:mod:`pipeline.hub.verify`)."""
    # the readers import h5py and the detector and CLIP stacks: loaded when a file is fetched, not for --help
    from pipeline.hub.verify import verifier  # noqa: PLC0415 -- keeps cli --help fast

    return verifier(kind)
