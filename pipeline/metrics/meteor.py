"""METEOR 1.5 through pycocoevalcap's bundled jar, with the same protocol and arguments as its wrapper.

pycocoevalcap (``meteor/meteor.py``) starts ``java -jar -Xmx2G meteor-1.5.jar - - -stdio -l en -norm``,
sends one ``SCORE ||| ref_1 ||| ... ||| ref_n ||| hypothesis`` line per image (hypothesis with ``|||`` removed
and double spaces collapsed), reads one statistics line for each, then sends ``EVAL ||| stats_1 ||| ...``
and reads one score per image followed by the corpus score. We do the same, but write from a thread
while reading (no per-line round trip), force an English locale, give the process a wall-clock timeout,
always kill it, and turn a dead or garbled process into one clear error instead of
``could not convert string to float: ''``.
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Sequence

from pipeline.core.errors import PipelineError
from pipeline.metrics.java import JavaRun, meteor_jar


def _hypothesis(text: str) -> str:
    return text.replace("|||", "").replace("  ", " ")


def meteor_scores(
    hypotheses: Sequence[str], references: Sequence[Sequence[str]], run: JavaRun
) -> tuple[float, list[float]]:
    """Corpus METEOR and per-image scores for tokenised ``hypotheses`` against their ``references`` (pycocoevalcap
    runs it with a 2G heap)."""
    if len(hypotheses) != len(references):
        raise ValueError(f"{len(hypotheses)} hypotheses but {len(references)} reference lists")
    if not hypotheses:
        raise ValueError("METEOR needs at least one hypothesis")
    jar = meteor_jar()
    cmd = run.command(jar, "-", "-", "-stdio", "-l", "en", "-norm")
    proc = subprocess.Popen(cmd, cwd=jar.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    timer = threading.Timer(run.timeout_s, proc.kill)
    timer.start()
    stderr_chunks: list[bytes] = []
    drain = threading.Thread(target=lambda: stderr_chunks.append(proc.stderr.read()), daemon=True)  # type: ignore[union-attr]
    drain.start()
    write_error: list[BaseException] = []

    def write_scores() -> None:
        try:
            for hyp, refs in zip(hypotheses, references):
                line = " ||| ".join(("SCORE", " ||| ".join(r.replace("|||", "") for r in refs), _hypothesis(hyp)))
                proc.stdin.write((line + "\n").encode("utf-8"))  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, OSError) as exc:
            write_error.append(exc)

    def read_line() -> str:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            proc.kill()
            drain.join(timeout=5)
            err = b"".join(stderr_chunks).decode("utf-8", "replace").strip().splitlines()
            why = "timed out" if not timer.is_alive() else f"exited ({err[-1] if err else 'no message'})"
            raise PipelineError(f"METEOR {why}; the other metrics are unaffected (set evaluate.metrics to skip METEOR)")
        return line.decode("utf-8", "replace").strip()

    try:
        writer = threading.Thread(target=write_scores, daemon=True)
        writer.start()
        stats = [read_line() for _ in hypotheses]
        writer.join()
        proc.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode("utf-8"))  # type: ignore[union-attr]
        proc.stdin.flush()  # type: ignore[union-attr]
        try:
            per_image = [float(read_line()) for _ in hypotheses]
            score = float(read_line())
        except ValueError as exc:
            raise PipelineError(f"METEOR returned a non-numeric score ({exc})") from None
    except BrokenPipeError:
        raise PipelineError("METEOR process closed its input unexpectedly") from None
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
        drain.join(timeout=5)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            if stream is not None:
                try:
                    stream.close()
                except OSError:  # unflushed input to a dead process
                    pass
    return score, per_image
