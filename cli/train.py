"""``attnmt train DATA_BIN --arch ARCH --save-dir DIR [options]``: train a model, or resume one.

The options are the fields of the loop's ``TrainConfig`` and of the configs of every registered task, model,
criterion, optimizer and LR scheduler (plugins included). Each typed option goes to the component(s) that own it;
an option that no CHOSEN component owns is an error naming the component it belongs to.

Several processes: under ``torchrun`` each worker reads RANK, WORLD_SIZE and LOCAL_RANK from the environment;
``--nproc-per-node N`` re-runs this same command line as N workers through ``torch.distributed.run`` (see
``attnmt/training/distributed.py``). A run stopped by SIGTERM/SIGUSR1 exits with status 75 after saving.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import click

from attnmt import registry
from attnmt.backends import configure_process
from attnmt.config import add_options, given_options, make_config, option_name, split_given
from attnmt.errors import UserError
from attnmt.training import distributed
from attnmt.training.distributed import DistributedConfig
from attnmt.training.loop import Setup, TrainConfig, train

KIND_OPTION = {"task": "--task", "criterion": "--criterion", "optimizer": "--optimizer",
               "lr_scheduler": "--lr-scheduler"}
DEFAULTS = {"task": "translation", "criterion": "label_smoothed_cross_entropy", "optimizer": "adam",
            "lr_scheduler": "inverse_sqrt"}


def _configs(kind: str) -> list[type]:
    return [e.config for e in registry.REGISTRIES[kind].entries.values() if e.config is not None]


def _owner(option: str) -> str:
    """Which registered component(s) an option belongs to (for the error message)."""
    from attnmt.config import fields_of

    owners = []
    for kind in ("task", "model", "criterion", "optimizer", "lr_scheduler"):
        for name, e in registry.REGISTRIES[kind].entries.items():
            if e.config is not None and option in fields_of(e.config):
                owners.append(f"{kind.replace('_', ' ')} {name}")
    return ", ".join(owners) or "no component"


# attnmt's defaults that fairseq-train does not share: option -> (its field, fairseq's default), printed at the start
# of a run for those the command line leaves out, so that a fairseq command line's meaning is never a guess
FAIRSEQ_DEFAULTS = {
    "--criterion": ("criterion", "cross_entropy"),
    "--label-smoothing": ("label_smoothing", "0 (cross_entropy)"),
    "--optimizer": ("optimizer", "none, it must be given"),
    "--adam-betas": ("adam_betas", "(0.9, 0.999)"),
    "--adam-eps": ("adam_eps", "1e-08"),
    "--lr-scheduler": ("lr_scheduler", "fixed"),
    "--lr": ("lr", "0.25"),
}


def fairseq_default_notice(given: set[str], setup: Setup) -> str | None:
    """One line naming the defaults in effect that differ from fairseq-train's (None when all were given)."""
    values = {"criterion": setup.criterion, "optimizer": setup.optimizer, "lr_scheduler": setup.lr_scheduler}
    for c in (setup.criterion_cfg, setup.optimizer_cfg, setup.lr_scheduler_cfg):
        if c is not None:
            values.update(dataclasses.asdict(c))
    parts = []
    for option, (name, theirs) in FAIRSEQ_DEFAULTS.items():
        if name not in given and name in values:
            value = values[name]
            value = tuple(value) if isinstance(value, list) else value
            parts.append(f"{option} {value} (fairseq: {theirs})")
    if not parts:
        return None
    return "defaults that differ from fairseq-train's, in effect: " + ", ".join(parts)


def _base_model(path: str) -> tuple[str, str, dict]:
    """(arch, model name, model config) of the --finetune-from checkpoint, for a run without --arch."""
    from attnmt import checkpoint

    p = checkpoint.resolve(path)
    ckpt = checkpoint.load(p)
    name = str(ckpt.get("model_name") or "")
    if name not in registry.choices("model") or not isinstance(ckpt.get("model_config"), dict):
        raise UserError(f"--finetune-from {p}: the checkpoint does not name a registered model and its config; "
                        f"give --arch")
    return str(ckpt.get("arch") or name), name, dict(ckpt["model_config"])


def _callback(data_bin: str, arch: str | None, **params) -> None:
    given_kinds = {k for k in KIND_OPTION if params.get(k)}
    names = {k: params.pop(k) or DEFAULTS[k] for k in KIND_OPTION}
    env = distributed.Env.from_environ()
    base_model = None
    if not arch:
        if not params.get("finetune_from"):
            raise UserError("give the model with --arch ARCH (or --finetune-from CKPT to continue its architecture)")
        arch, model_name, base_config = _base_model(params["finetune_from"])
        base_model = (model_name, base_config)
    else:
        model_name = registry.get("arch", arch).model
    entries = {k: registry.get(k, v) for k, v in names.items()}
    classes = {"train": TrainConfig, "distributed": DistributedConfig,
               "model": registry.get("model", model_name).config,
               **{k: e.config for k, e in entries.items()}}
    per, leftovers = split_given(given_options(params), classes)
    if leftovers:
        chosen = (f"--arch {arch}, " + ", ".join(f"{KIND_OPTION[k]} {v}" for k, v in names.items()))
        raise UserError("; ".join(f"{option_name(k)} does not apply to the chosen components ({chosen}): it is an "
                                  f"option of {_owner(k)}" for k in leftovers) + "; remove it or choose that component")

    def cfg(key: str, what: str):
        cls = classes[key]
        return make_config(cls, per[key], what=what) if cls is not None else None

    train_cfg = cfg("train", "attnmt train")
    dist_cfg = cfg("distributed", "attnmt train")
    env = distributed.job_environment(dist_cfg)
    if dist_cfg.nproc_per_node > 1:
        code = distributed.launch(dist_cfg.nproc_per_node, _worker_argv(), Path(train_cfg.save_dir))
        if code:
            sys.exit(code)
        return
    train_cfg = dataclasses.replace(train_cfg, world_size=env.world_size, rank=env.rank, local_rank=env.local_rank)
    lr_cfg = cfg("lr_scheduler", f"--lr-scheduler {names['lr_scheduler']}")
    if getattr(lr_cfg, "total_num_update", None) == 0:  # fairseq's default: the decay ends at --max-update
        if train_cfg.max_update <= 0:
            raise UserError(f"--lr-scheduler {names['lr_scheduler']} decays to its end over a known number of "
                            f"updates: give --total-num-update N or --max-update N")
        lr_cfg = make_config(type(lr_cfg), {**per["lr_scheduler"], "total_num_update": train_cfg.max_update},
                             what=f"--lr-scheduler {names['lr_scheduler']}")
    setup = Setup(
        task=names["task"], task_cfg=cfg("task", f"--task {names['task']}"),
        arch=arch, model_overrides=per["model"], base_model=base_model,
        criterion=names["criterion"], criterion_cfg=cfg("criterion", f"--criterion {names['criterion']}"),
        optimizer=names["optimizer"], optimizer_cfg=cfg("optimizer", f"--optimizer {names['optimizer']}"),
        lr_scheduler=names["lr_scheduler"],
        lr_scheduler_cfg=lr_cfg,
    )
    notice = fairseq_default_notice(given_kinds | set(given_options(params)), setup)
    if notice:
        setup = dataclasses.replace(setup, notices=(notice,))
    configure_process("train", "cpu" if train_cfg.cpu else "auto")  # allocator and oneDNN settings (attnmt/backends)
    try:
        summary = train(data_bin, setup, train_cfg, dist_cfg=dist_cfg)
    except FloatingPointError as e:
        raise UserError(str(e)) from None
    if summary["stop_reason"] == "preempted":
        sys.exit(distributed.PREEMPTED_EXIT)


ARGV_KEY = "attnmt.train.argv"


class TrainCommand(click.Command):
    """A click command that keeps its raw arguments: ``--nproc-per-node`` re-runs them in every worker."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        ctx.meta[ARGV_KEY] = list(args)
        return super().parse_args(ctx, args)


def _worker_argv() -> list[str]:
    """``[--user-dir D ...] train ARGS`` without ``--nproc-per-node``: what each worker runs."""
    ctx = click.get_current_context()
    args = ctx.meta[ARGV_KEY]
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    user_dirs = []
    if ctx.parent is not None:
        for d in ctx.parent.params.get("user_dir") or ():
            user_dirs += ["--user-dir", str(d)]
    return [*user_dirs, "train", *out]


def build_command() -> click.Command:
    params = [
        click.Argument(["data_bin"], metavar="DATA_BIN"),
        click.Option(["--arch", "-a"], metavar="ARCH",
                     help=f"named architecture: {', '.join(registry.choices('arch')) or '(none registered)'} "
                          f"[default with --finetune-from: the checkpoint's]"),
    ]
    for kind, opt in KIND_OPTION.items():
        params.append(click.Option([opt], default=None, metavar="NAME",
                                   help=f"{kind.replace('_', ' ')}: {', '.join(registry.choices(kind))} "
                                        f"[default: {DEFAULTS[kind]}]"))
    cmd = TrainCommand("train", callback=_callback, params=params,
                        help="Train a model on DATA_BIN (written by attnmt preprocess); running the same command "
                             "again resumes from SAVE_DIR/checkpoint_last.pt.")
    classes = [TrainConfig, DistributedConfig, *_configs("task"), *_configs("model"),
               *_configs("criterion"), *_configs("optimizer"), *_configs("lr_scheduler")]
    return add_options(cmd, classes)


command = build_command()
