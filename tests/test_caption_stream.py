"""`cli caption` streams and resumes: a SIGKILL mid-run loses nothing and a rerun captions each photo once;
memory stays bounded by the batch; odd images and odd file names never cost the run; --file-list; COCO
results; a run folder with several captioners picks the best by validation CIDEr-D."""

from __future__ import annotations

import gc
import json
import os
import re
import signal
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from caption_helpers import REPO, SMALL, cli_env, small_photos, tiny_detector
from forked_cli import ForkedChild, ForkedCli
from PIL import Image
from typer.testing import CliRunner

from cli import app
from pipeline.captioning.choose import validation_score
from pipeline.core import threads as thread_policy
from pipeline.core.keys import key_from_text

#: the tiny detector with 20 proposals per photo pooled to 7x7 (the tiny spec's are 60 at 14x14): its region
#: features stay 128-d, as the captioners expect; these tests are about streaming, resuming and memory, which
#: do not depend on how many regions a photo has
STREAM_DETECTOR = {"post_nms_topk": 20, "pooler_resolution": 7}


@pytest.fixture(scope="module")
def env(tmp_path_factory, tiny_captioners: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("stream")
    run = tiny_captioners
    weights = tiny_detector(root / "tiny.pth", **STREAM_DETECTOR)
    return {"root": root, "run": run, "weights": weights, "ckpt": run / "train-a" / "best.pt"}


def caption(env: dict[str, Path], *args: str, model: str | None = None):
    return CliRunner().invoke(
        app,
        ["caption", *args, "--model", model or str(env["ckpt"]), "--weights", str(env["weights"]), *SMALL],
        env={"COLUMNS": "600"},
    )  # wide enough that a long temp path (xdist basetemp) never folds inside a name


#: the most the peak RSS of `caption` on 400 small photos may exceed the peak on 40 (see the test below)
RSS_BOUND_MB = 40


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().decode("utf-8").splitlines()]


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (from /proc; none where there is no /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (name)": state, ppid, ...
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (a zombie has exited)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_kill_after_about_20_then_rerun_captions_each_photo_once(
    env: dict[str, Path], tmp_path: Path, forked_cli: ForkedCli
) -> None:
    """`cli.py caption` in child processes (forked from a pre-imported interpreter, tests/forked_cli.py): the first
    is SIGKILLed after about 20 of 40 rows, the second captions the rest, the third finds nothing to do."""
    photos = small_photos(tmp_path / "photos", 40, size=(200, 150))
    out = tmp_path / "out.jsonl"
    args = [
        "caption",
        str(tmp_path / "photos"),
        "--model",
        str(env["ckpt"]),
        "--weights",
        str(env["weights"]),
        "--output",
        str(out),
        *SMALL,
        "--set",
        "caption.batch_size=1",
        "--visualize",
        str(tmp_path / "pics"),
    ]
    runs = iter(range(3))

    def start() -> ForkedChild:
        n = next(runs)
        return forked_cli.start(
            [str(REPO / "cli.py"), *args], stdout=tmp_path / f"{n}.out", stderr=tmp_path / f"{n}.err", env=cli_env()
        )

    proc = start()
    seen, deadline, workers = 0, time.monotonic() + 300, []
    while proc.poll() is None and time.monotonic() < deadline:
        if out.exists():
            rows = read_jsonl(out)  # valid JSON lines at every moment, never a torn line
            seen = len(rows)
            if seen >= 20:
                workers = child_pids(proc.pid)  # the photo-decoding DataLoader workers (caption.num_workers)
                proc.kill()
                break
        time.sleep(0.02)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, (
        f"the run ended before it was killed ({seen} rows): {proc.output()[1][-2000:]}"
    )
    killed = read_jsonl(out)
    assert 20 <= len(killed) < 40
    if Path("/proc/self/stat").exists():  # Linux: the workers end with the killed run (none left behind)
        assert len(workers) == thread_policy.plan(workers=2, threads=1).workers  # the child's policy: one thread each
        deadline = time.monotonic() + 30  # a worker notices its parent's death within 5 s (torch's status check)
        while any(map(alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(alive, workers)), "a photo-decoding worker outlived the killed caption"
    proc = start()
    proc.wait(timeout=600)
    err = proc.output()[1]
    assert proc.returncode == 0, err[-2000:]
    rows = read_jsonl(out)
    keys = [r["key"] for r in rows]
    assert sorted(keys) == sorted(p.name for p in photos) and len(set(keys)) == 40  # every photo exactly once
    assert rows[: len(killed)] == killed and all("caption" in r for r in rows)
    done = int(re.search(r"(\d+) of 40 photos are already captioned", err).group(1))
    assert done in (len(killed) - 1, len(killed))  # a row written after the last commit is redone (identically)
    assert len(list((tmp_path / "pics").glob("*.png"))) == 40
    again = start()
    assert again.wait(timeout=600) == 0 and read_jsonl(out) == rows, again.output()[1][-2000:]  # a third does nothing


def traced_peak_mb(env: dict[str, Path], *args: str) -> float:
    """Peak of the Python and NumPy heap (tracemalloc) while `caption` runs in this process."""
    tracemalloc.start()
    try:
        res = caption(env, *args)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert res.exit_code == 0, res.output
    return peak / 2**20


def test_memory_is_bounded_by_the_batch(env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While 400 photos are captioned (batches of 2), at most one batch of results holds regions (features, boxes) at
    any time (before streaming, every result was kept to the end), and the traced heap peak with 400 photos
    exceeds the peak with 40 by less than 3 MB. (Region features are torch-allocated, so tracemalloc cannot
    see them: hence the count of live results.)"""
    from pipeline.captioning.engine import CaptionResult, PhotoCaptioner

    live: list[int] = []
    batches = PhotoCaptioner.caption_batches

    def counting(self, *args, **kw):
        for n, batch in enumerate(batches(self, *args, **kw)):
            yield batch
            if n % 8 == 7:  # every 8th batch (a full scan of what the runs allocated)
                gc.collect()
                live.append(sum(type(o) is CaptionResult and o.regions is not None for o in gc.get_objects()))

    small_photos(tmp_path / "warm", 2, size=(64, 48), seed=2)
    small_photos(tmp_path / "few", 40, size=(64, 48))
    small_photos(tmp_path / "many", 400, size=(64, 48), seed=1)
    caption(env, str(tmp_path / "warm"), "--quiet")  # imports and first-call caches before measuring
    fast = [
        "--quiet",
        "--beam-size",
        "1",
        "--num-workers",
        "0",
    ]  # batches of 2 (SMALL); decoded in this process, where tracemalloc sees it
    # The objects of the session so far (its cyclic garbage collected first) go to the permanent generation: the
    # collections during both runs, and the counts' gc.collect and gc.get_objects, go over the objects allocated
    # since, every CaptionResult of the runs among them, not over the whole heap of the test process.
    gc.collect()
    gc.freeze()
    try:
        few = traced_peak_mb(env, str(tmp_path / "few"), "--output", str(tmp_path / "few.jsonl"), *fast)
        monkeypatch.setattr(PhotoCaptioner, "caption_batches", counting)
        many = traced_peak_mb(env, str(tmp_path / "many"), "--output", str(tmp_path / "many.jsonl"), *fast)
    finally:
        gc.unfreeze()
    print(
        f"traced heap peak: {few:.1f} MB with 40 photos, {many:.1f} MB with 400; "
        f"live results with regions: max {max(live)}"
    )
    assert len(read_jsonl(tmp_path / "many.jsonl")) == 400 and len(live) == 25
    assert max(live) <= 2, f"{max(live)} results with regions alive after a batch (batch size 2)"
    assert many - few < 3, f"traced heap peak {many:.1f} MB for 400 photos vs {few:.1f} MB for 40"


#: `cli.py caption` in a child process that reports its peak resident set size (VmHWM) when the command ends, before
#: the interpreter's teardown (which alone adds ~100 MB to the process's lifetime peak with torch loaded, the same
#: for 40 photos as for 400); with KEEP=1 it keeps every result with its regions, image and word relevance to
#: the end, as `caption` did before it streamed (the counterfactual that shows the bound can fail)
RSS_CHILD = """
import copy, os, sys
if os.environ["KEEP"] == "1":
    from pipeline.captioning.engine import PhotoCaptioner
    kept, batches = [], PhotoCaptioner.caption_batches
    def keeping(self, *args, **kw):
        for batch in batches(self, *args, **kw):
            kept.extend(copy.deepcopy(batch))
            yield batch
    PhotoCaptioner.caption_batches = keeping
from cli import app
try:
    app(sys.argv[1:], prog_name="cli.py")
finally:
    with open("/proc/self/status") as fh:
        sys.stderr.write("peak-rss-kb " + fh.read().split("VmHWM:")[1].split()[0] + "\\n")
"""


def peak_rss_mb(forked_cli: ForkedCli, tmp_path: Path, *args: str, keep_everything: bool = False) -> float:
    """Peak RSS (MB) of one `caption` child process while its command ran (see RSS_CHILD). The child is forked
    from an interpreter that has imported the CLI (tests/forked_cli.py): every run starts from the same memory,
    and its peak is the resident memory it starts with (the imported modules) plus what the command adds."""
    env = dict(cli_env(), KEEP=str(int(keep_everything)))
    name = f"rss-{len(list(tmp_path.glob('rss-*.err')))}"
    proc = forked_cli.start(
        ["caption", *args], code=RSS_CHILD, stdout=tmp_path / f"{name}.out", stderr=tmp_path / f"{name}.err", env=env
    )
    proc.wait(timeout=300)
    err = proc.output()[1]
    assert proc.returncode == 0 and "peak-rss-kb" in err, err[-2000:]
    return int(err.split("peak-rss-kb ")[1].split()[0]) / 1024


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS (VmHWM) from /proc (Linux)")
def test_peak_rss_of_caption_on_400_photos_stays_within_the_bound(
    env: dict[str, Path], tmp_path: Path, forked_cli: ForkedCli
) -> None:
    """Process memory: the peak RSS of `caption --visualize` on 400 small photos (320x240, recipe sizes 48/64 so
    that detection is quick) exceeds its peak on 40 photos by less than RSS_BOUND_MB = 40 MB (photos decoded
    in the main process, ``--num-workers 0``, so that one process holds everything; the workers' prefetch is
    bounded in test_caption_workers).

    The bound rules out keeping more than 40 MB / 360 photos = 114 kB per photo to the end: each photo's decoded
    image (320 x 240 x 3 = 225 kB), or a real detector's regions (36 x 2048 float32 = 288 kB). The test also
    runs the counterfactual, the same command keeping every result with its regions and image (what `caption`
    did before it streamed), and checks that it breaks the bound. Each run is a child forked from an interpreter
    that has imported the CLI (tests/forked_cli.py), so all three start from the same memory. Measured on the
    2-core machine (load ~1-2): 40 photos 466-467 MB, 400 photos 468-469 MB, 400 keeping everything 560 MB
    (+93 MB); about 24 s.
    """
    small_photos(tmp_path / "few", 40, size=(320, 240))
    small_photos(tmp_path / "many", 400, size=(320, 240), seed=1)
    common = [
        "--model",
        str(env["ckpt"]),
        "--weights",
        str(env["weights"]),
        "--set",
        "caption.batch_size=2",
        "--set",
        "caption.min_size=48",
        "--set",
        "caption.max_size=64",
        "--beam-size",
        "1",
        "--num-workers",
        "0",
        "--quiet",
    ]
    few = peak_rss_mb(
        forked_cli,
        tmp_path,
        str(tmp_path / "few"),
        "--output",
        str(tmp_path / "few.jsonl"),
        "--visualize",
        str(tmp_path / "p1"),
        *common,
    )
    many = peak_rss_mb(
        forked_cli,
        tmp_path,
        str(tmp_path / "many"),
        "--output",
        str(tmp_path / "many.jsonl"),
        "--visualize",
        str(tmp_path / "p2"),
        *common,
    )
    kept = peak_rss_mb(
        forked_cli,
        tmp_path,
        str(tmp_path / "many"),
        "--output",
        str(tmp_path / "kept.jsonl"),
        "--visualize",
        str(tmp_path / "p3"),
        *common,
        keep_everything=True,
    )
    print(f"peak RSS: {few:.1f} MB with 40 photos, {many:.1f} MB with 400, {kept:.1f} MB with 400 keeping every result")
    rows = read_jsonl(tmp_path / "many.jsonl")
    assert len(rows) == 400 and sum("caption" in r for r in rows) == 400 and read_jsonl(tmp_path / "kept.jsonl") == rows
    assert len(list((tmp_path / "p2").glob("*.png"))) == 400
    assert many - few < RSS_BOUND_MB, f"peak RSS {many:.1f} MB for 400 photos vs {few:.1f} MB for 40"
    assert kept - few > RSS_BOUND_MB, (
        f"keeping every result costs only {kept - few:.1f} MB: the bound would not notice it"
    )


def test_odd_images_and_names_never_cost_the_run(env: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "odd"
    small_photos(folder, 3)
    Image.fromarray(np.full((2, 2000, 3), 90, np.uint8)).save(folder / "thin.png")  # 2000x2: too thin for the network
    (folder / "[").mkdir()
    (folder / "[/x].jpg").write_bytes((folder / "0000.jpg").read_bytes())  # rich markup in the name (key "[/x].jpg")
    (folder / "[bold]y.jpg").write_bytes((folder / "0000.jpg").read_bytes())
    latin1 = os.fsencode(folder) + b"/caf\xe9.jpg"  # not UTF-8
    with open(latin1, "wb") as fh:
        fh.write((folder / "0001.jpg").read_bytes())
    out = tmp_path / "odd.jsonl"
    res = caption(env, str(folder), "--output", str(out))
    assert res.exit_code == 0, res.output
    rows = {key_from_text(r["key"]): r for r in read_jsonl(out)}
    assert set(rows) == {
        "0000.jpg",
        "0001.jpg",
        "0002.jpg",
        "thin.png",
        "[/x].jpg",
        "[bold]y.jpg",
        os.fsdecode(b"caf\xe9.jpg"),
    }
    assert (
        "error" in rows["thin.png"] and "caption" in rows["[/x].jpg"] and "caption" in rows[os.fsdecode(b"caf\xe9.jpg")]
    )
    assert os.fsencode(key_from_text(rows[os.fsdecode(b"caf\xe9.jpg")]["image"])) == latin1  # lossless
    failures = read_jsonl(tmp_path / "odd.failures.jsonl")
    assert [f["key"] for f in failures] == ["thin.png"] and failures[0]["reason"]
    assert "[/x].jpg" in res.stdout and "[bold]y.jpg" in res.stdout and "caf\\xe9.jpg" in res.stdout
    csv_out = tmp_path / "odd.csv"
    res = caption(env, str(folder), "--output", str(csv_out))
    assert res.exit_code == 0, res.output
    text = csv_out.read_bytes().decode("utf-8")  # valid UTF-8, the odd name in its text form
    assert "caf\\xe9.jpg" in text and "[/x].jpg" in text and text.count("\n") == 8


def test_file_list_and_coco_results(env: dict[str, Path], tmp_path: Path) -> None:
    folder = tmp_path / "coco"
    a, b, c = small_photos(folder, 3)
    a = a.rename(folder / "COCO_val2014_000000391895.jpg")
    b = b.rename(folder / "000000000042.jpg")
    c = c.rename(folder / "cat.jpg")
    listing = tmp_path / "list.txt"
    listing.write_text(f"# two photos\n{a}\n{b}\n")
    out = tmp_path / "results.json"
    res = caption(env, "--file-list", str(listing), "--output", str(out), "--format", "coco")
    assert res.exit_code == 0, res.output
    results = json.loads(out.read_text())
    assert sorted(r["image_id"] for r in results) == [42, 391895]
    assert all(set(r) == {"image_id", "caption"} and isinstance(r["caption"], str) for r in results)
    res = caption(env, str(c), "--output", str(tmp_path / "bad.json"), "--format", "coco")
    assert (
        res.exit_code == 2
        and "--image-ids" in res.stderr
        and sum(line.startswith("error:") for line in res.stderr.splitlines()) == 1
    )
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps({c.name: 7}))
    res = caption(env, str(c), "--output", str(tmp_path / "mapped.json"), "--format", "coco", "--image-ids", str(ids))
    assert res.exit_code == 0, res.output
    assert [r["image_id"] for r in json.loads((tmp_path / "mapped.json").read_text())] == [7]
    res = caption(env, str(c), "--output", str(tmp_path / "x.csv"), "--format", "coco")
    assert res.exit_code == 2 and ".json" in res.stderr


def test_run_folder_picks_the_best_captioner_by_validation_cider(env: dict[str, Path], tmp_path: Path) -> None:
    run = env["run"]
    scores = {name: validation_score(run / f"train-{name}" / "best.pt")["value"] for name in ("a", "b")}
    assert scores["a"] != scores["b"]
    best, other = sorted(scores, key=lambda n: -scores[n])
    photo = small_photos(tmp_path / "one", 1)[0]
    res = caption(env, str(photo), "--output", str(tmp_path / "best.jsonl"), model=str(run))
    assert res.exit_code == 0, res.output
    assert f"captioner: {best} (best validation CIDEr-D" in " ".join(res.stderr.split())
    state = json.loads((tmp_path / "best.jsonl.committed").read_text())
    assert state["settings"]["captioner"].endswith(f"train-{best}/best.pt")
    res = caption(env, str(photo), "--output", str(tmp_path / "other.jsonl"), "--captioner", other, model=str(run))
    assert res.exit_code == 0, res.output
    assert json.loads((tmp_path / "other.jsonl.committed").read_text())["settings"]["captioner"].endswith(
        f"train-{other}/best.pt"
    )
    res = caption(env, str(photo), "--captioner", "nope", model=str(run))
    assert res.exit_code == 2 and "a, b" in res.stderr
    # an output made with one captioner is not silently extended with another
    res = caption(env, str(photo), "--output", str(tmp_path / "best.jsonl"), "--captioner", other, model=str(run))
    assert res.exit_code == 2 and "--force" in res.stderr


def test_a_model_error_on_one_image_costs_only_that_image(env: dict[str, Path], tmp_path: Path) -> None:
    """Fault injection around the real models: the detector raises on one wide photo and the captioner on
    every batch of more than one photo; the engine retries image by image and only the wide photo fails."""
    from extractors.inputs import items_from_paths
    from pipeline.captioning.run import build_engine
    from pipeline.core.config import load_config

    small_photos(tmp_path / "p", 3)
    Image.fromarray(np.full((60, 300, 3), 120, np.uint8)).save(tmp_path / "p" / "wide.jpg")
    cfg = load_config("caption", None, ["caption.min_size=96", "caption.max_size=160"]).caption
    engine, *_ = build_engine(env["ckpt"], str(env["weights"]), cfg)
    detect, encode = engine.detector.detect, engine.model.encode

    def flaky_detect(blobs, *args, **kw):
        if any(b.shape[-1] > 2 * b.shape[-2] for b in blobs):
            raise RuntimeError("Calculated output size: (64x75x0)")
        return detect(blobs, *args, **kw)

    def flaky_encode(feats, *args, **kw):
        if feats.shape[0] > 1:
            raise RuntimeError("out of memory")
        return encode(feats, *args, **kw)

    engine.detector.detect, engine.model.encode = flaky_detect, flaky_encode
    results = list(engine.caption_paths(items_from_paths([str(tmp_path / "p")]), batch_size=4))
    by_key = {r.key: r for r in results}
    assert by_key["wide.jpg"].error.startswith("detector_failed: RuntimeError: Calculated output size")
    assert all(by_key[k].error is None and by_key[k].nbest for k in ("0000.jpg", "0001.jpg", "0002.jpg"))
