"""The process pool that runs the jobs: ordered results, clean shutdown on errors and signals."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
from collections.abc import Callable
from typing import Any

from attnmt.signals import die_with_parent

# ---------------------------------------------------------------------------------------------------- running


class Runner:
    """Runs a list of jobs in order-preserving fashion, in a process pool or (one worker) in this process."""

    def __init__(self, workers: int):
        self.workers = workers
        self.pool = None
        if workers > 1:
            # fork: workers inherit the loaded modules and registered plugins, and nothing re-imports __main__
            method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
            # a forked worker must not run the command's SIGTERM handler (attnmt.signals): a terminate() that
            # reached it before _worker_init ran would raise inside the worker, which then lived on and hung join().
            # SIGTERM stays blocked while the pool forks; each worker unblocks it once its handler is the default
            # (and the command gets a SIGTERM sent meanwhile right after).
            with _sigterm_blocked():
                self.pool = mp.get_context(method).Pool(workers, initializer=_worker_init, initargs=(os.getpid(),))

    def map(self, fn: Callable, jobs: list, progress: Callable[[Any], None] | None = None) -> list:
        if self.pool is None:
            results = []
            for job in jobs:
                results.append(fn(job))
                if progress:
                    progress(job)
            return results
        results = [None] * len(jobs)
        for i, r in self.pool.imap_unordered(_indexed_call, [(fn, i, j) for i, j in enumerate(jobs)]):
            results[i] = r
            if progress:
                progress(jobs[i])
        return results

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
            self.pool = None


@contextlib.contextmanager
def _sigterm_blocked():
    """SIGTERM held back (in this thread, and so in the processes it forks) until the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _worker_init(parent: int) -> None:
    # Ctrl-C and kill reach the main process, which ends the pool; workers just die when told to
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked while the pool forked (Runner)
    die_with_parent(parent)


def _indexed_call(arg):
    fn, i, job = arg
    return i, fn(job)
