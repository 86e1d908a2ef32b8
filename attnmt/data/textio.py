"""Reading corpus text: plain or gzip, strictly UTF-8, with errors that name the file, the line and the byte.

Lines are split on ``\\n`` only (never on the other characters Python's ``splitlines`` treats as line breaks),
so that line *i* of a file is line *i* for every tool in the pipeline (``wc -l``, ``paste``, sacrebleu).

``scan`` reads a file once: it validates UTF-8, counts lines, hashes the decompressed bytes (the identity of
the input recorded in ``preprocess.json``) and remembers the byte offset of every ``CHECKPOINT``-th line, so
that workers can start reading in the middle of a file (``read_lines``).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import io
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from attnmt.errors import UserError

CHECKPOINT = 128
_BLOCK = 1 << 22
_GZIP_MAGIC = b"\x1f\x8b"


def is_gzip(path: str | os.PathLike) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == _GZIP_MAGIC


def open_binary(path: str | os.PathLike) -> io.BufferedIOBase:
    """The decompressed bytes of ``path`` (gzip is recognised by its magic bytes, whatever the name)."""
    try:
        return gzip.open(path, "rb") if is_gzip(path) else open(path, "rb")
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; check the path") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a text file") from None


def _gzip_error(path, e: Exception) -> UserError:
    return UserError(f"{path}: corrupt or truncated gzip data ({e}); re-download or re-compress the file")


def resolve_input(prefix: str, lang: str, option: str = "--trainpref") -> str:
    """``PREFIX.LANG`` if it exists, else ``PREFIX.LANG.gz``; a UserError listing both paths otherwise."""
    tried = [f"{prefix}.{lang}", f"{prefix}.{lang}.gz"]
    for p in tried:
        if os.path.isfile(p):
            return p
    raise UserError(f"{tried[0]}: input file not found (tried {' and '.join(tried)}); "
                    f"check {option} and -s/-t")


@dataclass
class ScanResult:
    """What one read of a file tells: identity, size in lines, and seek points for workers."""

    path: str
    sha256: str
    lines: int
    # checkpoints[k] = byte offset (in the decompressed stream) where line k * CHECKPOINT starts
    checkpoints: list[int] = field(default_factory=list)

    def offset_of(self, line: int) -> int:
        """Byte offset of ``line`` (0-based), which must be a multiple of ``CHECKPOINT``."""
        if line % CHECKPOINT:
            raise ValueError(f"line {line} is not a multiple of {CHECKPOINT}")
        return self.checkpoints[line // CHECKPOINT]


def scan(path: str | os.PathLike) -> ScanResult:
    """Validate UTF-8, count lines, sha256 the decompressed bytes, record seek points (one pass)."""
    path = str(path)
    h = hashlib.sha256()
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    newlines = 0
    pos = 0
    last = b""
    checkpoints = [0]
    f = open_binary(path)
    try:
        with f:
            while True:
                block = f.read(_BLOCK)
                if not block:
                    break
                h.update(block)
                decoder.decode(block, final=False)
                nl = np.flatnonzero(np.frombuffer(block, dtype=np.uint8) == 10)
                if len(nl):
                    # newline number (newlines + j) ends line (newlines + j); the next line starts after it
                    starts = newlines + np.arange(1, len(nl) + 1)
                    sel = nl[starts % CHECKPOINT == 0]
                    checkpoints.extend((pos + sel + 1).tolist())
                newlines += len(nl)
                pos += len(block)
                last = block[-1:]
            decoder.decode(b"", final=True)
    except UnicodeDecodeError:
        raise locate_utf8_error(path) from None
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:
        raise _gzip_error(path, e) from None
    lines = newlines + (1 if pos and last != b"\n" else 0)
    checkpoints = [c for k, c in enumerate(checkpoints) if k * CHECKPOINT < lines] or [0]
    return ScanResult(path, h.hexdigest(), lines, checkpoints)


def locate_utf8_error(path: str) -> UserError:
    """The UserError for the first invalid UTF-8 byte of ``path``: line number and byte offsets."""
    pos = 0
    with open_binary(path) as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return UserError(
                    f"{path}:{lineno}: invalid UTF-8 at byte {e.start} of the line (byte {pos + e.start} of the "
                    f"{'decompressed ' if is_gzip(path) else ''}file): {e.reason}; "
                    f"convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or fix that line")
            pos += len(raw)
    return UserError(f"{path}: invalid UTF-8; convert the file to UTF-8")


def read_lines(path: str, offset: int = 0, count: int | None = None) -> Iterator[str]:
    """Decoded lines of ``path`` (newline removed) from byte ``offset`` of the decompressed stream.

    The file must have passed ``scan`` (UTF-8 errors are reported there with their line number).
    """
    f = open_binary(path)
    with f:
        if offset:
            f.seek(offset)
        n = 0
        while count is None or n < count:
            raw = f.readline()
            if not raw:
                break
            yield raw.decode("utf-8").rstrip("\n")
            n += 1
