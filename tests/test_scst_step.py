"""The SCST step as the trainer runs it: the greedy baseline under the samples' autocast (a hook on the model
sees every forward under bf16 autocast)."""

from __future__ import annotations

import pytest
import torch

from pipeline.core.config import load_config
from pipeline.core.distributed import DistContext
from pipeline.core.vocab import EOS
from pipeline.training.engine import Progress, Trainer
from tests.train_helpers import make_world_run, train_overrides


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return make_world_run(tmp_path_factory.mktemp("scst_step"), num_images=40)


def trainer(run, tmp_path, model: str, *extra: str) -> Trainer:
    cfg = load_config("train", None, train_overrides(run, model, "train.stages=[scst]", *extra))
    return Trainer(tmp_path, cfg.train, DistContext())


def first_batch(t: Trainer, stage: str = "scst") -> dict:
    from pipeline.training.batches import epoch_batches

    batches = epoch_batches(t.train_set, t.recipes[stage].batch_size, 0, 0, t.ctx, str(t.cfg.batching))
    return next(iter(t.train_source.iterate(batches[:1], 0)))


def test_greedy_baseline_runs_under_the_samples_autocast(run, tmp_path) -> None:
    t = trainer(
        run, tmp_path, "ngsan", "train.precision=bf16", "train.scst={batch_size: 4, baseline: greedy, num_samples: 2}"
    )
    seen: list[bool] = []
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.append(torch.is_autocast_enabled("cpu")))
        for m in t.model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    optimizer, _, scaler = t._new_stage("scst")
    t._step("scst", t.recipes["scst"], first_batch(t), Progress(stage="scst"), optimizer, scaler)
    for h in hooks:
        h.remove()
    assert seen and all(seen), f"{seen.count(False)} of {len(seen)} forwards ran outside autocast"


# --- the sync-free decoding loops against the plain per-step loops (tests/reference_decoding.py) -------------


def _tiny(name: str):
    import models

    kw = {
        "m2": dict(d_model=32, num_heads=4, d_ff=64, num_layers=2, num_memory=4, dropout=0.1),
        "ngsan": dict(d_model=32, num_heads=4, d_ff=64, num_layers=2, dropout=0.1, embed_dropout=0.1),
        "aoa": dict(d_model=32, num_heads=4, num_layers=1),
    }[name]
    torch.manual_seed(0)
    model = models.build_captioner(name, 40, feat_dim=24, **kw)
    step = model.step
    bias = torch.zeros(40)
    bias[EOS] = 1.3  # captions that end at varied lengths (random weights almost never pick <eos>)

    def eos_biased_step(tokens, enc, state):
        logp, state = step(tokens, enc, state)
        return torch.log_softmax(logp + bias.to(logp.device), -1), state

    model.step = eos_biased_step
    return model


def _batch(images: int = 6) -> dict:
    g = torch.Generator().manual_seed(3)
    mask = torch.arange(7)[None] < torch.randint(3, 8, (images, 1), generator=g)
    xy = torch.rand(images, 7, 2, generator=g) * 100
    return {
        "feats": torch.rand(images, 7, 24, generator=g) * mask[..., None],
        "mask": mask,
        "boxes": torch.cat([xy, xy + 20], -1),
        "sizes": torch.full((images, 2), 200.0),
        "keys": list(range(images)),
    }


def _scorer_and_vocab():
    from pipeline.core.vocab import Vocab
    from pipeline.metrics.cider import CiderD

    vocab = Vocab(("<pad>", "<bos>", "<eos>", "<unk>") + tuple(f"w{i}" for i in range(36)))
    rng = torch.Generator().manual_seed(5)
    refs = {
        i: [
            [
                f"w{int(w)}"
                for w in torch.randint(0, 36, (int(torch.randint(3, 8, (1,), generator=rng)),), generator=rng)
            ]
            for _ in range(3)
        ]
        for i in range(6)
    }
    return CiderD(refs, df_mode="corpus"), vocab


def _run_scst(model, method: str, baseline: str, monkeypatch, old: bool) -> tuple:
    from pipeline.training import scst_step
    from tests import reference_decoding as ref

    scorer, vocab = _scorer_and_vocab()
    if old:
        monkeypatch.setattr(scst_step, "sample", ref.sample)
        monkeypatch.setattr(scst_step, "greedy", ref.greedy)
        monkeypatch.setattr(scst_step, "beam_search", ref.beam_search)
    words: list = []
    real = scst_step.sample_rewards
    monkeypatch.setattr(
        scst_step, "sample_rewards", lambda sc, samples, *a: words.append(samples) or real(sc, samples, *a)
    )
    model.zero_grad(set_to_none=True)
    model.train()
    torch.manual_seed(11)
    batch = _batch()
    base = scst_step.greedy_rewards(model, batch, scorer, vocab, 9) if baseline == "greedy" else None
    out = scst_step.scst_loss(
        model,
        batch,
        scorer,
        vocab,
        method=method,
        num_samples=3,
        max_len=9,
        baseline=baseline,
        normalize="tokens",
        baseline_rewards=base,
    )
    out.loss_sum.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    monkeypatch.undo()
    return words, out.loss_sum.detach(), out.count, out.reward, out.baseline_reward, base, grads


@pytest.mark.parametrize(
    ("name", "method", "baseline"), [("ngsan", "sample", "greedy"), ("m2", "beam", "mean"), ("aoa", "sample", "greedy")]
)
def test_scst_step_equals_the_old_decoding_loops(name, method, baseline, monkeypatch) -> None:
    """Same seed, dropout on, CPU fp32: the sampled captions, rewards, baseline, loss and gradients are bitwise the
    ones of the loops before the sync-free rewrite."""
    model = _tiny(name)
    new = _run_scst(model, method, baseline, monkeypatch, old=False)
    old = _run_scst(model, method, baseline, monkeypatch, old=True)
    assert new[0] == old[0] and len(new[0][0]) == 6 * 3  # the sampled captions (words)
    assert torch.equal(new[1], old[1]) and new[2:5] == old[2:5], (new[1:5], old[1:5])
    if baseline == "greedy":
        assert (new[5] == old[5]).all()
    assert len(new[6]) == len(old[6]) > 0 and all(torch.equal(a, b) for a, b in zip(new[6], old[6]))


@pytest.mark.parametrize("rule", ["exact", "first_k"])
@pytest.mark.parametrize("penalty", [0.0, 0.7])
def test_beam_search_equals_the_old_loop(rule, penalty) -> None:
    from models.decoding import DecodeOptions, beam_search
    from tests import reference_decoding as ref

    model = _tiny("m2").eval()
    batch = _batch(8)
    with torch.no_grad():
        enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
        for k, n in ((1, 1), (3, 2), (5, 5)):
            opts = DecodeOptions(
                method="beam",
                beam_size=k,
                n_best=n,
                max_len=12,
                stop_rule=rule,
                length_penalty=penalty,
                block_trigrams=k == 3,
            )
            a, b = beam_search(model, enc, opts), ref.beam_search(model, enc, opts)
            for x, y in zip((a.tokens, a.lengths, a.logprob, a.scores), (b.tokens, b.lengths, b.logprob, b.scores)):
                assert torch.equal(x, y)


def test_decoding_loops_sync_with_the_host_at_most_once_per_step() -> None:
    """bench.proxies counts host syncs (item/nonzero/tolist...); the plain loops of tests/reference_decoding.py need
    several."""
    from bench.proxies import count
    from models.decoding import DecodeOptions, beam_search, greedy, sample
    from tests import reference_decoding as ref

    assert count(lambda: (torch.ones(3).sum().item(), torch.ones(2).nonzero(), torch.ones(2).tolist()))["syncs"] == 3
    model = _tiny("m2").eval()
    batch = _batch(8)
    with torch.no_grad():
        enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
        beam = DecodeOptions(method="beam", beam_size=5, n_best=5, max_len=12)
        for new, old in (
            (lambda: beam_search(model, enc, beam), lambda: ref.beam_search(model, enc, beam)),
            (
                lambda: sample(model, enc, DecodeOptions(method="sample", max_len=12), n=5),
                lambda: ref.sample(model, enc, DecodeOptions(method="sample", max_len=12), n=5),
            ),
            (
                lambda: greedy(model, enc, DecodeOptions(method="greedy", max_len=12)),
                lambda: ref.greedy(model, enc, DecodeOptions(method="greedy", max_len=12)),
            ),
        ):
            torch.manual_seed(0)
            steps = int(new().lengths.max())
            torch.manual_seed(0)
            ours = count(new)
            torch.manual_seed(0)
            theirs = count(old)
            assert ours["syncs"] <= steps < theirs["syncs"], (ours, theirs, steps)
            assert ours["operators"] < theirs["operators"], (ours, theirs)


def test_official_aoanet_search_reads_back_once_per_decode() -> None:
    """The released AoANet search ranks its finished captions on the device (it used one read per finished caption)."""
    from bench.proxies import count
    from models.decoding import DecodeOptions, beam_search

    model = _tiny("aoa").eval()
    batch = _batch(8)
    with torch.no_grad():
        enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
        opts = DecodeOptions(method="beam", beam_size=3, n_best=2, max_len=10, stop_rule="official_aoanet")
        assert count(lambda: beam_search(model, enc, opts))["syncs"] <= 1


def test_draw_is_multinomial_without_its_read_back() -> None:
    """models.decoding.draw gives torch.multinomial(p, 1)'s words for the same random state (zeros and ties too)."""
    from models.decoding import draw

    for seed in range(10):
        g = torch.Generator().manual_seed(seed)
        p = torch.rand(9, 60, generator=g) ** 4
        p[:, :5] = 0  # filtered words
        for gen in (torch.Generator().manual_seed(seed), None):
            torch.manual_seed(seed)
            a = torch.multinomial(p, 1, generator=gen and torch.Generator().manual_seed(seed))[:, 0]
            torch.manual_seed(seed)
            b = draw(p, gen)
            assert torch.equal(a, b)
