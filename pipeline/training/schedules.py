"""Learning-rate schedules of the papers as pure, resumable objects.

A schedule knows the number of optimiser steps taken (``iteration``) and of finished epochs (``epoch``),
plus, for plateau decay, the metric history; :meth:`Schedule.lr` is a pure function of that state.
The training loop calls :meth:`Schedule.step` after each optimiser step, :meth:`Schedule.epoch_end`
(with the validation metric for plateau decay) after each epoch, and writes :meth:`Schedule.lr` into the
optimiser (:func:`apply_lr`). ``state_dict()`` / ``load_state_dict()`` make resuming exact.

Built from a YAML ``schedule:`` mapping by :func:`build_schedule`; ``type`` picks one of:

``noam`` (M2, ruotianluo's Transformer, X-LAN)
    lr(s) = factor * d_model^-0.5 * min(s^-0.5, s * warmup^-1.5), s = iteration + 1
    (Vaswani et al. Eq. 3; M2 ``train.py:191-199`` with d_model 512, warmup 10000). M2's code also steps
    its scheduler once at the start of every XE epoch, the first included (aimagelab/meshed-memory-transformer
    ``train.py``);
    ``extra_step_per_epoch: true`` reproduces that quirk: during epoch e (0-based), s = iteration + e + 2.
``step`` (AoANet, NG-SAN)
    lr = lr0 * min(1, (iteration + 1) / warmup_iters) * rate^k with k = (epoch - decay_start) // decay_every
    once epoch > decay_start, else 0 (ruotianluo's ``learning_rate_decay_*`` options, epochs counted from
    0). AoANet: lr0 2e-4, rate 0.8, every 3, start 0, no warm-up (lr = 2e-4 * 0.8^floor(e/3), husthuaan/AoANet
    ``train.py``). NG-SAN (ruotianluo ``transformer_step.yml``, "from arXiv 2003.08897"): lr0 3e-4, linear warm-up
    over 33,000 iterations, rate 0.5, every 3, start 3, so the first halving is at epoch 6, i.e. "after 6
    epochs, decayed by 1/2 every 3 epochs" (Guo et al. 2020 §5.1).
``plateau`` (AoANet / X-LAN SCST)
    lr = lr0 * factor^(number of reductions); a reduction happens at an epoch end when the metric has not
    improved (relative threshold, mode max or min) for more than ``patience`` epochs, as
    ``torch.optim.lr_scheduler.ReduceLROnPlateau`` does. AoANet SCST: factor 0.5, patience 3.
``constant`` (M2 SCST: 5e-6)
``gradual`` (BAN, jnhwkim/ban-vqa ``train.py``)
    lr = lr0 * warmup_factors[epoch] for the first epochs (BAN: x0.5, 1, 1.5, 2 over epochs 0-3), then
    lr0 * warmup_factors[-1] * rate^m with m = the number of decay epochs ``decay_start, decay_start +
    decay_every, ...`` that are <= epoch (BAN: x0.25 at epochs 10, 12, 14, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pipeline.core.errors import ConfigError
from pipeline.core.registry import Registry

SCHEDULES: Registry[type["Schedule"]] = Registry("learning-rate schedule")


class Schedule:
    """Base class: iteration/epoch counters and the state-dict protocol."""

    name = "base"
    #: constructor parameters (name -> default) accepted from YAML
    params: dict[str, Any] = {}
    #: the attribute holding a parameter whose name is taken by a method (``lr`` is :meth:`lr`)
    attributes: dict[str, str] = {"lr": "lr_value"}

    def __init__(self) -> None:
        self.iteration = 0
        self.epoch = 0

    def lr(self) -> float:
        """The learning rate for the next optimiser step."""
        raise NotImplementedError

    def step(self) -> float:
        """Record one optimiser step; returns the learning rate for the next one."""
        self.iteration += 1
        return self.lr()

    def epoch_end(self, metric: float | None = None) -> float:
        """Record the end of an epoch (``metric``: the validation score, used by plateau decay)."""
        self.epoch += 1
        return self.lr()

    def config(self) -> dict[str, Any]:
        """``type`` and the value of every parameter (lists copied)."""
        values = {k: getattr(self, self.attributes.get(k, k)) for k in self.params}
        return {"type": self.name, **{k: list(v) if isinstance(v, list) else v for k, v in values.items()}}

    def state_dict(self) -> dict[str, Any]:
        """Counters, extra state and the configuration (checked on load)."""
        return {"config": self.config(), "iteration": self.iteration, "epoch": self.epoch, **self._extra_state()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict`; a state from a different schedule or parameters is refused."""
        if dict(state.get("config", {})) != self.config():
            raise ConfigError(
                f"schedule state does not match the configured schedule: saved {state.get('config')}, configured "
                f"{self.config()}"
            )
        self.iteration = int(state["iteration"])
        self.epoch = int(state["epoch"])
        self._load_extra_state(state)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.config()}, iteration={self.iteration}, epoch={self.epoch})"


@SCHEDULES.register("constant")
class ConstantSchedule(Schedule):
    name = "constant"
    params = {"lr": 5e-6}

    def __init__(self, lr: float = 5e-6) -> None:
        super().__init__()
        self.lr_value = float(lr)

    def lr(self) -> float:
        return self.lr_value


@SCHEDULES.register("noam")
class NoamSchedule(Schedule):
    name = "noam"
    params = {"d_model": 512, "warmup": 10000, "factor": 1.0, "extra_step_per_epoch": False}

    def __init__(
        self, d_model: int = 512, warmup: int = 10000, factor: float = 1.0, extra_step_per_epoch: bool = False
    ) -> None:
        super().__init__()
        if warmup < 1 or d_model < 1:
            raise ConfigError(f"noam schedule needs warmup >= 1 and d_model >= 1, got {warmup}, {d_model}")
        self.d_model, self.warmup, self.factor = int(d_model), int(warmup), float(factor)
        self.extra_step_per_epoch = bool(extra_step_per_epoch)

    def lr(self) -> float:
        s = self.iteration + 1 + (self.epoch + 1 if self.extra_step_per_epoch else 0)
        return self.factor * self.d_model**-0.5 * min(s**-0.5, s * self.warmup**-1.5)


@SCHEDULES.register("step")
class StepSchedule(Schedule):
    name = "step"
    params = {"lr": 2e-4, "decay_rate": 0.8, "decay_every": 3, "decay_start": 0, "warmup_iters": 0}

    def __init__(
        self,
        lr: float = 2e-4,
        decay_rate: float = 0.8,
        decay_every: int = 3,
        decay_start: int = 0,
        warmup_iters: int = 0,
    ) -> None:
        super().__init__()
        if decay_every < 1 or warmup_iters < 0:
            raise ConfigError(
                f"step schedule needs decay_every >= 1 and warmup_iters >= 0, got {decay_every}, {warmup_iters}"
            )
        self.lr_value, self.decay_rate = float(lr), float(decay_rate)
        self.decay_every, self.decay_start, self.warmup_iters = int(decay_every), int(decay_start), int(warmup_iters)

    def lr(self) -> float:
        k = (self.epoch - self.decay_start) // self.decay_every if self.epoch > self.decay_start else 0
        warm = min(1.0, (self.iteration + 1) / self.warmup_iters) if self.warmup_iters else 1.0
        return self.lr_value * warm * self.decay_rate**k


@SCHEDULES.register("plateau")
class PlateauSchedule(Schedule):
    name = "plateau"
    params = {"lr": 2e-5, "factor": 0.5, "patience": 3, "mode": "max", "threshold": 1e-4, "min_lr": 0.0}

    def __init__(
        self,
        lr: float = 2e-5,
        factor: float = 0.5,
        patience: int = 3,
        mode: str = "max",
        threshold: float = 1e-4,
        min_lr: float = 0.0,
    ) -> None:
        super().__init__()
        if mode not in ("max", "min"):
            raise ConfigError(f"plateau schedule mode must be 'max' or 'min', got {mode!r}")
        if not 0.0 < factor < 1.0 or patience < 0:
            raise ConfigError(f"plateau schedule needs 0 < factor < 1 and patience >= 0, got {factor}, {patience}")
        self.lr_value, self.factor, self.patience = float(lr), float(factor), int(patience)
        self.mode, self.threshold, self.min_lr = mode, float(threshold), float(min_lr)
        self.best: float | None = None
        self.bad_epochs = 0
        self.reductions = 0

    def _improved(self, metric: float) -> bool:
        """Relative-threshold improvement test, exactly as torch's ReduceLROnPlateau (threshold_mode 'rel')."""
        if self.best is None:
            return True
        if self.mode == "max":
            return metric > self.best * (1.0 + self.threshold)
        return metric < self.best * (1.0 - self.threshold)

    def epoch_end(self, metric: float | None = None) -> float:
        if metric is None or not math.isfinite(metric):
            raise ValueError("plateau schedule needs a finite validation metric at every epoch end")
        if self._improved(metric):
            self.best = float(metric)
            self.bad_epochs = 0
        else:
            self.bad_epochs += 1
            if self.bad_epochs > self.patience:
                if self.lr() > self.min_lr:
                    self.reductions += 1
                self.bad_epochs = 0
        return super().epoch_end(metric)

    def lr(self) -> float:
        return max(self.min_lr, self.lr_value * self.factor**self.reductions)

    def _extra_state(self) -> dict[str, Any]:
        return {"best": self.best, "bad_epochs": self.bad_epochs, "reductions": self.reductions}

    def _load_extra_state(self, state: Mapping[str, Any]) -> None:
        self.best = None if state["best"] is None else float(state["best"])
        self.bad_epochs = int(state["bad_epochs"])
        self.reductions = int(state["reductions"])


@SCHEDULES.register("gradual")
class GradualSchedule(Schedule):
    name = "gradual"
    params = {
        "lr": 1e-3,
        "warmup_factors": [0.5, 1.0, 1.5, 2.0],
        "decay_start": 10,
        "decay_every": 2,
        "decay_rate": 0.25,
    }

    def __init__(
        self,
        lr: float = 1e-3,
        warmup_factors: list | None = None,
        decay_start: int = 10,
        decay_every: int = 2,
        decay_rate: float = 0.25,
    ) -> None:
        super().__init__()
        factors = [0.5, 1.0, 1.5, 2.0] if warmup_factors is None else [float(f) for f in warmup_factors]
        if not factors or decay_every < 1:
            raise ConfigError("gradual schedule needs at least one warm-up factor and decay_every >= 1")
        self.lr_value, self.warmup_factors = float(lr), factors
        self.decay_start, self.decay_every, self.decay_rate = int(decay_start), int(decay_every), float(decay_rate)

    def lr(self) -> float:
        if self.epoch < len(self.warmup_factors):
            return self.lr_value * self.warmup_factors[self.epoch]
        m = (self.epoch - self.decay_start) // self.decay_every + 1 if self.epoch >= self.decay_start else 0
        return self.lr_value * self.warmup_factors[-1] * self.decay_rate**m


def build_schedule(spec: Mapping[str, Any], where: str = "schedule") -> Schedule:
    """A schedule from a YAML mapping such as ``{type: step, lr: 2e-4, decay_rate: 0.8}``.

    Unknown types or keys raise :class:`ConfigError` naming ``where`` (e.g. ``configs/models/aoa.yaml:
    train.schedule``).
    """
    if not isinstance(spec, Mapping) or "type" not in spec:
        raise ConfigError(f"{where}: a schedule needs a 'type' (one of {', '.join(SCHEDULES.names())})")
    kind = str(spec["type"])
    if kind not in SCHEDULES:
        raise ConfigError(f"{where}: unknown schedule type '{kind}' (known: {', '.join(SCHEDULES.names())})")
    cls = SCHEDULES.get(kind)
    kwargs = {k: v for k, v in spec.items() if k != "type"}
    unknown = sorted(set(kwargs) - set(cls.params))
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)} for schedule '{kind}' (known: {', '.join(cls.params)})"
        )
    for key, value in kwargs.items():
        default = cls.params[key]
        ok = (
            isinstance(value, bool)
            if isinstance(default, bool)
            else (
                isinstance(value, (int, float)) and not isinstance(value, bool)
                if isinstance(default, float)
                else isinstance(value, int) and not isinstance(value, bool)
                if isinstance(default, int)
                else isinstance(value, type(default))
            )
        )
        if not ok:
            raise ConfigError(f"{where}.{key}: expected {type(default).__name__}, got {value!r}")
    return cls(**kwargs)


def apply_lr(optimizer: Any, lr: float) -> None:
    """Write ``lr`` into every parameter group of a torch optimiser."""
    for group in optimizer.param_groups:
        group["lr"] = lr
