"""Store robustness: bytes-safe keys, per-image checksums, `info --verify`, old stores, write failures."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
from store_helpers import IDENTITY, add_image, synthetic_image
from typer.testing import CliRunner

from cli import app
from pipeline.core.errors import PipelineError
from pipeline.core.keys import key_from_name
from pipeline.store import FeatureStore, compact_store, merge_stores, open_writer

REPO = Path(__file__).resolve().parent.parent
ODD_KEYS = [key_from_name(b"caf\xe9.jpg"), "a\nb.jpg", "[/x].jpg", "tab\there", "back\\slash", "日本.jpg"]


def _write(path: Path, keys: list[str], commit_every: int = 0) -> None:
    with open_writer(path, IDENTITY, commit_every=commit_every) as w:
        for i, k in enumerate(keys):
            add_image(w, dict(synthetic_image(i), key=k))


def test_odd_keys_round_trip_through_segments_merge_and_compact(tmp_path):
    _write(tmp_path / "s", ODD_KEYS, commit_every=2)
    st = FeatureStore(tmp_path / "s")
    assert st.keys() == ODD_KEYS
    for i, k in enumerate(ODD_KEYS):
        np.testing.assert_array_equal(st.get(k)["boxes"], synthetic_image(i)["boxes"])
    assert merge_stores([tmp_path / "s"], tmp_path / "m.h5") == len(ODD_KEYS)
    assert FeatureStore(tmp_path / "m.h5").keys() == ODD_KEYS
    assert compact_store(tmp_path / "s") == len(ODD_KEYS)
    assert FeatureStore(tmp_path / "s").keys() == ODD_KEYS
    assert not list((tmp_path / "s").glob("*.tmp"))


@pytest.mark.parametrize("bad", ["", "nul\x00key", "lone\ud800"])
def test_unrepresentable_keys_refused_before_anything_is_written(tmp_path, bad):
    with open_writer(tmp_path / "s", IDENTITY) as w:
        add_image(w, synthetic_image(0))
        with pytest.raises(PipelineError):
            add_image(w, dict(synthetic_image(1), key=bad))
    assert FeatureStore(tmp_path / "s").keys() == ["img00000"]


def _flip(path: Path, dataset: str, row: int, byte: int = 3) -> None:
    with h5py.File(path, "r") as fh:
        ds = fh[dataset]
        offset = ds.id.get_offset() + row * ds.dtype.itemsize * (ds.shape[1] if ds.ndim == 2 else 1) + byte
    with open(path, "r+b") as fh:
        fh.seek(offset)
        b = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([b[0] ^ 0xFF]))


def _rows_of(store: Path, key: str) -> int:
    return int(FeatureStore(store)._st().start[FeatureStore(store)._position(key)])


def test_flipped_feature_bytes_are_refused_and_verify_names_the_key(tmp_path):
    store = tmp_path / "s"
    _write(store, [f"k{i}" for i in range(6)], commit_every=3)
    seg = store / "seg-000001.h5"
    row = _rows_of(store, "k4") - int(FeatureStore(store)._st().start[3])
    _flip(seg, "features", row + 1)
    st = FeatureStore(store)
    with pytest.raises(PipelineError, match=r"seg-000001\.h5.*k4.*damaged"):
        st.get("k4")
    for k in ("k0", "k3", "k5"):  # the rest stays readable
        assert st.get(k)["features"].shape[1] == 64
    with pytest.raises(PipelineError, match="k4"):
        FeatureStore(store).preload()
    with pytest.raises(PipelineError, match="k4"):
        merge_stores([store], tmp_path / "copy")  # damaged rows are never copied on
    res = CliRunner().invoke(app, ["info", str(store)])
    assert res.exit_code != 0 and "nan" not in res.output and "k4" in res.output
    assert "Traceback" not in res.output
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 1, res.output
    assert "damaged image k4 in seg-000001.h5: checksum mismatch" in res.output
    assert "1 damaged images" in res.output and "6 of 6 images read" in res.output


def test_verify_clean_store_and_boxes_damage(tmp_path):
    store = tmp_path / "s"
    _write(store, [f"k{i}" for i in range(4)])
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 0 and "ok: 4 of 4 images" in res.output
    assert "checksums: crc32" in CliRunner().invoke(app, ["info", str(store)]).output
    _flip(store / "seg-000000.h5", "boxes", _rows_of(store, "k2"), byte=0)
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 1 and "damaged image k2" in res.output


def test_damaged_keys_index_refused_with_one_line(tmp_path):
    store = tmp_path / "s"
    _write(store, ["aaaa", "bbbb"])
    seg = store / "seg-000000.h5"
    data = seg.read_bytes()
    i = data.find(b"bbbb")
    assert i > 0
    seg.write_bytes(data[:i] + b"bbcb" + data[i + 4 :])
    with pytest.raises(PipelineError, match=r"seg-000000\.h5.*(index|corrupt)"):
        FeatureStore(store)
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 1 and "damaged segment seg-000000.h5" in res.output


def test_old_store_without_checksums_still_reads(tmp_path):
    store = tmp_path / "s"
    _write(store, ["a", "b"])
    with h5py.File(store / "seg-000000.h5", "r+") as fh:  # what a store written before checksums looks like
        del fh["row_crc32"]
        del fh.attrs["index_crc32"]
        del fh.attrs["checksum"]
    st = FeatureStore(store)
    np.testing.assert_array_equal(st.get("b")["boxes"], synthetic_image(1)["boxes"])
    out = CliRunner().invoke(app, ["info", str(store)]).output
    assert "checksums: none (written before checksums" in out
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 0 and "written before checksums" in res.output


def test_disk_full_during_commit_keeps_committed_data(tmp_path, monkeypatch):
    import pipeline.store.segment as segment

    store = tmp_path / "s"
    real = segment._write_segment_file
    w = open_writer(store, IDENTITY)
    add_image(w, synthetic_image(0))
    w.commit()
    add_image(w, synthetic_image(1))

    def full(*args, **kw):
        real(*args, **kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(segment, "_write_segment_file", full)
    with pytest.raises(OSError) as err:
        w.commit()
    assert err.value.errno == errno.ENOSPC and getattr(err.value, "butd_action") == "write feature segment"
    assert not list(store.glob("*.tmp"))
    monkeypatch.setattr(segment, "_write_segment_file", real)
    w.commit()  # space freed: the pending image commits
    w.close()
    assert FeatureStore(store).keys() == ["img00000", "img00001"]


def _unshare_ok() -> bool:
    if not shutil.which("unshare") or sys.platform != "linux":
        return False
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


FILL = """
import sys
from store_helpers import IDENTITY, add_image, synthetic_image
from pipeline.store import open_writer
w = open_writer(sys.argv[1], IDENTITY)
i = 0
try:
    while True:
        add_image(w, synthetic_image(i)); w.commit(); i += 1
except OSError as exc:
    print(f"ERRNO={exc.errno} ACTION={exc.butd_action} COMMITTED={i}")
w.close()
"""


@pytest.mark.skipif(not _unshare_ok(), reason="needs unprivileged user namespaces (unshare -rm) to mount a tiny tmpfs")
def test_real_full_disk_and_read_only_disk(tmp_path):
    """A real 300 KiB tmpfs fills up while a store commits; committed images verify; the CLI says one line
    for a full and for a read-only disk (exit 1, no traceback)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    _write(tmp_path / "src", [f"k{i}" for i in range(40)])
    (tmp_path / "fill.py").write_text(FILL)
    py = sys.executable
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(REPO), str(REPO / "tests"), *filter(None, [os.environ.get("PYTHONPATH")])]),
    )
    shell = (
        f"mount -t tmpfs -o size=300k tmpfs {mnt} || exit 9; "
        f"{py} {tmp_path}/fill.py {mnt}/s; {py} {REPO}/cli.py info --verify {mnt}/s; echo VERIFY=$?; "
        f"{py} {REPO}/cli.py export-features {tmp_path}/src --output {mnt}/x.tsv; echo FULL=$?; "
        f"mount -o remount,ro {mnt} && "
        f"{py} {REPO}/cli.py export-features {tmp_path}/src --output {mnt}/y.tsv; echo RO=$?"
    )
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )
    out = proc.stdout + proc.stderr
    assert "ERRNO=28 ACTION=write feature segment" in out, out
    committed = int(out.split("COMMITTED=")[1].split()[0])
    assert committed >= 3 and f"ok: {committed} of {committed} images" in out and "VERIFY=0" in out, out
    assert "FULL=1" in out and f"cannot write {mnt}/x.tsv: No space left on device (disk full" in out, out
    assert "RO=1" in out and f"cannot write {mnt}/y.tsv: Read-only file system" in out, out
    assert "Traceback" not in out, out


@pytest.mark.parametrize("fmt", ["butd-tsv", "obj36-tsv"])
def test_export_import_round_trips_every_key(tmp_path, fmt):
    """A key with a newline, a tab, a backslash or a non-UTF-8 byte: one line per image, same keys back."""
    store = tmp_path / "s"
    keys = ODD_KEYS + ["COCO_val2014_000000000042"]
    _write(store, keys)
    out = tmp_path / "x.tsv"
    res = CliRunner().invoke(app, ["export-features", str(store), "--output", str(out), "--format", fmt])
    assert res.exit_code == 0, res.output
    assert out.read_bytes().count(b"\n") == len(keys)
    out.read_bytes().decode("utf-8")  # the file is valid UTF-8
    res = CliRunner().invoke(
        app, ["import-features", str(out), "--format", fmt, "--store", str(tmp_path / "back"), "--keys", "raw"]
    )
    assert res.exit_code == 0, res.output
    back = FeatureStore(tmp_path / "back")
    assert sorted(back.keys()) == sorted(keys)
    np.testing.assert_array_equal(back.get(ODD_KEYS[1])["boxes"], synthetic_image(1)["boxes"])


def test_import_of_a_malformed_key_escape_is_a_bad_row(tmp_path):
    store = tmp_path / "s"
    _write(store, ["a", "b"])
    out = tmp_path / "x.tsv"
    assert CliRunner().invoke(app, ["export-features", str(store), "--output", str(out)]).exit_code == 0
    out.write_bytes(out.read_bytes().replace(b"b\t", b"b\\q\t", 1))
    res = CliRunner().invoke(
        app, ["import-features", str(out), "--format", "butd-tsv", "--store", str(tmp_path / "back"), "--skip-bad"]
    )
    assert res.exit_code == 0 and "malformed escape" in res.output
    assert FeatureStore(tmp_path / "back").keys() == ["a"]


@pytest.mark.skipif(
    not _unshare_ok(), reason="needs unprivileged user namespaces (unshare -rm) to mount a read-only tmpfs"
)
def test_every_writing_command_on_a_read_only_disk_is_one_line(tmp_path, shared_data):
    """extract, import-features, export-features, merge-features, prepare and demo writing to a read-only
    file system: each exits 1 with one `error: cannot ...` line naming the path, no traceback."""
    import json as _json

    _write(tmp_path / "src", ["a", "b"])
    assert (
        CliRunner()
        .invoke(app, ["export-features", str(tmp_path / "src"), "--output", str(tmp_path / "x.tsv")])
        .exit_code
        == 0
    )
    karpathy = tmp_path / "k.json"
    karpathy.write_text(
        _json.dumps(
            {
                "images": [
                    {
                        "cocoid": 1,
                        "filename": "1.jpg",
                        "split": "train",
                        "sentences": [{"tokens": ["a", "dog"], "raw": "a dog"}],
                    }
                ]
            }
        )
    )
    photo = shared_data / "photos" / "000456.jpg"
    ro = tmp_path / "ro"
    ro.mkdir()
    cli = f"{sys.executable} {REPO}/cli.py"
    commands = {
        "extract": f"extract {photo} --weights random --store {ro}/s --workers 0",
        "import": f"import-features {tmp_path}/x.tsv --format butd-tsv --store {ro}/s",
        "export": f"export-features {tmp_path}/src --output {ro}/y.tsv",
        "merge": f"merge-features {tmp_path}/src --store {ro}/m",
        "prepare": f"prepare --set prepare.karpathy_json={karpathy} --out {ro}/run",
        "demo": f"demo --out {ro}/demo --quick",
    }
    shell = f"mount -t tmpfs -o ro tmpfs {ro} || exit 9; " + "; ".join(
        f"echo '<<{name}>>'; {cli} {cmd} 2>&1; echo \"<<rc=$?>>\"" for name, cmd in commands.items()
    )
    env = dict(os.environ, BUTD_NO_PROGRESS="1", COLUMNS="400")
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", shell], capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    out = proc.stdout + proc.stderr
    for name in commands:
        part = out.split(f"<<{name}>>")[1].split("<<rc=")
        text, rc = part[0], part[1].split(">>")[0]
        assert rc == "1", (name, out)
        errors = [line for line in text.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "Read-only file system" in errors[0] and str(ro) in errors[0], (name, text)
        assert "Traceback" not in text, (name, text)


def test_fuzzed_segments_never_escape_as_anything_but_one_line(tmp_path):
    """150 single-byte flips and 15 truncations of a small segment: opening, reading every image and verifying
    either work with correct data or raise PipelineError; a flip inside row data is never returned silently."""
    from pipeline.store.verify import verify_store

    store = tmp_path / "s"
    _write(store, [f"k{i}" for i in range(5)])
    seg = store / "seg-000000.h5"
    original = seg.read_bytes()
    want = {f"k{i}": synthetic_image(i) for i in range(5)}
    rng = np.random.default_rng(0)
    positions = rng.integers(0, len(original), 150).tolist()
    cases = [(p, None) for p in positions] + [(None, int(n)) for n in rng.integers(1, len(original), 15)]
    silent = 0
    for pos, cut in cases:
        data = bytearray(original)
        if pos is not None:
            data[pos] ^= 0x5A
        else:
            data = data[:cut]
        seg.write_bytes(bytes(data))
        try:
            st = FeatureStore(store)
            for k, rec in want.items():
                got = st.get(k)
                np.testing.assert_array_equal(got["boxes"], rec["boxes"])
                np.testing.assert_array_equal(got["features"], rec["features"].astype(np.float16))
                np.testing.assert_array_equal(got["class_ids"], rec["class_ids"])
            st.close()
        except PipelineError:
            pass
        except AssertionError:
            silent += 1
        report = verify_store(store)  # never raises
        assert report.segments == 1
    seg.write_bytes(original)
    assert silent == 0
    assert verify_store(store).ok


def test_damaged_chunk_of_a_compressed_segment_is_one_line(tmp_path):
    store = tmp_path / "s"
    with open_writer(store, IDENTITY, chunk_rows=16, compression="gzip") as w:
        for i in range(3):
            add_image(w, synthetic_image(i))
    seg = store / "seg-000000.h5"
    with h5py.File(seg, "r") as fh:
        offset = fh["features"].id.get_chunk_info(0).byte_offset
    data = bytearray(seg.read_bytes())
    data[offset + 10 : offset + 40] = b"\xff" * 30
    seg.write_bytes(bytes(data))
    with pytest.raises(PipelineError, match=r"seg-000000\.h5"):
        FeatureStore(store).get("img00000")
    res = CliRunner().invoke(app, ["info", "--verify", str(store)])
    assert res.exit_code == 1 and "damaged image img00000" in res.output and "Traceback" not in res.output


def test_ctrl_c_inside_a_writer_keeps_the_pending_images(tmp_path):
    store = tmp_path / "s"
    with pytest.raises(KeyboardInterrupt):
        with open_writer(store, IDENTITY) as w:
            for i in range(3):
                add_image(w, synthetic_image(i))
            raise KeyboardInterrupt
    assert FeatureStore(store).keys() == ["img00000", "img00001", "img00002"]


def test_fuzzed_store_record_is_refused_with_one_line(tmp_path):
    """Truncated or bit-flipped store.json: the reader and the writer either work or raise PipelineError."""
    store = tmp_path / "s"
    _write(store, ["a", "b"], commit_every=1)
    record = (store / "store.json").read_bytes()
    rng = np.random.default_rng(1)
    for k in range(60):
        data = bytearray(record)
        if k % 3 == 0:
            data = data[: int(rng.integers(0, len(record)))]
        else:
            data[int(rng.integers(0, len(record)))] ^= 1 << int(rng.integers(0, 8))
        (store / "store.json").write_bytes(bytes(data))
        for open_it in (lambda: FeatureStore(store), lambda: open_writer(store, IDENTITY).close()):
            try:
                open_it()
            except PipelineError:
                pass
        res = CliRunner().invoke(app, ["info", "--verify", str(store)])
        assert res.exception is None or isinstance(res.exception, SystemExit), (k, res.exception)
        assert res.exit_code in (0, 1, 2) and "Traceback" not in res.output


def test_hdf5_runtime_error_of_a_full_disk_is_the_disk_full_os_error(tmp_path, monkeypatch):
    """Some h5py builds (the CUDA image's) report a write that fails at close on a full disk as RuntimeError
    ("file write failed: ... errno = 28"), not OSError: the segment writer still says "disk full" with the path,
    and leaves no partial file; a RuntimeError without an errno stays what it is."""
    from pipeline.store import segment

    def full_disk(h5py, path, *args):
        path.write_bytes(b"partial")
        raise RuntimeError(
            "Can't decrement id ref count (file write failed: time = now, filename = 'x', "
            "file descriptor = 4, errno = 28, error message = 'No space left on device')"
        )

    monkeypatch.setattr(segment, "_write_segment_file", full_disk)
    target = tmp_path / "seg-000000.h5.tmp"
    with pytest.raises(OSError) as info:
        segment.write_segment(
            target,
            [],
            num_images=0,
            num_rows=0,
            identity={},
            feature_dtype="float32",
            feature_dim=4,
            fields=[],
            fsync=False,
        )
    assert info.value.errno == 28 and info.value.butd_action == "write feature segment"
    assert info.value.filename == str(target) and not target.exists()

    def other(h5py, path, *args):
        raise RuntimeError("unrelated HDF5 failure")

    monkeypatch.setattr(segment, "_write_segment_file", other)
    with pytest.raises(RuntimeError, match="unrelated"):
        segment.write_segment(
            target,
            [],
            num_images=0,
            num_rows=0,
            identity={},
            feature_dtype="float32",
            feature_dim=4,
            fields=[],
            fsync=False,
        )


def test_export_never_replaces_an_existing_file_without_force(tmp_path):
    store, out = tmp_path / "s", tmp_path / "notes.tsv"
    _write(store, ["a", "b"])
    out.write_text("the user's own file\n")
    res = CliRunner().invoke(app, ["export-features", str(store), "--output", str(out)])
    assert res.exit_code == 2 and "Traceback" not in res.output
    assert f"--output {out} exists: pass --force to overwrite it" in res.output
    assert out.read_text() == "the user's own file\n"
    res = CliRunner().invoke(app, ["export-features", str(store), "--output", str(out), "--force"])
    assert res.exit_code == 0, res.output
    assert out.read_bytes().count(b"\n") == 2
    res = CliRunner().invoke(app, ["export-features", str(store), "--output", str(tmp_path)])
    assert res.exit_code == 2 and f"--output {tmp_path} is a directory" in res.output
