"""Decoding in several CPU processes (``--workers N``): whole batches translated side by side.

A small model gives each matrix product too little work to keep several cores busy, and a beam search spends
part of every step in single-threaded Python bookkeeping; on a few cores it is faster to run ``N`` searches with
``threads / N`` threads each than one search with all of them (CTranslate2's ``inter_threads`` does the same).

The workers are forked from the process that loaded the model, after it was cast and packed: the weights are
shared copy-on-write and nothing is loaded twice. Each takes the next batch from a shared queue, so a long batch
does not hold the others up, and sends back its hypotheses tagged with the batch's key; the caller restores input
order. Forking is safe here because the parent has finished its own parallel work (the OpenMP pool is rebuilt
with each worker's thread count) and holds no other threads yet. Linux only (``fork``); CPU only.
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

import torch

from attnmt.errors import UserError

Task = tuple[Any, list, list]  # (key, sources, sentence ids)


def fork_available() -> bool:
    return "fork" in mp.get_all_start_methods()


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _work(search_batch: Callable, threads: int, tasks, results) -> None:
    """A worker's loop: batches in, hypotheses out, until the ``None`` that closes the pool."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle; it stops the workers
    torch.set_num_threads(threads)
    while True:
        task = tasks.get()
        if task is None:
            return
        key, sources, ids = task
        try:
            hyps = search_batch(sources, ids)
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            results.put((key, None, traceback.format_exc(), os.getpid(), _peak_rss_mb()))
            continue
        results.put((key, hyps, None, os.getpid(), _peak_rss_mb()))


class WorkerPool:
    """``workers`` forked processes, each running ``search_batch(sources, ids)`` with ``threads`` CPU threads."""

    def __init__(self, search_batch: Callable, workers: int, threads: int):
        if not fork_available():
            raise UserError("--workers above 1 needs a system that can fork processes (Linux); drop --workers")
        ctx = mp.get_context("fork")
        self.tasks, self.results = ctx.Queue(), ctx.Queue()
        self.threads = threads
        self._run = 0  # numbers each map_unordered call: results of an abandoned earlier call are dropped
        self._pending = 0  # tasks sent whose results have not come back
        self.peak_rss_mb: dict[int, float] = {}
        self.procs = [ctx.Process(target=_work, args=(search_batch, threads, self.tasks, self.results),
                                  name=f"attnmt-decoder-{i}", daemon=True) for i in range(workers)]
        for p in self.procs:
            p.start()

    def __len__(self) -> int:
        return len(self.procs)

    def map_unordered(self, tasks: Iterable[Task]) -> Iterator[tuple[Any, list]]:
        """``(key, hypotheses)`` for every task, in the order the workers finish them."""
        if not self.procs:
            raise RuntimeError("the decoding workers were stopped")
        self._check_alive()
        self._run += 1
        run, pending = self._run, 0
        for key, sources, ids in tasks:
            self.tasks.put(((run, key), sources, ids))
            pending += 1
            self._pending += 1
        while pending:
            try:
                (task_run, key), hyps, error, pid, rss = self.results.get(timeout=1.0)
            except queue.Empty:
                self._check_alive()
                continue
            self.peak_rss_mb[pid] = max(self.peak_rss_mb.get(pid, 0.0), rss)
            self._pending -= 1
            if task_run != run:
                continue
            pending -= 1
            if error is not None:
                raise RuntimeError(f"decoding worker {pid} failed:\n{error}")
            yield key, hyps

    def _check_alive(self) -> None:
        for p in self.procs:
            if not p.is_alive():
                self.close()
                raise UserError(f"decoding worker {p.name} stopped (exit code {p.exitcode}), perhaps out of "
                                f"memory; run with fewer --workers or a smaller --max-tokens")

    def close(self) -> None:
        """Stop the workers (idempotent): at once if work is still queued (an error, Ctrl-C, a closed pipe),
        else after they have read the end of the queue."""
        if self._pending:
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
