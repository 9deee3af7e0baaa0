"""`evaluate`, `train-encoder` and `embed` everyday options: --num-workers reads the store (or tokenises the
sentences) in DataLoader worker processes with outputs identical to 0 workers; `embed --precision` runs the
encoder under autocast (bf16 close to fp32, fp32 exactly as without autocast, fp16 refused on CPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from train_helpers import make_world_run, train_overrides
from typer.testing import CliRunner

from cli import app
from pipeline.caption_data.prepared import PreparedCaptions
from pipeline.commands.embed import EMBED_EVERYDAY, ENCODER_EVERYDAY
from pipeline.commands.evaluate import EVALUATE_EVERYDAY
from pipeline.commands.options import CommandOptions
from pipeline.core import threads as thread_policy
from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext
from pipeline.embedding import data as enc_data
from pipeline.embedding.checkpoint import load_encoder
from pipeline.embedding.embed import SentenceBatches, sentence_batches
from pipeline.embedding.retrieval import words_to_inputs
from pipeline.embedding.train import EncoderTrainer, train_encoder
from pipeline.store import FeatureStore
from pipeline.training.api import train_captioner

ENC = (
    "{objective: cap2img, word_dim: 16, hidden_size: 24, attn_hidden: 12, attn_rows: 3, image_head_hidden: 32, "
    "image_head_dropout: 0.0}"
)
SENTENCES = [
    "a red circle above a blue square",
    "two green triangles",
    "   ",
    "a small circle",
    "words nobody knows",
    "a blue square left of a red triangle and a green circle",
]
#: workers the thread policy grants for a request of 2 on this machine (0 where the cores allow none)
GRANTED = thread_policy.plan(workers=2).workers


def _encoder_cfg(run: Path, *extra: str):
    return load_config(
        "embed",
        None,
        [
            f"sentence_encoder.model_overrides={ENC}",
            f"sentence_encoder.store={run / 'features/store'}",
            f"sentence_encoder.data={run / 'data'}",
            "sentence_encoder.device=cpu",
            "sentence_encoder.batch_size=16",
            "sentence_encoder.epochs=1",
            *extra,
        ],
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A 60-image synthetic world (oracle store, prepared captions), a 1-epoch tiny SAN and a 1-epoch tiny encoder."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("storeworkers")
    run = make_world_run(root, num_images=60)
    cfg = load_config(
        "train",
        None,
        train_overrides(
            run, "san", "train.stages=[xe]", "train.xe={epochs: 1, batch_size: 16, lr: 2.0e-3, warmup_iters: 0}"
        ),
    )
    captioner = train_captioner(run, cfg).directory / "best.pt"
    torch.manual_seed(0)
    train_encoder(root / "out", _encoder_cfg(run))
    return run, captioner, root / "out/encoder/best.pt"


def _record_pids(monkeypatch, cls, log: Path) -> None:
    """Wrap ``cls.__getitem__`` to note the reading process's pid in ``log`` (workers are forked: they see it)."""
    real = cls.__getitem__

    def getitem(self, i):
        with open(log, "a", encoding="utf-8") as fh:
            fh.write(f"{os.getpid()}\n")
        return real(self, i)

    monkeypatch.setattr(cls, "__getitem__", getitem)


def _pids(log: Path) -> set[int]:
    return {int(x) for x in log.read_text().split()} if log.exists() else set()


def _assert_read_in_workers(log: Path) -> None:
    pids = _pids(log)
    assert pids, "nothing was read through the dataset"
    if GRANTED:
        assert os.getpid() not in pids, f"with {GRANTED} worker(s) every read happens in a worker, got pids {pids}"


def invoke(*args: str):
    return CliRunner().invoke(app, [*args, "--quiet"])


def test_everyday_options_reach_the_config_keys() -> None:
    opts = dict(device="cpu", batch_size=5, precision="bf16", num_workers=2)
    ev = CommandOptions(everyday=EVALUATE_EVERYDAY, **opts).resolve("evaluate", show=False).evaluate
    assert (ev.device, ev.batch_size, ev.precision, ev.num_workers) == ("cpu", 5, "bf16", 2)
    cfg = CommandOptions(everyday=ENCODER_EVERYDAY, **opts).resolve("embed", show=False)
    assert (
        cfg.sentence_encoder.device,
        cfg.sentence_encoder.batch_size,
        cfg.sentence_encoder.precision,
        cfg.sentence_encoder.num_workers,
    ) == ("cpu", 5, "bf16", 2)
    cfg = CommandOptions(everyday=EMBED_EVERYDAY, **opts).resolve("embed", show=False)
    assert (cfg.embed.device, cfg.embed.batch_size, cfg.embed.precision, cfg.embed.num_workers) == ("cpu", 5, "bf16", 2)
    assert (
        cfg.sentence_encoder.num_workers == 0 and cfg.sentence_encoder.precision == "auto"
    )  # embed's options leave the encoder alone


def test_image_table_is_identical_for_0_and_2_workers(world, tmp_path, monkeypatch) -> None:
    run, _, _ = world
    store = FeatureStore(run / "features/store")
    keys = store.keys()
    for max_boxes in (None, 3):
        zero = enc_data.image_table(store, keys, max_boxes, num_workers=0, chunk=7)
        log = tmp_path / f"pids{max_boxes}"
        with monkeypatch.context() as m:
            _record_pids(m, enc_data.ImageMeans, log)
            two = enc_data.image_table(store, keys, max_boxes, num_workers=2, chunk=7)
        _assert_read_in_workers(log)
        assert zero.shape == (len(keys), store.feature_dim) and zero.dtype == np.float32
        assert np.array_equal(zero, two)
        first = store.get(keys[0])["features"][: max_boxes or None].astype(np.float32).mean(0)
        assert np.array_equal(zero[0], first)  # the mean region feature, as documented
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    enc_data.image_table(store, keys[:5], None, num_workers=2)
    list(sentence_batches(SENTENCES, PreparedCaptions.load(run / "data").vocab, 5, 2, num_workers=2))
    assert torch.equal(torch.rand(4), expected), (
        "reading must leave the global RNG (the encoder's initial weights) alone"
    )
    with pytest.raises(Exception, match="num_workers must be >= 0"):
        enc_data.image_table(store, keys, None, num_workers=-1)


def test_train_encoder_reads_its_image_table_in_workers(world, tmp_path, monkeypatch) -> None:
    run, _, _ = world
    base = EncoderTrainer(tmp_path / "a", _encoder_cfg(run).sentence_encoder, DistContext())
    log = tmp_path / "pids"
    _record_pids(monkeypatch, enc_data.ImageMeans, log)
    workers = EncoderTrainer(
        tmp_path / "b", _encoder_cfg(run, "sentence_encoder.num_workers=2").sentence_encoder, DistContext()
    )
    _assert_read_in_workers(log)
    assert torch.equal(base.train_images, workers.train_images)
    assert base.train_images.shape[0] == len(base.train_split.keys)
    assert np.array_equal(base.val_images, workers.val_images)


def _evaluate(run: Path, captioner: Path, out: Path, *extra: str):
    out.mkdir()
    res = invoke(
        "evaluate",
        "--model",
        str(captioner),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--split",
        "test",
        "--metrics",
        "bleu,cider",
        "--set",
        "evaluate.tokenizer=simple",
        "--device",
        "cpu",
        "--batch-size",
        "3",
        "--output",
        str(out / "m.json"),
        *extra,
    )
    assert res.exit_code == 0, res.output
    return json.loads((out / "predictions_test.json").read_text()), json.loads((out / "m.json").read_text())


def test_evaluate_model_decodes_the_same_with_store_workers(world, tmp_path, monkeypatch) -> None:
    from pipeline.data.dataset import CaptionDataset

    run, captioner, _ = world
    preds0, m0 = _evaluate(run, captioner, tmp_path / "w0", "--num-workers", "0")
    log = tmp_path / "pids"
    _record_pids(monkeypatch, CaptionDataset, log)
    preds2, m2 = _evaluate(run, captioner, tmp_path / "w2", "--num-workers", "2")
    _assert_read_in_workers(log)
    assert len(preds0) == m0["num_images"] > 3  # several decoding batches of 3
    assert len({p["caption"] for p in preds0}) > 1  # the captions depend on the images
    assert preds0 == preds2 and m0["metrics"] == m2["metrics"]


def test_decoding_batches_from_workers_equal_the_preloaded_ones(world) -> None:
    """What `evaluate --model` decodes from: the in-memory split (0 workers) and the store read by 2 workers
    give the same batches, tensor for tensor."""
    from pipeline.data.dataset import CaptionDataset
    from pipeline.training.batches import BatchSource, eval_batches

    run, _, _ = world
    dataset = CaptionDataset(run / "features/store", run / "data", "test")
    batches = eval_batches(dataset, 3, DistContext())
    cpu = torch.device("cpu")
    memory = list(BatchSource(dataset, "memory", cpu).iterate(batches))
    workers = list(BatchSource(dataset, "none", cpu, num_workers=2).iterate(batches))
    assert len(memory) == len(workers) == len(batches) > 1
    for a, b in zip(memory, workers):
        assert a.keys() == b.keys() and a["keys"] == b["keys"]
        for name in ("feats", "mask", "boxes", "sizes", "num_boxes"):
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_evaluate_retrieval_is_the_same_with_store_workers(world, tmp_path) -> None:
    run, _, encoder = world
    outs = []
    for n in ("0", "2"):
        out = tmp_path / f"r{n}.json"
        res = invoke(
            "evaluate",
            "--retrieval",
            str(encoder),
            "--store",
            str(run / "features/store"),
            "--data",
            str(run / "data"),
            "--num-workers",
            n,
            "--output",
            str(out),
        )
        assert res.exit_code == 0, res.output
        outs.append(json.loads(out.read_text())["retrieval"])
    assert outs[0] == outs[1] and outs[0]["split_images"] > 3


def _embed(encoder: Path, sentences: Path, out: Path, *extra: str):
    res = invoke("embed", "-k", str(encoder), "-i", str(sentences), "--output", str(out), "--batch-size", "2", *extra)
    assert res.exit_code == 0, res.output
    return np.load(out) if out.suffix == ".npy" else out.read_text()


def test_embed_tokenises_in_workers_with_the_same_output_and_guard(world, tmp_path, monkeypatch) -> None:
    _, _, encoder = world
    sents = tmp_path / "s.jsonl"  # JSON lines: the blank sentence reaches the guard (a text file skips blank lines)
    sents.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES))
    zero = _embed(encoder, sents, tmp_path / "e0.npy", "--num-workers", "0")
    log = tmp_path / "pids"
    _record_pids(monkeypatch, SentenceBatches, log)
    two = _embed(encoder, sents, tmp_path / "e2.npy", "--num-workers", "2")
    _assert_read_in_workers(log)
    assert zero.shape[0] == len(SENTENCES) and np.isnan(zero[2]).all()  # the blank sentence: guarded, row kept
    assert np.array_equal(zero, two, equal_nan=True)
    fails = (tmp_path / "e0.npy.failures.jsonl").read_text()
    assert fails == (tmp_path / "e2.npy.failures.jsonl").read_text() and '"line": 3' in fails
    jsonl = [_embed(encoder, sents, tmp_path / f"e{n}.jsonl", "--num-workers", n) for n in ("0", "2")]
    assert jsonl[0] == jsonl[1]


def test_embed_precision_bf16_close_to_fp32_and_fp32_unchanged(world, tmp_path) -> None:
    _, _, encoder = world
    sents = tmp_path / "s.txt"
    good = [s for s in SENTENCES if s.strip()]
    sents.write_text("\n".join(good) + "\n")
    # CPU claims (exact fp32 values, fp16 refused): the device is pinned so they hold on a CUDA machine too
    fp32 = _embed(encoder, sents, tmp_path / "f.npy", "--precision", "fp32", "--batch-size", "64", "--device", "cpu")
    bf16 = _embed(encoder, sents, tmp_path / "b.npy", "--precision", "bf16", "--batch-size", "64", "--device", "cpu")
    # fp32: exactly the encoder's forward without autocast on the same padded batch
    model, vocab, _ = load_encoder(encoder, torch.device("cpu"))
    tokens, lengths = words_to_inputs(good, vocab, int(load_config("embed", None, []).embed.max_words))
    with torch.no_grad():
        ref = model.eval().encode(tokens, lengths)["h"].numpy()
    assert np.array_equal(fp32, ref)
    # bf16 autocast ran (the vectors differ) and stays close: per row cosine > 0.999, |diff| < 2% of the row's largest
    # entry
    assert not np.array_equal(fp32, bf16)
    cos = (fp32 * bf16).sum(1) / np.linalg.norm(fp32, axis=1) / np.linalg.norm(bf16, axis=1)
    rel = np.abs(fp32 - bf16).max(1) / np.abs(fp32).max(1)
    print(f"\nbf16 vs fp32: min cosine {cos.min():.6f}, max relative deviation {rel.max():.4f}")
    assert cos.min() > 0.999 and rel.max() < 0.02
    res = invoke(
        "embed",
        "-k",
        str(encoder),
        "-i",
        str(sents),
        "--output",
        str(tmp_path / "h.npy"),
        "--precision",
        "fp16",
        "--device",
        "cpu",
    )
    assert (
        res.exit_code == 2
        and "embed.precision=fp16 needs a CUDA device" in res.output
        and "Traceback" not in res.output
    )


def test_evaluate_retrieval_encodes_under_the_precision_option(world, tmp_path, monkeypatch) -> None:
    """`evaluate --retrieval --precision` reaches the caption encoding: bf16 runs the encoder's linear layers in
    bfloat16 (seen by a forward hook) and gives a full report; fp16 on CPU is refused in one line."""
    from pipeline.embedding.sentence_encoder import SentenceEncoder

    run, _, encoder = world
    args = (
        "evaluate",
        "--retrieval",
        str(encoder),
        "--store",
        str(run / "features/store"),
        "--data",
        str(run / "data"),
        "--device",
        "cpu",
    )  # the CPU claim (fp16 refused) holds on a CUDA machine too
    res = invoke(*args, "--precision", "fp16")
    assert (
        res.exit_code == 2
        and "evaluate.precision=fp16 needs a CUDA device" in res.output
        and "Traceback" not in res.output
    )
    dtypes: list[torch.dtype] = []
    real = SentenceEncoder.predict_image

    def spy(self, h):
        out = real(self, h)
        dtypes.append(out.dtype)
        return out

    monkeypatch.setattr(SentenceEncoder, "predict_image", spy)
    reports = {}
    for precision in ("fp32", "bf16"):
        dtypes.clear()
        out = tmp_path / f"{precision}.json"
        res = invoke(*args, "--precision", precision, "--output", str(out))
        assert res.exit_code == 0, res.output
        assert dtypes and set(dtypes) == {torch.float32 if precision == "fp32" else torch.bfloat16}, dtypes
        reports[precision] = json.loads(out.read_text())["retrieval"]
    for rep in reports.values():
        recalls = {k: v for k, v in rep["ground_truth"].items() if "_R@" in k and "chance" not in k}
        assert len(recalls) == 6 and all(0.0 <= v <= 100.0 for v in recalls.values()), rep
