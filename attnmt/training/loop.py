"""The training loop: ``train(data_bin, setup, cfg)`` is what ``attnmt train`` runs.

It builds the task, model, criterion, optimizer and trainer, resumes from ``SAVE_DIR/checkpoint_last.pt`` when
it exists (``state.py``), then runs updates (``--update-freq`` batches each). After each update it logs (every
``--log-interval`` updates: a progress line or bar on stderr and a ``"type": "train"`` JSON line in
``train.jsonl``) and carries out what ``decisions.after_update`` decides: stop, validate (``"type": "valid"``
lines), save checkpoints.

Several processes (torchrun, see ``distributed.py``): every rank runs this loop on its shard of the batches, in
lockstep. Decisions that depend on a clock or a signal (``--max-time-minutes``, ``--save-interval-minutes``,
SIGTERM/SIGUSR1) are agreed on by all ranks after each update, so that every rank validates, saves and stops at
the same update. Only rank 0 writes checkpoints, ``train.jsonl`` and progress; saving gathers every rank's RNG
state to it first. A SIGTERM or SIGUSR1 stops training after the current update with ``checkpoint_last.pt`` saved
and the stop reason ``preempted``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

import attnmt.tasks  # noqa: F401  (the built-in tasks register on import)
from attnmt import checkpoint
from attnmt.backends import Backend, backend_for, resolve_precision, set_threads, training_device
from attnmt.checkpoint import resume as ckpts
from attnmt.checkpoint.saver import CheckpointSaver
from attnmt.config import make_config, to_dict
from attnmt.data.batching import Skipped
from attnmt.errors import UserError
from attnmt.fileio import check_output_dir, check_output_file, exclusive
from attnmt.optim import build_lr_scheduler, build_optimizer
from attnmt.progress import RunLog, fmt_number, hms
from attnmt.registry import get
from attnmt.training import decisions, distributed
from attnmt.training.bleu_validation import BleuValidator
from attnmt.training.config import Setup, TrainConfig
from attnmt.training.data import chunks, make_train_iterator, make_valid_batches, seed_everything
from attnmt.training.metrics import Best, Meter, log_train, validate
from attnmt.training.state import build_state, finetune, resume
from attnmt.training.trainer import Trainer

__all__ = ["Setup", "TrainConfig", "train"]


def train(data_bin: str | os.PathLike, setup: Setup, cfg: TrainConfig,
          extra_validators: list[Callable[[torch.nn.Module], dict]] | None = None,
          dist_cfg: distributed.DistributedConfig | None = None) -> dict:
    """Train (or resume) and return the final summary (also the last line of train.jsonl).

    With ``cfg.world_size > 1`` this is one rank of a torchrun job: it joins the process group (unless the caller
    already did), trains its shard with DistributedDataParallel and leaves the group at the end.
    """
    dist_cfg = dist_cfg or distributed.DistributedConfig()
    t_start = time.perf_counter()
    set_threads(cfg.threads)
    device = training_device(cfg.local_rank, cfg.cpu)
    backend = backend_for(device, resolve_precision(cfg.precision, device, mode="train"))  # the run's one backend
    peers = None
    owns_group = False
    if cfg.world_size > 1:
        owns_group = not distributed.is_initialized()
        peers = distributed.init(distributed.Env(cfg.rank, cfg.world_size, cfg.local_rank), backend, dist_cfg)
    try:
        with distributed.collective_errors(peers, dist_cfg.ddp_timeout, Path(cfg.save_dir)), _save_dir_lock(cfg):
            return TrainingRun(data_bin, setup, cfg, backend, dist_cfg, extra_validators, t_start).run()
    finally:
        if owns_group:
            distributed.shutdown()


LOCK = ".attnmt.lock"  # in --save-dir: held by the run writing there (rank 0)


def _save_dir_lock(cfg: TrainConfig):
    """One run at a time writes a --save-dir (its checkpoints, train.jsonl and temp files): rank 0 holds a lock
    on it for the whole run; a second run there stops at once, naming the first."""
    if cfg.rank != 0:
        return contextlib.nullcontext()
    save_dir = check_output_dir(cfg.save_dir, "--save-dir")
    return exclusive(save_dir / LOCK, f"--save-dir {save_dir}",
                     "wait for that run to end (or stop it), or choose another --save-dir")


class TrainingRun:
    """One run of ``attnmt train`` on this rank: set up in order by the ``_setup_*`` steps (the save directory, the
    model and its trainer, the data, the validators, the log and the checkpoint writer), then :meth:`run`: resume
    or restore, report, train until a decision stops it, report the end."""

    def __init__(self, data_bin, setup: Setup, cfg: TrainConfig, backend: Backend,
                 dist_cfg: distributed.DistributedConfig, extra_validators: list | None, t_start: float):
        self.setup, self.cfg, self.backend, self.dist_cfg, self.t_start = setup, cfg, backend, dist_cfg, t_start
        self.save_dir = Path(cfg.save_dir)
        self.is_master = cfg.rank == 0
        seed_everything(cfg.seed)
        stale = self._setup_save_dir()
        self._setup_model(data_bin)
        self._setup_data()
        self._setup_validators(extra_validators)
        self._setup_log(stale)

    # ------------------------------------------------------------------------------------------------- setup

    def _setup_save_dir(self) -> list[Path]:
        """Before any work: a bad --save-dir fails now, not at the first save; the partial files of interrupted
        saves are removed (returned, to be logged)."""
        if not self.is_master:
            return []
        check_output_dir(self.save_dir, "--save-dir")
        stale = checkpoint.remove_partial_files(self.save_dir)
        if self.cfg.log_file:
            check_output_file(self.cfg.log_file, "--log-file")
        return stale

    def _setup_model(self, data_bin) -> None:
        """The task, the model prepared by the backend, the criterion, the optimizer and the trainer."""
        cfg, setup, backend = self.cfg, self.setup, self.backend
        self.task = get("task", setup.task).obj(setup.task_cfg, data_bin)
        if setup.base_model is not None:  # --finetune-from without --arch: the checkpoint's architecture

            name, base = setup.base_model
            self.model_name, self.notes = name, [f"the architecture of --finetune-from {cfg.finetune_from}"]
            self.model_cfg = make_config(get("model", name).config, {**base, **setup.model_overrides},
                                         what=f"--finetune-from {cfg.finetune_from}")
        else:
            self.model_name, self.model_cfg, self.notes = self.task.model_config(setup.arch, setup.model_overrides)
        model = self.task.build_model(self.model_name, self.model_cfg).to(backend.device)
        backend.prepare_training(model, cfg.cpu_attention, cfg.compile)  # before the optimizer and DDP see it
        if cfg.world_size > 1:  # every rank built the same weights; from here on each draws its own dropout masks
            torch.manual_seed(cfg.seed + cfg.rank)
        criterion = self.task.build_criterion(setup.criterion, setup.criterion_cfg)
        backend.prepare_criterion(criterion)
        lr_scheduler = build_lr_scheduler(setup.lr_scheduler, setup.lr_scheduler_cfg)
        optimizer = build_optimizer(setup.optimizer, setup.optimizer_cfg, model.parameters(),
                                    lr=getattr(setup.lr_scheduler_cfg, "lr", 1e-3))
        ddp_model = distributed.wrap(model, backend) if cfg.world_size > 1 else None
        self.model = model
        self.trainer = Trainer(model, criterion, optimizer, lr_scheduler, backend=backend, clip_norm=cfg.clip_norm,
                               world_size=cfg.world_size, ddp_model=ddp_model)

    def _setup_data(self) -> None:
        """The train iterator (lengths padded to the backend's multiple) and the validation batches."""
        cfg, task = self.cfg, self.task
        max_positions = self.model.max_positions()
        multiple = cfg.required_seq_len_multiple or self.backend.length_multiple()
        self.itr, self.skipped = make_train_iterator(task, cfg, max_positions, multiple)
        if cfg.world_size > 1:  # a rank whose update holds only padding batches still joins the gradient all-reduce
            self.trainer.prime_padding_batch(self.itr.collate(self.itr.batches[0]))
        self.valid_sets = {} if cfg.disable_validation else {
            s: make_valid_batches(task, cfg, s, max_positions, multiple) for s in task.valid_subsets()}

    def _setup_validators(self, extra_validators: list | None) -> None:
        if extra_validators is None:
            extra_validators = []
            if self.cfg.eval_bleu and not self.cfg.disable_validation:
                extra_validators.append(BleuValidator(self.task, self.cfg, self.backend))
        self.extra_validators = extra_validators

    def _setup_log(self, stale: list[Path]) -> None:
        """train.jsonl and the progress display, the best value, the data section, the checkpoint writer."""
        cfg, save_dir = self.cfg, self.save_dir
        total = cfg.max_update or (cfg.max_epoch * math.ceil(len(self.itr) / cfg.update_freq) if cfg.max_epoch
                                   else None)
        self.log = RunLog(save_dir / "train.jsonl", cfg.progress, total, 0, enabled=self.is_master,
                          log_file=cfg.log_file, tensorboard_dir=cfg.tensorboard_logdir)
        if stale:
            self.log.info(f"removed {len(stale)} partial checkpoint file(s) of interrupted saves from {save_dir}")
        self.best = Best(cfg.best_checkpoint_metric, cfg.maximize_best_checkpoint_metric)
        self.data_state = self.task.data_state()
        self.saver = CheckpointSaver(save_dir, self.backend.host_staging(), background=cfg.background_save,
                                     after_write=functools.partial(ckpts.prune, save_dir, cfg.keep_interval_updates,
                                                                   cfg.keep_last_epochs, cfg.keep_best_checkpoints,
                                                                   cfg.maximize_best_checkpoint_metric))

    # --------------------------------------------------------------------------------------------------- run

    def run(self) -> dict:
        """Resume (or restore, or fine-tune), train until a decision stops it; the run's summary."""
        cfg, log, saver = self.cfg, self.log, self.saver
        try:
            train_time = self._start_state()
            _report_start(log, self.task, self.setup, cfg, self.model, self.itr, self.skipped, self.valid_sets,
                          self.backend, self.notes)
            if cfg.world_size > 1:
                dist_cfg = self.dist_cfg
                log.info(f"processes: {cfg.world_size} "
                         f"({distributed.choose_backend(self.backend, dist_cfg.distributed_backend)}, one per "
                         f"{self.backend.process_unit}), each on its own shard of the batches; "
                         f"collectives time out after --ddp-timeout {dist_cfg.ddp_timeout:g} s")
            with distributed.Preemption() as preemption:
                summary = self._loop(train_time, preemption)
            saver.close()
            summary["skipped_train"] = len(self.skipped)
            summary["wall_s"] = time.perf_counter() - self.t_start
            log.record(summary)
            _report_end(log, summary)
            return summary
        finally:
            if saver.writing:  # leaving on an error or Ctrl-C: let the write in progress finish (its error is moot)
                with contextlib.suppress(Exception):
                    saver.close()
            log.close()

    def _start_state(self) -> float:
        """Resume from --save-dir's checkpoint_last.pt, restore --restore-file, or fine-tune from --finetune-from;
        returns the training time already spent."""
        cfg, log, trainer = self.cfg, self.log, self.trainer
        args = (cfg, self.setup, trainer, self.itr, self.best, self.model_name, self.model_cfg, self.data_state, log)
        last = self.save_dir / checkpoint.LAST
        train_time = 0.0
        seen = distributed.all_gather(last.exists())
        if len(set(seen)) > 1:
            raise UserError(f"{last} exists for rank(s) {[r for r, x in enumerate(seen) if x]} only; put --save-dir "
                            f"on a file system that every node shares, so that every rank resumes from it")
        if last.exists():
            if cfg.finetune_from:
                log.info(f"{last} exists: resuming from it, --finetune-from is ignored")
            resets = cfg.restore_file == checkpoint.LAST  # with --restore-file, its --reset-* flags were for it
            if not resets and (cfg.reset_optimizer or cfg.reset_lr_scheduler or cfg.reset_dataloader):
                log.info(f"{last} exists: resuming this run's own progress; the --reset-* flags applied to "
                         f"--restore-file {cfg.restore_file} when the run began")
            train_time = resume(last, *args, resets=resets)
            dropped = log.forget_after(trainer.num_updates)
            if dropped:
                log.info(f"train.jsonl: dropped {dropped} record(s) of updates after {trainer.num_updates}, which "
                         f"the checkpoint does not hold and this run repeats")
        elif cfg.restore_file != checkpoint.LAST:  # fairseq's --restore-file: start from another run's state
            restore = Path(cfg.restore_file)
            if not restore.is_file():
                raise UserError(f"{restore}: --restore-file not found; give an attnmt checkpoint (fairseq's are "
                                f"converted by attnmt import-fairseq)")
            log.info(f"restoring {restore} (reset: optimizer {cfg.reset_optimizer}, lr scheduler "
                     f"{cfg.reset_lr_scheduler}, dataloader {cfg.reset_dataloader})")
            train_time = resume(restore, *args, restore=True)
        elif cfg.finetune_from:
            finetune(Path(cfg.finetune_from), trainer, self.data_state, log)
        if not last.exists() and log.forget_after(trainer.num_updates):  # a run killed before its first full save
            log.info(f"train.jsonl: dropped the records of an earlier run that left no {checkpoint.LAST}; this run "
                     f"starts at update {trainer.num_updates}")
        return train_time

    def _loop(self, train_time0: float, preemption: distributed.Preemption | None = None) -> dict:
        """Updates until a decision stops the run; after each: log, agree on the clocks and signals, validate,
        save, as ``decisions`` says. Returns the run's summary."""
        cfg, trainer, itr, log, best = self.cfg, self.trainer, self.itr, self.log, self.best
        meter = Meter(trainer.device)
        run_start = time.perf_counter()
        self._clock = lambda: train_time0 + time.perf_counter() - run_start  # the training time so far
        last_save = run_start
        start_updates = trainer.num_updates
        trainer.follow_clock(train_time0)  # the first update's learning rate, where the schedule follows the clock
        self.last_valid = {}
        stop = decisions.already_done(cfg, trainer.num_updates, itr.epoch, itr.end_of_epoch(), train_time0)
        if stop:
            flag = {"max_time": "max-time-minutes"}.get(stop, stop.replace("_", "-"))
            log.info(f"nothing to do: already at {stop.replace('_', ' ')} (update {trainer.num_updates}, epoch "
                     f"{itr.epoch}); raise --{flag} to train further")
        log.advance(trainer.num_updates, itr.epoch)
        while stop is None:
            if itr.end_of_epoch():
                itr.next_epoch()
            for group in chunks(iter(itr), cfg.update_freq):
                out = trainer.train_step(group)
                if out is not None:
                    meter.add(out)
                n = trainer.num_updates
                end_of_epoch = itr.end_of_epoch()
                if out is not None and not out["overflow"] and n % cfg.log_interval == 0:
                    log_train(log, meter, trainer, itr, cfg, n, start_updates, run_start, self._clock())
                log.advance(n, itr.epoch)
                # clock- and signal-driven decisions, agreed on by all ranks (identity in a single process), and
                # the training clock (the largest of the ranks' readings), for a schedule that follows it
                clock = self._clock()
                preempted, time_up, minutes_due, clock = distributed.max_over_ranks([
                    preemption is not None and preemption.requested,
                    bool(cfg.max_time_minutes) and clock >= cfg.max_time_minutes * 60,
                    bool(cfg.save_interval_minutes)
                    and time.perf_counter() - last_save >= cfg.save_interval_minutes * 60,
                    clock,
                ], trainer.device)
                preempted, time_up, minutes_due = bool(preempted), bool(time_up), bool(minutes_due)
                trainer.follow_clock(clock)
                decision = decisions.after_update(cfg, decisions.AfterUpdate(
                    n, itr.epoch, end_of_epoch, out is not None, time_up, preempted, minutes_due),
                    bool(self.valid_sets))
                if decision.validate:
                    decision = self._validate(n, decision)
                stop, names = decision.stop, decision.save
                if names:
                    self._save(names)
                    last_save = time.perf_counter()
                    if stop is None and distributed.any_rank([preemption is not None and preemption.requested],
                                                             trainer.device)[0]:
                        stop = "preempted"  # arrived while saving: the checkpoint just written holds this update
                if stop is not None:
                    self.saver.wait()  # the last checkpoint is on disk before the run says so or exits
                if stop == "preempted":
                    why = preemption.signal_name if preemption is not None and preemption.signal_name else \
                        "a signal to another rank"
                    log.info(f"preempted by {why}: stopped after update {n} and saved "
                             f"{self.saver.save_dir / checkpoint.LAST}; run the same command again to resume")
                if stop is not None:
                    break
        v = next(iter(self.last_valid.values())) if self.last_valid else {}
        return {"type": "summary", "stop_reason": stop, "num_updates": trainer.num_updates, "epoch": itr.epoch,
                "train_time": self._clock(), "updates_this_run": trainer.num_updates - start_updates,
                "best_metric": best.metric, "best": best.value, "best_num_updates": best.num_updates,
                "valid": {k: v[k] for k in v}, "lr": trainer.lr, "num_overflows": trainer.num_overflows}

    def _validate(self, n: int, decision: decisions.Decision) -> decisions.Decision:
        """Validate after update ``n``, log it, and complete the decision (the best, the N best, patience)."""
        log, best, itr = self.log, self.best, self.itr
        self.last_valid = validate(self.trainer, self.valid_sets, self.extra_validators)
        first = next(iter(self.last_valid.values()))
        improved = best.update(first[best.metric], n)
        for split, m in self.last_valid.items():
            samples = {k: m.pop(k) for k in ("sample_hypothesis", "sample_reference") if k in m}
            rec = {"type": "valid", "subset": split, "epoch": itr.epoch, "num_updates": n,
                   **{k: v for k, v in m.items()}, "best_" + best.metric: best.value, **samples}
            log.record(rec)
            log.line(f"valid on '{split}' | epoch {itr.epoch} | update {n} | "
                     + " | ".join(f"{k} {fmt_number(v)}" for k, v in m.items() if k != "ntokens")
                     + f" | best {best.metric} {fmt_number(best.value)}", None)
            for k, text in samples.items():
                log.info(f"valid on '{split}' | example {k.split('_')[1]}: {text}")
        decision = decisions.after_validation(self.cfg, decision, improved, best.bad_validations,
                                              first[best.metric], n)
        if decision.stop == "patience":
            log.info(f"early stop: {best.metric} has not improved for {self.cfg.patience} validations")
        return decision

    def _save(self, names: list[str]) -> None:
        """Every rank calls this with the same names (its RNG state goes to rank 0); rank 0 writes."""
        if not names:
            return
        rng_by_rank = distributed.gather_to_master(ckpts.rng_state(self.trainer.backend))
        if not self.is_master:
            return
        state = build_state(self.trainer, self.setup, self.cfg, self.model_name, self.model_cfg, self.data_state,
                            self.itr, self.best, self._clock(), rng_by_rank)
        self.saver.save(state, names)  # copied now, written in the background (--background-save)


def _report_start(log: RunLog, task, setup: Setup, cfg: TrainConfig, model, itr, skipped: Skipped, valid_sets,
                  backend, notes) -> None:
    n = model.num_parameters()
    train = itr.batches
    n_train = sum(len(b) for b in train)
    log.info(f"model: {setup.arch} ({n:,} parameters); {backend.describe()}, {torch.get_num_threads()} CPU threads")
    log.record({"type": "start", "arch": setup.arch, "parameters": n, "device": str(backend.device),
                "precision": backend.precision, "hardware": backend.describe(), "threads": torch.get_num_threads()})
    for note in notes:
        log.info(f"model: {note}")
    for notice in setup.notices:
        log.info(notice)
    log.info(f"data: {task.data_bin} {task.src_lang}->{task.tgt_lang}, dictionaries {len(task.src_dict)}/"
             f"{len(task.tgt_dict)} symbols{' (joined)' if task.joint_dictionary else ''}")
    name = task.cfg.train_subset
    if itr.num_plans > 1:
        name = f"{itr.num_plans} BPE-dropout segmentations of the training split in turn, the first"
    elif cfg.sampled_segmentations:
        name = "the one BPE-dropout segmentation of the training split"
    log.info(f"data: {name}: {n_train:,} pairs in {len(train):,} batches"
             + "".join(f"; {s}: {len(d)} pairs" for s, (d, _, _) in valid_sets.items()))
    if len(skipped):
        log.info(f"data: {name}: {skipped.describe()}")
    for s, (_, _, sk) in valid_sets.items():
        if len(sk):
            log.info(f"data: {s}: {sk.describe()}")
    what, per = ("max-tokens", cfg.max_tokens) if cfg.max_tokens else ("batch-size", cfg.batch_size)
    eff = per * cfg.world_size * cfg.update_freq
    log.info(f"effective batch = {what} x world size x update-freq = {per} x {cfg.world_size} x {cfg.update_freq} = "
             f"{eff:,} {'padded tokens' if cfg.max_tokens else 'sentences'} per update at most (the real count is "
             f"logged as ntokens)")
    log.info(f"optimizer: {setup.optimizer} {to_dict(setup.optimizer_cfg)}; lr scheduler: {setup.lr_scheduler} "
             f"{to_dict(setup.lr_scheduler_cfg)}; criterion: {setup.criterion} {to_dict(setup.criterion_cfg)}")


def _report_end(log: RunLog, s: dict) -> None:
    v = s.get("valid") or {}
    vtxt = "".join(f" | valid {k} {fmt_number(x)}" for k, x in v.items() if k in ("loss", "ppl", "bleu"))
    log.info(f"done ({s['stop_reason']}): {s['num_updates']} updates, epoch {s['epoch']}, "
             f"train time {hms(s['train_time'])}{vtxt} | best {s['best_metric']} "
             f"{fmt_number(s['best']) if s['best'] is not None else '-'}")
