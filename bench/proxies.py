"""CPU proxies of GPU launch overhead: operators dispatched and host syncs per training step, decoding step and image.

On a GPU a small-batch SCST step is bound by kernel launches and host synchronisations, not by arithmetic. Both
can be counted on any CPU with the torch profiler, so the GPU work can be judged without a GPU:

* **operators**: top-level ATen operators (profiler events with no ATen parent; what Python dispatches, each one
  kernel launch or more on a GPU), backward and optimizer included;
* **host syncs**: operators that make a CUDA host wait for the device: ``aten::_local_scalar_dense`` (``.item()``,
  ``float()``, ``bool()`` of a tensor, ``torch.multinomial``'s own check), ``aten::nonzero`` (``nonzero``, boolean
  indexing), plus calls of ``Tensor.tolist`` / ``.cpu`` / ``.numpy`` (seen with a ``TorchFunctionMode``); not counted:
  reads inside ``optimizer.step()`` (its step counters live on the host also on a GPU). On CPU every tensor is a
  host tensor, so a read of a small host-side tensor elsewhere counts too: the figure is an upper bound.

Rows: one SCST step and one XE step of each captioner **as the trainer runs it**
(:func:`pipeline.training.engine.Trainer._step` with its precision, clipping and optimizer; paper sizes, batch 10 = the
papers' SCST batch, 36 x 2048 regions), one beam-5 decode (per decoding step), and one extracted image of a shrunk
bottom-up detector. The captioner is first fitted for a few XE steps to captions of 8-16 words, so that its samples end
like a trained model's, not at ``max_len`` (the mean decoded length is printed).

    python -m bench.proxies [--models m2,ngsan] [--batch 10] [--json proxies.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

from bench.gpu import _fusable, _greedy_sampled
from bench.harness import Case
from bench.tiny import narrow_caffe_r101
from bench.train import VOCAB_SIZE, fitted_model, make_batch, reference_corpus, trainer_step
from extractors.preprocess import recipe_blob
from extractors.random_weights import random_detector
from extractors.recipes import apply_recipe, recipe_from_config
from extractors.selector import make_selector
from models.decoding import DecodeOptions, beam_search
from pipeline.core.precision import autocast
from pipeline.core.vocab import Vocab

SYNC_OPS = ("aten::_local_scalar_dense", "aten::nonzero")
SYNC_METHODS = ("tolist", "cpu", "numpy")


class _SyncCalls(TorchFunctionMode):
    """Counts Python calls that copy a tensor to the host (``tolist``, ``cpu``, ``numpy``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types_, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") in SYNC_METHODS:
            self.count += 1
        return func(*args, **(kwargs or {}))


def count(fn: Callable[[], Any]) -> dict[str, int]:
    """Top-level operators and host syncs of one call of ``fn`` (the torch profiler on CPU)."""
    mode = _SyncCalls()
    with profile(activities=[ProfilerActivity.CPU]) as prof, mode:
        fn()
    events = prof.events()
    top = [e for e in events if e.name.startswith("aten::") and not _has_aten_parent(e)]
    names = Counter(e.name for e in events if not _in_optimizer_step(e))
    return {"operators": len(top), "syncs": sum(names[n] for n in SYNC_OPS) + mode.count}


def _in_optimizer_step(event: Any) -> bool:
    """Inside ``optimizer.step()``: its scalar reads are of the step counters, host tensors also on a GPU (PyTorch
    keeps them on the CPU unless ``capturable``/``fused``), so they are not device syncs."""
    return _has_ancestor(event, "Optimizer.step")


def _has_aten_parent(event: Any) -> bool:
    return _has_ancestor(event, "aten::")


def _has_ancestor(event: Any, prefix: str) -> bool:
    """Whether a profiler event above ``event`` (its CPU parent, that one's parent, ...) has a name that starts with
    ``prefix``."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(prefix):
            return True
        parent = parent.cpu_parent
    return False


# --- captioner steps ------------------------------------------------------------------------------------------


def step_rows(name: str, batch_size: int, fit_steps: int = 25, fit_cache: str | None = None) -> list[dict[str, Any]]:
    words = ("<pad>", "<bos>", "<eos>", "<unk>")
    vocab = Vocab(words + tuple(f"w{i}" for i in range(VOCAB_SIZE - 4)))
    scorer = reference_corpus(Vocab(words), 200)
    cpu = torch.device("cpu")
    batch = make_batch(batch_size, VOCAB_SIZE, cpu, torch.Generator().manual_seed(0))
    cached = None if fit_cache is None else f"{fit_cache}/{name}-b{batch_size}-fit{fit_steps}.pt"
    if cached is not None and os.path.exists(cached):  # the same fitted weights for two checkouts being compared
        model = fitted_model(name, batch, 0)
        model.load_state_dict(torch.load(cached, weights_only=True))
    else:
        model = fitted_model(name, batch, fit_steps)
        if cached is not None:
            os.makedirs(fit_cache, exist_ok=True)
            torch.save(model.state_dict(), cached)
    rows = []

    variants = [("scst", None, ""), ("xe", None, "")]
    if _fusable(name):
        variants += [
            ("scst", {"optimizer_impl": "fused"}, ", fused optimizer"),
            ("xe", {"optimizer_impl": "fused"}, ", fused optimizer"),
        ]
    if _greedy_sampled(
        name
    ):  # beside it, the same step with the greedy baseline in a loop of its own (baseline_loop: separate)
        variants.insert(1, ("scst", {"baseline_loop": "separate"}, ", baseline loop separate"))
    for stage, overrides, label in variants:
        step = trainer_step(
            model, name, stage, cpu, "fp32", scorer, vocab, lr=0.0, overrides=overrides
        )  # lr 0: same weights
        step(batch)  # warm-up (the optimizer's lazy state)
        torch.manual_seed(1)
        rows.append({"row": f"{name} {stage} step{label}", "work": f"batch {batch_size}", **count(lambda: step(batch))})
    model.eval()
    opts = DecodeOptions(method="beam", beam_size=5, max_len=20)
    with torch.no_grad():
        enc = model.encode(batch["feats"], batch["mask"], batch["boxes"], batch["sizes"])
        g = beam_search(model, enc, opts)
        steps = int(g.lengths.max())
        c = count(lambda: beam_search(model, enc, opts))
    mean_len = float(g.lengths.float().mean())
    rows.append(
        {
            "row": f"{name} beam-5 decode, per step",
            "work": f"batch {batch_size}, {steps} steps, mean length {mean_len:.1f}",
            "operators": round(c["operators"] / steps, 1),
            "syncs": round(c["syncs"] / steps, 2),
        }
    )
    return rows


# --- extraction -------------------------------------------------------------------------------------------------


def extract_row(images: int = 4) -> dict[str, Any]:
    spec = narrow_caffe_r101(min_size=200, max_size=333, post_nms_topk=100)
    model = random_detector(spec, seed=0).fold_batchnorm()
    recipe = apply_recipe(model, recipe_from_config({"recipe": "caffe", "boxes": "adaptive"}, "milvlg"))
    rule = make_selector(recipe, model.spec)
    rng = np.random.default_rng(0)
    decoded = [recipe_blob(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), recipe) for _ in range(images)]
    blobs = [torch.from_numpy(d[0]) for d in decoded]
    scales = [d[1] for d in decoded]

    def go() -> None:
        with autocast(torch.device("cpu"), "fp32"), torch.no_grad():
            model.detect(blobs, scales, rule)

    go()
    c = count(go)
    return {
        "row": "extract, per image",
        "work": f"{images} images 480x640, shrunk R101, {spec.post_nms_topk} proposals, {spec.num_classes} classes",
        "operators": round(c["operators"] / images, 1),
        "syncs": round(c["syncs"] / images, 2),
    }


def cases(size: str, models: list[str]) -> list:
    """The proxies as rows of ``python -m bench`` (``reports="value"``: each row's figure is the count itself).
    ``size="tiny"`` counts only the extraction row (seconds; what the test suite runs)."""
    found: list[dict[str, Any]] = []

    def rows() -> list[dict[str, Any]]:
        if not found:
            found.extend(r for m in ([] if size == "tiny" else models) for r in step_rows(m.strip(), 10))
            found.append(extract_row(2 if size == "tiny" else 4))
        return found

    out = []
    for i, label in enumerate(
        [
            f"{m.strip()} {what}"
            for m in ([] if size == "tiny" else models)
            for what in ("scst step", "xe step", "beam-5 decode, per step")
        ]
        + ["extract, per image"]
    ):
        for key in ("operators", "syncs"):
            out.append(
                Case(
                    "proxies",
                    f"{label}: {key}",
                    None,
                    "operators dispatched / host syncs (torch profiler, CPU)",
                    lambda i=i, key=key: rows()[i][key],
                    unit=key,
                    reports="value",
                )
            )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    out = [f"{'row':<34} {'operators':>10} {'host syncs':>11}  work"]
    out += [f"{r['row']:<34} {r['operators']:>10} {r['syncs']:>11}  {r['work']}" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.proxies", description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="m2,ngsan")
    ap.add_argument("--batch", type=int, default=10)
    ap.add_argument("--no-extract", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--fit-steps", type=int, default=25, help="XE steps that fit the captioner to trained-like lengths")
    ap.add_argument("--fit-cache", default=None, help="folder keeping the fitted weights (reused by a second run)")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = [r for m in args.models.split(",") for r in step_rows(m.strip(), args.batch, args.fit_steps, args.fit_cache)]
    if not args.no_extract:
        rows.append(extract_row())
    print(table(rows))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(rows, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
