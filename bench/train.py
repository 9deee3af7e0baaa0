"""XE and SCST training throughput of the captioners at their paper sizes, and the CIDEr-D reward speed-up.

Runs the trainer's own step (:meth:`pipeline.training.engine.Trainer._step`: the XE or SCST loss under the
precision's autocast, samples and greedy baseline alike, the non-finite check, backward, clipping as configured,
optimiser step) on a captioner first fitted for a few XE steps to captions of 8-16 words (so that samples end like
a trained model's, not at ``max_len``), on synthetic batches shaped like COCO
bottom-up features: 36 regions x 2048-d per image, 5 captions of 8-16 words, a 9,487-word vocabulary,
and CIDEr-D rewards against a 2,000-image synthetic-world reference corpus. Batch sizes are the papers'
(``schedule.xe.batch_size`` / ``schedule.scst.batch_size`` of each model YAML) unless ``--batch`` is given;
on CPU use a small ``--batch`` and few ``--iters`` (and say so when reporting). The last columns
extrapolate a Karpathy-train epoch (113,287 images) from the measured images/s.

    PYTHONPATH=. python bench/train.py [--models san,ngsan,m2,aoa] [--device auto] [--precision auto]
                                        [--batch N] [--iters 5] [--stages xe,scst] [--cider]
                                        [--deterministic off|on|both]

``--deterministic on`` times the steps under ``train.deterministic: true``
(:func:`pipeline.core.training.determinism.deterministic_mode`); ``both`` times every row without and with
it, one after the other on the same model and batches, and prints the cost as a ratio. ``CUBLAS_WORKSPACE_CONFIG``
is set for the whole process then (it must be set before cuBLAS's first call), so the "off" rows of ``both``
run with the fixed cuBLAS workspace too; run ``off`` and ``on`` as two processes to include its cost.
"""

from __future__ import annotations

import argparse
import os
import time
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from models import build_captioner, model_card
from pipeline.core.distributed import DistContext, resolve_device
from pipeline.core.training import make_scaler, resolve_precision
from pipeline.core.training.determinism import CUBLAS_SETTING, deterministic_mode
from pipeline.core.vocab import BOS, EOS, Vocab
from pipeline.metrics.cider import CiderD
from pipeline.training.engine import Progress, Trainer, _Policy, build_optimizer
from pipeline.training.recipe import stage_recipe
from pipeline.training.xe import xe_loss_sum
from pipeline.world.captions import make_captions, tokenize
from pipeline.world.scene import SceneParams, sample_scene

COCO_TRAIN_IMAGES = 113_287
VOCAB_SIZE = 9487


def make_batch(b: int, vocab: int, device: torch.device, rng: torch.Generator) -> dict:
    n, k = 36, 5
    lengths = torch.randint(8, 17, (b * k,), generator=rng)
    t = int(lengths.max()) + 2
    caps = torch.zeros(b * k, t, dtype=torch.long)
    for r, ln in enumerate(lengths.tolist()):
        caps[r, 0] = BOS
        caps[r, 1 : ln + 1] = torch.randint(4, vocab, (ln,), generator=rng)
        caps[r, ln + 1] = EOS
    xy = torch.rand(b, n, 2, generator=rng) * 400
    wh = torch.rand(b, n, 2, generator=rng) * 200 + 10
    batch = {
        "feats": torch.rand(b, n, 2048, generator=rng),
        "mask": torch.ones(b, n, dtype=torch.bool),
        "boxes": torch.cat([xy, xy + wh], -1),
        "sizes": torch.full((b, 2), 640.0),
        "captions": caps,
        "caption_image": torch.arange(b).repeat_interleave(k),
        "keys": [i % 2000 for i in range(b)],
    }
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def reference_corpus(vocab: Vocab, images: int = 2000) -> CiderD:
    rng = np.random.default_rng(0)
    refs = {i: [tokenize(c) for c in make_captions(sample_scene(rng, SceneParams()), rng)] for i in range(images)}
    return CiderD(refs, df_mode="corpus")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_stage(
    name: str,
    stage: str,
    batch_size: int | None,
    iters: int,
    device: torch.device,
    amp: str,
    scorer: CiderD,
    vocab: Vocab,
    deterministic: bool = False,
    fit_steps: int = 25,
    overrides: dict | None = None,
) -> tuple[int, float]:
    """(images per batch, seconds per step) of ``iters`` timed steps after one warm-up step, on a captioner fitted
    for ``fit_steps`` XE steps to trained-like caption lengths."""
    with deterministic_mode(deterministic, "--deterministic"):
        model, step, batches, b = prepare_stage(
            name,
            stage,
            batch_size,
            device,
            amp,
            scorer,
            vocab,
            min(iters, 3) + 1,
            fit_steps=fit_steps,
            overrides=overrides,
        )
        step(batches[0])  # warm-up
        sync(device)
        t0 = time.perf_counter()
        for i in range(iters):
            step(batches[1 + i % (len(batches) - 1)])
        sync(device)
        return b, (time.perf_counter() - t0) / iters


def world_captions(batch: dict, seed: int = 0) -> dict:
    """``batch`` with its captions replaced by synthetic-world sentences (5 per image, 5-15 words, ids of
    :func:`bench_vocab`): a grammar a captioner can fit in a few steps, unlike random words (whose one frequent
    token, ``<eos>``, a briefly fitted model predicts first)."""
    vocab = bench_vocab()
    rng = np.random.default_rng(seed)
    images = batch["feats"].shape[0]
    rows = [
        vocab.encode(tokenize(c), add_bos=True)
        for _ in range(images)
        for c in (make_captions(sample_scene(rng, SceneParams()), rng) * 5)[:5]
    ]
    caps = torch.zeros(len(rows), max(map(len, rows)), dtype=torch.long)
    for r, ids in enumerate(rows):
        caps[r, : len(ids)] = torch.tensor(ids)
    return {
        **batch,
        "captions": caps.to(batch["feats"].device),
        "caption_image": torch.arange(images, device=batch["feats"].device).repeat_interleave(len(rows) // images),
    }


def fitted_model(
    name: str, batch: dict, steps: int = 25, device: torch.device | None = None, seed: int = 0
) -> torch.nn.Module:
    """A paper-size captioner, fitted for ``steps`` XE steps (Adam, lr 1e-3) to synthetic-world captions of
    ``batch``'s images (:func:`world_captions`), so that its samples and beams end like a trained model's instead of
    running to ``max_len`` (random weights almost never pick ``<eos>``); ``steps=0``: the random initial weights."""
    torch.manual_seed(seed)
    model = build_captioner(name, VOCAB_SIZE).to(device or batch["feats"].device).train()
    if steps:
        batch = world_captions(batch, seed)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for _ in range(steps):
            loss, n = xe_loss_sum(model, batch)
            opt.zero_grad(set_to_none=True)
            (loss / n).backward()
            opt.step()
    return model


def trainer_step(
    model: torch.nn.Module,
    name: str,
    stage: str,
    device: torch.device,
    amp: str,
    scorer: CiderD,
    vocab: Vocab,
    lr: float = 1e-5,
    overrides: dict | None = None,
) -> Callable[[dict], float]:
    """``step(batch) -> loss``: :meth:`pipeline.training.engine.Trainer._step` (the trainer's own step) on what it
    reads from a trainer, built as the trainer builds it (the stage's optimizer at ``lr``, the precision's scaler);
    ``overrides``: recipe keys over the model card's (e.g. ``{"baseline_loop": "separate"}``)."""
    recipe = stage_recipe(stage, model_card(name).schedule.to_dict(), overrides, 30, name)
    me = types.SimpleNamespace(
        model=model,
        policy=_Policy(model),
        ctx=DistContext(device=device),
        precision=amp,
        vocab=vocab,
        dir=Path("."),
        _scst_scorer=lambda: scorer,
    )
    opt = build_optimizer(recipe, model.parameters())
    for group in opt.param_groups:
        group["lr"] = lr
    prog, scaler = Progress(stage=stage), make_scaler(amp, device)
    return lambda batch: Trainer._step(me, stage, recipe, batch, prog, opt, scaler)["loss"]


def prepare_stage(
    name: str,
    stage: str,
    batch_size: int | None,
    device: torch.device,
    amp: str,
    scorer: CiderD,
    vocab: Vocab,
    num_batches: int,
    seed: int = 0,
    fit_steps: int = 0,
    overrides: dict | None = None,
) -> tuple[torch.nn.Module, Callable[[dict], float], list[dict], int]:
    """A paper-size ``name`` captioner on ``device`` (fitted for ``fit_steps`` XE steps to the first batch's captions),
    ``num_batches`` synthetic batches and ``step(batch)``: one training step of ``stage`` (xe | scst) exactly as the
    trainer runs it under ``amp`` (:func:`trainer_step`, lr 1e-5), returning the loss.
    Returns ``(model, step, batches, images per batch)``."""
    recipe = stage_recipe(stage, model_card(name).schedule.to_dict(), None, 30, name)
    b = batch_size or recipe.batch_size
    rng = torch.Generator().manual_seed(seed)
    batches = [make_batch(b, VOCAB_SIZE, device, rng) for _ in range(num_batches)]
    model = fitted_model(name, batches[0], fit_steps, device, seed)
    return model, trainer_step(model, name, stage, device, amp, scorer, vocab, overrides=overrides), batches, b


def bench_vocab() -> Vocab:
    """A 9,487-word vocabulary whose ids 4.. decode to the reference corpus's words, so sampled ids become real
    (mostly wrong) words."""
    words = ("<pad>", "<bos>", "<eos>", "<unk>")
    rng = np.random.default_rng(0)
    corpus_words = sorted(
        {w for _ in range(200) for c in make_captions(sample_scene(rng, SceneParams()), rng) for w in tokenize(c)}
    )
    return Vocab(words + tuple(corpus_words) + tuple(f"w{i}" for i in range(VOCAB_SIZE - 4 - len(corpus_words))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="san,ngsan,m2,aoa")
    ap.add_argument("--stages", default="xe,scst")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--precision", default="auto", help="auto | fp32 | bf16 | fp16")
    ap.add_argument("--batch", type=int, default=None, help="images per batch for every model (default: the paper's)")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument(
        "--cider", action="store_true", help="also run the CIDEr-D rows of python -m bench (vs pycocoevalcap)"
    )
    ap.add_argument(
        "--deterministic",
        choices=("off", "on", "both"),
        default="off",
        help="time under train.deterministic: true (on), or without and with it (both: the cost as a ratio)",
    )
    args = ap.parse_args()
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.deterministic]
    if True in modes:  # before cuBLAS's first call (see the module docstring)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_SETTING)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    amp = resolve_precision(args.precision, device, "--precision")
    scorer = reference_corpus(Vocab(("<pad>", "<bos>", "<eos>", "<unk>")))
    vocab = bench_vocab()
    batch_note = f", batch {args.batch} images for every model (reduced from the papers)" if args.batch else ""
    print(
        f"device {device}, precision {amp}, torch threads {torch.get_num_threads()}, {args.iters} timed iterations "
        f"per row{batch_note or ', paper batch sizes'}, deterministic {args.deterministic}"
    )
    print(f"{'model':<7}{'stage':<6}{'det':<5}{'batch':>6}{'s/iter':>9}{'iter/s':>8}{'images/s':>10}{'COCO epoch':>12}")
    for name in args.models.split(","):
        for stage in args.stages.split(","):
            seconds = []
            for det in modes:
                b, sec = bench_stage(name, stage, args.batch, args.iters, device, amp, scorer, vocab, deterministic=det)
                seconds.append(sec)
                ips = b / sec
                epoch = COCO_TRAIN_IMAGES / ips
                print(
                    f"{name:<7}{stage:<6}{'on' if det else 'off':<5}{b:>6}{sec:>9.3f}{1 / sec:>8.2f}{ips:>10.1f}"
                    f"{epoch / 60:>10.1f} m",
                    flush=True,
                )
            if len(seconds) == 2:
                print(
                    f"{name:<7}{stage:<6}deterministic costs x{seconds[1] / seconds[0]:.2f} the step time", flush=True
                )
    if args.cider:
        # bench.__main__ imports this module (through bench.gpu): imported here, when it runs
        from bench.__main__ import main as bench_main  # noqa: PLC0415 -- import cycle

        bench_main(["--only", "cider", "--repeats", "5", "--threads", str(torch.get_num_threads())])


if __name__ == "__main__":
    main()
