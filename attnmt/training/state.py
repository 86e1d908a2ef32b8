"""Training's side of a checkpoint: the state it writes (model, data section, optimizer, schedule, iterator position,
random states, best value, configs), and how a run resumes from it or fine-tunes from another run's weights.

Resuming restores everything, so that N updates + restart + N updates give bitwise the same weights as 2N updates
(fp32 on CPU); every rank restores its own random state.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from attnmt import checkpoint
from attnmt.checkpoint import DataSection
from attnmt.checkpoint import resume as ckpts
from attnmt.config import to_dict
from attnmt.data.batching import EpochBatchIterator
from attnmt.errors import UserError
from attnmt.progress import RunLog
from attnmt.training.config import Setup, TrainConfig
from attnmt.training.metrics import Best
from attnmt.training.trainer import Trainer


def build_state(trainer: Trainer, setup: Setup, cfg: TrainConfig, model_name: str, model_cfg,
                data_state: DataSection, itr: EpochBatchIterator, best: Best, train_time: float,
                rng_by_rank: list[dict] | None = None) -> dict:
    """The checkpoint dict (see attnmt.checkpoint); ``rng_by_rank``: every rank's RNG state, rank order."""
    rng_by_rank = rng_by_rank or [ckpts.rng_state(trainer.backend)]
    return {
        "format": checkpoint.FORMAT, "version": checkpoint.VERSION,
        "model_name": model_name, "arch": setup.arch, "model_config": to_dict(model_cfg),
        "model": checkpoint.portable_weights(trainer.model.state_dict()),
        "data": data_state.to_dict(),
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


def resume(path: Path, cfg: TrainConfig, setup: Setup, trainer: Trainer, itr: EpochBatchIterator, best: Best,
           model_name: str, model_cfg, data_state: DataSection, log: RunLog, restore: bool = False,
           resets: bool = True) -> float:
    """Continue from checkpoint_last.pt (or, ``restore``, from another run's checkpoint: ``--restore-file``);
    returns the training time already spent.

    ``--restore-file X --reset-optimizer`` is fairseq's fine-tuning idiom: the update count (which fairseq keeps
    with the optimizer's state) starts again at 0, and with it the schedule and ``--max-update``. A run resuming
    its own checkpoint_last.pt keeps its count; ``resets=False`` (the restart of a run begun with --restore-file)
    ignores the --reset-* flags, which were meant for the restored checkpoint, so the restart resumes exactly.
    """
    if not resets:
        cfg = dataclasses.replace(cfg, reset_optimizer=False, reset_lr_scheduler=False, reset_dataloader=False)
    ckpt = checkpoint.load(path)
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
    recount = restore and cfg.reset_optimizer
    try:
        trainer.load_state_dict(tstate, reset_optimizer=cfg.reset_optimizer,
                                reset_lr_scheduler=cfg.reset_lr_scheduler, reset_num_updates=recount)
    except (ValueError, KeyError) as e:
        raise UserError(f"{path}: optimizer state does not fit ({e}); add --reset-optimizer") from None
    if recount:
        log.info(f"--reset-optimizer with --restore-file: the update count starts again at 0 (was "
                 f"{int(tstate['num_updates'])} in {path}), as in fairseq")
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
    ckpts.set_rng_state(rank_rng(tstate, cfg.rank), trainer.backend)
    log.info(f"resumed from {path}: update {trainer.num_updates}, epoch {itr.epoch}, "
             f"batch {itr.offset}/{len(itr)} of the epoch")
    return float(tstate.get("train_time", 0.0))


def rank_rng(tstate: dict, rank: int) -> dict:
    """This rank's RNG state from a checkpoint: its own when the checkpoint has one, else rank 0's."""
    others = tstate.get("rng_other_ranks") or []
    if 1 <= rank <= len(others):
        return others[rank - 1]
    return tstate["rng"]


def finetune(path: Path, trainer: Trainer, data_state: DataSection, log: RunLog) -> None:
    """Start from the weights of ``path`` (a checkpoint of a model trained on the same dictionaries)."""
    ckpt = checkpoint.load(path)
    cdata = DataSection.from_dict(ckpt["data"], path)
    for side, name in (("src", "source"), ("tgt", "target")):
        if getattr(cdata, f"{side}_dict_sha256") != getattr(data_state, f"{side}_dict_sha256"):
            raise UserError(f"{path}: its {name} dictionary differs from DATA_BIN's; fine-tune on data binarized "
                            f"with the checkpoint's dictionaries (attnmt preprocess --srcdict/--tgtdict)")
    try:
        trainer.model.load_state_dict(ckpt["model"])
    except RuntimeError as e:
        raise UserError(f"--finetune-from {path}: weights do not fit --arch/options "
                        f"({str(e).splitlines()[0]}); use the checkpoint's architecture (arch {ckpt.get('arch')})") \
            from None
    log.info(f"fine-tuning from the weights of {path} (fresh optimizer, schedule and data order)")
