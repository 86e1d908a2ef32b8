"""Optimizers and learning-rate schedules (paper section 5.3).

The learning rate belongs to the SCHEDULER: ``--lr`` is an option of the schedule (the peak of ``inverse_sqrt``,
the value of ``fixed``); the optimizer is built with that value and the scheduler sets it before every update.

``inverse_sqrt`` is fairseq's schedule. Update number k (1-based) runs with ``lr(k - 1)`` where

    lr(n) = warmup_init_lr + n * (lr - warmup_init_lr) / warmup_updates     for n < warmup_updates
    lr(n) = lr * sqrt(warmup_updates / n)                                    for n >= warmup_updates

The paper's ``lrate = d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)`` is the same curve with the peak
``lr = d_model^-0.5 * warmup^-0.5`` (7.0e-4 for d_model 512 and 4000 warm-up updates) and warmup_init_lr 0,
shifted by one step (fairseq evaluates the schedule at the number of updates done so far).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch

from attnmt.registry import get, register

# ------------------------------------------------------------------------------------------------ optimizers


@dataclass
class AdamConfig:
    adam_betas: tuple[float, float] = field(
        default=(0.9, 0.98), metadata={"help": "Adam (beta1, beta2), paper 5.3: '(0.9, 0.98)'"})
    adam_eps: float = field(default=1e-9, metadata={"above": 0, "help": "Adam epsilon (paper 5.3: 1e-9)"})
    weight_decay: float = field(
        default=0.0, metadata={"min": 0, "help": "decoupled weight decay (AdamW-style, as fairseq's adam)"})
    adam_impl: Literal["auto", "fused", "foreach", "for-loop"] = field(
        default="auto", metadata={"help": "update kernel: auto (fused when supported, else foreach), fused, foreach, "
                                          "for-loop"})

    def __post_init__(self):
        b1, b2 = self.adam_betas
        if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
            raise ValueError(f"--adam-betas {self.adam_betas} out of range; each beta must be in [0, 1)")
        if self.adam_eps <= 0:
            raise ValueError(f"--adam-eps {self.adam_eps} must be > 0")
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay {self.weight_decay} must be >= 0")


@register("optimizer", "adam", config=AdamConfig)
def build_adam(cfg: AdamConfig, params, lr: float) -> torch.optim.Optimizer:
    """Adam with decoupled weight decay (torch AdamW; identical to Adam when --weight-decay is 0)."""
    params = [p for p in params if p.requires_grad]
    kwargs = {}
    impl = cfg.adam_impl
    if impl == "auto":
        impl = "fused" if all(p.dtype.is_floating_point for p in params) else "foreach"
    if impl == "fused":
        kwargs["fused"] = True
    elif impl == "foreach":
        kwargs["foreach"] = True
    else:
        kwargs["foreach"] = False
    return torch.optim.AdamW(params, lr=lr, betas=tuple(cfg.adam_betas), eps=cfg.adam_eps,
                             weight_decay=cfg.weight_decay, **kwargs)


def build_optimizer(name: str, cfg, params, lr: float) -> torch.optim.Optimizer:
    return get("optimizer", name).obj(cfg, params, lr)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


# ------------------------------------------------------------------------------------------------ schedulers


@dataclass
class InverseSqrtConfig:
    lr: float = field(default=7e-4, metadata={"above": 0,
        "help": "peak learning rate reached after warm-up; the paper's base schedule peaks at 512^-0.5 * 4000^-0.5 "
                "= 7.0e-4"})
    warmup_updates: int = field(default=4000, metadata={"min": 0, "help": "linear warm-up updates (paper: 4000)"})
    warmup_init_lr: float = field(default=-1.0, metadata={"min": -1,
        "help": "learning rate at update 0 of the warm-up; -1 means 0 with warm-up, --lr without"})

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if self.warmup_updates < 0:
            raise ValueError(f"--warmup-updates {self.warmup_updates} must be >= 0")


class _Schedule:
    """Common state: the update and the training time (seconds) at which the schedule (re)started
    (``--reset-lr-scheduler`` moves both; a start time of None is taken from the next clock reading), and the
    training time last read from the clock, for schedules that follow it."""

    def __init__(self):
        self.start_update = 0
        self.start_time: float | None = 0.0
        self.train_time = 0.0

    def lr_at(self, step: int) -> float:  # step counted from start_update
        raise NotImplementedError

    def elapsed(self) -> float:
        """Seconds of training since the schedule started, as of the last clock reading."""
        return max(self.train_time - (self.start_time if self.start_time is not None else self.train_time), 0.0)

    def step_update(self, optimizer: torch.optim.Optimizer, num_updates: int,
                    train_time: float | None = None) -> float:
        """Set and return the learning rate for the update that follows ``num_updates`` finished updates;
        ``train_time``: the training clock now (seconds), when the caller has read it."""
        if train_time is not None:
            self.train_time = float(train_time)
            if self.start_time is None:
                self.start_time = self.train_time
        lr = self.lr_at(max(num_updates - self.start_update, 0))
        set_lr(optimizer, lr)
        return lr

    def restart(self, num_updates: int) -> None:
        """Start the schedule again from this update and the next clock reading."""
        self.start_update = num_updates
        self.start_time = None

    def state_dict(self) -> dict:
        return {"start_update": int(self.start_update),
                "start_time": float(self.start_time if self.start_time is not None else self.train_time)}

    def load_state_dict(self, state: dict) -> None:
        self.start_update = int(state.get("start_update", 0))
        self.start_time = float(state.get("start_time", 0.0))


@register("lr_scheduler", "inverse_sqrt", config=InverseSqrtConfig)
class InverseSqrtSchedule(_Schedule):
    """Linear warm-up then decay proportional to the inverse square root of the update number (paper 5.3)."""

    def __init__(self, cfg: InverseSqrtConfig):
        super().__init__()
        self.cfg = cfg
        self.peak = cfg.lr
        self.warmup = cfg.warmup_updates
        if cfg.warmup_init_lr >= 0:
            self.init_lr = cfg.warmup_init_lr
        else:
            self.init_lr = 0.0 if self.warmup > 0 else cfg.lr
        self.decay_factor = self.peak * math.sqrt(max(self.warmup, 1))

    def lr_at(self, step: int) -> float:
        if step < self.warmup:
            return self.init_lr + step * (self.peak - self.init_lr) / self.warmup
        if self.warmup == 0:
            return self.peak * max(step, 1) ** -0.5
        return self.decay_factor * step ** -0.5


@dataclass
class FixedConfig:
    lr: float = field(default=7e-4, metadata={"above": 0, "help": "learning rate"})

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr} must be > 0")


@register("lr_scheduler", "fixed", config=FixedConfig)
class FixedSchedule(_Schedule):
    """A constant learning rate."""

    def __init__(self, cfg: FixedConfig):
        super().__init__()
        self.cfg = cfg
        self.peak = cfg.lr

    def lr_at(self, step: int) -> float:
        return self.cfg.lr


@dataclass
class PolynomialDecayConfig:
    lr: float = field(default=7e-4, metadata={"above": 0, "help": "peak learning rate reached after warm-up"})
    warmup_updates: int = field(default=0, metadata={"min": 0, "help": "linear warm-up updates"})
    end_learning_rate: float = field(default=0.0, metadata={"min": 0,
        "help": "learning rate reached at --total-num-update and kept after it"})
    power: float = field(default=1.0, metadata={"above": 0, "help": "decay exponent (1: linear)"})
    total_num_update: int = field(default=0, metadata={"min": 0,
        "help": "update at which the decay reaches --end-learning-rate (0: --max-update)"})
    total_train_minutes: float = field(default=0.0, metadata={"min": 0,
        "help": "training minutes at which the decay reaches --end-learning-rate if that comes before "
                "--total-num-update (0: off): the decay follows whichever of the update count and the training "
                "clock is further along, so a run stopped by --max-time-minutes ends annealed even when it makes "
                "fewer updates than planned"})

    def __post_init__(self):
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr} must be > 0")
        if self.end_learning_rate > self.lr:
            raise ValueError(f"--end-learning-rate {self.end_learning_rate} must not exceed --lr {self.lr}")
        if self.total_num_update and self.total_num_update <= self.warmup_updates:
            raise ValueError(f"--total-num-update {self.total_num_update} must exceed --warmup-updates "
                             f"{self.warmup_updates}")


@register("lr_scheduler", "polynomial_decay", config=PolynomialDecayConfig)
class PolynomialDecaySchedule(_Schedule):
    """fairseq's polynomial_decay: linear warm-up from ``lr / warmup_updates``, then
    ``end + (lr - end) * (1 - progress) ** power`` down to ``end_learning_rate`` at ``total_num_update``.
    With a known budget of updates, power 1 (linear decay to 0) anneals the model by the end of the run.
    ``total_train_minutes`` adds a budget of time: the schedule then stands at the further along of the update
    count and the clock's share of those minutes (read by :meth:`step_update`), so a run whose updates were
    over-estimated still reaches ``end_learning_rate`` when its time is up."""

    def __init__(self, cfg: PolynomialDecayConfig):
        super().__init__()
        if cfg.total_num_update <= 0:
            raise ValueError("--lr-scheduler polynomial_decay needs --total-num-update or --max-update")
        self.cfg = cfg
        self.peak = cfg.lr

    def lr_at(self, step: int) -> float:
        cfg = self.cfg
        if cfg.warmup_updates > 0 and step <= cfg.warmup_updates:
            return cfg.lr * max(step, 1) / cfg.warmup_updates
        if cfg.total_train_minutes > 0:  # the clock's share of the minutes counts as that share of the updates
            step = max(step, self.elapsed() / (cfg.total_train_minutes * 60) * cfg.total_num_update)
        if step >= cfg.total_num_update:
            return cfg.end_learning_rate
        remaining = 1 - (step - cfg.warmup_updates) / (cfg.total_num_update - cfg.warmup_updates)
        return cfg.end_learning_rate + (cfg.lr - cfg.end_learning_rate) * remaining ** cfg.power


def build_lr_scheduler(name: str, cfg) -> _Schedule:
    return get("lr_scheduler", name).obj(cfg)
