"""Finding Java and the jars pycocoevalcap bundles, without triggering any download.

The Java metrics (PTB tokenizer, METEOR, SPICE) are run by our own thin runners on pycocoevalcap's jars,
with the same command-line arguments as pycocoevalcap, but with temporary files outside the package
directory (which may be read-only), a forced English locale (METEOR's "could not convert string to
float" failure with decimal commas, salaniz/pycocoevalcap#15), timeouts, and clear one-line errors.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from pipeline.core.errors import PipelineError

#: JVM flags given to every Java metric: English number formatting and UTF-8 I/O
JVM_FLAGS = ("-Duser.language=en", "-Duser.country=US", "-Dfile.encoding=UTF-8", "-Dsun.stdout.encoding=UTF-8")


@dataclass(frozen=True)
class JavaRun:
    """How a Java metric is run: the ``java`` executable, a wall-clock limit, the JVM heap (``-Xmx``)."""

    java: str
    timeout_s: float
    max_memory: str

    def command(self, jar: Path, *args: str, flags: tuple[str, ...] = ()) -> list[str]:
        """``java <JVM_FLAGS> <flags> -jar -Xmx<max_memory> <jar name> <args>``, run from the jar's folder (the
        argument order of pycocoevalcap's wrappers)."""
        return [self.java, *JVM_FLAGS, *flags, "-jar", f"-Xmx{self.max_memory}", jar.name, *args]


class JavaMissing(PipelineError):
    """No usable ``java`` executable."""


def pycocoevalcap_dir() -> Path:
    """The installed pycocoevalcap package directory (holds the jars)."""
    spec = importlib.util.find_spec("pycocoevalcap")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError("pycocoevalcap is not installed (pip install pycocoevalcap)")
    return Path(list(spec.submodule_search_locations)[0]).resolve()


def ptb_jar() -> Path:
    return pycocoevalcap_dir() / "tokenizer" / "stanford-corenlp-3.4.1.jar"


def meteor_jar() -> Path:
    return pycocoevalcap_dir() / "meteor" / "meteor-1.5.jar"


def spice_jar() -> Path:
    return pycocoevalcap_dir() / "spice" / "spice-1.0.jar"


def spice_corenlp_jars() -> tuple[Path, Path]:
    """The Stanford CoreNLP 3.6.0 jars SPICE needs; pycocoevalcap downloads them (~385 MB) at first use."""
    lib = pycocoevalcap_dir() / "spice" / "lib"
    return lib / "stanford-corenlp-3.6.0.jar", lib / "stanford-corenlp-3.6.0-models.jar"


def find_java(java: str | None = None) -> str:
    """Path of the Java executable: ``java`` (a command or path), else ``$JAVA_HOME/bin/java``, else ``java`` on PATH.

    Raises :class:`JavaMissing` with one line saying what was looked for.
    """
    candidates: list[str] = []
    if java:
        candidates.append(java)
    else:
        home = os.environ.get("JAVA_HOME")
        if home:
            candidates.append(str(Path(home) / "bin" / "java"))
        candidates.append("java")
    for cand in candidates:
        found = shutil.which(cand)
        if found:
            return found
    raise JavaMissing(
        f"Java not found (looked for {', '.join(candidates)}); install a JRE (e.g. openjdk-17-jre-headless) or set "
        "evaluate.java"
    )


@lru_cache(maxsize=8)
def java_major_version(java: str) -> int | None:
    """Major version of ``java`` (8 for "1.8.0_x", 17 for "17.0.x"), or None if it cannot be run."""
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if not match:
        return None
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major
