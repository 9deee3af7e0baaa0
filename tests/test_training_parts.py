"""Training building blocks: recipes from the model YAMLs, XE with one encoder pass, scheduled sampling,
SCST samplers and baselines, batch order and sharding, oracle features."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from models import build_captioner
from pipeline.core.config import CONFIG_DIR, load_config, load_yaml_with_bases
from pipeline.core.distributed import DistContext
from pipeline.core.errors import ConfigError
from pipeline.core.vocab import BOS, EOS, PAD, Vocab
from pipeline.metrics.cider import CiderD
from pipeline.store import FeatureStore
from pipeline.training.recipe import stage_recipe
from pipeline.training.schedules import build_schedule
from pipeline.training.scst_step import scst_loss
from pipeline.training.xe import scheduled_sampling_log_probs, xe_loss_sum
from pipeline.world.generate import generate_world
from pipeline.world.oracle_features import oracle_dim, write_oracle_store
from pipeline.world.vocab import COLOUR_NAMES, SHAPES


def recipe(model: str, stage: str, overrides=None):
    sched = load_yaml_with_bases(CONFIG_DIR / "models" / f"{model}.yaml")["schedule"]
    return stage_recipe(stage, sched, overrides, 30, model)


def lrs(spec: dict, epochs: list[int], iteration: int = 10**6) -> list[float]:
    out = []
    for e in epochs:
        s = build_schedule(spec)
        s.iteration, s.epoch = iteration, e
        out.append(s.lr())
    return out


def test_paper_recipes_from_the_model_yamls() -> None:
    san = recipe("ngsan", "xe")  # NG-SAN: 3e-4, linear warm-up 33k its, x0.5 every 3 epochs from epoch 6
    assert san.epochs == 15 and san.batch_size == 10 and san.optimizer == "adam"
    assert lrs(san.schedule, [0, 5, 6, 8, 9]) == pytest.approx([3e-4, 3e-4, 1.5e-4, 1.5e-4, 7.5e-5])
    assert lrs(san.schedule, [0], iteration=16499)[0] == pytest.approx(1.5e-4)
    m2 = recipe("m2", "xe")  # Noam, warm-up 10k, d 512, patience 5
    assert m2.schedule["type"] == "noam" and m2.schedule["warmup"] == 10000 and m2.patience == 5 and m2.epochs == 30
    m2s = recipe("m2", "scst")
    assert (m2s.sample_method, m2s.baseline, m2s.num_samples, m2s.pg_normalize) == ("beam", "mean", 5, "steps")
    assert m2s.schedule == {"type": "constant", "lr": 5e-6}
    aoa = recipe("aoa", "xe")  # 2e-4 x 0.8 every 3 epochs, LS 0.2, clamp 0.1, scheduled sampling
    assert lrs(aoa.schedule, [0, 2, 3, 6]) == pytest.approx([2e-4, 2e-4, 1.6e-4, 1.28e-4])
    assert aoa.label_smoothing == 0.2 and aoa.grad_clip_value == 0.1 and aoa.epochs == 25
    assert [aoa.ss_prob(e) for e in (0, 4, 5, 10, 20, 24)] == pytest.approx([0, 0, 0.05, 0.1, 0.2, 0.2])
    aoas = recipe("aoa", "scst")
    assert aoas.schedule["type"] == "plateau" and aoas.baseline == "greedy" and aoas.scheduled_sampling is None
    ban = recipe("ban", "xe")
    assert ban.optimizer == "adamax" and ban.grad_clip_norm == 0.25
    assert lrs(ban.schedule, [0, 3, 9, 10, 12]) == pytest.approx([5e-4, 2e-3, 2e-3, 5e-4, 1.25e-4])
    assert recipe("san", "xe", {"epochs": 2, "lr": 1e-3}).schedule["lr"] == 1e-3
    with pytest.raises(ConfigError, match="unknown key"):
        recipe("san", "xe", {"epochz": 2})
    with pytest.raises(ConfigError, match="baseline"):
        recipe("san", "scst", {"baseline": "best"})


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    vocab = Vocab(("<pad>", "<bos>", "<eos>", "<unk>") + tuple(f"w{i}" for i in range(12)))
    model = build_captioner(
        "san", len(vocab), feat_dim=8, d_model=32, num_heads=4, d_ff=64, num_layers=1, dropout=0.0, embed_dropout=0.0
    )
    g = torch.Generator().manual_seed(1)
    b, n = 3, 5
    caps = torch.randint(4, len(vocab), (7, 6), generator=g)
    caps[:, 0] = BOS
    caps[:, 4] = EOS
    caps[:, 5] = PAD
    batch = {
        "feats": torch.randn(b, n, 8, generator=g),
        "mask": torch.ones(b, n, dtype=torch.bool),
        "boxes": torch.tensor([0.0, 0.0, 10.0, 10.0]).expand(b, n, 4).clone(),
        "sizes": torch.full((b, 2), 20.0),
        "captions": caps,
        "caption_image": torch.tensor([0, 0, 0, 1, 1, 2, 2]),
        "keys": ["a", "b", "c"],
    }
    return model, vocab, batch


def test_xe_encodes_each_image_once_and_equals_per_caption_encoding(tiny) -> None:
    model, _, batch = tiny
    model.eval()
    calls = []
    orig = model.encode
    model.encode = lambda *a: calls.append(a[0].shape[0]) or orig(*a)  # count encoder passes and their rows
    try:
        loss, count = xe_loss_sum(model, batch)
    finally:
        del model.encode
    assert calls == [3] and int(count) == 7 * 4
    img = batch["caption_image"]
    per_caption = model(
        batch["feats"][img], batch["mask"][img], batch["boxes"][img], batch["sizes"][img], batch["captions"][:, :-1]
    )
    ref = -per_caption.gather(-1, batch["captions"][:, 1:, None])[..., 0][batch["captions"][:, 1:] != PAD].sum()
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-5)
    # the step-by-step path (used by scheduled sampling) with p = 0 is teacher forcing
    stepwise = scheduled_sampling_log_probs(model, batch, batch["captions"][:, :-1], 0.0)
    parallel = model(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"], batch["captions"][:, :-1], img)
    assert torch.allclose(stepwise, parallel, atol=1e-5)
    # with p = 1 every input after BOS is a model sample, so the log-probs change
    torch.manual_seed(0)
    assert not torch.allclose(
        scheduled_sampling_log_probs(model, batch, batch["captions"][:, :-1], 1.0), parallel, atol=1e-3
    )


@pytest.mark.parametrize("method,baseline", [("sample", "greedy"), ("sample", "mean_of_others"), ("beam", "mean")])
def test_scst_samplers_and_baselines_give_gradients(tiny, method, baseline) -> None:
    model, vocab, batch = tiny
    model.train()
    scorer = CiderD({"a": ["w4 w5 w6", "w4 w5"], "b": ["w7 w8 w9"], "c": ["w10 w11", "w4 w10 w11"]})
    base = np.array([0.1, 0.2, 0.3]) if baseline == "greedy" else None
    model.zero_grad()
    out = scst_loss(
        model,
        batch,
        scorer,
        vocab,
        method=method,
        num_samples=3,
        max_len=6,
        baseline=baseline,
        normalize="steps" if method == "beam" else "tokens",
        baseline_rewards=base,
    )
    assert torch.isfinite(out.loss_sum) and out.count > 0
    out.loss_sum.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0
    if baseline == "greedy":
        assert out.baseline_reward == pytest.approx(0.2)


def test_batch_order_is_a_function_of_seed_and_epoch_and_shards_partition(tmp_path) -> None:
    from pipeline.training.batches import epoch_batches, eval_batches

    class DS:
        def __init__(self, n):
            self.counts = np.random.default_rng(0).integers(1, 30, n)

        def num_boxes(self):
            return self.counts

        def __len__(self):
            return len(self.counts)

    ds = DS(53)
    one = epoch_batches(ds, 8, 5, 2, DistContext())
    assert one == epoch_batches(ds, 8, 5, 2, DistContext()) and one != epoch_batches(ds, 8, 5, 3, DistContext())
    assert sorted(i for b in one for i in b) == list(range(53))
    r0, r1 = (epoch_batches(ds, 8, 5, 2, DistContext(rank=r, world=2)) for r in (0, 1))
    assert len(r0) == len(r1) and all(sorted(a + b) == sorted(g) for a, b, g in zip(r0, r1, one))
    e0, e1 = (eval_batches(ds, 8, DistContext(rank=r, world=2)) for r in (0, 1))
    flat = [i for b in e0 + e1 for i in b]
    assert sorted(flat) == list(range(53)) and len(set(flat)) == 53  # every image once, no duplicates


def test_oracle_features_encode_the_ground_truth(tmp_path) -> None:
    generate_world(tmp_path / "w", load_config("world", None, ["world.num_images=12", "world.num_workers=1"]).world)
    summary = write_oracle_store(tmp_path / "w", tmp_path / "s", noise=0.0)
    assert summary["images"] == 12 and summary["feature_dim"] == oracle_dim()
    store = FeatureStore(tmp_path / "s")
    assert store.identity["name"] == "oracle"
    inst = json.loads((tmp_path / "w/annotations/instances_train.json").read_text())
    img = inst["images"][0]
    anns = [a for a in inst["annotations"] if a["image_id"] == img["id"]]
    rec = store.get(str(img["id"]))
    assert rec["features"].shape == (len(anns), oracle_dim())
    for row, box, ann in zip(rec["features"], rec["boxes"], anns):
        assert np.argmax(row[: len(SHAPES)]) == ann["category_id"] - 1
        assert np.argmax(row[len(SHAPES) : len(SHAPES) + len(COLOUR_NAMES)]) == min(ann["attribute_ids"]) - 1
        x, y, w, h = ann["bbox"]
        assert np.allclose(box, [x, y, x + w, y + h], atol=1e-3)
    again = write_oracle_store(tmp_path / "w", tmp_path / "s", noise=0.0)
    assert again["written"] == 0  # resumable: nothing is rewritten


def test_rewards_of_samples_sharing_no_ngram_with_the_references_are_zero() -> None:
    """An untrained policy can emit only words absent from the references: the reward is 0, not a crash."""
    scorer = CiderD({"a": ["w4 w5 w6", "w4 w5"], "b": ["w7 w8 w9"]})
    assert scorer.scores(["x y z", "q"], ["a", "b"]).tolist() == [0.0, 0.0]


def test_noam_without_warmup_is_refused_not_silently_replaced() -> None:
    from pipeline.core.errors import ConfigError

    with pytest.raises(ConfigError, match="warmup_iters >= 1"):
        recipe("m2", "xe", {"warmup_iters": 0})
    assert recipe("m2", "xe", {"warmup_iters": 50}).schedule["warmup"] == 50


@pytest.mark.parametrize(
    "synonym,value,one_spelling",
    [
        ("max_epochs", 3, "epochs"),
        ("warmup_steps", 100, "warmup_iters"),
        ("grad_clip", 1.0, "grad_clip_norm"),
        ("seq_per_img", 5, "captions_per_image"),
    ],
)
def test_the_recipe_accepts_no_synonym(synonym, value, one_spelling):
    """One spelling per schedule key: a synonym is refused (naming the known keys), never translated."""
    from pipeline.core.errors import ConfigError
    from pipeline.training.recipe import stage_recipe

    card = {"xe": {"epochs": 2, "lr": 1e-3, "lr_schedule": "constant", "batch_size": 4}}
    assert stage_recipe("xe", card, {one_spelling: value}, 5, "schedule") is not None
    with pytest.raises(ConfigError, match=f"unknown key\\(s\\) {synonym} .*{one_spelling}"):
        stage_recipe("xe", card, {synonym: value}, 5, "schedule")


@pytest.mark.parametrize(
    "change,message",
    [
        ({"lr_schedule": None}, "name the learning-rate schedule: lr_schedule: one of"),
        ({"lr_schedule": "reduce_on_plateau"}, "unknown schedule 'reduce_on_plateau' \\(known: "),
        ({"warmup": "noam"}, "warmup: linear or none"),
        ({"scheduled_sampling": {"start_epoch": 0}}, "unknown key\\(s\\) \\['start_epoch'\\]"),
    ],
)
def test_the_schedule_is_named_from_the_registry_without_hidden_defaults(change, message):
    from pipeline.core.errors import ConfigError
    from pipeline.training.recipe import stage_recipe

    card = {"xe": {"epochs": 2, "lr": 1e-3, "lr_schedule": "step", "batch_size": 4, **change}}
    with pytest.raises(ConfigError, match=message):
        stage_recipe("xe", card, None, 5, "schedule")


def test_scst_mean_baseline_has_one_name():
    from pipeline.core.errors import ConfigError
    from pipeline.training.recipe import stage_recipe

    card = {"scst": {"epochs": 1, "lr": 1e-5, "lr_schedule": "constant", "batch_size": 4, "num_samples": 5}}
    assert stage_recipe("scst", card, {"baseline": "mean"}, 5, "schedule").baseline == "mean"
    with pytest.raises(ConfigError, match="baseline must be one of greedy, mean_of_others, mean"):
        stage_recipe("scst", card, {"baseline": "mean_of_samples"}, 5, "schedule")
