"""Writing outputs: every file attnmt writes goes through here.

* Atomic writes: a file is either the old one or the complete new one, never half-written (temp file beside it,
  fsync, rename); a failed write removes its temp file, and a killed writer's is removed by the next run
  (:func:`remove_stale_temps`). A target that is not a regular file (``/dev/null``, a FIFO) is written in place,
  never replaced; a symbolic link stays, and its target is replaced.
* Locks (:func:`exclusive`): one writer at a time for a training run's ``--save-dir`` and a ``--destdir``.
* Write errors (a full disk, a read-only file system, a directory where a file should be, ...) become one-line
  ``UserError``s that name the path, and outputs can be checked before any work starts
  (:func:`check_output_dir`, :func:`check_output_file`), so that a long run does not fail at its end.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from attnmt.errors import UserError

# errors of the target, not of attnmt: reported as one line naming the path
WRITE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR, errno.ENOTDIR,
                errno.EEXIST, errno.EFBIG, errno.ENAMETOOLONG}


def write_error(path: str | os.PathLike, e: OSError, option: str = "") -> UserError:
    """The one-line error for a failed write of ``path``."""
    what = f"{option} " if option else ""
    fix = {errno.ENOSPC: "free some space or write elsewhere", errno.EDQUOT: "free some space or write elsewhere",
           errno.EROFS: "the file system is read-only: write elsewhere",
           errno.EFBIG: "the file would pass this process's file-size limit (ulimit -f): raise it or write less"
           }.get(e.errno, f"choose another {what or 'path'}")
    return UserError(f"{path}: cannot write {what}({e.strerror or e}); {fix}")


def _blocking_file(path: Path) -> Path | None:
    """The first existing component of ``path`` (itself included) that is not a directory, if any."""
    for p in [*reversed(path.parents), path]:
        if p.exists() and not p.is_dir():
            return p
        if not p.exists():
            return None
    return None


def _probe(directory: Path, path: Path, option: str) -> None:
    """Create ``directory`` if needed and check that a file can be created in it."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".attnmt-probe.", dir=directory)
        os.close(fd)
        os.unlink(tmp)
    except OSError as e:
        raise write_error(path, e, option) from None


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """Fail fast (UserError) unless ``path`` is, or can be made, a directory that files can be written into."""
    path = Path(path)
    blocker = _blocking_file(path)
    if blocker == path:
        raise UserError(f"{path}: {option} is a file, not a directory; choose a directory")
    if blocker is not None:
        raise UserError(f"{path}: {option} is under {blocker}, which is a file; choose a directory")
    _probe(path, path, option)
    return path


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """Fail fast (UserError) unless ``path`` can be written (atomically: a temp file beside it, then a rename)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{path}: {option} is a directory; give a file name, e.g. {path / 'out.txt'}")
    if path.exists() and not path.is_file():  # /dev/null, a FIFO: written in place
        if not os.access(path, os.W_OK):
            raise UserError(f"{path}: cannot write {option} (permission denied); choose another path")
        return path
    path = Path(os.path.realpath(path)) if path.is_symlink() else path
    blocker = _blocking_file(path.parent)
    if blocker is not None:
        raise UserError(f"{path}: {option} is under {blocker}, which is a file; choose another path")
    _probe(path.parent, path, option)
    remove_stale_temps(path.parent, path.name)
    return path


# ------------------------------------------------------------------------------------------------ temp files


def temp_prefix(name: str) -> str:
    """The prefix of this process's temp files and directories for the output ``name``: ``.NAME.PID.``; the pid
    tells a later run whether the writer is still alive (:func:`remove_stale_temps`)."""
    return f".{name}.{os.getpid()}."


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's live process
    return True


def remove_stale_temps(directory: str | os.PathLike, name: str) -> list[Path]:
    """Delete the temp files and directories that killed attnmt processes left for the output ``name`` in
    ``directory`` (``.NAME.PID.*``, see :func:`temp_prefix`, whose PID no longer runs); those of live writers
    are left alone. Returns what was removed."""
    removed = []
    prefix = f".{name}."
    with contextlib.suppress(OSError):
        for p in Path(directory).iterdir():
            if not p.name.startswith(prefix):
                continue
            pid = p.name[len(prefix):].split(".", 1)[0]
            if not pid.isdigit() or pid_alive(int(pid)):
                continue
            with contextlib.suppress(OSError):
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
                removed.append(p)
    return removed


# ------------------------------------------------------------------------------------------------ locks


@contextlib.contextmanager
def exclusive(lock_file: str | os.PathLike, what: str, fix: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_file`` (``flock``; created if needed) for the block: one attnmt process
    at a time writes ``what``. A second one fails at once with a UserError naming the holder (its pid, command
    and start time, recorded in the file) and ``fix``. The kernel drops the lock when its holder dies, however
    it dies: a stale lock file never blocks anyone; the holder removes the file when the block ends. A symbolic
    link in the lock file's place is refused, never followed."""
    import fcntl
    import json
    import sys
    import time

    lock_file = Path(lock_file)
    while True:
        try:  # never through a symbolic link: the lock file is attnmt's own, and is written to
            fd = os.open(lock_file, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UserError(f"{lock_file}: is a symbolic link (to {os.path.realpath(lock_file)}), which attnmt's "
                                f"lock file never is; remove the link (rm {lock_file}) and run again") from None
            raise (write_error(lock_file, e) if e.errno in WRITE_ERRNOS else e) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8"))
                who = (f"attnmt {holder.get('command', '?')} (pid {holder.get('pid', '?')} on "
                       f"{holder.get('host', '?')}, since {holder.get('started', '?')})")
            except (ValueError, OSError, AttributeError):
                who = "another attnmt process"
            os.close(fd)
            raise UserError(f"{what} is in use by {who}; {fix}") from None
        try:  # the holder before us may have removed the file between our open and our lock: take the new one
            if os.stat(lock_file).st_ino == os.fstat(fd).st_ino:
                break
        except FileNotFoundError:
            pass
        os.close(fd)
    try:
        record = {"pid": os.getpid(), "host": os.uname().nodename, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "command": " ".join(sys.argv[1:3]) or "?"}
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(record) + "\n").encode("utf-8"), 0)
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock_file)  # still holding the lock: whoever opens the path next gets a new file
        os.close(fd)


# ------------------------------------------------------------------------------------------------ atomic writes


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temp file next to ``path``; on success fsync and rename it over ``path``; on error remove it.

    A write error of the target (full disk, read-only file system, ...) becomes a UserError naming ``path``.
    """
    path = Path(path)
    if path.exists() and not path.is_file():  # a device, FIFO or socket: written in place (never replaced)
        with _open_special(path, mode, encoding) as f:
            yield f
        return
    if path.is_symlink():  # the link stays; its target is replaced atomically
        path = Path(os.path.realpath(path))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=temp_prefix(path.name), suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise (write_error(path, e) if e.errno in WRITE_ERRNOS else e) from None
    os.fchmod(fd, 0o666 & ~umask())  # mkstemp makes 0600; give the result the permissions open() would
    binary = "b" in mode
    try:
        with os.fdopen(fd, mode, encoding=None if binary else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno in WRITE_ERRNOS:
            raise write_error(path, e) from None
        raise


@contextlib.contextmanager
def _open_special(path: Path, mode: str, encoding: str | None) -> Iterator[IO]:
    """``path`` (not a regular file: ``/dev/null``, ``/dev/stdout``, a FIFO) opened for writing as it is."""
    binary = "b" in mode
    try:
        f = open(path, mode.replace("x", "w"), encoding=None if binary else encoding)  # noqa: SIM115
    except OSError as e:
        raise (write_error(path, e) if e.errno in WRITE_ERRNOS else e) from None
    try:
        with f:
            yield f
    except OSError as e:
        if e.errno in WRITE_ERRNOS:
            raise write_error(path, e) from None
        raise


def umask() -> int:
    """The process's file-creation mask (read without changing it)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_torch_save(obj, path: str | os.PathLike) -> None:
    """``torch.save`` through a temp file and a rename (a crash mid-save never corrupts ``path``)."""
    import torch

    try:
        with atomic_open(path, "wb") as f:
            torch.save(obj, f)
    except RuntimeError as e:  # torch's zip writer reports a failed write (ENOSPC) as "unexpected pos"
        if "inline_container" not in str(e) and "unexpected pos" not in str(e):
            raise
        import resource

        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY:  # the likelier cause: writes past it fail as on a full disk
            raise UserError(f"{path}: cannot write the checkpoint (File too large: this process may write files "
                            f"of at most {limit:,} bytes, ulimit -f); raise the limit or write less") from None
        free = shutil.disk_usage(Path(path).parent).free
        raise UserError(f"{path}: cannot write the checkpoint (the write failed: disk full? {free / 2**20:.0f} MB "
                        f"free once the partial file was removed); free some space or choose another directory") \
            from None


MARKER = ".attnmt-output.json"  # in every directory write_directory makes: what wrote it


def _replaceable(out: Path, command: str, known: Callable[[str], bool] | None) -> str | None:
    """Why ``--force`` may not replace the existing directory ``out`` (None: it may): only a directory that
    ``command`` wrote (its marker says so) or, from before markers, one holding nothing but files that
    ``known`` recognises as ``command``'s own."""
    import json

    try:
        record = json.loads((out / MARKER).read_text(encoding="utf-8"))
        if isinstance(record, dict) and record.get("command") == command:
            return None
    except (OSError, ValueError):
        pass
    try:
        entries = list(out.iterdir())
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    foreign = [p.name for p in entries if p.name != MARKER and not (
        known is not None and known(p.name) and p.is_file() and not p.is_symlink())]
    if entries and foreign:
        return (f"it holds {', '.join(sorted(foreign)[:3])}{' ...' if len(foreign) > 3 else ''}, which attnmt "
                f"{command} did not write")
    return None


def write_directory(output_dir: str | os.PathLike, force: bool, write, command: str = "export",
                    known: Callable[[str], bool] | None = None) -> str:
    """Make the directory ``output_dir`` whole or not at all: ``write(tmp)`` fills a new directory beside it, which
    is then renamed into place; with ``force`` an existing ``output_dir`` is replaced, and goes only once the new
    one is complete (a failure, a full disk, leaves the old state), and only where ``attnmt COMMAND`` wrote it
    (the :data:`MARKER` file it leaves, or only files ``known`` names as its own): a directory of the user's
    is never deleted. A symbolic link stays and its target is replaced. Half-written directories of killed runs
    are removed first."""
    import json
    import time

    out = Path(output_dir)
    if out.is_symlink():
        real = Path(os.path.realpath(out))
        if not real.exists():
            raise UserError(f"{out}: --output-dir is a symbolic link to {real}, which does not exist; give a "
                            f"directory (or make the link's target)")
        target = real
    else:
        target = out
    if target.exists() and not target.is_dir():
        raise UserError(f"{out}: --output-dir is a file; choose a directory")
    if target.exists():
        if not force:
            raise UserError(f"{out}: --output-dir already exists; use --force to replace it, or choose another")
        real, here = Path(os.path.realpath(target)), Path(os.path.realpath(os.getcwd()))
        if real == here or real in here.parents or os.path.ismount(real):
            what = "a mount point" if os.path.ismount(real) else (
                "the working directory" if real == here else "a directory above the working directory")
            raise UserError(f"{out}: --output-dir is {what}, which cannot be replaced as a whole; give a directory "
                            f"inside it, e.g. {out / 'model'}")
        why = _replaceable(target, command, known)
        if why is not None:
            raise UserError(f"{out}: --force replaces only a directory that attnmt {command} wrote, and {why}; "
                            f"move those files away or choose another --output-dir")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temps(target.parent, target.name)
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), dir=target.parent))
    except OSError as e:
        raise (write_error(out, e, "--output-dir") if e.errno in WRITE_ERRNOS else e) from None
    os.chmod(tmp, 0o777 & ~umask())  # a model directory as mkdir would make it (mkdtemp's is private)
    try:
        try:
            write(tmp)
            (tmp / MARKER).write_text(json.dumps({"command": command, "written": time.strftime(
                "%Y-%m-%d %H:%M:%S")}) + "\n", encoding="utf-8")
        except OSError as e:
            if e.errno in WRITE_ERRNOS:
                raise write_error(out, e, "--output-dir") from None
            raise
        try:
            if target.exists():
                old = Path(tempfile.mkdtemp(prefix=temp_prefix(target.name), dir=target.parent))
                os.replace(target, old / "old")
                try:
                    os.replace(tmp, target)
                except OSError:
                    os.replace(old / "old", target)
                    raise
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, target)
        except OSError as e:
            raise UserError(f"{out}: cannot replace --output-dir ({e.strerror or e}); choose another") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
