"""Decoding in several CPU processes (``--workers N``): whole batches translated side by side.

A small model gives each matrix product too little work to keep several cores busy, and a beam search spends
part of every step in single-threaded Python bookkeeping; on a few cores it is faster to run ``N`` searches with
``threads / N`` threads each than one search with all of them (CTranslate2's ``inter_threads`` does the same).
Each worker takes the next batch from a shared queue, so a long batch does not hold the others up, and sends back
its hypotheses tagged with the batch's key; the caller restores input order.

How the workers start depends on their thread count:

* **One thread each** (``--workers`` = ``--threads``, the fastest layout for small models): forked from the
  process that loaded the model, after it was cast and packed, so the weights are shared copy-on-write and start-up
  is instant. A forked child cannot run OpenMP regions of more than one thread once its parent has run one (GNU
  libgomp's thread pool does not survive ``fork``; the child hangs), but single-threaded regions never touch the
  pool. Linux only (``fork``).
* **Several threads each**: started as fresh interpreters (``spawn``), each loading the checkpoint itself with
  the same options (a second or two, in parallel).

CPU only. Start-up waits until every worker is ready, so a checkpoint a worker cannot load fails at once.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import resource
import signal
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from attnmt.backends import set_threads
from attnmt.errors import UserError
from attnmt.signals import die_with_parent

Task = tuple[Any, list, list, Any]  # (key, sources, sentence ids, their Guidance or None)
START_TIMEOUT_S = 600.0


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _work(search_batch: Callable | None, load: Callable | None, threads: int, tasks, results, parent: int) -> None:
    """A worker's loop: batches in, hypotheses out, until the ``None`` that closes the pool.

    ``search_batch`` (forked workers) or ``load()`` -> a Generator whose ``search_batch`` runs (spawned workers).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a forked child must not inherit the parent's SIGTERM policy
    die_with_parent(parent)  # a parent killed by SIGKILL, even before this line, leaves no worker behind
    set_threads(threads)
    pid = os.getpid()
    try:
        if search_batch is None:
            search_batch = load().search_batch
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put(("failed", pid, 0.0, None, traceback.format_exc()))
        return
    results.put(("ready", pid, _peak_rss_mb(), None, None))
    while True:
        task = tasks.get()
        if task is None:
            return
        key, sources, ids, guide = task
        try:
            hyps = search_batch(sources, ids, guide)
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            results.put(("error", pid, _peak_rss_mb(), key, traceback.format_exc()))
            continue
        results.put(("done", pid, _peak_rss_mb(), key, hyps))


class WorkerPool:
    """``workers`` processes running ``search_batch(sources, ids, guide)`` with ``threads`` CPU threads each.

    ``search_batch`` is used by forked workers (one thread each); ``load``, a picklable function returning a
    Generator, by spawned ones (several threads each); without it, several threads per worker are refused.
    """

    def __init__(self, search_batch: Callable, workers: int, threads: int, load: Callable | None = None):
        if threads == 1:
            if not fork_available():
                raise UserError("--workers with one thread each needs a system that can fork processes (Linux); "
                                "drop --workers")
            ctx, args = mp.get_context("fork"), (search_batch, None)
        elif load is None:
            raise ValueError("workers of several threads each load the model themselves: pass load=")
        else:
            ctx, args = mp.get_context("spawn"), (None, load)
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.threads = threads
        self._run = 0  # numbers each map_unordered call: results of an abandoned earlier call are dropped
        self._pending = 0  # tasks sent whose results have not come back
        self.peak_rss_mb: dict[int, float] = {}
        self.procs = [ctx.Process(target=_work, args=(*args, threads, self.tasks, self.results, os.getpid()),
                                  name=f"attnmt-decoder-{i}", daemon=True) for i in range(workers)]
        for p in self.procs:
            p.start()
        try:
            self._wait_ready()
        except BaseException:
            self.close(now=True)
            raise

    def __len__(self) -> int:
        return len(self.procs)

    def _next(self) -> tuple:
        """The next message from a worker; a worker that died is reported."""
        while True:
            try:
                return self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()

    def _wait_ready(self) -> None:
        ready = 0
        while ready < len(self.procs):
            kind, pid, rss, _, error = self._next()
            if kind == "failed":
                raise UserError(f"decoding worker {pid} could not load the model: {error.strip().splitlines()[-1]}")
            ready += 1
            self.peak_rss_mb[pid] = rss

    def map_unordered(self, tasks: Iterable[Task]) -> Iterator[tuple[Any, list]]:
        """``(key, hypotheses)`` for every task, in the order the workers finish them."""
        if not self.procs:
            raise RuntimeError("the decoding workers were stopped")
        self._check_alive()
        self._run += 1
        run, pending = self._run, 0
        for key, sources, ids, guide in tasks:
            self.tasks.put(((run, key), sources, ids, guide))
            pending += 1
            self._pending += 1
        while pending:
            kind, pid, rss, (task_run, key), payload = self._next()
            self.peak_rss_mb[pid] = max(self.peak_rss_mb.get(pid, 0.0), rss)
            self._pending -= 1
            if task_run != run:
                continue
            pending -= 1
            if kind == "error":
                raise RuntimeError(f"decoding worker {pid} failed:\n{payload}")
            yield key, payload

    def _check_alive(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                self.close(now=True)
                raise UserError(f"decoding worker {p.name} stopped (exit code {p.exitcode}), perhaps out of "
                                f"memory; run with fewer --workers or a smaller --max-tokens")

    def close(self, now: bool = False) -> None:
        """Stop the workers (idempotent): at once if ``now`` or if work is still queued (an error, Ctrl-C, a
        closed pipe), else after they have read the end of the queue."""
        if now or self._pending:
            for p in self.procs:
                p.terminate()
        else:
            for p in self.procs:
                if p.is_alive():
                    self.tasks.put(None)
        for p in self.procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
        self.procs = []
