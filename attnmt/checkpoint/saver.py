"""Checkpoint writes off the training's critical path.

A checkpoint of transformer_big (fp32 weights and Adam's two moments) is about 2.4 GB; writing it where training
waits stalls every epoch end or save interval for seconds. :class:`CheckpointSaver` instead copies the state's
tensors into host memory (:class:`~attnmt.backends.base.HostStaging`: buffers reused from save to save, page-locked
for a GPU) and writes the copy from a background thread while training goes on. What stays true:

* **Atomic.** The file is written as before (``checkpoint.save_as``: temp file, fsync, rename), so a crash or a
  kill mid-write leaves the previous checkpoint intact; the partial temp file is removed at the next start.
* **The state of the update it was taken at.** The copy is made before ``save`` returns; later updates do not
  leak into it. Tensors that were one tensor (tied embeddings) stay one tensor in the copy, stored once.
* **One write at a time, errors not lost.** A save first waits for the previous write; a write that failed (full
  disk, ...) raises its error at the next save or at :meth:`close`, which every run calls before it reports
  its end, so nothing is claimed saved before it is on disk.
* **Loadable as always** (``torch.load(weights_only=True)``): the copy has the same structure and types.

``--no-background-save`` writes in the training thread, as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from attnmt import checkpoint
from attnmt.backends.base import HostStaging


def snapshot(state: Any, staging: HostStaging) -> Any:
    """``state`` (nested dicts/lists/tuples) with every tensor copied into ``staging``'s host buffers; tensors
    that are views of the same data with the same layout (tied weights) become one copy."""
    memo: dict[tuple, torch.Tensor] = {}

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            key = checkpoint.same_tensor(x)
            if key not in memo:
                memo[key] = staging.copy(path, x)
            return memo[key]
        if isinstance(x, dict):
            return {k: walk(v, f"{path}/{k}") for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            out = [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
            return out if isinstance(x, list) else tuple(out)
        return x

    copied = walk(state, "")
    staging.done()
    return copied


class CheckpointSaver:
    """Writes ``state`` under ``names`` in ``save_dir`` and then runs ``after_write`` (pruning old files), in a
    background thread (``background``) or right away."""

    def __init__(self, save_dir: str | Path, staging: HostStaging, background: bool = True,
                 after_write: Callable[[], object] | None = None):
        self.save_dir = Path(save_dir)
        self.staging = staging
        self.background = background
        self.after_write = after_write
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def save(self, state: dict, names: list[str]) -> None:
        self.wait()
        if not self.background:
            self._write(state, names)
            return
        copy = snapshot(state, self.staging)
        self._thread = threading.Thread(target=self._write_catching, args=(copy, list(names)),
                                        name="attnmt-checkpoint-writer", daemon=True)
        self._thread.start()

    def _write(self, state: dict, names: list[str]) -> None:
        checkpoint.save_as(state, self.save_dir, names)
        if self.after_write is not None:
            self.after_write()

    def _write_catching(self, state: dict, names: list[str]) -> None:
        try:
            self._write(state, names)
        except BaseException as e:  # re-raised in the training thread by wait()
            self._error = e

    @property
    def writing(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def wait(self) -> None:
        """Block until the write in progress is on disk; raise its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        self.wait()
