"""One signal policy for every command.

* **SIGINT** (Ctrl-C): Python's KeyboardInterrupt; the command line prints "attnmt: interrupted" and exits 130.
* **SIGTERM** (and SIGHUP): raised as :class:`Terminated` in the main thread, so that cleanups run as for Ctrl-C
  (temp files removed, decoding workers stopped, finished output flushed); the command line prints "attnmt:
  terminated by SIGTERM" and exits 128 + the signal number (143). Training replaces this while it runs its updates
  (``training.distributed.Preemption``): SIGTERM or SIGUSR1 then stops after the current update with
  ``checkpoint_last.pt`` saved, and exits 75.
* **Child processes** (decoding workers, preprocessing workers) ignore SIGINT (the parent stops them) and die with
  their parent (:func:`die_with_parent`): a killed parent leaves no orphan behind.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import threading

TERMINATING = ("SIGTERM", "SIGHUP")
_PR_SET_PDEATHSIG = 1


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived; carried up like KeyboardInterrupt, so that ``finally`` blocks run."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _raise(signum, frame) -> None:
    raise Terminated(signum)


def install() -> None:
    """Turn the terminating signals into :class:`Terminated` (main thread only; elsewhere nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for name in TERMINATING:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), _raise)


def die_with_parent(parent: int | None = None) -> bool:
    """In a child process: the kernel sends it SIGKILL when its parent dies (Linux); False where unsupported.

    ``parent``: the pid of the process that started this one. A parent that died before this call (while a
    spawned child was still importing its modules) is not signalled about any more: the child then exits at
    once instead of living on as an orphan.
    """
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        armed = libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        armed = False
    if parent is not None and os.getppid() != parent:
        os._exit(1)  # the parent is gone already: nothing to work for
    return armed
