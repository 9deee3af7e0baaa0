"""The benchmark harness (python -m bench) at tiny sizes: ratios only from compared outputs, and the
comparison bites when the project's output is wrong."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench import harness
from bench.__main__ import main


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["--size", "tiny", "--repeats", "3", "--warmup", "1", *args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_row_is_compared_before_its_ratio(capsys, tmp_path):
    code, out, err = _run(
        capsys, "--only", "cider,nms,store", "--json", str(tmp_path / "r.json"), "--store-dir", str(tmp_path / "s")
    )
    assert code == 0, err
    data = json.loads((tmp_path / "r.json").read_text())
    rows = data["rows"]
    assert {r["name"] for r in rows} == {"cider", "nms uniform", "nms clustered", "nms max_conf", "store reads"}
    assert {r["baseline"] for r in rows if r["name"] == "store reads"} == {"npz", "npz-compressed", "h5-groups"}
    for r in rows:
        assert r["repeats"] == 3 and r["max_diff"] is not None and r["max_diff"] <= r["tolerance"]
        assert r["speedup_min"] == pytest.approx(r["baseline_min"] / r["project_min"])
        assert r["project_min"] <= r["project_median"] and r["baseline_min"] <= r["baseline_median"]
    assert max(r["tolerance"] for r in rows if r["name"] == "cider") == 1e-9
    assert all(r["tolerance"] == 0 for r in rows if r["name"] != "cider")  # NMS and store: exact
    assert data["environment"]["torch_threads"] == 1 and len(data["environment"]["load_average"]) == 3
    assert out.count("\n") >= len(rows) + 2 and "speed-up" in out  # the table went to stdout


@pytest.mark.parametrize("bench", ["cider", "nms", "store"])
def test_a_wrong_project_output_fails_without_a_ratio(bench, monkeypatch, capsys, tmp_path):
    if bench == "cider":
        from pipeline.metrics.cider import CiderD

        real = CiderD.scores
        monkeypatch.setattr(CiderD, "scores", lambda self, *a, **k: real(self, *a, **k) * (1 + 1e-6))
    elif bench == "nms":
        from extractors import nms

        real_keep = nms.per_class_keep

        def wrong_keep(*a, **k):
            mask = real_keep(*a, **k).clone()
            mask[0, -1] = ~mask[0, -1]  # one proposal, one class
            return mask

        monkeypatch.setattr(nms, "per_class_keep", wrong_keep)
    else:
        from pipeline.store import FeatureStore

        real_get = FeatureStore.get

        def wrong_get(self, key):
            rec = dict(real_get(self, key))
            if key == "7":
                rec["features"] = rec["features"].copy()
                rec["features"][0, 0] += np.float16(1)
            return rec

        monkeypatch.setattr(FeatureStore, "get", wrong_get)
    code, out, err = _run(capsys, "--only", bench, "--store-dir", str(tmp_path / "s"))
    assert code == 1
    assert "outputs differ" in err and "no ratio reported" in err
    assert out == ""  # no table, no ratio


def test_every_timed_round_is_checked():
    """An output that goes wrong only in the third timed round is still caught."""
    calls = {"n": 0}

    def project() -> float:
        calls["n"] += 1
        return 1.0 if calls["n"] < 4 else 2.0  # warm-up + 2 timed rounds right, then wrong

    case = harness.Case("toy", "p", "b", "nothing", project, lambda: 1.0, lambda a, b: abs(a - b), 0.0)
    with pytest.raises(harness.Mismatch, match="timed round 3"):
        harness.measure(case, repeats=3, warmup=1)
    calls["n"] = 0
    row = harness.measure(case, repeats=2, warmup=1)
    assert row.max_diff == 0.0 and row.speedup_min is not None


def test_usage_errors_are_one_line(capsys):
    assert main(["--only", "nope"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    with pytest.raises(SystemExit) as exc:
        main(["--repeats", "x"])
    assert exc.value.code == 2 and capsys.readouterr().err.startswith("error:")
    if not torch.cuda.is_available():
        assert main(["--device", "cuda"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: --device cuda: CUDA is not available") and err.count("\n") == 1


@pytest.mark.slow
def test_the_cuda_table_code_runs_on_cpu_at_tiny_size():
    """No GPU here: the CUDA rows' code (extraction fp32/bf16, XE/SCST epoch, beam-5 decode) runs on CPU at
    tiny sizes, so a GPU user does not meet a broken script; throughput rows carry no ratio."""
    from bench import gpu

    rows = []
    for name in ("extract", "train", "decode"):
        for case in gpu.cases(name, "tiny", ["ngsan"], device="cpu"):
            if case.name != "train scst":  # the same bench.train.bench_stage as XE, at 3x the cost
                rows.append(harness.measure(case, repeats=1, warmup=0))
    # bf16 extraction only on CUDA; the second extract row batches equal sizes across the folder
    # (extract.bucket_window); the second XE row runs the opt-in fused optimizer (optimizer_impl: fused)
    assert [r.name for r in rows] == ["extract", "extract", "train xe", "train xe", "decode"]
    assert rows[3].project.endswith(", fused optimizer") and not rows[2].project.endswith("optimizer")
    for r in rows:
        assert r.project_min > 0 and r.baseline is None and r.speedup_min is None


def test_vinvl_rows_side_by_side(capsys, tmp_path, monkeypatch):
    """X-152 vs R-101 regions and grid vs regions: s/img on both sides and the ratio; a side whose output loses
    a photo reports no ratio."""
    code, out, err = _run(
        capsys, "--only", "vinvl", "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "v.json")
    )
    assert code == 0, err
    rows = json.loads((tmp_path / "v.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["regions X-152 vs R-101", "grid vs regions (X-152)", "grid vs regions (R-101)"]
    assert all(r["unit"] == "s/img" and r["speedup_min"] > 0 and r["max_diff"] == 0 for r in rows)
    from bench import vinvl

    check = vinvl._shared(2048, 2)
    good = [type("R", (), {"features": np.ones((3, 2048), np.float32)})()] * 2
    assert check(good, good) == 0 and check(good[:1], good) == float("inf")


def test_proxies_count_operators_and_syncs(capsys, tmp_path):
    """python -m bench --only proxies at tiny size (the extraction row): counts, not times, and an exact sync count."""
    from bench.proxies import count

    assert count(lambda: (torch.ones(3).sum().item(), torch.ones(2).nonzero(), torch.ones(2).tolist()))["syncs"] == 3
    code, out, err = _run(
        capsys, "--only", "proxies", "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "p.json")
    )
    assert code == 0, err
    rows = json.loads((tmp_path / "p.json").read_text())["rows"]
    assert [r["unit"] for r in rows] == ["operators", "syncs"] and rows[0]["project_min"] > 50


def test_clip_rows_batch_per_image_and_regions(capsys, tmp_path):
    """CLIP RN50x4 and ViT-B/16 grids (random weights, narrowed): batch vs photo by photo, checked equal before the
    ratio, and the RN50x4 grid beside the R-101 regions; a batch that loses a photo or changes a cell reports none."""
    code, out, err = _run(
        capsys, "--only", "clip", "--repeats", "1", "--warmup", "0", "--json", str(tmp_path / "c.json")
    )
    assert code == 0, err
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["name"] for r in rows] == [
        "clip RN50x4 batch vs per-image",
        "clip ViT-B/16 batch vs per-image",
        "clip RN50x4 grid vs R-101 regions",
    ]
    assert all(r["unit"] == "s/img" and r["speedup_min"] > 0 and r["max_diff"] <= r["tolerance"] for r in rows)
    assert "random weights" in rows[0]["note"] and "random weights" in rows[2]["note"]
    from bench import clip

    good = [type("F", (), {"regions": type("R", (), {"features": np.ones((4, 8), np.float32)})()})()] * 2
    bad = [type("F", (), {"regions": type("R", (), {"features": np.full((4, 8), 1.1, np.float32)})()})()] * 2
    assert clip._grids_agree(good, good) == 0 and clip._grids_agree(good[:1], good) == float("inf")
    assert clip._grids_agree(bad, good) == pytest.approx(0.1, rel=1e-5)
