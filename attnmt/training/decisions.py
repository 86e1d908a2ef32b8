"""What the loop does after an update: stop, validate, save which checkpoints. Pure functions of the run's state.

After each update, in this order:

* stop? ``--max-update`` reached, ``--max-time-minutes`` used up, the end of the ``--max-epoch``-th epoch, or a
  preemption signal (SIGTERM/SIGUSR1), first match wins;
* validate? at the end of every ``--validate-interval``-th epoch, every ``--validate-interval-updates`` updates
  (not at an epoch end, which validates on its own schedule), and when stopping, except after a preemption (the
  job must leave quickly);
* save? ``checkpoint{epoch}.pt`` at the end of every ``--save-interval``-th epoch (unless
  ``--no-epoch-checkpoints``), ``checkpoint_{epoch}_{updates}.pt`` every ``--save-interval-updates`` updates or
  ``--save-interval-minutes`` minutes (not at an epoch end), and ``checkpoint_last.pt`` with any of these and
  whenever the run stops;
* after validation: ``checkpoint_best.pt`` (and ``checkpoint_last.pt``) when the metric improved, with
  ``--keep-best-checkpoints N`` also ``checkpoint.best_METRIC_VALUE.pt`` (pruned to the N best), and a stop with
  ``patience`` once it has not improved for ``--patience`` validations.

``--no-last-checkpoints`` leaves ``checkpoint_last.pt`` out of every list, ``--no-save`` writes nothing.

An update without any target token (``stepped`` False) triggers no update-count interval.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from attnmt.checkpoint import BEST, LAST, best_n_name, epoch_name, interval_name
from attnmt.training.config import TrainConfig


@dataclass(frozen=True)
class AfterUpdate:
    """The run's state right after an update."""

    num_updates: int
    epoch: int
    end_of_epoch: bool  # the update consumed the epoch's last batch
    stepped: bool = True  # the update held target tokens (False: every batch of it, on every rank, was empty)
    time_up: bool = False  # --max-time-minutes used up (agreed on by every rank)
    preempted: bool = False  # a preemption signal arrived (agreed on by every rank)
    minutes_due: bool = False  # --save-interval-minutes elapsed since the last save


@dataclass
class Decision:
    stop: str | None = None  # max_update, max_time, max_epoch, preempted, patience
    validate: bool = False
    save: list[str] = field(default_factory=list)  # checkpoint names; the first is written, the others linked


def stop_reason(cfg: TrainConfig, s: AfterUpdate) -> str | None:
    if cfg.max_update and s.num_updates >= cfg.max_update:
        return "max_update"
    if s.time_up:
        return "max_time"
    if s.end_of_epoch and cfg.max_epoch and s.epoch >= cfg.max_epoch:
        return "max_epoch"
    if s.preempted:
        return "preempted"
    return None


def after_update(cfg: TrainConfig, s: AfterUpdate, can_validate: bool) -> Decision:
    """Stop, validate and save after an update (``can_validate``: there are validation sets)."""
    stop = stop_reason(cfg, s)
    n, epoch_due = s.num_updates, s.end_of_epoch and s.epoch % cfg.validate_interval == 0
    updates_due = bool(cfg.validate_interval_updates) and n % cfg.validate_interval_updates == 0 \
        and not s.end_of_epoch and s.stepped
    validate = can_validate and stop != "preempted" and (stop is not None or epoch_due or updates_due)
    names: list[str] = []
    epoch_save = s.end_of_epoch and s.epoch % cfg.save_interval == 0
    if epoch_save and not cfg.no_epoch_checkpoints:
        names.append(epoch_name(s.epoch))
    interval_hit = bool(cfg.save_interval_updates) and n % cfg.save_interval_updates == 0 and s.stepped
    if (interval_hit or s.minutes_due) and not s.end_of_epoch:
        names.append(interval_name(s.epoch, n))
    if names or stop is not None or epoch_save:
        names.append(LAST)
    return Decision(stop, validate, writable(cfg, names))


def writable(cfg: TrainConfig, names: list[str]) -> list[str]:
    """The names the checkpoint options let the run write."""
    if cfg.no_save:
        return []
    return [n for n in names if n != LAST] if cfg.no_last_checkpoints else names


def after_validation(cfg: TrainConfig, d: Decision, improved: bool, bad_validations: int,
                     value: float | None = None, num_updates: int = 0) -> Decision:
    """The decision once validation ran (``value``: the --best-checkpoint-metric's, after ``num_updates``): save
    the new best, and a candidate for the N best; stop when ``--patience`` ran out."""
    names, stop = list(d.save), d.stop
    if improved:
        names = [BEST, *names]
        if LAST not in names:
            names.append(LAST)
    if cfg.keep_best_checkpoints > 0 and value is not None:
        names.append(best_n_name(cfg.best_checkpoint_metric, value, num_updates))
    if cfg.patience > 0 and bad_validations >= cfg.patience and stop is None:
        stop = "patience"
        if LAST not in names:
            names.append(LAST)
    return Decision(stop, d.validate, writable(cfg, names))


def already_done(cfg: TrainConfig, num_updates: int, epoch: int, end_of_epoch: bool, train_time: float) -> str | None:
    """Why a resumed run has nothing left to do (None: it has)."""
    stop = None
    if end_of_epoch and cfg.max_epoch and epoch >= cfg.max_epoch:
        stop = "max_epoch"
    if cfg.max_update and num_updates >= cfg.max_update:
        stop = "max_update"
    if cfg.max_time_minutes and train_time >= cfg.max_time_minutes * 60:
        stop = "max_time"
    return stop
