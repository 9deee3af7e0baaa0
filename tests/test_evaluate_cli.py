"""`cli evaluate` on results files: exit codes, the printed table, the JSON output, one-line errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli import app
from pipeline.metrics.coco import EvalOptions, score_captions
from pipeline.world.captions import make_captions
from pipeline.world.scene import SceneParams, sample_scene

needs_java = pytest.mark.skipif(
    shutil.which("java") is None, reason="Java is not installed (the PTB tokenizer needs it)"
)
FAST = ["--metrics", "bleu,rouge,cider"]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict, dict]:
    rng = np.random.default_rng(2)
    refs = {i: make_captions(sample_scene(rng, SceneParams()), rng) for i in range(1, 21)}
    preds = {i: refs[i][0] if i % 2 else refs[(i % 20) + 1][1] for i in refs}
    root = tmp_path_factory.mktemp("eval")
    ref_path = root / "captions_test.json"
    anns = [{"id": 10 * i + k, "image_id": i, "caption": c} for i, cs in refs.items() for k, c in enumerate(cs)]
    ref_path.write_text(json.dumps({"images": [{"id": i} for i in refs], "annotations": anns}))
    pred_path = root / "results.json"
    pred_path.write_text(json.dumps([{"image_id": i, "caption": c} for i, c in preds.items()]))
    return pred_path, ref_path, refs, preds


def _run(*args: str):
    return CliRunner().invoke(app, ["evaluate", *args])


def _error_lines(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


@needs_java
def test_scores_a_results_file_and_writes_json(files, tmp_path: Path) -> None:
    pred_path, ref_path, refs, preds = files
    out = tmp_path / "sub" / "metrics.json"
    result = _run("-p", str(pred_path), "-r", str(ref_path), "--output", str(out), *FAST)
    assert result.exit_code == 0, result.stderr
    assert "CIDEr" in result.stdout and "Bleu_4" in result.stdout and "20 images" in result.stdout
    payload = json.loads(out.read_text())
    expected = score_captions(refs, preds, EvalOptions(metrics=("bleu", "rouge", "cider")))
    assert payload["metrics"] == pytest.approx(expected.metrics, abs=1e-12)
    assert payload["num_images"] == 20 and payload["tokenizer"] == "ptb"
    assert payload["predictions"] == str(pred_path) and "per_image" not in payload
    assert 0.2 < payload["metrics"]["Bleu_4"] < 1.0
    # per-image scores on request
    result = _run(
        "-p", str(pred_path), "-r", str(ref_path), "--output", str(out), *FAST, "--set", "evaluate.per_image=true"
    )
    assert result.exit_code == 0, result.stderr
    rows = json.loads(out.read_text())["per_image"]
    assert [r["image_id"] for r in rows] == list(preds) and rows[0]["ROUGE_L"] == pytest.approx(1.0)


def test_without_java_still_reports_the_other_metrics(files, tmp_path: Path) -> None:
    pred_path, ref_path, _, _ = files
    out = tmp_path / "m.json"
    missing = str(tmp_path / "nowhere" / "java")
    result = _run(
        "-p",
        str(pred_path),
        "-r",
        str(ref_path),
        "--output",
        str(out),
        "--metrics",
        "bleu,meteor,cider",
        "--set",
        f"evaluate.java={missing}",
    )
    assert result.exit_code == 0, result.stderr
    payload = json.loads(out.read_text())
    assert payload["tokenizer"] == "simple" and set(payload["skipped"]) == {"meteor"}
    assert set(payload["metrics"]) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "CIDEr"}
    assert "Java not found" in result.stderr and "METEOR" in result.stdout
    # with java_missing=error: one line, exit 1 (an environment problem, not a usage error)
    result = _run(
        "-p",
        str(pred_path),
        "-r",
        str(ref_path),
        "--set",
        f"evaluate.java={missing}",
        "--set",
        "evaluate.java_missing=error",
    )
    assert result.exit_code == 1
    lines = _error_lines(result)
    assert len(lines) == 1 and "Java not found" in lines[0]
    assert "Traceback" not in result.output


@pytest.mark.parametrize(
    "case,message",
    [
        ("missing_predictions", "predictions file not found"),
        ("bad_json", "is not valid JSON"),
        ("not_a_list", "must hold a JSON list"),
        ("duplicate", "have more than one caption"),
        ("unknown_image", "have no reference captions"),
        ("bad_references", "not in COCO captions format"),
        ("no_args", "no captioner at runs/demo"),  # no option: the default run directory's best captioner
        ("model", "--model CHECKPOINT needs --store"),
        ("bad_metric", "unknown metric(s) ['wer']"),
        ("bad_config_key", "unknown config key 'evaluate.tokeniser'"),
    ],
)
def test_bad_inputs_exit_2_with_one_line(files, tmp_path: Path, case: str, message: str, monkeypatch) -> None:
    pred_path, ref_path, _, preds = files
    p, r = str(pred_path), str(ref_path)
    extra: list[str] = []

    def write(name: str, content: str) -> str:
        path = tmp_path / name
        path.write_text(content)
        return str(path)

    if case == "missing_predictions":
        p = str(tmp_path / "nope.json")
    elif case == "bad_json":
        p = write("bad.json", "[{")
    elif case == "not_a_list":
        p = write("obj.json", json.dumps({"image_id": 1, "caption": "x"}))
    elif case == "duplicate":
        p = write("dup.json", json.dumps([{"image_id": 1, "caption": "a"}, {"image_id": 1, "caption": "b"}]))
    elif case == "unknown_image":
        p = write("unk.json", json.dumps([{"image_id": 1, "caption": "a"}, {"image_id": 999, "caption": "b"}]))
    elif case == "bad_references":
        r = write("refs.json", json.dumps({"images": []}))
    elif case == "bad_metric":
        extra = ["--metrics", "bleu,wer"]
    elif case == "bad_config_key":
        extra = ["--set", "evaluate.tokeniser=ptb"]
    if case == "no_args":
        monkeypatch.chdir(tmp_path)  # no runs/demo here
        result = _run()
    elif case == "model":
        result = _run("--model", write("best.pt", ""), "--split", "test")
    else:
        result = _run("-p", p, "-r", r, *extra)
    assert result.exit_code == 2, result.output
    lines = _error_lines(result)
    assert len(lines) == 1, lines
    assert lines[0].startswith("error:") and message in lines[0]
    assert "Traceback" not in result.output
    if case in ("missing_predictions", "bad_json", "not_a_list", "duplicate", "unknown_image"):
        assert p in lines[0]  # the message names the file


def test_unknown_option_is_rejected() -> None:
    result = _run("--predictons", "x.json")
    assert result.exit_code == 2
