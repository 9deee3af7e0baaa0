"""SPICE through pycocoevalcap's bundled jar, only when its Stanford CoreNLP jars are already present.

pycocoevalcap's ``Spice()`` downloads CoreNLP 3.6.0 (~385 MB, no checksum, no timeout) at first use and
writes its temp and LMDB cache files into the package directory (salaniz/pycocoevalcap ``spice/spice.py``).
We never download: :func:`spice_available` only checks for the jars, and :func:`spice_scores` runs the same command
(``java -jar -Xmx8G spice-1.0.jar IN -cache DIR -out OUT -subset -silent``) with temp files in the system
temp dir, a private cache dir per run (no freezes from concurrent runs sharing one LMDB), a timeout, and
``--add-opens`` for Java >= 9 (SPICE's serializer touches ``java.lang`` internals that Java 16+ closes).
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
from collections.abc import Hashable, Sequence
from pathlib import Path

from pipeline.core.errors import PipelineError
from pipeline.metrics.java import JavaRun, java_major_version, spice_corenlp_jars, spice_jar

ADD_OPENS = ("--add-opens", "java.base/java.lang=ALL-UNNAMED", "--add-opens", "java.base/java.util=ALL-UNNAMED")


def spice_available() -> tuple[bool, str]:
    """(available, reason when not): checks the SPICE jar and the CoreNLP jars without downloading anything."""
    missing = [p for p in (spice_jar(), *spice_corenlp_jars()) if not p.is_file()]
    if not missing:
        return True, ""
    names = ", ".join(p.name for p in missing)
    return False, (
        f"not installed ({names} missing in {missing[0].parent}; nothing was "
        "downloaded; pycocoevalcap.spice.get_stanford_models.get_stanford_models() fetches them, ~385 MB)"
    )


def _float(value: object) -> float:
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def spice_scores(
    image_ids: Sequence[Hashable],
    hypotheses: Sequence[str],
    references: Sequence[Sequence[str]],
    run: JavaRun,
) -> tuple[float, list[float]]:
    """Mean SPICE F-score and per-image F-scores (NaN where SPICE gives none), like pycocoevalcap (which runs it
    with an 8G heap)."""
    jar = spice_jar()
    flags = ADD_OPENS if (java_major_version(run.java) or 8) >= 9 else ()
    with tempfile.TemporaryDirectory(prefix="butd-spice-") as tmp:
        in_file, out_file, cache = Path(tmp) / "in.json", Path(tmp) / "out.json", Path(tmp) / "cache"
        data = [{"image_id": i, "test": h, "refs": list(r)} for i, h, r in zip(image_ids, hypotheses, references)]
        in_file.write_text(json.dumps(data), encoding="utf-8")
        cmd = run.command(
            jar, str(in_file), "-cache", str(cache), "-out", str(out_file), "-subset", "-silent", flags=flags
        )
        try:
            proc = subprocess.run(cmd, cwd=jar.parent, capture_output=True, timeout=run.timeout_s)
        except subprocess.TimeoutExpired:
            raise PipelineError(f"SPICE timed out after {run.timeout_s:.0f} s") from None
        if proc.returncode != 0 or not out_file.is_file():
            err = proc.stderr.decode("utf-8", "replace").strip().splitlines()
            raise PipelineError(f"SPICE failed (exit {proc.returncode}): {err[-1] if err else 'no message'}")
        try:
            results = json.loads(out_file.read_text(encoding="utf-8"))
            by_id = {item["image_id"]: _float(item["scores"]["All"]["f"]) for item in results}
        except (ValueError, KeyError, TypeError) as exc:
            raise PipelineError(f"SPICE wrote an unreadable result file ({exc})") from None
    per_image = [by_id.get(i, math.nan) for i in image_ids]
    return (sum(per_image) / len(per_image) if per_image else math.nan), per_image
