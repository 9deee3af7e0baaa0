"""The project's documentation stands alone: no citation of notes outside the repository, no dangling doc links.

* No tracked file outside ``tests/`` and ``.ci/`` (the test harness, which may read fixtures beside the checkout)
  names a path outside the repository (``../shared``, ``shared/reference``), and no file at all cites a
  section of a notes file (``models.md §3.4``, ``peers.md``) or a notes-only source key (``YOO-P``).
* Every ``docs/NAME.md`` (optionally ``#anchor``) named in code, configs or docs, and every relative link
  ``[text](NAME.md#anchor)`` inside ``docs/``, points to an existing file and, with an anchor, to one of its
  headings (GitHub's heading slugs).
* Every repository path (``models/captioners/m2.py``, ``configs/...``) that README.md or a docs page names exists.
* docs/models.md has a section per registered captioner and names every key of its YAML ``model:`` section.

Each checker is first run on planted problems, so the repository checks can fail.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

#: a path outside the checkout (only the test harness may name one)
OUTSIDE_PATH = re.compile(r"\.\./shared\b|\bshared/reference\b")
#: citations of notes that are not part of the repository
NOTES_CITATION = re.compile(
    r"\.md`{0,2}\s*§"  # "models.md §1.4", "``extractor.md`` §6.2"
    r"|\bpeers\.md\b"
    r"|\b(?:YOO|BAN|NGSAN)-P\b"  # source keys of the notes
)
#: outside docs/, the project's pages are named with their folder (``docs/models.md``); a bare name is the notes'
BARE_NOTES_NAME = re.compile(r"(?<![\w/.-])(?:models|extractor)\.md\b")
#: "docs/NAME.md" or "docs/NAME.md#anchor" anywhere in a file
DOC_REF = re.compile(r"\bdocs/([A-Za-z0-9_.-]+\.md)(?:#([A-Za-z0-9_-]+))?")
#: a relative markdown link inside docs/: "](NAME.md)" or "](NAME.md#anchor)" (also "](#anchor)")
MD_LINK = re.compile(r"\]\((?!https?:|/)([A-Za-z0-9_.-]+\.md)?(?:#([A-Za-z0-9_-]+))?\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def tracked_files() -> list[str]:
    """Repository-relative paths of the tracked text files (``git ls-files``; a walk when git is absent)."""
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
        names = [n for n in out.splitlines() if n]
    except (OSError, subprocess.CalledProcessError):
        skip = {
            ".git",
            ".venv",
            "runs",
            "__pycache__",
            ".pytest_cache",
            "shared",
            ".whl",
            ".gl",
        }  # shared: fixtures copied in
        names = [
            p.relative_to(REPO).as_posix()
            for p in REPO.rglob("*")
            if p.is_file() and not skip & set(p.relative_to(REPO).parts)
        ]
    return [n for n in names if (REPO / n).is_file()]


def read_text(rel: str) -> str | None:
    """The file's text, or None for binary files."""
    data = (REPO / rel).read_bytes()
    if b"\0" in data:
        return None
    return data.decode("utf-8", errors="replace")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    """Anchors of every heading of a markdown page (code blocks excluded; repeated headings get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def violations(rel: str, text: str) -> list[str]:
    """``file:line: match`` for every forbidden path or notes citation in ``text``."""
    patterns = [NOTES_CITATION]
    if not rel.startswith(("tests/", ".ci/")):
        patterns.append(OUTSIDE_PATH)
    if not rel.startswith("docs/"):
        patterns.append(BARE_NOTES_NAME)
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern in patterns:
            for m in pattern.finditer(line):
                found.append(f"{rel}:{lineno}: {m.group(0)!r} in {line.strip()[:100]!r}")
    return found


def doc_references(rel: str, text: str) -> list[tuple[int, str, str | None]]:
    """``(line, page, anchor)`` of every docs page referenced by ``text`` (page relative to ``docs/``)."""
    refs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in DOC_REF.finditer(line):
            refs.append((lineno, m.group(1), m.group(2)))
        if rel.startswith("docs/") and rel.endswith(".md"):
            for m in MD_LINK.finditer(line):
                page = m.group(1) or Path(rel).name
                if m.group(1) is None and m.group(2) is None:
                    continue
                refs.append((lineno, page, m.group(2)))
    return refs


def broken_references(files: dict[str, str]) -> list[str]:
    """References to a missing docs page or to an anchor that is not a heading of the page."""
    docs = {Path(rel).name: text for rel, text in files.items() if rel.startswith("docs/") and rel.count("/") == 1}
    cache: dict[str, set[str]] = {}
    broken = []
    for rel, text in files.items():
        for lineno, page, anchor in doc_references(rel, text):
            if page not in docs:
                broken.append(f"{rel}:{lineno}: docs/{page} does not exist")
                continue
            if anchor is not None:
                names = cache.setdefault(page, anchors(docs[page]))
                if anchor not in names:
                    broken.append(f"{rel}:{lineno}: docs/{page}#{anchor} is not a heading of docs/{page}")
    return broken


@pytest.fixture(scope="module")
def repo_files() -> dict[str, str]:
    files = {}
    for rel in tracked_files():
        if rel == SELF:
            continue
        text = read_text(rel)
        if text is not None:
            files[rel] = text
    assert "docs/architecture.md" in files and "models/captioners/m2.py" in files, (
        "the repository's files were not found"
    )
    return files


# --- the checkers catch what they must (so that the repository checks below can fail) -------------------------
def test_checkers_find_planted_problems() -> None:
    planted = (
        "see models.md §1.4\nFacts: ``shared/reference/extractor.md`` §3\n(peers.md A.2.6)\n"
        "load ../shared/data/x\nYOO-P §3.3\n"
    )
    found = violations("models/x.py", planted)
    assert [f.split(":")[1] for f in found] == ["1", "1", "2", "2", "3", "4", "5"], found
    # the harness may read fixtures beside the checkout, never cite notes
    assert [f.split(":")[1] for f in violations("tests/test_x.py", planted)] == ["1", "1", "2", "3", "5"]
    assert violations("models/x.py", "see docs/models.md#m2 and docs/extractor.md\n") == []
    assert violations("docs/x.md", "[models.md](models.md#m2)\n") == []
    assert len(violations("docs/x.md", "models.md §1.4\n")) == 1

    pages = {
        "docs/a.md": (
            "# Title\n\n## m2: encoder\n\n```\n# not a heading\n```\n[b](b.md#x) [self](#title) [gone](c.md)\n"
        ),
        "docs/b.md": "## X\n",
        "models/y.py": '"""docs/a.md#m2-encoder docs/a.md#not-a-heading docs/zzz.md docs/b.md"""\n',
    }
    assert sorted(b.split(": ", 1)[1] for b in broken_references(pages)) == [
        "docs/a.md#not-a-heading is not a heading of docs/a.md",
        "docs/c.md does not exist",
        "docs/zzz.md does not exist",
    ]


def test_slug_matches_github() -> None:
    assert slug("m2: encoder") == "m2-encoder"
    assert slug("SCST and CIDEr-D") == "scst-and-cider-d"
    assert slug("gsan: geometry feature") == "gsan-geometry-feature"
    assert slug("Run directories and stage manifests") == "run-directories-and-stage-manifests"
    assert slug("`aoa`: attention on attention") == "aoa-attention-on-attention"


# --- the repository -------------------------------------------------------------------------------------------
def test_no_paths_outside_the_repository_nor_notes_citations(repo_files: dict[str, str]) -> None:
    found = [v for rel, text in sorted(repo_files.items()) for v in violations(rel, text)]
    assert found == [], "cite papers, public repositories or docs/ instead:\n" + "\n".join(found)


def test_every_referenced_doc_and_anchor_exists(repo_files: dict[str, str]) -> None:
    broken = broken_references(repo_files)
    assert broken == [], "\n".join(broken)


def test_model_and_extractor_docs_cover_every_captioner_and_switch(repo_files: dict[str, str]) -> None:
    """docs/models.md has a section per registered captioner and names every key of its YAML ``model:``."""
    import models
    from pipeline.core.config import CONFIG_DIR, load_yaml_with_bases

    text = repo_files["docs/models.md"]
    names = anchors(text)
    for name in models.available_captioners():
        assert name in names, f"docs/models.md has no '## {name}' section"
        keys = load_yaml_with_bases(CONFIG_DIR / "models" / f"{name}.yaml")["model"]
        missing = [k for k in keys if f"`{k}`" not in text]
        assert missing == [], f"docs/models.md does not document the {name} switches {missing}"
    assert {"weights-layouts", "layout-detection", "feature-store", "roi-head"} <= anchors(
        repo_files["docs/extractor.md"]
    )


#: a repository path in prose: a known top-level folder, then a file name (templates like <name> are skipped)
REPO_PATH = re.compile(
    r"(?<![\w/.<-])((?:pipeline|extractors|models|bench|configs|tests|docs)/[A-Za-z0-9_./-]*[A-Za-z0-9_])(?![/<\w])"
)


#: file names that stand for the reader's own file, not one of the repository's
PLACEHOLDERS = ("name", "NAME", "toy")


#: the project's code packages: a path into them must exist; under configs/, tests/, docs/, bench/ a path whose
#: folder this repository does not have is another project's file (``configs/caffe/...`` of MILVLG)
CODE_PACKAGES = ("pipeline", "extractors", "models")


def missing_paths(rel: str, text: str, root: Path) -> list[str]:
    """Repository paths named in a page that do not exist under ``root``."""
    out = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for m in REPO_PATH.finditer(line):
            path = m.group(1).rstrip(".")
            if Path(path).stem in PLACEHOLDERS:  # configs/models/NAME.yaml, extending.md's toy example
                continue
            ours = path.split("/")[0] in CODE_PACKAGES or (root / path).parent.is_dir()
            if ours and not (root / path).exists():
                out.append(f"{rel}:{lineno}: {path} does not exist")
    return out


def test_paths_named_in_the_docs_exist(repo_files: dict[str, str], tmp_path: Path) -> None:
    """Every ``pipeline/...``, ``models/...``, ``configs/...`` path that README.md or docs/ names is in the
    repository."""
    (tmp_path / "models").mkdir()
    (tmp_path / "configs" / "models").mkdir(parents=True)
    (tmp_path / "models" / "m2.py").write_text("")
    planted = (
        "see `models/m2.py`, `models/nope.py`, configs/models/<name>.yaml, configs/models/NAME.yaml,\n"
        "pipeline/captions/prepare.py, configs/models/gone.yaml and MILVLG's configs/caffe/test.yaml\n"
    )
    assert missing_paths("x.md", planted, tmp_path) == [
        "x.md:1: models/nope.py does not exist",
        "x.md:2: pipeline/captions/prepare.py does not exist",
        "x.md:2: configs/models/gone.yaml does not exist",
    ]
    pages = {
        rel: text
        for rel, text in repo_files.items()
        if rel == "README.md" or (rel.startswith("docs/") and rel.endswith(".md"))
    }
    missing = [m for rel, text in sorted(pages.items()) for m in missing_paths(rel, text, REPO)]
    assert missing == [], "\n".join(missing)
