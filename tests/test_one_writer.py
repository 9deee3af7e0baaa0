"""One writer per artifact: a second process on a stage folder, a caption output, a gallery, a pictures folder or
the converted-checkpoint cache is refused in one line naming the holder, and nothing committed is touched; a
lock left by a SIGKILLed process never blocks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.core.config import Config
from pipeline.core.errors import UsageError
from pipeline.core.stages import MANIFEST, RUNNING, run_stage

REPO = Path(__file__).resolve().parents[1]
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "BUTD_NO_PROGRESS": "1",
    "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
}


def holder(code: str, ready: Path) -> subprocess.Popen:
    """A child process that runs ``code`` (which must create ``ready`` once it holds the artifact) then sleeps."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code], cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 60
    while not ready.exists():
        assert proc.poll() is None, proc.stderr.read()[-2000:]
        assert time.time() < deadline, "the holder never got ready"
        time.sleep(0.05)
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def snapshot(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and not p.name.endswith(".lock")
    }


STAGE_HOLDER = """
import sys, time
from pathlib import Path
from pipeline.core.config import Config
from pipeline.core.stages import run_stage
run, ready = Path(sys.argv[1] if len(sys.argv) > 1 else {run!r}), Path({ready!r})
def work(d, cfg):
    (d / 'last.pt').write_bytes(b'live process state')
    ready.write_text('x')
    time.sleep(60)
    return {{}}
run_stage(run, 'train-san', Config({{'lr': 0.1}}), work)
"""


def test_second_process_on_a_stage_folder_is_refused_naming_the_holder(tmp_path: Path) -> None:
    run, ready = tmp_path / "run", tmp_path / "ready"
    proc = holder(STAGE_HOLDER.format(run=str(run), ready=str(ready)), ready)
    try:
        before = snapshot(run)
        calls = []
        for force in (False, True):  # --force must not clear a live stage either
            with pytest.raises(UsageError) as info:
                run_stage(run, "train-san", Config({"lr": 0.1}), lambda d, c: calls.append(d) or {}, force=force)
            msg = str(info.value)
            assert "\n" not in msg and f"pid {proc.pid}" in msg and "another process" in msg, msg
        assert calls == [] and snapshot(run) == before
        assert (run / "train-san" / RUNNING).exists() and not (run / "train-san" / MANIFEST).exists()
    finally:
        stop(proc)
    # the holder was SIGKILLed: its lock is gone with it, the next run resumes the interrupted stage
    result = run_stage(run, "train-san", Config({"lr": 0.1}), lambda d, c: {"seen": (d / "last.pt").read_text()})
    assert result.outputs == {"seen": "live process state"}


JOURNAL_HOLDER = """
import time
from pathlib import Path
from pipeline.captioning.journal import Journal
j = Journal({{'results': Path({out!r}), 'failures': Path({fail!r})}}, {{'model': 'x'}})
j.append({{'results': [{{'key': 'a.jpg', 'caption': 'a cat'}}], 'failures': []}})
Path({ready!r}).write_text('x')
time.sleep(60)
"""


def test_second_journal_on_one_output_is_refused_and_the_output_untouched(tmp_path: Path) -> None:
    from pipeline.captioning.journal import Journal

    out, fail, ready = tmp_path / "out.jsonl", tmp_path / "out.failures.jsonl", tmp_path / "ready"
    proc = holder(JOURNAL_HOLDER.format(out=str(out), fail=str(fail), ready=str(ready)), ready)
    try:
        before = snapshot(tmp_path)
        for force in (False, True):
            with pytest.raises(UsageError, match=f"pid {proc.pid}"):
                Journal({"results": out, "failures": fail}, {"model": "x"}, force=force)
        assert snapshot(tmp_path) == before and out.read_text().count("\n") == 1
    finally:
        stop(proc)
    j = Journal({"results": out, "failures": fail}, {"model": "x"})  # the killed holder's lock is gone
    assert j.done == {"a.jpg"}
    j.close()


def test_caption_refuses_a_second_writer_of_each_artifact(tmp_path: Path) -> None:
    """Another ``caption`` holds the output / gallery / pictures folder: the second is refused naming the holder,
    before any model is read (the model path here does not even exist); the CLI says it in one line, exit 2."""
    from PIL import Image

    from pipeline.captioning.run import caption_photos

    out, gallery, pics, ready = tmp_path / "out.jsonl", tmp_path / "gallery", tmp_path / "pics", tmp_path / "ready"
    locks = [out.with_name("out.jsonl.lock"), gallery / ".lock", pics / ".lock"]
    code = (
        f"import time; from pathlib import Path; from pipeline.core.locks import acquire_lock\n"
        f"ls = [acquire_lock(Path(p), 'x') for p in {[str(p) for p in locks]!r}]; "
        f"Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    )
    photo = tmp_path / "a.jpg"
    Image.new("RGB", (32, 32)).save(photo)
    proc = holder(code, ready)
    try:
        for kw in ({"output": out}, {"gallery": gallery}, {"visualize": pics}):
            with pytest.raises(UsageError, match=f"another process: pid {proc.pid}"):
                caption_photos([str(photo)], tmp_path / "no-model.pt", None, None, **kw)
        res = subprocess.run(
            [
                sys.executable,
                str(REPO / "cli.py"),
                "caption",
                str(photo),
                "--model",
                str(tmp_path / "no-model.pt"),
                "--output",
                str(out),
            ],
            cwd=REPO,
            env=ENV,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        stop(proc)
    lines = [x for x in res.stderr.splitlines() if x.startswith("error:")]
    assert res.returncode == 2 and len(lines) == 1, res.stderr
    assert f"pid {proc.pid}" in lines[0] and "another process" in lines[0] and "Traceback" not in res.stderr
    assert not out.exists() and not (gallery / "records.jsonl").exists()


def test_a_lock_left_by_a_killed_process_never_blocks(tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock, read_holder

    lock, ready = tmp_path / "x.lock", tmp_path / "ready"
    code = (
        f"import time; from pathlib import Path; from pipeline.core.locks import acquire_lock\n"
        f"l = acquire_lock(Path({str(lock)!r}), 'x'); Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    )
    proc = holder(code, ready)
    assert read_holder(lock)["pid"] == proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    t0 = time.monotonic()
    with acquire_lock(lock, "x") as held:
        assert held.held and read_holder(lock)["pid"] == os.getpid()
    assert time.monotonic() - t0 < 2.0
    assert read_holder(lock) == {}  # released: no stale name left behind


def test_the_converted_checkpoint_cache_has_one_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from release_helpers import write_aoanet

    import models.released as released

    folder = tmp_path / "aoa"
    folder.mkdir()
    write_aoanet(folder, ["a", "cat", "on", "the", "mat", "UNK"], d=32, d_in=16)
    monkeypatch.setenv("BUTD_CACHE", str(tmp_path / "cache"))
    weights = folder / "model-best.pth"
    kind, obj = released.load_release(weights)
    target = released._cache_target(
        kind, weights, released._sha256(weights), released.find_companion(weights, kind, None)
    )
    ready = tmp_path / "ready"
    code = (
        f"import time; from pathlib import Path; from pipeline.core.locks import acquire_lock\n"
        f"l = acquire_lock(Path({str(target) + '.lock'!r}), 'x'); Path({str(ready)!r}).write_text('x'); time.sleep(60)"
    )
    proc = holder(code, ready)
    try:
        with pytest.raises(UsageError, match=f"pid {proc.pid}"):
            released.ensure_native(weights)
        assert not target.exists()
    finally:
        stop(proc)
    assert released.ensure_native(weights) == target and target.is_file()


def test_holder_record_is_json_with_pid_and_host(tmp_path: Path) -> None:
    from pipeline.core.locks import acquire_lock

    with acquire_lock(tmp_path / "a.lock", "x"):
        rec = json.loads((tmp_path / "a.lock").read_text())
        assert rec["pid"] == os.getpid() and rec["host"]
