"""What training keeps in a checkpoint besides the model: random-number states, pruning, the resume check.

The file format, names and loading live in :mod:`attnmt.checkpoint`. ``train.rng`` is rank 0's random-number
state and ``train.rng_other_ranks`` those of ranks 1..W-1 of a multi-process run (gathered to rank 0, which alone
writes checkpoints); on resume every rank restores its own.
"""

from __future__ import annotations

import contextlib
import os
import random
from pathlib import Path

import numpy as np
import torch

from attnmt.checkpoint import BEST_N_PATTERN, EPOCH_PATTERN, UPDATE_PATTERN, DataSection
from attnmt.errors import UserError

# ---------------------------------------------------------------------------------------------------- RNG


def rng_state(backend=None) -> dict:
    """Python, numpy, torch CPU and the run's device (``backend.device_rng_state()``: the GPUs') generator states
    as tensors/plain containers."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": backend.device_rng_state() if backend is not None else None,
    }
    return state


def set_rng_state(state: dict, backend=None) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["name"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and backend is not None:
        backend.set_device_rng_state(state["cuda"])


# ---------------------------------------------------------------------------------------------------- files


def prune(save_dir: str | os.PathLike, keep_interval_updates: int, keep_last_epochs: int,
          keep_best: int = -1, maximize: bool = False) -> list[Path]:
    """Delete old interval / epoch checkpoints beyond the newest N of each kind, and ``checkpoint.best_*`` files
    beyond the ``keep_best`` best (negative N keeps all)."""
    save_dir = Path(save_dir)
    removed: list[Path] = []
    interval, epochs, best = [], [], []
    for p in save_dir.iterdir():
        if m := UPDATE_PATTERN.match(p.name):
            interval.append(((int(m.group(2)), int(m.group(1))), p))
        elif m := EPOCH_PATTERN.match(p.name):
            epochs.append((int(m.group(1)), p))
        elif m := BEST_N_PATTERN.match(p.name):
            best.append((float(m.group(2)) if maximize else -float(m.group(2)), p))
    for keep, items in ((keep_interval_updates, interval), (keep_last_epochs, epochs), (keep_best, best)):
        if keep < 0:
            continue
        items.sort(key=lambda kv: kv[0], reverse=True)
        for _, p in items[keep:]:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
            removed.append(p)
    return removed


# ---------------------------------------------------------------------------------------------------- checks


def config_diff(saved: dict, current: dict) -> list[str]:
    """Human-readable differences between two config dicts (``--option: checkpoint X, now Y``)."""
    diffs = []
    for k in sorted(set(saved) | set(current)):
        a, b = saved.get(k, "(absent)"), current.get(k, "(absent)")
        if isinstance(a, tuple):
            a = list(a)
        if isinstance(b, tuple):
            b = list(b)
        if a != b:
            diffs.append(f"--{k.replace('_', '-')}: checkpoint {a!r}, now {b!r}")
    return diffs


def check_same_model(path: Path, ckpt: dict, model_name: str, arch: str, model_config: dict, data: DataSection,
                     fix: str) -> None:
    """Refuse to continue from a checkpoint made for another model or other dictionaries (UserError)."""
    problems = []
    if ckpt.get("model_name") != model_name:
        problems.append(f"model: checkpoint {ckpt.get('model_name')!r}, now {model_name!r}")
    problems += config_diff(ckpt.get("model_config", {}), model_config)
    problems += DataSection.from_dict(ckpt.get("data"), path).dictionary_differences(data)
    if problems:
        shown = "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
        raise UserError(f"{path}: was trained with a different setup (arch {ckpt.get('arch')!r}, now {arch!r}): "
                        f"{shown}. {fix}")
