"""Retrieval metrics on hand-built similarity matrices, encoder training on the synthetic world (far above
chance, exact resume), and the `embed` / `train-encoder` / `evaluate --retrieval` command lines."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from train_helpers import make_world_run
from typer.testing import CliRunner

from cli import app
from pipeline.core.checkpoint import save_checkpoint
from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext
from pipeline.embedding.train import EncoderTrainer, train_encoder
from pipeline.metrics.retrieval import caption_to_image_ranks, image_to_caption_ranks, recall_at, retrieval_metrics
from pipeline.training.engine import TrainingInterrupted

# -- metrics -------------------------------------------------------------------------------------------


def test_recall_on_a_hand_built_matrix() -> None:
    # 4 captions x 3 images; captions 0, 1 belong to image 0, caption 2 to image 1, caption 3 to image 2
    sim = np.array(
        [
            [0.9, 0.1, 0.2],  # own image first            -> rank 0
            [0.5, 0.7, 0.6],  # own image third            -> rank 2
            [0.3, 0.2, 0.8],  # own image (1) third        -> rank 2
            [0.1, 0.4, 0.3],  # own image (2) second       -> rank 1
        ]
    )
    own = np.array([0, 0, 1, 2])
    assert caption_to_image_ranks(sim, own).tolist() == [0, 2, 2, 1]
    # image 0: best own caption 0 (0.9), nobody above -> 0; image 1: own caption 2 (0.2), captions 0.4/0.7 above -> 2
    # image 2: own caption 3 (0.3): captions 0.8 (c2), 0.6 (c1) above -> 2
    assert image_to_caption_ranks(sim, own).tolist() == [0, 2, 2]
    m = retrieval_metrics(sim, own, ks=(1, 2))
    assert m["c2i_R@1"] == pytest.approx(25.0) and m["c2i_R@2"] == pytest.approx(50.0)
    assert m["i2c_R@1"] == pytest.approx(100 / 3) and m["i2c_R@2"] == pytest.approx(100 / 3)
    assert m["c2i_medr"] == 2.5 and m["c2i_chance_R@1"] == pytest.approx(100 / 3)


def test_perfect_constant_and_ties() -> None:
    own = np.arange(5)
    assert retrieval_metrics(np.eye(5), own)["c2i_R@1"] == 100.0 == retrieval_metrics(np.eye(5), own)["i2c_R@1"]
    flat = retrieval_metrics(np.zeros((5, 5)), own)  # ties count against the query: no free hits
    assert flat["c2i_R@1"] == 0.0 and flat["i2c_R@1"] == 0.0 and flat["c2i_R@5"] == 100.0
    assert recall_at(np.array([0, 3, 9, 10]), (1, 5, 10)) == {1: 25.0, 5: 50.0, 10: 75.0}
    with pytest.raises(ValueError):
        retrieval_metrics(np.zeros((3, 2)), np.array([0, 1]))
    with pytest.raises(ValueError):
        retrieval_metrics(np.zeros((2, 2)), np.array([0, 2]))


def test_random_scores_sit_near_chance() -> None:
    rng = np.random.default_rng(0)
    m = retrieval_metrics(rng.normal(size=(2000, 100)), rng.integers(0, 100, 2000))
    assert abs(m["c2i_R@1"] - 1.0) < 1.0 and abs(m["c2i_R@10"] - 10.0) < 3.0


# -- training on the synthetic world ---------------------------------------------------------------------

TINY = (
    "{objective: cap2img, word_dim: 32, hidden_size: 48, attn_hidden: 24, attn_rows: 6, image_head_hidden: 96, "
    "image_head_dropout: 0.0}"
)


def _cfg(run: Path, *extra: str):
    return load_config(
        "embed",
        None,
        [
            f"sentence_encoder.model_overrides={TINY}",
            f"sentence_encoder.store={run / 'features/store'}",
            f"sentence_encoder.data={run / 'data'}",
            "sentence_encoder.device=cpu",
            "sentence_encoder.batch_size=32",
            "sentence_encoder.lr=3.0e-3",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("enc")
    run = make_world_run(root, num_images=200)
    torch.manual_seed(0)
    res = train_encoder(root / "out", _cfg(run, "sentence_encoder.epochs=6"))
    return run, root / "out" / "encoder", res


def test_cap2img_training_beats_chance_by_far(trained) -> None:
    run, enc, res = trained
    history = res.summary["history"]
    best = res.summary["best"]
    chance = history[0]["c2i_chance_R@1"]
    print(
        f"\nval caption-to-image R@1 {best['value']:.1f} (chance {chance:.1f}); "
        f"per epoch {[round(h['c2i_R@1'], 1) for h in history]}"
    )
    assert best["value"] > 5 * chance
    assert history[-1]["c2i_R@1"] > history[0]["c2i_R@1"] or best["epoch"] > 0
    records = [json.loads(line) for line in (enc / "log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in records] == list(range(6))
    assert records[-1]["loss"] < records[0]["loss"]


def test_resume_is_exact(trained, tmp_path) -> None:
    """Two epochs in one go == one epoch, a new process-like trainer resuming last.pt, one more epoch."""
    run, _, _ = trained
    two = _cfg(
        run,
        "sentence_encoder.epochs=2",
        "sentence_encoder.batch_size=64",
        "sentence_encoder.validation.split=null",
        "sentence_encoder.model_overrides.image_head_dropout=0.3",
    ).sentence_encoder
    one = two.with_overrides({"epochs": 1})
    EncoderTrainer(tmp_path / "a", two, DistContext()).run()
    EncoderTrainer(tmp_path / "b", one, DistContext()).run()
    EncoderTrainer(tmp_path / "b", two, DistContext()).run()
    epochs = [json.loads(line)["epoch"] for line in (tmp_path / "b/log.jsonl").read_text().splitlines()]
    assert epochs == [0, 1], "the second run must resume after epoch 0, not start over"
    # and mid-epoch: a signal stops the run after its next step; a new trainer resumes at that batch
    stopped = EncoderTrainer(tmp_path / "c", two, DistContext())
    stopped.stop_signal = signal.SIGTERM
    with pytest.raises(TrainingInterrupted, match="batch 1"):
        stopped.run()
    resumed = EncoderTrainer(tmp_path / "c", two, DistContext())
    assert resumed._resume().position == 1  # picks up after the first batch of epoch 0
    resumed.run()
    wa = torch.load(tmp_path / "a/last.pt", weights_only=True)["weights"]
    for other in ("b", "c"):
        wb = torch.load(tmp_path / other / "last.pt", weights_only=True)["weights"]
        for k in wa:
            assert torch.equal(wa[k], wb[k]), (other, k)


# -- command lines ----------------------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def test_embed_writes_npy_jsonl_and_heatmap(trained, tmp_path) -> None:
    _, enc, _ = trained
    sents = tmp_path / "s.txt"
    sents.write_text("a red circle above a blue square\n\na small green triangle\nwords nobody knows\n")
    r = invoke(
        "embed",
        "-k",
        str(enc / "best.pt"),
        "-i",
        str(sents),
        "--output",
        str(tmp_path / "e.npy"),
        "--visualize",
        str(tmp_path / "a.png"),
    )
    assert r.exit_code == 0, r.output
    arr = np.load(tmp_path / "e.npy")
    assert arr.shape == (3, 96) and np.isfinite(arr).all() and not np.allclose(arr[0], arr[1])
    png = Image.open(tmp_path / "a.png")
    assert png.format == "PNG" and png.size[0] > 300 and png.size[1] > 3 * 100
    pixels = np.asarray(png.convert("RGB"))
    assert (pixels[..., 1] < 200).sum() > 1000  # shaded cells are drawn
    jl = tmp_path / "s.jsonl"
    jl.write_text('{"text": "a red circle"}\n{"caption": "two squares"}\n')
    r = invoke(
        "embed",
        "-k",
        str(enc / "best.pt"),
        "-i",
        str(jl),
        "--output",
        str(tmp_path / "e.jsonl"),
        "--set",
        "embed.output=image",
    )
    assert r.exit_code == 0, r.output
    rows = [json.loads(line) for line in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert [x["text"] for x in rows] == ["a red circle", "two squares"] and len(
        rows[0]["embedding"]
    ) == 22  # the oracle feature size


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_args", "Missing option '--checkpoint'"),
        ("missing_input", "input file not found"),
        ("bad_suffix", "--output must end in .npy or .jsonl"),
        ("bad_png", "--visualize must name a .png"),
        ("bad_jsonl", "not a JSON line"),
        ("empty", "holds no sentence"),
        ("missing_ckpt", "checkpoint not found"),
    ],
)
def test_embed_bad_inputs_exit_2_with_one_line(trained, tmp_path, case: str, message: str) -> None:
    _, enc, _ = trained
    good = tmp_path / "s.txt"
    good.write_text("a red circle\n")
    args = ["embed", "-k", str(enc / "best.pt"), "-i", str(good), "--output", str(tmp_path / "e.npy")]
    if case == "no_args":
        args = ["embed"]
    elif case == "missing_input":
        args[4] = str(tmp_path / "nope.txt")
    elif case == "bad_suffix":
        args[6] = str(tmp_path / "e.csv")
    elif case == "bad_png":
        args += ["--visualize", str(tmp_path / "a.jpg")]
    elif case == "bad_jsonl":
        (tmp_path / "b.jsonl").write_text("{oops\n")
        args[4] = str(tmp_path / "b.jsonl")
    elif case == "empty":
        (tmp_path / "e.txt").write_text("\n\n")
        args[4] = str(tmp_path / "e.txt")
    elif case == "missing_ckpt":
        args[2] = str(tmp_path / "none.pt")
    r = invoke(*args)
    assert r.exit_code == 2, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output


def test_evaluate_retrieval_ground_truth_and_generated(trained, tmp_path) -> None:
    run, enc, _ = trained
    refs = json.loads((run / "data/references.json").read_text())
    images = json.loads((run / "data/images.json").read_text())["images"]
    test = [im for im in images if im["split"] == "test"]
    results = tmp_path / "results.json"
    results.write_text(json.dumps([{"image_id": im["cocoid"], "caption": refs[im["key"]][0]} for im in test]))
    out = tmp_path / "m.json"
    r = invoke(
        "evaluate",
        "-p",
        str(results),
        "-r",
        str(run.parent / "world/annotations/captions_test.json"),
        "-e",
        "bleu",
        "--set",
        "evaluate.tokenizer=simple",
        "--retrieval",
        str(enc / "best.pt"),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--output",
        str(out),
    )
    assert r.exit_code == 0, r.output
    payload = json.loads(out.read_text())
    assert "Bleu_4" in payload["metrics"] and payload["retrieval"]["generated_captions"] == len(test)
    gt, gen = payload["retrieval"]["ground_truth"], payload["retrieval"]["generated"]
    assert gt["c2i_R@1"] > 3 * gt["c2i_chance_R@1"] and gen["c2i_R@1"] > 3 * gen["c2i_chance_R@1"]
    assert "c2i_R@10" in r.output and "generated" in r.output


@pytest.mark.parametrize(
    "case,message",
    [
        ("no_store", "--retrieval needs --store"),
        ("store_alone", "--store and --data are used with"),
        ("cap2cap", "has no image head"),
        ("captioner_file", "holds a 'san' model, not a sentence encoder"),
        ("junk_file", "cannot read checkpoint"),
    ],
)
def test_evaluate_retrieval_bad_inputs(trained, tmp_path, case: str, message: str) -> None:
    run, enc, _ = trained
    store, data = str(run / "features/store"), str(run / "data")
    args = ["evaluate", "--retrieval", str(enc / "best.pt"), "--store", store, "--data", data]
    code = 2
    if case == "no_store":
        args = args[:3]
    elif case == "store_alone":
        args = ["evaluate", "-p", "x.json", "-r", "y.json", "--store", store]
    elif case == "cap2cap":
        ck = torch.load(enc / "best.pt", weights_only=True)
        ck["model"]["config"]["objective"] = "cap2cap"
        ck["weights"] = {k: v for k, v in ck["weights"].items() if not k.startswith("image_head")}
        ck["weights"].update({k: v for k, v in _cap2cap_weights(len(ck["vocab"]), ck["model"]["config"]).items()})
        torch.save(ck, tmp_path / "c.pt")
        args[2] = str(tmp_path / "c.pt")
    elif case == "captioner_file":
        save_checkpoint(
            tmp_path / "san.pt", {"kind": "weights", "model": {"name": "san", "config": {}}, "vocab": [], "weights": {}}
        )
        args[2] = str(tmp_path / "san.pt")
    elif case == "junk_file":
        (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
        args[2] = str(tmp_path / "junk.pt")
        code = 1  # an unreadable file is a runtime failure (exit 1), still one line
    r = invoke(*args)
    assert r.exit_code == code, r.output
    assert message in r.output and len(r.output.strip().splitlines()) == 1


def _cap2cap_weights(vocab_size: int, config: dict) -> dict:
    from pipeline.embedding.sentence_encoder import SentenceEncoder

    m = SentenceEncoder(vocab_size, 22, **{**config, "objective": "cap2cap"})
    return {k: v for k, v in m.state_dict().items() if k.startswith("decoder")}


def test_a_missing_store_names_the_sentence_encoder_key(tmp_path: Path) -> None:
    """The advice of the one-line error is a key the config accepts (sentence_encoder.*, not the refused encoder.*)."""
    from pipeline.core.errors import UsageError
    from pipeline.embedding.train import resolve_encoder_paths

    cfg = load_config("embed")
    with pytest.raises(UsageError) as err:
        resolve_encoder_paths(tmp_path, cfg.sentence_encoder)
    line = str(err.value)
    assert "--set sentence_encoder.store=PATH" in line and line.startswith("sentence_encoder.store is not set")
    cfg.with_overrides(["sentence_encoder.store=/x"])  # the advised key is accepted
