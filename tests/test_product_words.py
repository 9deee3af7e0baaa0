"""The project speaks of the product only: no doc, help text, comment or docstring narrates how it was made.

The scan reads every *.py, *.md, *.yaml, *.yml, *.toml, *.html and *.txt file of the checkout (tracked or not,
git's ignored files and .git excluded) and reports each line that tells the history of the code instead of what
it does: the periods of work and the people behind the code, numbered tickets, comparisons with a former state
of the code ("before/after this change", "no longer needed"); the pattern list is HISTORY below. A comment says what
the code does and why; git keeps the history.

The patterns are narrow on purpose: "a lock whose holder no longer runs", ``scope="session"`` and "draining
starts now" describe the product and pass. Each check first runs on planted text, so it can fail.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SELF = Path(__file__).resolve().relative_to(REPO).as_posix()

#: the file kinds that hold prose: code comments and docstrings, docs, configs, help pages
SCANNED_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".toml", ".html", ".txt")
#: folders a walk skips where git cannot list the files (a copy without .git): environments, runs, caches
WALK_SKIP = {".git", ".venv", "venv", "runs", "__pycache__", ".pytest_cache", "shared", "build", "dist"}

#: phrases that narrate the development of the code rather than describe it
HISTORY = [
    re.compile(r"\b(this|last|next|previous|first|second|third|fourth|fifth|sixth|earlier|later) sessions?\b", re.I),
    re.compile(r"\bengineers?\b", re.I),
    re.compile(r"\breviewers?\b", re.I),
    re.compile(r"\bissues? \d+", re.I),  # the project's own tracker; an upstream one is cited as owner/repo#N
    re.compile(r"\bwhile this was (written|developed|made)\b", re.I),
    re.compile(r"\bas before\b", re.I),
    re.compile(r"\bthe old way\b", re.I),
    re.compile(r"\b(before|after|since|until) this change\b", re.I),
    re.compile(r"\bno longer (supported|used|uses|needed|required|necessary|exists|accepted|applies)\b", re.I),
    re.compile(r"\bno longer the default\b", re.I),
    re.compile(r"\bthe (previous|former|old) (code|loops?|version|implementation)\b", re.I),
    re.compile(r"\b(is|are) now (the default|refused|supported|used)\b", re.I),
]


def narrations(rel: str, text: str) -> list[str]:
    """``file:line: 'match' in 'line'`` for every history phrase in ``text``."""
    found = []
    for lineno, line in enumerate(text.splitlines(), 1):
        for pattern in HISTORY:
            for m in pattern.finditer(line):
                found.append(f"{rel}:{lineno}: {m.group(0)!r} in {line.strip()[:110]!r}")
    return found


def scanned_files(root: Path) -> list[str]:
    """Paths (relative to ``root``) of the files the scan reads: git's tracked and untracked-but-not-ignored
    files, or, outside a git checkout, a walk that skips .git and the usual ignored folders."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        git_top = ["git", "rev-parse", "--show-toplevel"]
        top = subprocess.run(git_top, cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        if Path(top).resolve() != root.resolve():
            raise subprocess.CalledProcessError(1, "git")  # root lies inside another checkout: walk it instead
        names = [n for n in out.split("\0") if n]
    except (OSError, subprocess.CalledProcessError):
        names = []
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in WALK_SKIP]
            names += [(Path(folder) / f).relative_to(root).as_posix() for f in files]
    keep = (n for n in names if n.endswith(SCANNED_SUFFIXES) and ".git" not in Path(n).parts)
    return sorted(n for n in keep if (root / n).is_file())


def test_history_phrases_are_found_and_product_phrases_pass() -> None:
    planted = "\n".join(
        [
            "The fifth session re-measured the demo.",  # 1
            "# six other engineers' jobs ran beside it",  # 2
            "A reviewer asked for this; see issue 27.",  # 3
            "(not measured: no download was possible while this was written)",  # 4
            "Keys are stored as before.",  # 5
            "# the greedy baseline in its own loop (the old way)",  # 6
            "Before this change the loader copied the table.",  # 7
            "The num_threads key is no longer supported.",  # 8
            "Bitwise those of the previous loops.",  # 9
            "float32 is now the default.",  # 10
        ]
    )
    hits = narrations("x.md", planted)
    assert [int(h.split(":")[1]) for h in hits] == [1, 2, 3, 3, 4, 5, 6, 7, 8, 9, 10], hits  # line 3 holds two
    product = "\n".join(
        [
            "a lock whose recorded holder on this host no longer runs is retried",
            "gone = ' (no longer running; a process it started still holds the lock)'",
            "Whether torch is already imported (then OMP_WAIT_POLICY can no longer take effect).",
            '@pytest.fixture(scope="session")',
            "self.session = self.send('Target.attachToTarget')",
            "SIGTERM/SIGINT: draining starts now",
            "METEOR's decimal-comma failure (salaniz/pycocoevalcap#15); transformers issues #8333, #11042",
            "the first 50 regions; the second stage trains with SCST",
        ]
    )
    assert narrations("y.py", product) == []


def test_the_file_selection_reads_every_prose_kind_and_skips_git(tmp_path: Path) -> None:
    names = ["a.py", "b.md", "c.yaml", "d.toml", "e.html", "f.txt", "g.yml", "sub/h.py"]
    for name in [*names, "i.json", "j.png", ".git/k.md", ".venv/l.py"]:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("as before\n")
    assert scanned_files(tmp_path) == names
    found = [h for rel in scanned_files(tmp_path) for h in narrations(rel, (tmp_path / rel).read_text())]
    assert len(found) == 8


def test_the_repository_speaks_of_the_product_only() -> None:
    files = [rel for rel in scanned_files(REPO) if rel != SELF]
    assert len(files) > 100 and "README.md" in files and "cli.py" in files  # the scan does see the tree
    found = [h for rel in files for h in narrations(rel, (REPO / rel).read_text(encoding="utf-8", errors="replace"))]
    assert found == [], "history narrated instead of the product (say what the code does):\n" + "\n".join(found)
