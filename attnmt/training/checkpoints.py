"""Checkpoint files: what they hold, how they are named, written, pruned, loaded and checked on resume.

A checkpoint is a ``torch.save``d dict of tensors and plain containers only, loadable with
``torch.load(path, map_location="cpu", weights_only=True)``::

    {"format": "attnmt-checkpoint", "version": 1, "model_name", "arch", "model_config", "model",
     "data": {languages, dictionaries + sha256, SentencePiece model bytes as a uint8 tensor, tokenizer, lowercase},
     "train": {num_updates, epoch, iterator position, optimizer, lr_scheduler, scaler, rng, rng_other_ranks, best,
               configs, ...}}

``rng`` is rank 0's random-number state and ``rng_other_ranks`` those of ranks 1..W-1 of a multi-process run
(gathered to rank 0, which alone writes checkpoints); on resume every rank restores its own.

Names in ``--save-dir`` (as fairseq): ``checkpoint_last.pt`` (every save), ``checkpoint_best.pt`` (best validation
so far), ``checkpoint{epoch}.pt`` (end of an epoch), ``checkpoint_{epoch}_{updates}.pt`` (every
``--save-interval-updates`` / ``--save-interval-minutes``). One file is written atomically (temp file + rename) and
the other names are hard links to it (or copies where links are not supported), themselves renamed into place.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from attnmt.errors import UserError
from attnmt.fileio import atomic_torch_save

FORMAT = "attnmt-checkpoint"
VERSION = 1
LAST = "checkpoint_last.pt"
BEST = "checkpoint_best.pt"
_EPOCH_RE = re.compile(r"^checkpoint(\d+)\.pt$")
_INTERVAL_RE = re.compile(r"^checkpoint_(\d+)_(\d+)\.pt$")


def epoch_name(epoch: int) -> str:
    return f"checkpoint{epoch}.pt"


def interval_name(epoch: int, num_updates: int) -> str:
    return f"checkpoint_{epoch}_{num_updates}.pt"


# ---------------------------------------------------------------------------------------------------- RNG


def rng_state() -> dict:
    """Python, numpy, torch CPU (and CUDA) generator states as tensors/plain containers."""
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    nps = state["numpy"]
    np.random.set_state((nps["name"], nps["keys"].numpy().astype(np.uint32), nps["pos"], nps["has_gauss"],
                         nps["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        with contextlib.suppress(RuntimeError):  # a different number of visible GPUs
            torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------------------------------- files


def _link_or_copy(src: Path, dst: Path) -> None:
    """Make ``dst`` hold the same bytes as ``src``, atomically (link/copy to a temp name, then rename)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{dst.name}.", suffix=".tmp", dir=dst.parent)
    os.close(fd)
    os.unlink(tmp)
    try:
        try:
            os.link(src, tmp)
        except OSError:
            shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def save(state: dict, save_dir: str | os.PathLike, names: list[str]) -> list[Path]:
    """Write ``state`` once under ``names[0]`` and give it the other names; returns the paths."""
    save_dir = Path(save_dir)
    save_dir.mkdir(parents=True, exist_ok=True)
    paths = [save_dir / n for n in dict.fromkeys(names)]
    atomic_torch_save(state, paths[0])
    for p in paths[1:]:
        _link_or_copy(paths[0], p)
    return paths


def load(path: str | os.PathLike) -> dict:
    """Load a checkpoint safely (``weights_only=True``); a file that is not ours gives a UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint file; check the path")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated file, foreign pickle, ...
        raise UserError(f"{path}: cannot be read as an attnmt checkpoint ({type(e).__name__}: "
                        f"{str(e).splitlines()[0] if str(e) else ''}); use a file written by attnmt train") from None
    if not isinstance(ckpt, dict) or ckpt.get("format") != FORMAT:
        raise UserError(f"{path}: not an attnmt checkpoint (no format '{FORMAT}'); use a file written by attnmt train")
    if int(ckpt.get("version", 0)) > VERSION:
        raise UserError(f"{path}: checkpoint version {ckpt.get('version')} is newer than this attnmt supports "
                        f"({VERSION}); upgrade attnmt")
    return ckpt


def prune(save_dir: str | os.PathLike, keep_interval_updates: int, keep_last_epochs: int) -> list[Path]:
    """Delete old interval / epoch checkpoints beyond the newest N of each kind (negative N keeps all)."""
    save_dir = Path(save_dir)
    removed: list[Path] = []
    interval, epochs = [], []
    for p in save_dir.iterdir():
        if m := _INTERVAL_RE.match(p.name):
            interval.append(((int(m.group(2)), int(m.group(1))), p))
        elif m := _EPOCH_RE.match(p.name):
            epochs.append((int(m.group(1)), p))
    for keep, items in ((keep_interval_updates, interval), (keep_last_epochs, epochs)):
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


def check_same_model(path: Path, ckpt: dict, model_name: str, arch: str, model_config: dict, data: dict,
                     fix: str) -> None:
    """Refuse to continue from a checkpoint made for another model or other dictionaries (UserError)."""
    problems = []
    if ckpt.get("model_name") != model_name:
        problems.append(f"model: checkpoint {ckpt.get('model_name')!r}, now {model_name!r}")
    problems += config_diff(ckpt.get("model_config", {}), model_config)
    cdata = ckpt.get("data", {})
    for side in ("src", "tgt"):
        a, b = cdata.get(f"{side}_dict_sha256"), data.get(f"{side}_dict_sha256")
        if a != b:
            problems.append(f"{'source' if side == 'src' else 'target'} dictionary: checkpoint "
                            f"sha256 {str(a)[:12]} ({len(cdata.get(f'{side}_dict', {}).get('symbols', []))} symbols), "
                            f"now {str(b)[:12]} ({len(data.get(f'{side}_dict', {}).get('symbols', []))} symbols)")
    for key in ("source_lang", "target_lang"):
        if cdata.get(key) != data.get(key):
            problems.append(f"{key.replace('_', ' ')}: checkpoint {cdata.get(key)!r}, now {data.get(key)!r}")
    if problems:
        shown = "; ".join(problems[:6]) + ("; ..." if len(problems) > 6 else "")
        raise UserError(f"{path}: was trained with a different setup (arch {ckpt.get('arch')!r}, now {arch!r}): "
                        f"{shown}. {fix}")
