"""The training loop: epochs, validation, checkpoints, stopping, progress and ``train.jsonl``.

``train(data_bin, setup, cfg)`` is what ``attnmt train`` runs. One pass of the loop body is one update
(``--update-freq`` batches). After each update the loop decides, in this order:

* log (every ``--log-interval`` updates): progress line/bar on stderr and a ``"type": "train"`` JSON line;
* stop? (``--max-update``, ``--max-time-minutes``, end of the ``--max-epoch``-th epoch);
* validate? (end of an epoch every ``--validate-interval`` epochs, every ``--validate-interval-updates``, and
  when stopping): ``"type": "valid"`` JSON line, best metric, ``--patience``;
* save? (end of an epoch every ``--save-interval`` epochs, every ``--save-interval-updates``, every
  ``--save-interval-minutes``, when stopping, and whenever validation found a new best).

Resuming: when ``SAVE_DIR/checkpoint_last.pt`` exists the run continues from it: weights, optimizer, LR schedule,
loss scaler, update count, the data iterator's position (epoch + batches consumed) and every RNG state (each
rank's own), so that N updates + restart + N updates give bitwise the same weights as 2N updates (fp32 on CPU).

Several processes (torchrun, see ``distributed.py``): every rank runs this loop on its shard of the batches, in
lockstep. Decisions that depend on a clock or a signal (``--max-time-minutes``, ``--save-interval-minutes``,
SIGTERM/SIGUSR1) are agreed on by all ranks after each update, so that every rank validates, saves and stops at
the same update. Only rank 0 writes checkpoints, ``train.jsonl`` and progress; saving gathers every rank's RNG
state to it first. A SIGTERM or SIGUSR1 stops training after the current update with ``checkpoint_last.pt`` saved
and the stop reason ``preempted``.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from attnmt.backends import backend_for, resolve_precision
from attnmt.backends.precision import requested_precision
from attnmt.config import to_dict
from attnmt.criterions import reduce_metrics
from attnmt.data.batching import EpochBatchIterator, Skipped, batch_by_size, filter_by_size
from attnmt.errors import UserError
from attnmt.optim import build_lr_scheduler, build_optimizer
from attnmt.registry import get
from attnmt.training import checkpoints as ckpts
from attnmt.training import distributed
from attnmt.training.trainer import Trainer, global_sum


@dataclass
class TrainConfig:
    """Options of ``attnmt train`` that belong to the loop (the components have their own configs)."""

    # batching
    max_tokens: int | None = field(default=4096, metadata={
        "help": "max PADDED tokens per batch per process: n_sentences * max(src_len, tgt_len)"})
    batch_size: int | None = field(default=None, metadata={"help": "max sentences per batch (optional cap)"})
    required_batch_size_multiple: int = field(default=8, metadata={
        "help": "full batches hold a multiple of this many sentences (friendlier matrix shapes)"})
    update_freq: int = field(default=1, metadata={"help": "accumulate gradients over N batches per update"})
    # stopping
    max_update: int = field(default=0, metadata={"help": "stop after this many updates (0: no limit)"})
    max_epoch: int = field(default=0, metadata={"help": "stop after this many epochs (0: no limit)"})
    max_time_minutes: float = field(default=0.0, metadata={
        "help": "stop after this much training time, summed over restarts (0: no limit)"})
    patience: int = field(default=-1, metadata={
        "help": "stop when the best validation metric has not improved for N validations (-1: off)"})
    # numerics and device
    seed: int = field(default=1, metadata={"help": "random seed (initialisation, dropout, batch order)"})
    precision: Literal["auto", "fp32", "bf16", "fp16"] = field(default="fp32", metadata={
        "help": "auto: bf16 where the hardware computes it natively (a CPU with AMX or AVX-512 BF16, a GPU of "
                "compute capability >= 8.0), fp32 otherwise; bf16: bf16 autocast with fp32 master weights (an "
                "error on a CPU without native bf16); fp16: fp16 autocast with dynamic loss scaling (CUDA)"})
    bf16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision bf16"})
    fp16: bool = field(default=False, metadata={"help": "fairseq's spelling of --precision fp16"})
    cpu: bool = field(default=False, metadata={"help": "train on the CPU even when CUDA is available"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads for torch (torch.set_num_threads)"})
    clip_norm: float = field(default=0.0, metadata={"help": "clip the gradient norm to this value (0: off)"})
    cpu_attention: Literal["auto", "math", "flash"] = field(default="auto", metadata={
        "help": "attention kernel on CPU: math (matmul-softmax-matmul, fastest for sentences up to ~256 tokens), "
                "flash (fused, faster for long sequences) or auto (math up to 256 tokens, flash beyond)"})
    # checkpoints
    save_dir: str = field(default="checkpoints", metadata={"help": "directory for checkpoints and train.jsonl"})
    save_interval: int = field(default=1, metadata={"help": "save an epoch checkpoint every N epochs"})
    save_interval_updates: int = field(default=0, metadata={
        "help": "also save checkpoint_EPOCH_UPDATES.pt every N updates (0: off)"})
    save_interval_minutes: float = field(default=0.0, metadata={
        "help": "also save checkpoint_EPOCH_UPDATES.pt every N minutes of training (0: off)"})
    keep_interval_updates: int = field(default=-1, metadata={
        "help": "keep only the newest N update-interval checkpoints (-1: all)"})
    keep_last_epochs: int = field(default=-1, metadata={"help": "keep only the newest N epoch checkpoints (-1: all)"})
    no_epoch_checkpoints: bool = field(default=False, metadata={"help": "do not write checkpointEPOCH.pt files"})
    best_checkpoint_metric: str = field(default="loss", metadata={
        "help": "validation metric that picks checkpoint_best.pt: loss, nll_loss, ppl or bleu (needs --eval-bleu)"})
    maximize_best_checkpoint_metric: bool = field(default=False, metadata={
        "help": "higher is better for --best-checkpoint-metric (e.g. bleu)"})
    # validation
    validate_interval: int = field(default=1, metadata={"help": "validate every N epochs"})
    validate_interval_updates: int = field(default=0, metadata={"help": "also validate every N updates (0: off)"})
    disable_validation: bool = field(default=False, metadata={"help": "never validate"})
    eval_bleu: bool = field(default=False, metadata={
        "help": "also decode the validation set with beam search and report detokenized sacreBLEU"})
    eval_bleu_beam: int = field(default=4, metadata={"help": "beam size for --eval-bleu"})
    eval_bleu_lenpen: float = field(default=0.6, metadata={"help": "length penalty alpha for --eval-bleu"})
    eval_bleu_max_len_a: float = field(default=1.0, metadata={"help": "--eval-bleu max length = a * src_len + b"})
    eval_bleu_max_len_b: int = field(default=50, metadata={"help": "--eval-bleu max length = a * src_len + b"})
    eval_bleu_max_sentences: int = field(default=0, metadata={
        "help": "decode only the first N validation sentences for --eval-bleu (0: all)"})
    # resume
    reset_optimizer: bool = field(default=False, metadata={"help": "resume with fresh optimizer state"})
    reset_lr_scheduler: bool = field(default=False, metadata={
        "help": "resume with the LR schedule started again (warm-up from the current update)"})
    reset_dataloader: bool = field(default=False, metadata={"help": "resume from epoch 1, batch 0"})
    finetune_from: str | None = field(default=None, metadata={
        "help": "start from this checkpoint's weights only (ignored when SAVE_DIR/checkpoint_last.pt exists)"})
    # output
    log_interval: int = field(default=100, metadata={"help": "log training figures every N updates"})
    progress: Literal["auto", "bar", "lines", "none"] = field(default="auto", metadata={
        "help": "progress display on stderr: auto (bar on a terminal, lines otherwise), bar, lines, none"})
    world_size: int = field(default=1, metadata={"help": "number of training processes", "cli": False})
    rank: int = field(default=0, metadata={"help": "this process's rank", "cli": False})
    local_rank: int = field(default=0, metadata={"help": "this process's rank on its machine (its GPU)", "cli": False})

    def __post_init__(self):
        if self.max_tokens is None and self.batch_size is None:
            raise ValueError("give --max-tokens or --batch-size")
        for name in ("max_tokens", "batch_size"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {v}")
        if self.update_freq < 1:
            raise ValueError(f"--update-freq must be >= 1, got {self.update_freq}")
        if self.log_interval < 1:
            raise ValueError(f"--log-interval must be >= 1, got {self.log_interval}")
        self.precision = requested_precision(self.precision, self.bf16, self.fp16)
        if self.best_checkpoint_metric not in ("loss", "nll_loss", "ppl", "bleu"):
            raise ValueError(f"--best-checkpoint-metric {self.best_checkpoint_metric!r}: use loss, nll_loss, ppl or "
                             f"bleu")
        if self.best_checkpoint_metric == "bleu" and not self.eval_bleu:
            raise ValueError("--best-checkpoint-metric bleu needs --eval-bleu")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {self.threads}")


@dataclass
class Setup:
    """The chosen components and their configs (what the command line resolved)."""

    task: str
    task_cfg: Any
    arch: str
    model_overrides: dict
    criterion: str
    criterion_cfg: Any
    optimizer: str
    optimizer_cfg: Any
    lr_scheduler: str
    lr_scheduler_cfg: Any


# ---------------------------------------------------------------------------------------------------- output


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"


def _hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class RunLog:
    """Progress on stderr (a rich bar on a terminal, plain lines otherwise) and JSON lines in ``train.jsonl``."""

    def __init__(self, jsonl: Path | None, mode: str, total: int | None, done: int, enabled: bool = True):
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.jsonl = open(jsonl, "a", encoding="utf-8") if jsonl is not None and enabled else None  # noqa: SIM115
        self.bar = None
        if self.mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("{task.description}"), BarColumn(bar_width=20), MofNCompleteColumn(),
                                TimeRemainingColumn(), TextColumn("{task.fields[stats]}"), console=self.console,
                                transient=False, expand=False)
            self.bar.start()
            self.task_id = self.bar.add_task("train", total=total, completed=done, stats="")

    def info(self, text: str) -> None:
        if self.mode != "none":
            self.console.print(text, markup=False, soft_wrap=True)

    def record(self, obj: dict) -> None:
        if self.jsonl is not None:
            self.jsonl.write(json.dumps(obj, sort_keys=False) + "\n")
            self.jsonl.flush()

    def advance(self, num_updates: int, epoch: int, stats: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=num_updates, description=f"ep {epoch}",
                            **({"stats": stats} if stats else {}))

    def line(self, text: str, compact: str) -> None:
        """A log line: printed in plain-lines mode; its ``compact`` form is shown next to the bar otherwise."""
        if self.mode == "lines":
            self.info(text)
        elif self.bar is not None:
            self.bar.update(self.task_id, stats=compact)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.jsonl is not None:
            self.jsonl.close()


class Meter:
    """Sums over one log interval; tensors stay on the device until the interval is reported."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), dtype=torch.float64, device=self.device)
        self.nll = torch.zeros((), dtype=torch.float64, device=self.device)
        self.gnorm = torch.zeros((), dtype=torch.float64, device=self.device)
        self.ngnorm = 0
        self.ntokens = 0
        self.nsentences = 0
        self.updates = 0
        self.start = time.perf_counter()

    def add(self, log: dict) -> None:
        self.loss += log["loss"]
        self.nll += log["nll_loss"]
        if log["gnorm"] is not None:
            self.gnorm += log["gnorm"]
            self.ngnorm += 1
        self.ntokens += log["ntokens"]
        self.nsentences += log["nsentences"]
        self.updates += 0 if log["overflow"] else 1

    def report(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        loss, nll, ntok, nsent = global_sum([float(self.loss), float(self.nll), self.ntokens, self.nsentences],
                                            self.device)
        out = reduce_metrics(loss, nll, ntok)
        out.update(wps=ntok / elapsed, ups=self.updates / elapsed,
                   gnorm=float(self.gnorm) / max(self.ngnorm, 1), ntokens=int(ntok), nsentences=int(nsent))
        return out


# ---------------------------------------------------------------------------------------------------- pieces


def _device(cfg: TrainConfig) -> torch.device:
    return distributed.choose_device(distributed.Env(cfg.rank, cfg.world_size, cfg.local_rank), cfg.cpu)


def _seed_everything(seed: int) -> None:
    import random

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _chunks(it, n: int):
    group = []
    for x in it:
        group.append(x)
        if len(group) == n:
            yield group
            group = []
    if group:
        yield group


def make_train_iterator(task, cfg: TrainConfig, max_positions: tuple[int, int]) -> tuple[EpochBatchIterator, Skipped]:
    """Filter overlong pairs, bucket by length into --max-tokens batches, shuffle per epoch, shard by rank."""
    data = task.dataset(task.cfg.train_subset)
    order = data.ordered_indices(cfg.seed)
    kept, skipped = filter_by_size(order, data.src_sizes, data.tgt_sizes, max_positions[0], max_positions[1],
                                   cfg.max_tokens)
    batches = batch_by_size(kept, data.num_tokens(), cfg.max_tokens, cfg.batch_size, cfg.required_batch_size_multiple)
    if not batches:
        raise UserError(f"{task.split_prefix(task.cfg.train_subset, task.src_lang)}: no training pair fits "
                        f"(all {len(data)} skipped: {skipped.reason}); raise --max-tokens or the model's max positions")
    if len(batches) < cfg.world_size:
        raise UserError(f"{task.split_prefix(task.cfg.train_subset, task.src_lang)}: {len(batches)} batch(es) of "
                        f"--max-tokens {cfg.max_tokens} for {cfg.world_size} processes; every process needs at least "
                        f"one: lower --max-tokens or start fewer processes")
    return EpochBatchIterator(batches, data.collate, seed=cfg.seed, shuffle=True, world_size=cfg.world_size,
                              rank=cfg.rank), skipped


def make_valid_batches(task, cfg: TrainConfig, split: str, max_positions: tuple[int, int]):
    """(dataset, batches, skipped) for a validation split: every pair that fits, in length order, no shuffle."""
    data = task.dataset(split)
    order = data.ordered_indices(0)
    kept, skipped = filter_by_size(order, data.src_sizes, data.tgt_sizes, max_positions[0], max_positions[1],
                                   cfg.max_tokens)
    batches = batch_by_size(kept, data.num_tokens(), cfg.max_tokens, cfg.batch_size, 1)
    batches = batches[cfg.rank:: cfg.world_size]
    return data, batches, skipped


def validate(trainer: Trainer, valid_sets: dict, extra: list[Callable[[torch.nn.Module], dict]]) -> dict[str, dict]:
    """Loss, NLL and perplexity on each validation split (plus the extra validators on the first one)."""
    results = {}
    for i, (split, (data, batches, _)) in enumerate(valid_sets.items()):
        loss = torch.zeros((), dtype=torch.float64, device=trainer.device)
        nll = torch.zeros((), dtype=torch.float64, device=trainer.device)
        ntok = 0
        for b in batches:
            log = trainer.valid_step(data.collate(b))
            loss += log["loss"]
            nll += log["nll_loss"]
            ntok += log["ntokens"]
        loss_f, nll_f, ntok_f = global_sum([float(loss), float(nll), ntok], trainer.device)
        metrics = reduce_metrics(loss_f, nll_f, ntok_f)
        metrics["ntokens"] = int(ntok_f)
        if i == 0:
            for fn in extra:
                metrics.update(fn(trainer.model))
        results[split] = metrics
    return results


@dataclass
class Best:
    """The best validation value so far and the patience counter (saved in every checkpoint)."""

    metric: str
    maximize: bool
    value: float | None = None
    num_updates: int = 0
    bad_validations: int = 0

    def update(self, value: float, num_updates: int) -> bool:
        better = self.value is None or (value > self.value if self.maximize else value < self.value)
        if better:
            self.value, self.num_updates, self.bad_validations = float(value), num_updates, 0
        else:
            self.bad_validations += 1
        return better

    def state(self) -> dict:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------------------------------- train


def build_state(trainer: Trainer, task, setup: Setup, cfg: TrainConfig, model_name: str, model_cfg, data_state: dict,
                itr: EpochBatchIterator, best: Best, train_time: float, rng_by_rank: list[dict] | None = None) -> dict:
    """The checkpoint dict (see attnmt.training.checkpoints); ``rng_by_rank``: every rank's RNG state, rank order."""
    rng_by_rank = rng_by_rank or [ckpts.rng_state()]
    model_state = {k: v.detach().float().cpu() if v.is_floating_point() else v.detach().cpu()
                   for k, v in trainer.model.state_dict().items()}
    return {
        "format": ckpts.FORMAT, "version": ckpts.VERSION,
        "model_name": model_name, "arch": setup.arch, "model_config": to_dict(model_cfg),
        "model": model_state,
        "data": data_state,
        "train": {
            **trainer.state_dict(),
            "epoch": int(itr.epoch),
            "iterator": itr.state_dict(),
            "rng": rng_by_rank[0],
            "rng_other_ranks": rng_by_rank[1:],
            "best": best.state(),
            "train_time": float(train_time),
            "task": setup.task, "task_config": to_dict(setup.task_cfg),
            "criterion": setup.criterion, "criterion_config": to_dict(setup.criterion_cfg),
            "optimizer_name": setup.optimizer, "optimizer_config": to_dict(setup.optimizer_cfg),
            "lr_scheduler_name": setup.lr_scheduler, "lr_scheduler_config": to_dict(setup.lr_scheduler_cfg),
            "train_config": to_dict(cfg),
        },
    }


def _resume(path: Path, cfg: TrainConfig, setup: Setup, trainer: Trainer, itr: EpochBatchIterator, best: Best,
            model_name: str, model_cfg, data_state: dict, log: RunLog) -> float:
    """Continue from checkpoint_last.pt; returns the training time already spent."""
    ckpt = ckpts.load(path)
    fix = (f"Use a different --save-dir for a new model, or --finetune-from {path} (weights only) with the "
           f"matching --arch/options to start a new run from it")
    ckpts.check_same_model(path, ckpt, model_name, setup.arch, to_dict(model_cfg), data_state, fix)
    tstate = ckpt.get("train")
    if tstate is None:
        raise UserError(f"{path}: holds no training state (an averaged or inference checkpoint); "
                        f"use --finetune-from {path} or another --save-dir")
    if tstate.get("optimizer_name") != setup.optimizer and not cfg.reset_optimizer:
        raise UserError(f"{path}: was trained with --optimizer {tstate.get('optimizer_name')}, now {setup.optimizer}; "
                        f"add --reset-optimizer to switch")
    if tstate.get("lr_scheduler_name") != setup.lr_scheduler and not cfg.reset_lr_scheduler:
        raise UserError(f"{path}: was trained with --lr-scheduler {tstate.get('lr_scheduler_name')}, now "
                        f"{setup.lr_scheduler}; add --reset-lr-scheduler to switch")
    try:
        trainer.model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"{path}: weights do not fit the model ({str(e).splitlines()[0]}); {fix}") from None
    try:
        trainer.load_state_dict(tstate, reset_optimizer=cfg.reset_optimizer,
                                reset_lr_scheduler=cfg.reset_lr_scheduler)
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: optimizer state does not fit ({e}); add --reset-optimizer") from None
    if not cfg.reset_dataloader:
        warning = itr.load_state_dict(tstate["iterator"])
        if warning:
            log.info(f"warning: {warning}")
    b = tstate.get("best") or {}
    if b.get("metric") == best.metric and bool(b.get("maximize")) == best.maximize:
        best.value, best.num_updates = b.get("value"), int(b.get("num_updates", 0))
        best.bad_validations = int(b.get("bad_validations", 0))
    saved_world = int(tstate.get("iterator", {}).get("world_size", 1))
    if saved_world != cfg.world_size:
        log.info(f"note: {path} was written by {saved_world} process(es), now {cfg.world_size}: a rank without a "
                 f"saved random state continues from rank 0's")
    ckpts.set_rng_state(_rank_rng(tstate, cfg.rank))
    log.info(f"resumed from {path}: update {trainer.num_updates}, epoch {itr.epoch}, "
             f"batch {itr.offset}/{len(itr)} of the epoch")
    return float(tstate.get("train_time", 0.0))


def _rank_rng(tstate: dict, rank: int) -> dict:
    """This rank's RNG state from a checkpoint: its own when the checkpoint has one, else rank 0's."""
    others = tstate.get("rng_other_ranks") or []
    if 1 <= rank <= len(others):
        return others[rank - 1]
    return tstate["rng"]


def _finetune(path: Path, trainer: Trainer, data_state: dict, log: RunLog) -> None:
    ckpt = ckpts.load(path)
    cdata = ckpt.get("data", {})
    for side in ("src", "tgt"):
        if cdata.get(f"{side}_dict_sha256") != data_state[f"{side}_dict_sha256"]:
            raise UserError(f"{path}: its {'source' if side == 'src' else 'target'} dictionary differs from "
                            f"DATA_BIN's; fine-tune on data binarized with the checkpoint's dictionaries "
                            f"(attnmt preprocess --srcdict/--tgtdict)")
    try:
        trainer.model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"--finetune-from {path}: weights do not fit --arch/options "
                        f"({str(e).splitlines()[0]}); use the checkpoint's architecture (arch {ckpt.get('arch')})") \
            from None
    log.info(f"fine-tuning from the weights of {path} (fresh optimizer, schedule and data order)")


def train(data_bin: str | os.PathLike, setup: Setup, cfg: TrainConfig,
          extra_validators: list[Callable[[torch.nn.Module], dict]] | None = None,
          dist_cfg: distributed.DistributedConfig | None = None) -> dict:
    """Train (or resume) and return the final summary (also the last line of train.jsonl).

    With ``cfg.world_size > 1`` this is one rank of a torchrun job: it joins the process group (unless the caller
    already did), trains its shard with DistributedDataParallel and leaves the group at the end.
    """
    dist_cfg = dist_cfg or distributed.DistributedConfig()
    t_start = time.perf_counter()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    device = _device(cfg)
    precision = resolve_precision(cfg.precision, device, mode="train")
    peers = None
    owns_group = False
    if cfg.world_size > 1:
        owns_group = not distributed.is_initialized()
        peers = distributed.init(distributed.Env(cfg.rank, cfg.world_size, cfg.local_rank), device, dist_cfg)
    try:
        with distributed.collective_errors(peers, dist_cfg.ddp_timeout, Path(cfg.save_dir)):
            return _train(data_bin, setup, cfg, extra_validators, dist_cfg, device, precision, t_start)
    finally:
        if owns_group:
            distributed.shutdown()


def _train(data_bin, setup: Setup, cfg: TrainConfig, extra_validators, dist_cfg: distributed.DistributedConfig,
           device: torch.device, precision: str, t_start: float) -> dict:
    _seed_everything(cfg.seed)

    task_cls = get("task", setup.task).obj
    task = task_cls(setup.task_cfg, data_bin)
    model_name, model_cfg, notes = task.model_config(setup.arch, setup.model_overrides)
    model = task.build_model(model_name, model_cfg).to(device)
    backend = backend_for(device, precision)
    backend.prepare_training(model, cfg.cpu_attention)  # before the optimizer and DDP see the modules
    criterion = task.build_criterion(setup.criterion, setup.criterion_cfg)
    backend.prepare_criterion(criterion)
    lr_scheduler = build_lr_scheduler(setup.lr_scheduler, setup.lr_scheduler_cfg)
    optimizer = build_optimizer(setup.optimizer, setup.optimizer_cfg, model.parameters(),
                                lr=getattr(setup.lr_scheduler_cfg, "lr", 1e-3))
    ddp_model = distributed.wrap(model, device) if cfg.world_size > 1 else None
    trainer = Trainer(model, criterion, optimizer, lr_scheduler, device=device, precision=precision,
                      clip_norm=cfg.clip_norm, world_size=cfg.world_size, ddp_model=ddp_model)
    max_positions = model.max_positions()
    itr, skipped = make_train_iterator(task, cfg, max_positions)
    if cfg.world_size > 1:  # a rank whose update holds only padding batches still joins the gradient all-reduce
        trainer.prime_padding_batch(itr.collate(itr.batches[0]))
    valid_sets = {} if cfg.disable_validation else {
        s: make_valid_batches(task, cfg, s, max_positions) for s in task.valid_subsets()}
    if extra_validators is None:
        extra_validators = []
        if cfg.eval_bleu and not cfg.disable_validation:
            from attnmt.training.bleu import BleuValidator

            extra_validators.append(BleuValidator(task, cfg, device, precision))

    save_dir = Path(cfg.save_dir)
    is_master = cfg.rank == 0
    if is_master:
        save_dir.mkdir(parents=True, exist_ok=True)
    total = cfg.max_update or (cfg.max_epoch * math.ceil(len(itr) / cfg.update_freq) if cfg.max_epoch else None)
    log = RunLog(save_dir / "train.jsonl", cfg.progress, total, 0, enabled=is_master)
    best = Best(cfg.best_checkpoint_metric, cfg.maximize_best_checkpoint_metric)
    data_state = task.data_state()
    try:
        last = save_dir / ckpts.LAST
        train_time = 0.0
        seen = distributed.all_gather(last.exists())
        if len(set(seen)) > 1:
            raise UserError(f"{last} exists for rank(s) {[r for r, x in enumerate(seen) if x]} only; put --save-dir "
                            f"on a file system that every node shares, so that every rank resumes from it")
        if last.exists():
            if cfg.finetune_from:
                log.info(f"{last} exists: resuming from it, --finetune-from is ignored")
            train_time = _resume(last, cfg, setup, trainer, itr, best, model_name, model_cfg, data_state, log)
        elif cfg.finetune_from:
            _finetune(Path(cfg.finetune_from), trainer, data_state, log)

        _report_start(log, task, setup, cfg, model, itr, skipped, valid_sets, trainer.backend, notes)
        if cfg.world_size > 1:
            log.info(f"processes: {cfg.world_size} ({distributed.choose_backend(device, dist_cfg.distributed_backend)}"
                     f", one per {'GPU' if device.type == 'cuda' else 'CPU share'}), each on its own shard of the "
                     f"batches; collectives time out after --ddp-timeout {dist_cfg.ddp_timeout:g} s")
        with distributed.Preemption() as preemption:
            summary = _run(trainer, task, setup, cfg, model_name, model_cfg, data_state, itr, valid_sets,
                           extra_validators, best, log, save_dir, train_time, is_master, preemption)
        summary["skipped_train"] = len(skipped)
        summary["wall_s"] = time.perf_counter() - t_start
        log.record(summary)
        _report_end(log, summary)
        return summary
    finally:
        log.close()


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
    log.info(f"data: {task.data_bin} {task.src_lang}->{task.tgt_lang}, dictionaries {len(task.src_dict)}/"
             f"{len(task.tgt_dict)} symbols{' (joined)' if task.joint_dictionary else ''}")
    log.info(f"data: {task.cfg.train_subset}: {n_train:,} pairs in {len(train):,} batches"
             + "".join(f"; {s}: {len(d)} pairs" for s, (d, _, _) in valid_sets.items()))
    if len(skipped):
        log.info(f"data: {task.cfg.train_subset}: {skipped.describe()}")
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
    vtxt = "".join(f" | valid {k} {_fmt(x)}" for k, x in v.items() if k in ("loss", "ppl", "bleu"))
    log.info(f"done ({s['stop_reason']}): {s['num_updates']} updates, epoch {s['epoch']}, "
             f"train time {_hms(s['train_time'])}{vtxt} | best {s['best_metric']} "
             f"{_fmt(s['best']) if s['best'] is not None else '-'}")


def _run(trainer: Trainer, task, setup: Setup, cfg: TrainConfig, model_name: str, model_cfg, data_state: dict,
         itr: EpochBatchIterator, valid_sets: dict, extra_validators, best: Best, log: RunLog, save_dir: Path,
         train_time0: float, is_master: bool, preemption: distributed.Preemption | None = None) -> dict:
    meter = Meter(trainer.device)
    run_start = time.perf_counter()
    last_save = run_start
    start_updates = trainer.num_updates
    last_valid: dict = {}

    def train_time() -> float:
        return train_time0 + time.perf_counter() - run_start

    def save(names: list[str]) -> None:
        """Every rank calls this with the same names (its RNG state goes to rank 0); rank 0 writes."""
        if not names:
            return
        rng_by_rank = distributed.gather_to_master(ckpts.rng_state())
        if not is_master:
            return
        state = build_state(trainer, task, setup, cfg, model_name, model_cfg, data_state, itr, best, train_time(),
                            rng_by_rank)
        ckpts.save(state, save_dir, names)
        ckpts.prune(save_dir, cfg.keep_interval_updates, cfg.keep_last_epochs)

    def stop_reason_now(end_of_epoch: bool, time_up: bool, preempted: bool) -> str | None:
        if cfg.max_update and trainer.num_updates >= cfg.max_update:
            return "max_update"
        if time_up:
            return "max_time"
        if end_of_epoch and cfg.max_epoch and itr.epoch >= cfg.max_epoch:
            return "max_epoch"
        if preempted:
            return "preempted"
        return None

    stop = None
    if itr.end_of_epoch():
        if cfg.max_epoch and itr.epoch >= cfg.max_epoch:
            stop = "max_epoch"
    if cfg.max_update and trainer.num_updates >= cfg.max_update:
        stop = "max_update"
    if cfg.max_time_minutes and train_time0 >= cfg.max_time_minutes * 60:
        stop = "max_time"
    if stop:
        flag = {"max_time": "max-time-minutes"}.get(stop, stop.replace("_", "-"))
        log.info(f"nothing to do: already at {stop.replace('_', ' ')} (update {trainer.num_updates}, epoch "
                 f"{itr.epoch}); raise --{flag} to train further")
    log.advance(trainer.num_updates, itr.epoch)
    while stop is None:
        if itr.end_of_epoch():
            itr.next_epoch()
        for group in _chunks(iter(itr), cfg.update_freq):
            out = trainer.train_step(group)
            if out is not None:
                meter.add(out)
            n = trainer.num_updates
            end_of_epoch = itr.end_of_epoch()
            if out is not None and not out["overflow"] and n % cfg.log_interval == 0:
                _log_train(log, meter, trainer, itr, cfg, n, start_updates, run_start, train_time())
            log.advance(n, itr.epoch)
            # clock- and signal-driven decisions, agreed on by all ranks (identity in a single process)
            preempted, time_up, minutes_due = distributed.any_rank([
                preemption is not None and preemption.requested,
                bool(cfg.max_time_minutes) and train_time() >= cfg.max_time_minutes * 60,
                bool(cfg.save_interval_minutes) and time.perf_counter() - last_save >= cfg.save_interval_minutes * 60,
            ], trainer.device)
            stop = stop_reason_now(end_of_epoch, time_up, preempted)
            new_epoch_point = end_of_epoch
            do_valid = bool(valid_sets) and stop != "preempted" and (
                stop is not None
                or (new_epoch_point and itr.epoch % cfg.validate_interval == 0)
                or (cfg.validate_interval_updates and n % cfg.validate_interval_updates == 0 and not end_of_epoch
                    and out is not None))
            names: list[str] = []
            if new_epoch_point and itr.epoch % cfg.save_interval == 0 and not cfg.no_epoch_checkpoints:
                names.append(ckpts.epoch_name(itr.epoch))
            interval_hit = cfg.save_interval_updates and n % cfg.save_interval_updates == 0 and out is not None
            if (interval_hit or minutes_due) and not end_of_epoch:
                names.append(ckpts.interval_name(itr.epoch, n))
            if names or stop is not None or (new_epoch_point and itr.epoch % cfg.save_interval == 0):
                names.append(ckpts.LAST)
            if do_valid:
                last_valid = validate(trainer, valid_sets, extra_validators)
                first = next(iter(last_valid.values()))
                improved = best.update(first[best.metric], n)
                for split, m in last_valid.items():
                    rec = {"type": "valid", "subset": split, "epoch": itr.epoch, "num_updates": n,
                           **{k: v for k, v in m.items()}, "best_" + best.metric: best.value}
                    log.record(rec)
                    log.info(f"valid on '{split}' | epoch {itr.epoch} | update {n} | "
                             + " | ".join(f"{k} {_fmt(v)}" for k, v in m.items() if k != "ntokens")
                             + f" | best {best.metric} {_fmt(best.value)}")
                if improved:
                    names = [ckpts.BEST, *names]
                    if ckpts.LAST not in names:
                        names.append(ckpts.LAST)
                if cfg.patience > 0 and best.bad_validations >= cfg.patience and stop is None:
                    stop = "patience"
                    log.info(f"early stop: {best.metric} has not improved for {cfg.patience} validations")
                    if ckpts.LAST not in names:
                        names.append(ckpts.LAST)
            if names:
                save(names)
                last_save = time.perf_counter()
            if stop == "preempted":
                why = preemption.signal_name if preemption is not None and preemption.signal_name else \
                    "a signal to another rank"
                log.info(f"preempted by {why}: stopped after update {n} and saved "
                         f"{save_dir / ckpts.LAST}; run the same command again to resume")
            if stop is not None:
                break
    v = next(iter(last_valid.values())) if last_valid else {}
    return {"type": "summary", "stop_reason": stop, "num_updates": trainer.num_updates, "epoch": itr.epoch,
            "train_time": train_time(), "updates_this_run": trainer.num_updates - start_updates,
            "best_metric": best.metric, "best": best.value, "best_num_updates": best.num_updates,
            "valid": {k: v[k] for k in v}, "lr": trainer.lr, "num_overflows": trainer.num_overflows}


def _log_train(log: RunLog, meter: Meter, trainer: Trainer, itr: EpochBatchIterator, cfg: TrainConfig, n: int,
               start_updates: int, run_start: float, train_time: float) -> None:
    m = meter.report()
    meter.reset()
    ups_run = (n - start_updates) / max(time.perf_counter() - run_start, 1e-9)
    eta = None
    if ups_run > 0:
        per_epoch = math.ceil(len(itr) / cfg.update_freq)
        left = [cfg.max_update - n] if cfg.max_update else []
        if cfg.max_epoch:
            left.append((cfg.max_epoch - itr.epoch) * per_epoch + math.ceil((len(itr) - itr.offset) / cfg.update_freq))
        eta = min(left) / ups_run if left else None
    rec = {"type": "train", "epoch": itr.epoch, "num_updates": n, "loss": m["loss"], "nll_loss": m["nll_loss"],
           "ppl": m["ppl"], "lr": trainer.lr, "wps": m["wps"], "ups": m["ups"], "gnorm": m["gnorm"],
           "ntokens": m["ntokens"], "nsentences": m["nsentences"], "train_time": train_time, "eta_s": eta}
    log.record(rec)
    text = (f"epoch {itr.epoch} | update {n}{'/' + str(cfg.max_update) if cfg.max_update else ''} | "
            f"loss {m['loss']:.3f} | nll {m['nll_loss']:.3f} | ppl {_fmt(m['ppl'])} | lr {trainer.lr:.3g} | "
            f"wps {m['wps']:.0f} | ups {m['ups']:.2f} | gnorm {m['gnorm']:.3f}"
            + (f" | eta {_hms(eta)}" if eta is not None else ""))
    compact = (f"loss {m['loss']:.3f} ppl {_fmt(m['ppl'])} lr {trainer.lr:.2e} wps {m['wps']:.0f} "
               f"ups {m['ups']:.2f} gnorm {m['gnorm']:.2f}")
    log.line(text, compact)
