"""The training recipe of one stage (XE or SCST), read from a model YAML's ``schedule:`` section.

Each ``configs/models/<name>.yaml`` states its paper's recipe with one spelling per key: the learning-rate
schedule is named from the registry (``lr_schedule``: a name of :data:`pipeline.training.schedules.SCHEDULES`:
``noam`` for M2, ``step`` for AoANet and NG-SAN, ``plateau``, ``gradual`` for BAN, ``constant``) with its
parameters (``warmup_iters``, ``lr_decay_every`` / ``decay_start_epoch``, ...). :func:`stage_recipe` merges the
user's overrides (``train.xe`` / ``train.scst``) on top, refuses unknown keys (no synonyms: ``max_epochs``,
``warmup_steps``, ``grad_clip``, ``seq_per_img``, ``mean_of_samples``, ... are refused, not translated), and
turns it into one :class:`StageRecipe` with a :func:`~pipeline.training.schedules.build_schedule` spec.

Choices where the YAMLs are silent (documented here, each overridable):

* ``epochs``: null (M2: "until validation CIDEr stops improving") runs the stage at most
  ``train.default_epochs`` epochs and stops early after ``patience`` epochs without a gain of the
  validation metric.
* NG-SAN's "after 6 epochs decayed by 1/2 every 3 epochs" (``decay_start_epoch: 6``) is the ``step``
  schedule with ``decay_start = decay_start_epoch - decay_every_epochs``, so the first halving happens
  when epoch 6 (0-based) starts (ruotianluo's ``learning_rate_decay_start`` semantics).
* A stage without ``optimizer`` uses Adam with PyTorch's defaults; a stage without a schedule keeps its
  ``lr`` constant. SCST always starts a fresh optimizer (as M2 does).
* ``max_caption_len`` (AoANet: 16) is what ``prepare.max_length`` truncates the labels to; the trainer only
  warns when they differ.
* ``baseline: mean`` is M2's "mean of the samples" baseline (:mod:`pipeline.training.scst`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.config import deep_merge
from pipeline.core.errors import ConfigError
from pipeline.training.schedules import SCHEDULES
from pipeline.training.scst import BASELINES

OPTIMIZERS = ("adam", "adamw", "adamax", "sgd")
SAMPLE_METHODS = ("sample", "beam")

_COMMON = {
    "epochs",
    "patience",
    "batch_size",
    "optimizer",
    "betas",
    "eps",
    "weight_decay",
    "lr",
    "lr_schedule",
    "warmup",
    "warmup_iters",
    "decay_start_epoch",
    "decay_every_epochs",
    "decay_rate",
    "noam_model_size",
    "extra_scheduler_step_per_epoch",
    "lr_decay_start",
    "lr_decay_every",
    "lr_decay_rate",
    "plateau_factor",
    "plateau_patience",
    "warmup_epoch_factors",
    "grad_clip_value",
    "grad_clip_norm",
    "label_smoothing",
    "scheduled_sampling",
    "seed",
    "reward",
    "captions_per_image",
    "max_caption_len",
    "optimizer_impl",
}
_SCST = {"sample_method", "num_samples", "sample_max_len", "baseline", "pg_normalize", "baseline_loop"}
BASELINE_LOOPS = ("joint", "separate")
OPTIMIZER_IMPLS = ("foreach", "fused")  # PyTorch's multi-tensor kernels (the default) or its one fused kernel
FUSED_OPTIMIZERS = ("adam", "adamw", "sgd")  # those PyTorch has a fused kernel for (not Adamax)


@dataclass(frozen=True)
class StageRecipe:
    """Everything the loop needs to run one stage."""

    stage: str
    epochs: int
    patience: int | None
    batch_size: int
    optimizer: str
    optimizer_kwargs: dict[str, Any]
    schedule: dict[str, Any]
    label_smoothing: float = 0.0
    grad_clip_value: float | None = None
    grad_clip_norm: float | None = None
    scheduled_sampling: dict[str, float] | None = None
    captions_per_image: int | None = None
    max_caption_len: int | None = None
    sample_method: str = "sample"
    num_samples: int = 5
    sample_max_len: int = 20
    baseline: str = "greedy"
    pg_normalize: str = "tokens"
    baseline_loop: str = "joint"  # greedy baseline with multinomial samples: one decoding loop, or a loop of its own
    optimizer_impl: str = "foreach"  # "fused": PyTorch's fused kernel (one operator per step; other float rounding)
    extra: dict[str, Any] = field(default_factory=dict)

    def ss_prob(self, epoch: int) -> float:
        """Scheduled-sampling probability at ``epoch`` (0-based; ruotianluo/AoANet rule):
        ``min(max_prob, increase_prob * ((epoch - start) // increase_every))`` once ``epoch > start``."""
        ss = self.scheduled_sampling
        if not ss or epoch <= ss["start"] or ss["start"] < 0:
            return 0.0
        return float(min(ss["max_prob"], ss["increase_prob"] * ((epoch - ss["start"]) // ss["increase_every"])))


def _noam_warmup(r: Mapping[str, Any], where: str) -> int:
    """Warm-up steps of a Noam schedule (``warmup_iters``; 0 is refused, not replaced)."""
    value = r.get("warmup_iters")
    steps = 10000 if value is None else int(value)
    if steps < 1:
        raise ConfigError(
            f"{where}: the Noam schedule needs warmup_iters >= 1 (set lr_schedule: constant or step for no warm-up)"
        )
    return steps


def _schedule_spec(r: Mapping[str, Any], where: str) -> dict[str, Any]:
    kind = r.get("lr_schedule")
    lr = r.get("lr")
    if kind is None:
        raise ConfigError(
            f"{where}: name the learning-rate schedule: lr_schedule: one of {', '.join(SCHEDULES.names())}"
        )
    if kind not in SCHEDULES:
        raise ConfigError(f"{where}.lr_schedule: unknown schedule {kind!r} (known: {', '.join(SCHEDULES.names())})")
    if r.get("warmup") not in (None, "linear", "none"):
        raise ConfigError(f"{where}.warmup: linear or none (the warm-up of a step schedule), got {r['warmup']!r}")
    if kind == "constant":
        if lr is None:
            raise ConfigError(f"{where}: a constant learning rate needs 'lr'")
        return {"type": "constant", "lr": float(lr)}
    if kind == "noam":
        return {
            "type": "noam",
            "d_model": int(r.get("noam_model_size") or 512),
            "warmup": _noam_warmup(r, where),
            "factor": float(lr) if lr is not None else 1.0,
            "extra_step_per_epoch": bool(r.get("extra_scheduler_step_per_epoch", False)),
        }
    if kind == "step":
        if lr is None:
            raise ConfigError(f"{where}: a step schedule needs 'lr'")
        if r.get("decay_start_epoch") is not None:  # NG-SAN wording, see the module docstring
            every = int(r.get("decay_every_epochs") or 3)
            start, rate = int(r["decay_start_epoch"]) - every, float(r.get("decay_rate", 0.5))
        else:
            every, start, rate = (
                int(r.get("lr_decay_every") or 3),
                int(r.get("lr_decay_start") or 0),
                float(r.get("lr_decay_rate", 0.8)),
            )
        warm = int(r.get("warmup_iters") or 0)
        return {
            "type": "step",
            "lr": float(lr),
            "decay_rate": rate,
            "decay_every": every,
            "decay_start": start,
            "warmup_iters": warm,
        }
    if kind == "plateau":
        return {
            "type": "plateau",
            "lr": float(lr if lr is not None else 2e-5),
            "factor": float(r.get("plateau_factor", 0.5)),
            "patience": int(r.get("plateau_patience", 3)),
        }
    if kind == "gradual":
        return {
            "type": "gradual",
            "lr": float(lr if lr is not None else 1e-3),
            "warmup_factors": [float(f) for f in r.get("warmup_epoch_factors") or [0.5, 1.0, 1.5, 2.0]],
            "decay_start": int(r.get("lr_decay_start", r.get("decay_start_epoch", 10))),
            "decay_every": int(r.get("lr_decay_every", r.get("decay_every_epochs", 2))),
            "decay_rate": float(r.get("lr_decay_rate", r.get("decay_rate", 0.25))),
        }
    raise ConfigError(f"{where}.lr_schedule: the recipe cannot build a {kind!r} schedule")


def _scheduled_sampling(value: Any, where: str) -> dict[str, float] | None:
    if value in (None, False):
        return None
    if not isinstance(value, Mapping):
        raise ConfigError(
            f"{where}.scheduled_sampling must be false or a mapping (start, increase_every, increase_prob, max_prob)"
        )
    keys = {"start", "increase_every", "increase_prob", "max_prob"}
    if set(value) - keys:
        raise ConfigError(
            f"{where}.scheduled_sampling: unknown key(s) {sorted(set(value) - keys)} (known: {sorted(keys)})"
        )
    out = {"start": 0, "increase_every": 5, "increase_prob": 0.05, "max_prob": 0.25, **dict(value)}
    if out["increase_every"] < 1:
        raise ConfigError(f"{where}.scheduled_sampling.increase_every must be >= 1")
    return out


def stage_recipe(
    stage: str, model_schedule: Mapping[str, Any], overrides: Mapping[str, Any] | None, default_epochs: int, where: str
) -> StageRecipe:
    """The :class:`StageRecipe` of ``stage`` (``xe`` or ``scst``) from a model's ``schedule:`` mapping."""
    if stage not in ("xe", "scst"):
        raise ConfigError(f"unknown training stage {stage!r} (known: xe, scst)")
    base = model_schedule.get(stage) or {}
    if not isinstance(base, Mapping):
        raise ConfigError(f"{where}.{stage} must be a mapping")
    r = deep_merge(base, dict(overrides or {}))
    if isinstance(base.get("scheduled_sampling"), Mapping) and (overrides or {}).get("scheduled_sampling") is False:
        r["scheduled_sampling"] = False
    allowed = _COMMON | (_SCST if stage == "scst" else set())
    unknown = sorted(set(r) - allowed)
    if unknown:
        raise ConfigError(f"{where}.{stage}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(allowed))})")
    w = f"{where}.{stage}"
    epochs = r.get("epochs")
    opt = str(r.get("optimizer") or "adam").lower()
    if opt not in OPTIMIZERS:
        raise ConfigError(f"{w}.optimizer: unknown optimizer {opt!r} (known: {', '.join(OPTIMIZERS)})")
    kwargs: dict[str, Any] = {}
    if r.get("betas") is not None and opt != "sgd":
        kwargs["betas"] = tuple(float(b) for b in r["betas"])
    if r.get("eps") is not None and opt != "sgd":
        kwargs["eps"] = float(r["eps"])
    if r.get("weight_decay") is not None:
        kwargs["weight_decay"] = float(r["weight_decay"])
    if r.get("reward", "cider_d") != "cider_d":
        raise ConfigError(f"{w}.reward: only cider_d is implemented, got {r['reward']!r}")
    clip_norm = r.get("grad_clip_norm")
    recipe = StageRecipe(
        stage=stage,
        epochs=int(epochs) if epochs is not None else int(default_epochs),
        patience=None if r.get("patience") is None else int(r["patience"]),
        batch_size=int(r.get("batch_size") or 10),
        optimizer=opt,
        optimizer_kwargs=kwargs,
        schedule=_schedule_spec(r, w),
        label_smoothing=float(r.get("label_smoothing") or 0.0),
        grad_clip_value=None if r.get("grad_clip_value") is None else float(r["grad_clip_value"]),
        grad_clip_norm=None if clip_norm is None else float(clip_norm),
        scheduled_sampling=_scheduled_sampling(r.get("scheduled_sampling"), w) if stage == "xe" else None,
        captions_per_image=r.get("captions_per_image"),
        max_caption_len=r.get("max_caption_len"),
        sample_method=str(r.get("sample_method", "sample")),
        num_samples=int(r.get("num_samples", 5)),
        sample_max_len=int(r.get("sample_max_len", 20)),
        baseline=str(r.get("baseline", "greedy")),
        pg_normalize=str(r.get("pg_normalize", "steps" if r.get("sample_method") == "beam" else "tokens")),
        baseline_loop=str(r.get("baseline_loop", "joint")),
        optimizer_impl=str(r.get("optimizer_impl", "foreach")),
        extra={"seed": r.get("seed")},
    )
    if recipe.epochs < 0 or recipe.batch_size < 1:
        raise ConfigError(f"{w}: epochs must be >= 0 and batch_size >= 1")
    if recipe.optimizer_impl not in OPTIMIZER_IMPLS:
        raise ConfigError(
            f"{w}.optimizer_impl must be one of {', '.join(OPTIMIZER_IMPLS)}, got {recipe.optimizer_impl!r}"
        )
    if recipe.optimizer_impl == "fused" and opt not in FUSED_OPTIMIZERS:
        raise ConfigError(
            f"{w}.optimizer_impl: fused: PyTorch has no fused {opt} (only {', '.join(FUSED_OPTIMIZERS)}); use foreach"
        )
    if stage == "scst":
        if recipe.sample_method not in SAMPLE_METHODS:
            raise ConfigError(f"{w}.sample_method must be one of {SAMPLE_METHODS}, got {recipe.sample_method!r}")
        if recipe.baseline not in BASELINES:
            raise ConfigError(f"{w}.baseline must be one of {', '.join(BASELINES)}, got {recipe.baseline!r}")
        if recipe.baseline_loop not in BASELINE_LOOPS:
            raise ConfigError(
                f"{w}.baseline_loop must be one of {', '.join(BASELINE_LOOPS)}, got {recipe.baseline_loop!r}"
            )
        if recipe.num_samples < 1 or (recipe.baseline != "greedy" and recipe.num_samples < 2):
            raise ConfigError(f"{w}.num_samples must be >= 1 (>= 2 for the {recipe.baseline} baseline)")
    return recipe
