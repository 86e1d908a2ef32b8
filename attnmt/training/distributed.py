"""Training on several processes with ``torch.distributed``: one process per GPU (NCCL) or per CPU share (gloo).

Processes are started by the stock launcher, ``torchrun`` (``torch.distributed.run``), which sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous in each worker's environment; ``attnmt train --nproc-per-node
N`` calls the same launcher in-process (:func:`launch`), so there is no launcher or communication layer of our
own. What this module adds on top of ``torch.distributed``:

* :class:`Env` (the torchrun environment; ``attnmt.backends.training_device`` picks ``cuda:LOCAL_RANK`` or the CPU),
  :func:`choose_backend` (NCCL on CUDA, gloo on the CPU, ``--distributed-backend`` to override) and :func:`init`
  (``init_process_group`` with ``--ddp-timeout`` as the timeout of every collective);
* :func:`wrap` (DistributedDataParallel; the trainer's loss scaling makes its gradient AVERAGE the global
  per-token mean, see ``trainer.py``);
* agreement between ranks: :func:`any_rank` (a MAX all-reduce of flags: preemption, time limits),
  :func:`check_peers` (a failure flag reduced before DDP's gradient all-reduce, so that an out-of-memory batch on
  one rank stops every rank instead of leaving the others waiting), :func:`gather_to_master` (per-rank RNG
  states for the checkpoint);
* faults: :class:`Preemption` (SIGTERM/SIGUSR1 -> save after the current update, exit :data:`PREEMPTED_EXIT`)
  and :func:`collective_errors` (a collective that fails or times out because a peer died or hangs becomes one
  line naming the rank that is gone).

Every function here is the identity or a no-op in a single process, so the training loop has one code path.
"""

from __future__ import annotations

import contextlib
import datetime
import inspect
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist

from attnmt.backends.base import Backend
from attnmt.errors import UserError

PREEMPTED_EXIT = 75  # EX_TEMPFAIL: "preempted, checkpoint saved, run the same command again to resume"
PREEMPTION_SIGNALS = ("SIGTERM", "SIGUSR1")
# the launcher forwards these to the workers (torchrun's default list plus SIGUSR1, SLURM's usual warning signal)
LAUNCHER_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"


@dataclass
class DistributedConfig:
    """Options of ``attnmt train`` for multi-process training (the process layout itself comes from torchrun)."""

    nproc_per_node: int = field(default=0, metadata={
        "help": "start N training processes on this machine through torch.distributed.run (one per GPU; on the "
                "CPU with gloo) and wait for them; 0: this process only, or the processes torchrun started"})
    distributed_backend: Literal["auto", "nccl", "gloo"] = field(default="auto", metadata={
        "help": "torch.distributed backend: auto (nccl on CUDA, gloo on the CPU), nccl or gloo"})
    ddp_timeout: float = field(default=600.0, metadata={"above": 0,
        "help": "seconds a collective operation may wait for the other processes before the run stops with an "
                "error naming the missing rank (a dead or hung peer)"})

    distributed_port: int = field(default=-1, metadata={
        "help": "fairseq's SLURM rendezvous: under srun (SLURM_PROCID set, no torchrun), every task joins the job "
                "at the first node of SLURM_JOB_NODELIST on this port (-1: off)"})
    local_rank: int | None = field(default=None, metadata={
        "help": "what python -m torch.distributed.launch passes (also spelled --local_rank); the LOCAL_RANK "
                "environment variable wins", "aliases": ("--local_rank",)})

    def __post_init__(self):
        if self.distributed_port != -1 and not 0 < self.distributed_port < 65536:
            raise ValueError(f"--distributed-port must be a TCP port (1-65535), got {self.distributed_port}")
        if self.nproc_per_node < 0:
            raise ValueError(f"--nproc-per-node must be >= 0, got {self.nproc_per_node}")
        if self.ddp_timeout <= 0:
            raise ValueError(f"--ddp-timeout must be > 0 seconds, got {self.ddp_timeout}")


# ---------------------------------------------------------------------------------------------------- setup


def slurm_environ(port: int, environ=None, hostnames=None) -> dict[str, str]:
    """torchrun's variables for a task that ``srun`` started (fairseq's ``--distributed-port`` path): rank, world
    size and local rank from SLURM, the rendezvous at the first host of the job's node list on ``port``. Empty when
    the process was not started by srun, or a launcher already set WORLD_SIZE."""
    environ = os.environ if environ is None else environ
    if "SLURM_PROCID" not in environ or environ.get("WORLD_SIZE") not in (None, ""):
        return {}
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise UserError("--distributed-port: SLURM_PROCID is set but SLURM_JOB_NODELIST is not; run the tasks with "
                        "srun inside an allocation")
    if hostnames is None:
        try:
            hostnames = subprocess.run(["scontrol", "show", "hostnames", nodelist], check=True, capture_output=True,
                                       text=True).stdout.split()
        except (OSError, subprocess.CalledProcessError) as e:
            raise UserError(f"--distributed-port: cannot expand SLURM_JOB_NODELIST={nodelist} with scontrol ({e}); "
                            f"set MASTER_ADDR and launch with torchrun instead") from None
    return {"RANK": environ["SLURM_PROCID"], "WORLD_SIZE": environ.get("SLURM_NTASKS", "1"),
            "LOCAL_RANK": environ.get("SLURM_LOCALID", "0"), "MASTER_ADDR": hostnames[0], "MASTER_PORT": str(port)}


@dataclass(frozen=True)
class Env:
    """This process's place in the job, as torchrun describes it in the environment."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @classmethod
    def from_environ(cls, environ=None) -> Env:
        environ = os.environ if environ is None else environ
        if environ.get("WORLD_SIZE") in (None, ""):  # not started by a launcher (a stray RANK alone means nothing)
            return cls()
        values = {}
        for key, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
            raw = environ.get(key)
            try:
                values[key] = default if raw in (None, "") else int(raw)
            except ValueError:
                raise UserError(f"environment variable {key}={raw!r} is not an integer; launch with torchrun, "
                                f"which sets it, or unset it") from None
        env = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
        if env.world_size < 1 or not 0 <= env.rank < env.world_size or env.local_rank < 0:
            raise UserError(f"environment: RANK={env.rank}, WORLD_SIZE={env.world_size}, LOCAL_RANK={env.local_rank} "
                            f"do not describe a process of the job; launch with torchrun, which sets them")
        return env


def job_environment(cfg: DistributedConfig) -> Env:
    """This process's place in the job: ``--distributed-port`` (an srun task) and ``--local-rank`` (the old
    launcher) written into the environment as torchrun's variables, then read back; refuses ``--nproc-per-node``
    inside a process a launcher started."""
    if cfg.distributed_port > 0:
        os.environ.update(slurm_environ(cfg.distributed_port))
    if cfg.local_rank is not None and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", str(cfg.local_rank))
    env = Env.from_environ()
    if cfg.nproc_per_node and "WORLD_SIZE" in os.environ:
        raise UserError(f"--nproc-per-node starts the training processes itself, but this process is already one "
                        f"of {env.world_size} started by a launcher (WORLD_SIZE is set); remove --nproc-per-node, or "
                        f"run attnmt train without torchrun")
    return env


def choose_backend(backend: Backend, requested: str = "auto") -> str:
    """The collectives of the run's device (``Backend.collectives``: NCCL for CUDA tensors, gloo for CPU ones);
    an explicit choice must fit the device."""
    if requested == "auto":
        return backend.collectives()
    if requested == "nccl" and backend.collectives() != "nccl":
        raise UserError("--distributed-backend nccl needs CUDA GPUs; on the CPU use gloo (or leave it at auto)")
    return requested


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


@dataclass
class Peers:
    """Where every rank runs (host name and pid), to name the missing one when a collective fails."""

    hosts: list[str]
    pids: list[int]

    def missing(self, me: int) -> list[str]:
        """'rank 1 (pid 123) has exited' for each peer on this host whose process is gone or stopped."""
        found = []
        for r, (h, pid) in enumerate(zip(self.hosts, self.pids)):
            if r == me or h != self.hosts[me]:
                continue
            state = _process_state(pid)
            if state is None or state in "ZX":
                found.append(f"rank {r} (pid {pid}) has exited")
            elif state in "Tt":
                found.append(f"rank {r} (pid {pid}) is stopped")
        return found

    def describe_missing(self, me: int, wait_s: float = 2.0) -> str:
        """Who is missing; waits up to ``wait_s`` because a killed peer's sockets close before its process is gone."""
        deadline = time.monotonic() + wait_s
        while True:
            found = self.missing(me)
            if found or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        if found:
            return "; ".join(found)
        others = len(self.hosts) - 1
        return ("the other rank has died or stopped responding" if others == 1
                else "another rank has died or stopped responding (see the first error of the job)")


def _process_state(pid: int) -> str | None:
    """The one-letter state of ``pid`` from /proc (R, S, D, Z, T...), or None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


def init(env: Env, run_backend: Backend, cfg: DistributedConfig) -> Peers:
    """Join the process group (from torchrun's MASTER_ADDR/MASTER_PORT) and exchange hosts and pids.

    ``cfg.ddp_timeout`` becomes the timeout of every collective: with gloo a collective that waits longer
    raises; with NCCL the watchdog aborts the process (and torchrun stops the others).
    """
    if not dist.is_available():
        raise UserError("this PyTorch build has no torch.distributed; install a standard build to train on "
                        "several processes")
    backend = choose_backend(run_backend, cfg.distributed_backend)
    device = run_backend.device
    if backend == "gloo" and not dist.is_gloo_available():
        raise UserError("this PyTorch build has no gloo backend; use --distributed-backend nccl on GPUs")
    if backend == "nccl" and not dist.is_nccl_available():
        raise UserError("this PyTorch build has no NCCL backend; use --distributed-backend gloo")
    run_backend.bind_process()
    if not dist.is_initialized():
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            if key not in os.environ:
                raise UserError(f"WORLD_SIZE={env.world_size} but {key} is not set; launch with torchrun "
                                f"(or attnmt train --nproc-per-node N), which sets the rendezvous")
        kwargs = {}
        if backend == "nccl" and "device_id" in inspect.signature(dist.init_process_group).parameters:
            kwargs["device_id"] = device  # binds this process's communicator to its GPU (torch >= 2.3)
        try:
            dist.init_process_group(backend, rank=env.rank, world_size=env.world_size,
                                    timeout=datetime.timedelta(seconds=cfg.ddp_timeout), **kwargs)
        except (RuntimeError, ValueError) as e:
            raise UserError(f"rank {env.rank}: could not join the {env.world_size} training processes "
                            f"({_first_line(e)}); check that all of them were started with the same rendezvous "
                            f"and can reach MASTER_ADDR:MASTER_PORT") from None
    info: list = [None] * env.world_size
    try:
        dist.all_gather_object(info, (socket.gethostname(), os.getpid()))
    except RuntimeError as e:
        raise UserError(f"rank {env.rank}: lost the other training processes while starting ({_first_line(e)}); "
                        f"see the first failing rank's error and run the same command again") from None
    return Peers([h for h, _ in info], [p for _, p in info])


# How long a leaving process yields the GIL to the communication threads (see shutdown).
GIL_HANDOVER_S = 0.1


def shutdown() -> None:
    """Leave the process group at the end of a run (also one that failed).

    A gradient all-reduce that DDP starts inside a backward pass carries a Python object, and the communication
    thread that ran it drops that object after the all-reduce completes, under the GIL. A thread still waiting for
    the GIL when the interpreter shuts down aborts the whole process ("terminate called without an active
    exception", SIGABRT), which turns a clean exit, or a clean one-line error, into a crash when the process ends
    right after a backward pass. So the process sleeps briefly here, which lets such a thread take the GIL and
    finish. (The group's threads outlive destroy_process_group: DDP keeps the group alive, so they are not joined.)
    """
    if is_initialized():
        with contextlib.suppress(Exception):  # a broken group cannot always be torn down cleanly
            dist.destroy_process_group()
        time.sleep(GIL_HANDOVER_S)


# 25 MB buckets (PyTorch's default, kept on purpose): transformer_big's 0.84 GB of fp32 gradients make 34 of them,
# base's 0.24 GB 10; small enough that all but the last overlap the backward, large enough that each all-reduce
# runs near the link's bandwidth (NCCL reaches most of it from a few MB on).
BUCKET_CAP_MB = 25


def wrap(model: torch.nn.Module, backend: Backend) -> torch.nn.Module:
    """DistributedDataParallel around ``model`` (whose parameters it broadcasts from rank 0).

    No buffer broadcast in forward: the only buffers are the sinusoid tables, identical on every rank by
    construction (and regrown in place for long sentences), and a broadcast would be one more collective in
    every forward.

    Gradients are all-reduced in buckets of :data:`BUCKET_CAP_MB` while the backward pass goes on: a bucket is
    sent as soon as the gradients in it are complete (the last layers' first), so the all-reduce of one bucket
    overlaps the backward of the layers before it, and only the last bucket's all-reduce is left after the
    backward ends. ``gradient_as_bucket_view``: the ``.grad`` tensors are views into the buckets, so gradients
    are not copied into the buckets and back (one copy of the gradients less in memory and in time).
    """
    from torch.nn.parallel import DistributedDataParallel

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    no_buffer_sync = ({"forward_sync_buffers": False} if "forward_sync_buffers" in params  # torch >= 2.12 name
                      else {"broadcast_buffers": False})
    return DistributedDataParallel(model, device_ids=backend.ddp_device_ids(),
                                   bucket_cap_mb=BUCKET_CAP_MB, gradient_as_bucket_view=True, **no_buffer_sync)


# ---------------------------------------------------------------------------------------------------- agreement


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag is True on every rank when it is True on at least one (one MAX all-reduce)."""
    return [v > 0 for v in max_over_ranks([bool(f) for f in flags], device)]


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Each value is its largest over the ranks (one MAX all-reduce): flags as 0/1, and clocks, which every rank
    must read alike where they decide something that has to agree (the learning rate)."""
    if world_size() == 1:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def check_peers(failure: str | None, device: torch.device) -> None:
    """Tell every rank whether some rank failed in this update, and raise everywhere if one did.

    Called once per update just before DDP's gradient all-reduce (and by a rank that failed before reaching it),
    so a rank that hit an error it survived (out of memory) does not leave the others blocked in that all-reduce.
    """
    if world_size() == 1:
        if failure:
            raise UserError(failure)
        return
    t = torch.tensor([1 if failure else 0], dtype=torch.int32, device=device)
    dist.all_reduce(t)
    n = int(t.item())
    if failure:
        raise UserError(failure)
    if n:
        raise UserError(f"rank {rank()}: stopping with the other processes: {n} rank(s) failed in this update "
                        f"(see their error)")


def gather_to_master(obj) -> list | None:
    """Every rank's ``obj`` on rank 0 (a list in rank order), None elsewhere; ``[obj]`` in a single process."""
    if world_size() == 1:
        return [obj]
    out = [None] * world_size() if rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather(obj) -> list:
    """Every rank's ``obj`` on every rank, in rank order."""
    if world_size() == 1:
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


# ---------------------------------------------------------------------------------------------------- faults


class Preemption:
    """SIGTERM / SIGUSR1 set a flag instead of killing the process; the loop saves after the current update.

    Used as a context manager around training (the previous handlers come back afterwards). Only the main
    thread can install signal handlers; elsewhere this does nothing.
    """

    def __init__(self, signals: tuple[str, ...] = PREEMPTION_SIGNALS):
        self.signals = [getattr(signal, s) for s in signals if hasattr(signal, s)]
        self.received: int | None = None
        self._old: dict = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else ""

    def _handle(self, signum, frame) -> None:
        self.received = signum

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()


def oom_message(sample: dict | None, update: int, device: torch.device) -> str:
    """Which batch did not fit, and what to lower (one line)."""
    if sample is not None:
        src = sample["net_input"]["src_tokens"]
        shape = (f"a batch of {src.size(0)} sentences x {src.size(1)} source / {sample['target'].size(1)} target "
                 f"tokens")
    else:
        shape = "a batch"
    return (f"rank {rank()}: out of memory on {device} in update {update} with {shape}; lower --max-tokens "
            f"(and raise --update-freq by the same factor to keep the effective batch)")


_COLLECTIVE_HINTS = ("gloo", "nccl", "connection closed", "connection reset", "timed out", "broken pipe",
                     "socket", "ProcessGroup")


def _is_collective_error(e: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", None)
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(h.lower() in text for h in _COLLECTIVE_HINTS)


def _first_line(e: BaseException, limit: int = 200) -> str:
    """The first line of an error without gloo's/NCCL's ``[source/file.cc:123]`` prefix, at most ``limit`` chars."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    line = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", lines[0]) if lines else type(e).__name__
    line = line.split(". ")[0]  # gloo appends advice that does not apply here
    return line if len(line) <= limit else line[: limit - 3].rstrip() + "..."


@contextlib.contextmanager
def collective_errors(peers: Peers | None, timeout_s: float, save_dir: Path) -> Iterator[None]:
    """Turn a collective that failed because a peer died or hung into one line naming that peer."""
    try:
        yield
    except Exception as e:
        if peers is None or not _is_collective_error(e):
            raise
        me = rank()
        text = str(e).lower()
        how = (f"a collective operation timed out after --ddp-timeout {timeout_s:g} s" if "timed out" in text
               or "timeout" in text else "a collective operation failed")
        raise UserError(
            f"rank {me}: {how} ({_first_line(e)}): {peers.describe_missing(me)}. Find why in that rank's error or "
            f"the launcher's report, fix it and run the same command again (it resumes from "
            f"{save_dir / 'checkpoint_last.pt'} if one was saved)") from None


# ---------------------------------------------------------------------------------------------------- launcher


def _preempted_since(jsonl: Path, offset: int) -> bool:
    """Whether rank 0 logged a 'preempted' summary in ``train.jsonl`` after byte ``offset``."""
    try:
        with open(jsonl, "rb") as f:
            f.seek(offset)
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return False
    for line in lines:
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if rec.get("type") == "summary" and rec.get("stop_reason") == "preempted":
                return True
    return False


def launch(nproc: int, argv: list[str], save_dir: Path) -> int:
    """Run ``python -m attnmt.cli ARGV`` as ``nproc`` local workers through torch.distributed.run.

    This is torchrun's own code path (elastic agent, c10d rendezvous on a free local port): when one worker fails
    the agent stops the others, and the signals in :data:`LAUNCHER_SIGNALS` sent to this process are forwarded
    to the workers. Returns the exit status: 0, :data:`PREEMPTED_EXIT` when the workers saved and stopped after
    a signal; raises a UserError naming the failed ranks otherwise.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    jsonl = Path(save_dir) / "train.jsonl"
    offset = jsonl.stat().st_size if jsonl.exists() else 0
    args = get_args_parser().parse_args([
        "--standalone", f"--nproc-per-node={nproc}", f"--signals-to-handle={LAUNCHER_SIGNALS}",
        "--module", "attnmt.cli", *argv])
    try:
        run(args)
    except SignalException as e:
        sig = signal.Signals(e.sigval)
        if _preempted_since(jsonl, offset):
            print(f"attnmt: {sig.name}: the workers saved {save_dir / 'checkpoint_last.pt'} and stopped; run the "
                  f"same command again to resume", file=sys.stderr)
            return PREEMPTED_EXIT
        print(f"attnmt: stopped by {sig.name} before a checkpoint was saved", file=sys.stderr)
        return 128 + int(sig)
    except ChildFailedError as e:
        failures = e.failures
        if failures and all(f.exitcode == PREEMPTED_EXIT for f in failures.values()):
            print(f"attnmt: preempted: the workers saved {save_dir / 'checkpoint_last.pt'} and stopped; run the "
                  f"same command again to resume", file=sys.stderr)
            return PREEMPTED_EXIT
        parts = []
        for r, f in sorted(failures.items()):
            how = (f"killed by {f.signal_name()}" if f.exitcode < 0 else f"exit status {f.exitcode}")
            parts.append(f"rank {r} (pid {f.pid}) {how}")
        raise UserError(f"training failed: {'; '.join(parts)}; see the first rank's error above, fix its cause and "
                        f"run the same command again (it resumes from {save_dir / 'checkpoint_last.pt'} when one "
                        f"was saved)") from None
    return 0
