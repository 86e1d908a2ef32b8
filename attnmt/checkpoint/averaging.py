"""Checkpoint averaging: the element-wise mean of the parameters of the last few checkpoints of one run.

Vaswani et al. (2017) average the last 5 (base) or 20 (big) checkpoints, written at 10-minute intervals; this
smooths out the noise of the final updates and is worth a few tenths of BLEU.

Only checkpoints of the same run can be averaged meaningfully, so the architecture and the dictionaries must
match exactly. Memory stays at one running float64 sum plus one loaded checkpoint (memory-mapped when possible,
so optimizer state that is never read is never paged in). The result is an inference/fine-tuning checkpoint: the
model, its config and the data section of the LAST input, with no training state.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from attnmt import checkpoint
from attnmt.checkpoint import EPOCH_PATTERN, UPDATE_PATTERN, DataSection
from attnmt.errors import UserError
from attnmt.fileio import check_output_file

Log = Callable[[str], None]


def _no_log(_msg: str) -> None:
    pass


# --------------------------------------------------------------------------------------------------- selection

def select_checkpoints(directory: str | os.PathLike, num_update_checkpoints: int | None = None,
                       num_epoch_checkpoints: int | None = None, upper_bound: int | None = None) -> list[Path]:
    """The last N checkpoints in ``directory``, oldest first, ordered by the number in the file name; with
    ``upper_bound`` (fairseq's ``--checkpoint-upper-bound``) the last N up to that epoch or update number.

    File names, not modification times, decide: mtimes change when a directory is copied or synced.
    Update checkpoints ``checkpoint_{epoch}_{updates}.pt`` are ordered by updates; epoch checkpoints
    ``checkpoint{epoch}.pt`` by epoch. ``checkpoint_best.pt`` / ``checkpoint_last.pt`` never match.
    """
    directory = Path(directory)
    if num_update_checkpoints is not None and num_epoch_checkpoints is not None:
        raise UserError("give either --num-update-checkpoints or --num-epoch-checkpoints, not both")
    if num_update_checkpoints is None and num_epoch_checkpoints is None:
        raise UserError(f"{directory}: is a directory; say how many checkpoints to average with "
                        f"--num-update-checkpoints N or --num-epoch-checkpoints N, or list the files")
    if num_update_checkpoints is not None:
        n, pattern, shown, option = num_update_checkpoints, UPDATE_PATTERN, "checkpoint_{epoch}_{updates}.pt", \
            "--num-update-checkpoints"
    else:
        n, pattern, shown, option = num_epoch_checkpoints, EPOCH_PATTERN, "checkpoint{epoch}.pt", \
            "--num-epoch-checkpoints"
    if n < 1:
        raise UserError(f"{option} must be at least 1 (got {n})")
    found = []
    for name in os.listdir(directory):
        m = pattern.match(name)
        if m:
            nums = tuple(int(g) for g in m.groups())
            key = (nums[1], nums[0]) if pattern is UPDATE_PATTERN else nums
            if upper_bound is None or key[0] <= upper_bound:
                found.append((key, directory / name))
    found.sort()
    if len(found) < n:
        names = ", ".join(p.name for _, p in found) or "none"
        bound = f" up to --checkpoint-upper-bound {upper_bound}" if upper_bound is not None else ""
        raise UserError(f"{directory}: found {len(found)} checkpoint(s) matching {shown}{bound}, need {n} ({names}); "
                        f"lower {option}, or save checkpoints with that naming")
    return [p for _, p in found[-n:]]


def resolve_inputs(inputs: Sequence[str | os.PathLike], num_update_checkpoints: int | None = None,
                   num_epoch_checkpoints: int | None = None, upper_bound: int | None = None) -> list[Path]:
    """One directory (then pick the last N) or an explicit list of files (averaged exactly as given)."""
    paths = [Path(p) for p in inputs]
    if not paths:
        raise UserError("no inputs; give --inputs DIR with --num-update-checkpoints N, or checkpoint files")
    dirs = [p for p in paths if p.is_dir()]
    if dirs:
        if len(paths) > 1:
            raise UserError(f"{dirs[0]}: is a directory among several inputs; give one directory or a list of files")
        return select_checkpoints(dirs[0], num_update_checkpoints, num_epoch_checkpoints, upper_bound)
    if upper_bound is not None:
        raise UserError("--checkpoint-upper-bound selects from a directory with --num-*-checkpoints; with explicit "
                        "files every file given is averaged")
    if num_update_checkpoints is not None or num_epoch_checkpoints is not None:
        raise UserError("--num-update-checkpoints / --num-epoch-checkpoints select from a directory; with explicit "
                        "files every file given is averaged (drop the option or give a directory)")
    seen: dict[Path, Path] = {}
    for p in paths:
        if not p.exists():
            raise UserError(f"{p}: no such checkpoint file")
        real = p.resolve()
        if real in seen:
            raise UserError(f"{p}: given twice (also as {seen[real]}); list each checkpoint once")
        seen[real] = p
    return paths


# ---------------------------------------------------------------------------------------------- compatibility

def _bytes_sha256(t: Any) -> str | None:
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
    return hashlib.sha256(repr(t).encode()).hexdigest()


def _short(key: str, v: Any) -> str:
    if isinstance(v, str) and (key.endswith("sha256") or key == "data.bpe_model"):
        return repr(v[:12] + "...")  # checksums: the first 12 hex digits identify them
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def _identity(ck: dict) -> dict[str, Any]:
    """What must agree between averaged checkpoints, flattened to comparable values."""
    data = ck.get("data") or {}
    ident: dict[str, Any] = {"model_name": ck.get("model_name"), "arch": ck.get("arch")}
    for k, v in sorted((ck.get("model_config") or {}).items()):
        ident[f"model_config.{k}"] = v
    for k in DataSection.IDENTITY:
        ident[f"data.{k}"] = data.get(k)
    ident["data.bpe_model"] = _bytes_sha256(data.get("bpe_model"))
    return ident


def check_compatible(first: dict, first_path: Path, other: dict, other_path: Path) -> None:
    """Refuse checkpoints of different architectures or dictionaries, naming both files and the difference."""
    a, b = _identity(first), _identity(other)
    diffs = [k for k in dict.fromkeys([*a, *b]) if a.get(k, "<absent>") != b.get(k, "<absent>")]
    if not diffs:
        return
    arch = [k for k in diffs if not k.startswith("data.")]
    what = "different architectures" if arch else "different dictionaries / data preparation"
    shown = "; ".join(f"{k}: {_short(k, a.get(k, '<absent>'))} vs {_short(k, b.get(k, '<absent>'))}" for k in diffs[:4])
    more = f" (+{len(diffs) - 4} more)" if len(diffs) > 4 else ""
    raise UserError(f"cannot average {first_path} and {other_path}: {what} ({shown}{more}); "
                    f"average only checkpoints of the same training run")


def _check_keys(ref_keys: list[str], ref_path: Path, state: dict, path: Path) -> None:
    missing = [k for k in ref_keys if k not in state]
    extra = [k for k in state if k not in set(ref_keys)]
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing in {path.name}: {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
        if extra:
            parts.append(f"only in {path.name}: {', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}")
        raise UserError(f"cannot average {ref_path} and {path}: different parameter sets ({'; '.join(parts)}); "
                        f"average only checkpoints of the same model")


# -------------------------------------------------------------------------------------------------- averaging

def _clone_tensors(obj: Any) -> Any:
    """Deep copy of containers with tensors cloned (detaches them from the memory-mapped input file)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, dict):
        return {k: _clone_tensors(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clone_tensors(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_clone_tensors(v) for v in obj)
    return obj


def average_checkpoints(paths: Sequence[str | os.PathLike], log: Log | None = None) -> dict:
    """Average the model parameters of ``paths``; return a checkpoint dict (no training state).

    Floating-point tensors are summed in float64 and divided once, then cast back to the dtype they have in the
    last input. Integer/bool buffers (counters, masks) cannot be averaged: they are taken from the last input,
    with a note when they differ.
    """
    log = log or _no_log
    paths = [Path(p) for p in paths]
    if not paths:
        raise UserError("no checkpoints to average")
    first: dict | None = None
    keys: list[str] = []
    sums: dict[str, torch.Tensor] = {}
    exact: dict[str, Any] = {}  # non-floating entries: value from the latest input
    differing: set[str] = set()
    last: dict | None = None
    last_state: dict = {}
    for i, path in enumerate(paths):
        log(f"[{i + 1}/{len(paths)}] {path}")
        ck = checkpoint.load(path, mmap=True)
        state = ck["model"]
        if first is None:
            first = {k: v for k, v in ck.items() if k not in ("model", "train")}
            first = _clone_tensors(first)
            keys = list(state)
        else:
            check_compatible(first, paths[0], ck, path)
            _check_keys(keys, paths[0], state, path)
        for k in keys:
            t = state[k]
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if k not in sums:
                    if i:
                        raise UserError(f"cannot average {paths[0]} and {path}: {k} is not floating point in "
                                        f"{paths[0].name} but {t.dtype} in {path.name}")
                    sums[k] = t.detach().to(torch.float64, copy=True)
                else:
                    if t.shape != sums[k].shape:
                        raise UserError(f"cannot average {paths[0]} and {path}: {k} has shape "
                                        f"{tuple(sums[k].shape)} vs {tuple(t.shape)}; average only checkpoints of "
                                        f"the same model")
                    sums[k].add_(t.detach())
            else:
                if k in sums:
                    raise UserError(f"cannot average {paths[0]} and {path}: {k} is floating point in "
                                    f"{paths[0].name} but not in {path.name}")
                if k in exact and not _same(exact[k], t):
                    differing.add(k)
                exact[k] = _clone_tensors(t)
        last = {k: v for k, v in ck.items() if k not in ("model", "train")}
        last["dtypes"] = {k: state[k].dtype for k in sums}
        last["order"] = list(state)
        last = _clone_tensors(last)
        last_state = state
        del ck
    assert last is not None
    if differing:
        log(f"note: non-float buffers differ between inputs, taken from the last: {', '.join(sorted(differing))}")
    n = len(paths)
    model = {}
    for k in last["order"]:
        model[k] = (sums[k] / n).to(last["dtypes"][k]) if k in sums else exact[k]
    model = checkpoint.tie_like(model, last_state)  # tied weights stay one tensor, stored once
    return {
        "format": checkpoint.FORMAT,
        "version": checkpoint.VERSION,
        "model_name": last["model_name"],
        "arch": last.get("arch"),
        "model_config": last["model_config"],
        "model": model,
        "data": last["data"],
        "averaged_from": [str(p) for p in paths],
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b)))
    return bool(a == b)


def average_to_file(paths: Sequence[str | os.PathLike], output: str | os.PathLike, log: Log | None = None) -> dict:
    """Average ``paths`` and write the result atomically to ``output``; returns the written checkpoint."""
    output = Path(output)
    if output.is_dir():
        raise UserError(f"{output}: is a directory; give the output file name, e.g. {output / 'averaged.pt'}")
    check_output_file(output, "--output")
    for p in paths:
        if Path(p).exists() and Path(p).resolve() == output.resolve():
            raise UserError(f"{output}: is also an input; write the average to a new file")
    ck = average_checkpoints(paths, log=log)
    checkpoint.save(ck, output)
    return ck
