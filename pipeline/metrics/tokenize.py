"""Caption tokenisation for evaluation: pycocoevalcap's PTB tokenizer (Java), or a flagged pure-Python fallback.

``ptb_tokenize`` runs exactly pycocoevalcap's command (``java -cp stanford-corenlp-3.4.1.jar
edu.stanford.nlp.process.PTBTokenizer -preserveLines -lowerCase FILE``) and removes the same punctuation
tokens, so scores are comparable with published numbers. Differences from pycocoevalcap's wrapper: the
temporary file lives in the system temp dir (not in site-packages), all captions go through one JVM, a
sentinel last line guards against a trailing empty caption being dropped, and the line count is checked.

``simple_tokenize`` (used only when Java is missing, and reported as such) lower-cases, splits off
punctuation and English clitics like PTB, and removes the same punctuation tokens. It agrees with PTB on
ordinary captions but is not guaranteed identical.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections.abc import Sequence

from pipeline.core.errors import PipelineError
from pipeline.metrics.java import JVM_FLAGS, ptb_jar

#: tokens pycocoevalcap removes after PTB tokenisation (``tokenizer/ptbtokenizer.py``)
PUNCTUATIONS = frozenset(
    ["''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-", ".", "?", "!", ",", ":", "-", "--", "...", ";"]
)
_SENTINEL = "zzsentinelzz"


def _clean(line: str) -> str:
    return " ".join(w for w in line.rstrip().split(" ") if w not in PUNCTUATIONS)


def ptb_tokenize(captions: Sequence[str], java: str, timeout_s: float = 600.0) -> list[str]:
    """PTB-tokenise ``captions`` (one line each), lower-cased, punctuation removed, space-joined."""
    if not captions:
        return []
    text = "\n".join(c.replace("\n", " ").replace("\r", " ") for c in captions) + "\n" + _SENTINEL
    fd, path = tempfile.mkstemp(prefix="butd-ptb-", suffix=".txt")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(text.encode("utf-8"))
        cmd = [
            java,
            *JVM_FLAGS,
            "-cp",
            str(ptb_jar()),
            "edu.stanford.nlp.process.PTBTokenizer",
            "-preserveLines",
            "-lowerCase",
            path,
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise PipelineError(f"PTB tokenizer timed out after {timeout_s:.0f} s") from None
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
        raise PipelineError(f"PTB tokenizer failed (exit {proc.returncode}): {err[-1] if err else 'no message'}")
    lines = proc.stdout.decode("utf-8", "replace").split("\n")
    if len(lines) < len(captions) + 1 or lines[len(captions)].strip() != _SENTINEL:
        raise PipelineError(f"PTB tokenizer returned {len(lines) - 1} lines for {len(captions)} captions")
    return [_clean(line) for line in lines[: len(captions)]]


_BRACKETS = {"(": "-lrb-", ")": "-rrb-", "[": "-lsb-", "]": "-rsb-", "{": "-lcb-", "}": "-rcb-"}
_ABBREVIATIONS = r"mr|mrs|ms|dr|st|jr|sr|vs|etc|inc|co|ltd|no"
_TOKEN_RE = re.compile(
    rf"""n't\b|'(?:s|re|ve|m|ll|d)\b|                  # clitics split off as PTB does
        (?:[^\W_]\.){{2,}}|(?:{_ABBREVIATIONS})\.|      # e.g. u.s. mr.
        \w+?(?=n't\b)|                                 # the word before n't
        \w+(?:[-./:]\w+)*|                            # words, t-shirt, 1.5, 5:30, dog/cat
        \.\.\.|--|[^\s\w]""",
    re.VERBOSE,
)


def simple_tokenize(captions: Sequence[str]) -> list[str]:
    """Pure-Python approximation of :func:`ptb_tokenize` (lower-case, PTB-like splits, same punctuation removed).

    Like PTB with ``-lowerCase``, brackets become ``-lrb-`` etc. and are *kept* (pycocoevalcap only removes
    the upper-case forms); double quotes become quote tokens and are removed.
    """
    out = []
    for caption in captions:
        tokens = [_BRACKETS.get(t, t) for t in _TOKEN_RE.findall(caption.lower())]
        out.append(" ".join(t for t in tokens if t not in PUNCTUATIONS and t != '"'))
    return out
