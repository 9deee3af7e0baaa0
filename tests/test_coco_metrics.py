"""COCO caption metrics: real Java runs compared with pycocoevalcap's own pipeline, known properties,
graceful degradation without Java or SPICE, and validation of results / reference files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from pipeline.core.errors import PipelineError, UsageError
from pipeline.metrics.coco import EvalOptions, evaluate_files, score_captions
from pipeline.metrics.coco_files import load_predictions, load_references, match_predictions
from pipeline.metrics.java import JavaMissing, JavaRun, find_java, pycocoevalcap_dir
from pipeline.metrics.meteor import meteor_scores
from pipeline.metrics.spice import spice_available
from pipeline.metrics.tokenize import ptb_tokenize, simple_tokenize
from pipeline.world.captions import make_captions
from pipeline.world.scene import SceneParams, sample_scene

JAVA = shutil.which("java")
needs_java = pytest.mark.skipif(JAVA is None, reason="Java is not installed (METEOR and the PTB tokenizer need it)")
NO_METEOR = EvalOptions(metrics=("bleu", "rouge", "cider"))

EXTRA_REFS = {
    900: ["A dog (brown) catches a frisbee.", "The dog's frisbee is red!", "A dog -- jumping high; catching it."],
    901: ["Two people, 3 dogs: a park scene.", "People walking their dogs... in a park?", "a PARK with dogs"],
}


@pytest.fixture(scope="module")
def data() -> tuple[dict, dict, dict]:
    """~30 synthetic-world images (raw captions, with capitals and periods) plus two hand-written ones.

    Predictions: exact copies of a reference (kind 'copy'), another image's caption ('other'), a shortened
    reference with extra punctuation ('edit'), and one empty caption."""
    rng = np.random.default_rng(5)
    refs = {i: make_captions(sample_scene(rng, SceneParams()), rng) for i in range(1, 31)}
    refs.update(EXTRA_REFS)
    ids = list(refs)
    preds, kinds = {}, {}
    for k, i in enumerate(ids):
        kind = ("copy", "other", "edit")[k % 3]
        if kind == "copy":
            preds[i] = refs[i][1]
        elif kind == "other":
            preds[i] = refs[ids[(k + 7) % len(ids)]][0]
        else:
            words = refs[i][2].rstrip(".").split()
            preds[i] = ", ".join([" ".join(words[:-1]), words[-1]]) + "!"
        kinds[i] = kind
    preds[ids[4]], kinds[ids[4]] = "", "empty"
    return refs, preds, kinds


@pytest.fixture(scope="module")
def both(data) -> tuple[object, dict]:
    """(ours, oracle). The oracle is pycocoevalcap run as COCOEvalCap.evaluate runs it (PTBTokenizer,
    Bleu(4), Meteor, Rouge, Cider); COCOEvalCap.evaluate itself also builds Spice(), which downloads
    CoreNLP, so its steps are run here. pycocoevalcap's METEOR JVM is started first so that it loads its
    paraphrase table while ours runs."""
    if JAVA is None:
        pytest.skip("Java is not installed")
    if not os.access(pycocoevalcap_dir() / "tokenizer", os.W_OK):
        pytest.skip("pycocoevalcap's PTBTokenizer writes into its package dir, which is read-only here")
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    refs, preds, _ = data
    meteor = Meteor()
    ours = score_captions(refs, preds, EvalOptions(metrics=("bleu", "meteor", "rouge", "cider")))
    tok = PTBTokenizer()
    gts = tok.tokenize({i: [{"caption": c} for c in refs[i]] for i in preds})
    res = tok.tokenize({i: [{"caption": preds[i]}] for i in preds})
    oracle: dict = {}
    bleu, bleu_img = Bleu(4).compute_score(gts, res, verbose=0)
    for k in range(4):
        oracle[f"Bleu_{k + 1}"] = (bleu[k], bleu_img[k])
    oracle["METEOR"] = meteor.compute_score(gts, res)
    del meteor
    oracle["ROUGE_L"] = Rouge().compute_score(gts, res)
    oracle["CIDEr"] = Cider().compute_score(gts, res)
    return ours, oracle


@pytest.fixture(scope="module")
def ours(both) -> object:
    return both[0]


@needs_java
def test_equals_pycocoevalcap(data, both) -> None:
    ours, oracle = both
    refs, preds, _ = data
    assert ours.tokenizer == "ptb"
    assert set(ours.metrics) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr"}
    ids = list(preds)
    assert ours.image_ids == ids
    for key, value in ours.metrics.items():
        corpus, per_image = oracle[key]
        assert value == pytest.approx(float(corpus), abs=1e-9), key
        assert np.allclose(ours.per_image[key], [float(s) for s in per_image], atol=1e-9, rtol=0), key
    assert 0.05 < ours.metrics["Bleu_4"] < 0.99 and 0.05 < ours.metrics["METEOR"] < 0.99


@needs_java
def test_known_properties(data, ours) -> None:
    """Exact copies of a reference get METEOR/ROUGE-L near 1; an empty caption gets 0; copies beat others."""
    refs, preds, kinds = data
    per = {k: dict(zip(ours.image_ids, v)) for k, v in ours.per_image.items()}
    copies = [i for i in preds if kinds[i] == "copy"]
    others = [i for i in preds if kinds[i] == "other"]
    empty = [i for i in preds if kinds[i] == "empty"][0]
    assert all(per["ROUGE_L"][i] == pytest.approx(1.0) for i in copies)
    assert all(per["METEOR"][i] > 0.9 for i in copies)
    assert min(per["CIDEr"][i] for i in copies) > max(per["CIDEr"][i] for i in others)
    assert per["CIDEr"][empty] == 0.0 and per["ROUGE_L"][empty] == 0.0 and per["METEOR"][empty] == 0.0
    # a results file that copies one reference per image: corpus BLEU-1..4 = 1 (up to pycocoevalcap's 1e-9 smoothing)
    exact = score_captions(refs, {i: refs[i][0] for i in refs}, NO_METEOR)
    for n in range(1, 5):
        assert exact.metrics[f"Bleu_{n}"] == pytest.approx(1.0, abs=1e-6)
    assert exact.metrics["ROUGE_L"] == pytest.approx(1.0)
    shuffled = score_captions(refs, {i: refs[j][0] for i, j in zip(refs, list(refs)[1:] + list(refs)[:1])}, NO_METEOR)
    assert shuffled.metrics["Bleu_4"] < 0.6 and shuffled.metrics["CIDEr"] < exact.metrics["CIDEr"] / 3


@needs_java
def test_without_java_falls_back_and_reports(data, ours, tmp_path: Path) -> None:
    refs, preds, _ = data
    missing = str(tmp_path / "no-java-here" / "java")
    result = score_captions(refs, preds, EvalOptions(java=missing))
    assert result.tokenizer == "simple"
    assert set(result.skipped) == {"meteor", "spice"}
    assert set(result.metrics) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"}
    assert any("Java not found" in n for n in result.notes)
    # on these captions the pure-Python tokenizer agrees with PTB, so the Java-free metrics agree too
    for key in result.metrics:
        assert result.metrics[key] == pytest.approx(ours.metrics[key], abs=1e-12), key
    with pytest.raises(JavaMissing, match="Java not found"):
        score_captions(refs, preds, EvalOptions(java=missing, java_missing="error"))


def _java_found() -> bool:
    try:
        find_java()
    except JavaMissing:
        return False
    return True


@pytest.mark.skipif(
    not _java_found(),
    reason="Java is not installed: scoring reports SPICE as 'Java not found' before "
    "it looks for the CoreNLP jars, so the jar check cannot be reached",
)
def test_spice_is_detected_without_downloading(data) -> None:
    available, reason = spice_available()
    if available:
        pytest.skip("the SPICE CoreNLP jars are installed here; the skip path cannot be exercised")
    lib = pycocoevalcap_dir() / "spice" / "lib"
    before = sorted(p.name for p in lib.iterdir()) if lib.is_dir() else []
    refs, preds, _ = data
    result = score_captions(refs, preds, EvalOptions(metrics=("bleu", "spice"), tokenizer="simple"))
    assert "SPICE" not in result.metrics and "Bleu_4" in result.metrics
    assert (
        "stanford-corenlp-3.6.0.jar" in result.skipped["spice"] and "nothing was downloaded" in result.skipped["spice"]
    )
    assert "\n" not in result.skipped["spice"]
    after = sorted(p.name for p in lib.iterdir()) if lib.is_dir() else []
    assert before == after


@needs_java
def test_ptb_tokenizer_matches_pycocoevalcap_conventions() -> None:
    caps = [
        "A man riding a horse.",
        "The dog's \"ball\" -- isn't red!",
        "(a) café, 5:30 pm",
        "",
        "trailing empty next",
        "",
    ]
    out = ptb_tokenize(caps, JAVA)
    assert out == [
        "a man riding a horse",
        "the dog 's ball is n't red",
        "-lrb- a -rrb- café 5:30 pm",
        "",
        "trailing empty next",
        "",
    ]
    assert simple_tokenize(caps) == out


def test_broken_java_gives_one_line_errors(tmp_path: Path) -> None:
    false = shutil.which("false")
    if false is None:
        pytest.skip("no `false` executable")
    with pytest.raises(PipelineError, match="METEOR exited") as exc:
        meteor_scores(["a dog"], [["a dog runs"]], JavaRun(false, 30, "2G"))
    assert "\n" not in str(exc.value)
    with pytest.raises(PipelineError, match="PTB tokenizer failed"):
        score_captions({1: ["a dog"]}, {1: "a dog"}, EvalOptions(java=false, metrics=("bleu",)))


# ----------------------------------------------------------------------------- files and policies


def _write(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


@pytest.fixture()
def ref_file(tmp_path: Path) -> Path:
    anns = [
        {"image_id": i, "id": 10 * i + k, "caption": c}
        for i in (1, 2, 3)
        for k, c in enumerate(["a red circle", "one red circle"])
    ]
    anns.append({"image_id": 3, "id": 99, "caption": "  "})
    return _write(tmp_path / "refs.json", {"images": [{"id": i} for i in (1, 2, 3)], "annotations": anns})


def test_reference_file_validation(tmp_path: Path, ref_file: Path) -> None:
    refs, notes = load_references(ref_file)
    assert refs == {
        1: ["a red circle", "one red circle"],
        2: ["a red circle", "one red circle"],
        3: ["a red circle", "one red circle"],
    }
    assert notes == [f"1 empty reference captions in {ref_file} were ignored"]
    cases = [
        ({"images": []}, "not in COCO captions format"),
        ({"annotations": [{"image_id": 1}]}, "annotation 0: expected an object with 'image_id' and 'caption'"),
        (
            {"annotations": [{"image_id": 1.5, "caption": "x"}]},
            "annotation 0: 'image_id' must be an integer or a string",
        ),
        ({"annotations": [{"image_id": 1, "caption": 3}]}, "annotation 0: 'caption' must be a string"),
        ({"annotations": []}, "holds no reference captions"),
        ("{not json", "is not valid JSON"),
        ([1, 2], "must hold a JSON dict"),
    ]
    for k, (content, message) in enumerate(cases):
        path = _write(tmp_path / f"bad{k}.json", content)
        with pytest.raises(UsageError, match=message) as exc:
            load_references(path)
        assert str(path) in str(exc.value)
    with pytest.raises(UsageError, match="references file not found"):
        load_references(tmp_path / "missing.json")


def test_predictions_file_validation(tmp_path: Path) -> None:
    cases = [
        ({"image_id": 1, "caption": "x"}, "must hold a JSON list"),
        ([], "is empty"),
        ([{"image_id": 1}], "entry 0: expected an object"),
        ([{"image_id": 1, "caption": "x"}, {"image_id": None, "caption": "x"}], "entry 1: 'image_id' must be"),
        ([{"image_id": 1, "caption": ["x"]}], "entry 0: 'caption' must be a string"),
    ]
    for k, (content, message) in enumerate(cases):
        path = _write(tmp_path / f"pred{k}.json", content)
        with pytest.raises(UsageError, match=message) as exc:
            load_predictions(path)
        assert str(path) in str(exc.value)
    path = _write(tmp_path / "ok.json", [{"image_id": 2, "caption": "b", "id": 7}, {"image_id": "x", "caption": "a"}])
    assert load_predictions(path) == [(2, "b"), ("x", "a")]


def test_match_policies() -> None:
    refs = {1: ["a"], 2: ["b"], 3: ["c"]}
    dup = [(1, "a"), (2, "b"), (1, "z")]
    with pytest.raises(UsageError, match=r"res.json: 1 image ids have more than one caption \(1\).*duplicates=first"):
        match_predictions(dup, refs, "res.json")
    m = match_predictions(dup, refs, "res.json", duplicates="first")
    assert m.predictions == {1: "a", 2: "b"} and m.references == {1: ["a"], 2: ["b"]}
    assert any("first of each" in n for n in m.notes) and any("2 of 3 reference images" in n for n in m.notes)

    unknown = [(1, "a"), (7, "x")]
    with pytest.raises(UsageError, match=r"1 of 2 image ids have no reference captions \(7\).*unknown_images=drop"):
        match_predictions(unknown, refs, "res.json")
    m = match_predictions(unknown, refs, "res.json", unknown_images="drop")
    assert m.predictions == {1: "a"}
    with pytest.raises(UsageError, match="predictions use str ids, references int ids"):
        match_predictions([("1", "a"), ("2", "b")], refs, "res.json", unknown_images="drop")

    empty = [(1, "a"), (2, "  ")]
    assert match_predictions(empty, refs, "r.json").predictions[2] == "  "
    with pytest.raises(UsageError, match=r"1 empty captions \(2\)"):
        match_predictions(empty, refs, "r.json", empty_captions="error")
    with pytest.raises(UsageError, match="evaluate.duplicates must be one of"):
        match_predictions(empty, refs, "r.json", duplicates="last")


def test_evaluate_files_end_to_end_without_java(tmp_path: Path, ref_file: Path) -> None:
    preds = _write(
        tmp_path / "res.json",
        [{"image_id": 1, "caption": "A red circle."}, {"image_id": 2, "caption": "two blue squares"}],
    )
    result = evaluate_files(preds, ref_file, EvalOptions(metrics=("bleu", "rouge", "cider"), tokenizer="simple"))
    assert result.image_ids == [1, 2]
    per = dict(zip(result.image_ids, result.per_image["ROUGE_L"]))
    assert per[1] == pytest.approx(1.0) and per[2] == 0.0
    assert any("empty reference captions" in n for n in result.notes)
    assert any("2 of 3 reference images" in n for n in result.notes)
    payload = result.to_json(per_image=True)
    assert payload["num_images"] == 2 and payload["per_image"][0]["image_id"] == 1
    with pytest.raises(UsageError, match="unknown metric"):
        EvalOptions(metrics=("bleu", "wer"))
