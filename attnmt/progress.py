"""Progress on stderr, one module for every command: a rich bar on a terminal, plain lines otherwise.

* :class:`RunLog`: training (a bar with the latest figures, or one line per ``--log-interval``) and the JSON
  lines of ``train.jsonl``;
* :class:`SentenceProgress`: translation (sentences done);
* :class:`StageProgress`: preprocessing (one bar, or one line, per stage).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def rich_bar(*, elapsed: bool = False, remaining: bool = False, stats: bool = False, transient: bool = False,
             console=None):
    """A started rich progress display on stderr: description, bar, done/total, and the chosen columns."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = [TextColumn("{task.description}"), BarColumn(bar_width=20 if stats else 40), MofNCompleteColumn()]
    columns += [TimeElapsedColumn()] if elapsed else []
    columns += [TimeRemainingColumn()] if remaining else []
    columns += [TextColumn("{task.fields[stats]}")] if stats else []
    bar = Progress(*columns, console=console or Console(stderr=True), transient=transient, expand=False)
    bar.start()
    return bar


def fmt_number(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1e5 or abs(v) < 1e-3:
        return f"{v:.3g}"
    return f"{v:.4g}" if abs(v) < 100 else f"{v:.1f}"


def hms(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def _whole_record(line: bytes) -> bool:
    """A complete train.jsonl line: terminated, UTF-8, one JSON object (a killed run can leave a partial last
    line, a damaged file anything)."""
    try:
        return line.endswith(b"\n") and isinstance(json.loads(line.decode("utf-8")), dict)
    except ValueError:  # JSONDecodeError and UnicodeDecodeError
        return False


def _record_update(line: str | bytes) -> int:
    """The update a train.jsonl record belongs to (0 for records without one, or lines that do not parse)."""
    try:
        return int(json.loads(line).get("num_updates") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0


def _cut_partial_line(path) -> None:
    """Cut an unterminated last line (a run killed while writing it) off ``path``, so that the next record
    starts a line of its own."""
    try:
        with open(path, "rb+") as f:
            size = f.seek(0, os.SEEK_END)
            if not size:
                return
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return
            start = max(0, size - (1 << 20))
            f.seek(start)
            tail = f.read()
            end = tail.rfind(b"\n")
            f.truncate(start + end + 1 if end >= 0 else start)
    except FileNotFoundError:
        return


def timestamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")


class RunLog:
    """Progress on stderr and JSON lines in ``train.jsonl``; optionally a log file and TensorBoard scalars.

    Modes: ``bar`` (a rich bar on a terminal), ``lines`` (plain lines), ``simple`` (plain lines with timestamps),
    ``json`` (the records themselves, one JSON object per line, plus the informational lines), ``none``.
    """

    def __init__(self, jsonl: Path | None, mode: str, total: int | None, done: int, enabled: bool = True,
                 log_file: str | None = None, tensorboard_dir: str | None = None):
        from rich.console import Console

        self.console = Console(stderr=True, highlight=False)
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        self.mode = mode if enabled else "none"
        self.jsonl_path = jsonl if enabled else None  # opened on the first record: a failed start writes nothing
        self.jsonl = None
        self.log_file = open(log_file, "a", encoding="utf-8") if log_file and enabled else None  # noqa: SIM115
        self.tensorboard = _summary_writer(tensorboard_dir) if tensorboard_dir and enabled else None
        self.bar = None
        if self.mode == "bar":
            self.bar = rich_bar(remaining=True, stats=True, transient=False, console=self.console)
            self.task_id = self.bar.add_task("train", total=total, completed=done, stats="")

    def _print(self, text: str) -> None:
        if self.mode != "none":
            shown = f"{timestamp()} | {text}" if self.mode == "simple" else text
            self.console.print(shown, markup=False, soft_wrap=True)
        if self.log_file is not None:
            self.log_file.write(f"{timestamp()} | {text}\n")
            self.log_file.flush()

    def info(self, text: str) -> None:
        self._print(text)

    def record(self, obj: dict) -> None:
        if self.mode == "json":
            self._print(json.dumps(obj, sort_keys=False))
        if self.tensorboard is not None and obj.get("type") in ("train", "valid") and "num_updates" in obj:
            tag = obj["type"] if obj["type"] == "train" else f"valid/{obj.get('subset', 'valid')}"
            for k, v in obj.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("num_updates", "epoch"):
                    self.tensorboard.add_scalar(f"{tag}/{k}", v, obj["num_updates"])
            self.tensorboard.flush()
        if self.jsonl_path is None:
            return
        if self.jsonl is None:
            _cut_partial_line(self.jsonl_path)
            self.jsonl = open(self.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        self.jsonl.write(json.dumps(obj, sort_keys=False) + "\n")
        self.jsonl.flush()

    def forget_after(self, num_updates: int) -> int:
        """Drop the records of updates after ``num_updates`` (a resumed run repeats them); returns how many."""
        if self.jsonl_path is None or self.jsonl is not None or not Path(self.jsonl_path).is_file():
            return 0
        from attnmt.fileio import atomic_open

        lines = Path(self.jsonl_path).read_bytes().splitlines(keepends=True)
        keep = [ln.decode("utf-8") for ln in lines if _whole_record(ln) and _record_update(ln) <= num_updates]
        if len(keep) < len(lines):
            with atomic_open(self.jsonl_path, "w") as f:
                f.writelines(keep)
        return len(lines) - len(keep)

    def advance(self, num_updates: int, epoch: int, stats: str = "") -> None:
        if self.bar is not None:
            self.bar.update(self.task_id, completed=num_updates, description=f"ep {epoch}",
                            **({"stats": stats} if stats else {}))

    def line(self, text: str, compact: str | None) -> None:
        """A figures line (its record is logged too): printed in the plain modes, and under the bar unless it has a
        ``compact`` form to show next to the bar; in json mode the record stands for it."""
        if self.mode == "json":
            if self.log_file is not None:
                self.log_file.write(f"{timestamp()} | {text}\n")
            return
        if self.bar is not None and compact is not None:
            self.bar.update(self.task_id, stats=compact)
            if self.log_file is not None:
                self.log_file.write(f"{timestamp()} | {text}\n")
            return
        self._print(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.jsonl is not None:
            self.jsonl.close()
        if self.log_file is not None:
            self.log_file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()


def _summary_writer(logdir: str):
    """A TensorBoard writer (the optional ``tensorboard`` package), or a one-line error naming the fix."""
    from attnmt.errors import UserError

    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise UserError(f"--tensorboard-logdir {logdir}: the tensorboard package is not installed; pip install "
                        f"'attnmt[tensorboard]' (or tensorboard), or drop the option") from None
    return SummaryWriter(logdir)


class SentenceProgress:
    """Sentences done, on stderr: a rich bar on a terminal, a plain line every ``every`` seconds otherwise."""

    def __init__(self, total: int | None, label: str = "translating", quiet: bool = False, every: float = 30.0):
        self.total, self.label, self.quiet, self.every = total, label, quiet, every
        self.done = 0
        self._bar = None
        self._last = self._start = time.perf_counter()
        if not quiet and sys.stderr.isatty():
            self._bar = rich_bar(elapsed=True, remaining=True, transient=True)
            self._task = self._bar.add_task(label, total=total)

    def __call__(self, n: int) -> None:
        self.done += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.advance(self._task, n)
            return
        now = time.perf_counter()
        if now - self._last >= self.every:
            self._last = now
            of = f"/{self.total}" if self.total is not None else ""
            rate = self.done / max(now - self._start, 1e-9)
            print(f"attnmt: {self.label} {self.done}{of} sentences ({rate:.1f}/s)", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


class StageProgress:
    """Stage progress on stderr: rich progress bars on a terminal; otherwise one plain line per finished stage
    (so that an input error is the only line a failed run prints)."""

    def __init__(self, quiet: bool = False):
        self.quiet = quiet
        self._rich = None
        if sys.stderr.isatty() and not quiet:
            self._rich = rich_bar(elapsed=True, transient=False)

    def stage(self, description: str, total: int) -> Stage:
        return Stage(self, description, total)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
            self._rich = None


class Stage:
    def __init__(self, progress: StageProgress, description: str, total: int):
        self.progress, self.description, self.total = progress, description, total
        self.t0 = time.time()
        self.task = progress._rich.add_task(description, total=total) if progress._rich is not None else None

    def __call__(self, _job: Any = None) -> None:
        if self.task is not None:
            self.progress._rich.advance(self.task)

    def done(self, note: str = "") -> None:
        if self.progress.quiet or self.task is not None:
            return
        print(f"attnmt preprocess: {self.description}: done in {time.time() - self.t0:.1f} s{note}",
              file=sys.stderr, flush=True)


