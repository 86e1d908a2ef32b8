"""Memory-mapped datasets of token-id sequences: ``PREFIX.bin`` (the ids) and ``PREFIX.idx`` (where each is).

Nothing is read into RAM: sizes, offsets and ids are ``numpy.memmap`` views, so a many-GB training set opens
instantly and is shared between data-loader workers through the page cache.

``PREFIX.bin``: all sequences back to back, each id stored little-endian in the narrowest dtype that holds the
vocabulary (``best_dtype``): uint8, uint16 or int32.

``PREFIX.idx`` (all integers little-endian)::

    offset  size            field
    0       8               magic  b"ATNMIDX\\0"
    8       4   uint32      version (1)
    12      1   uint8       dtype code of .bin: 1 = uint8, 2 = uint16, 3 = int32
    13      3               reserved, zero
    16      8   uint64      count: number of sequences
    24      8   uint64      total number of ids in .bin (a truncated .bin is detected on open)
    32      4*count int32   sizes[count]: length of each sequence
    ...     0 or 4          zero padding so that offsets start on an 8-byte boundary
    ...     8*count int64   offsets[count]: where each sequence starts in .bin, counted in ids (not bytes)

fairseq's memory-mapped data-bins (``MMIDIDX`` indexes, fairseq-preprocess's default) are read as they are: the
same ``.bin`` layout, an index of magic ``b"MMIDIDX\0\0"``, uint64 version 1, uint8 dtype code, uint64 count, int32
sizes and int64 byte offsets. ``IndexedDatasetBuilder(..., index_format="mmap")`` (``preprocess --dataset-impl
mmap``) writes that index instead of attnmt's, so that fairseq reads the data-bin too.

So sequence ``i`` is ``bin[offsets[i] : offsets[i] + sizes[i]]``, readable with nothing but numpy::

    count = int(np.frombuffer(idx_bytes, "<u8", 1, 16)[0])
    sizes = np.memmap(prefix + ".idx", "<i4", "r", offset=32, shape=(count,))
"""

from __future__ import annotations

import array
import os
import struct
import tempfile
from pathlib import Path

import numpy as np

from attnmt.errors import UserError
from attnmt.fileio import atomic_open

MAGIC = b"ATNMIDX\x00"
FAIRSEQ_MAGIC = b"MMIDIDX\x00\x00"
FAIRSEQ_HEADER = struct.Struct("<9sQBQ")  # magic, version, dtype code, count (26 bytes)
_FAIRSEQ_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<i1"), 3: np.dtype("<i2"), 4: np.dtype("<i4"),
                   5: np.dtype("<i8"), 8: np.dtype("<u2"), 9: np.dtype("<u4"), 10: np.dtype("<u8")}
VERSION = 1
HEADER = struct.Struct("<8sIB3xQQ")  # magic, version, dtype code, count, total ids (32 bytes)
assert HEADER.size == 32

_DTYPES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 3: np.dtype("<i4")}
_CODES = {v: k for k, v in _DTYPES.items()}
_FAIRSEQ_CODES = {np.dtype("<u1"): 1, np.dtype("<u2"): 8, np.dtype("<i4"): 4}
INDEX_FORMATS = ("attnmt", "mmap")  # mmap: fairseq-preprocess's MMIDIDX index, which fairseq reads too


def best_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds ids ``0 .. vocab_size - 1``: uint8, uint16 or int32."""
    if vocab_size <= 1 << 8:
        return np.dtype(np.uint8)
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 31:
        return np.dtype(np.int32)
    raise ValueError(f"vocabulary of {vocab_size} symbols does not fit int32 ids")


def _code(dtype: np.dtype) -> int:
    return _CODES[np.dtype(dtype).newbyteorder("<")]


def offsets_start(count: int) -> int:
    """Byte position of ``offsets`` in ``.idx`` (after the sizes, aligned to 8 bytes)."""
    pos = HEADER.size + 4 * count
    return pos + (-pos) % 8


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(bin_path(prefix)) and os.path.isfile(idx_path(prefix))


def pair_prefix(data_bin: str | os.PathLike, split: str, src: str, tgt: str) -> str:
    """``DATA_BIN/SPLIT.SRC-TGT`` (add ``.LANG``), or ``SPLIT.TGT-SRC`` when only the pair written the other way
    round is there: a data-bin binarized de-en also serves en-de, as in fairseq."""
    forward = os.path.join(os.fspath(data_bin), f"{split}.{src}-{tgt}")
    backward = os.path.join(os.fspath(data_bin), f"{split}.{tgt}-{src}")
    if not exists(f"{forward}.{src}") and exists(f"{backward}.{src}"):
        return backward
    return forward


class IndexedDatasetBuilder:
    """Appends sequences to ``PREFIX.bin`` (through a temp file) and writes ``PREFIX.idx`` on ``finalize``.

    Both files appear under their final names only when ``finalize`` succeeds.
    """

    FLUSH_IDS = 1 << 20

    def __init__(self, prefix: str | os.PathLike, vocab_size: int, index_format: str = "attnmt"):
        if index_format not in INDEX_FORMATS:
            raise ValueError(f"index format {index_format!r}: one of {', '.join(INDEX_FORMATS)}")
        self.prefix = str(prefix)
        self.vocab_size = int(vocab_size)
        self.index_format = index_format
        self.dtype = best_dtype(self.vocab_size).newbyteorder("<")
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp_bin = tempfile.mkstemp(prefix=f".{Path(self.prefix).name}.", suffix=".bin.tmp",
                                             dir=Path(self.prefix).parent)
        self._bin = os.fdopen(fd, "wb")
        self._sizes = array.array("i")
        self._pending = array.array("q")
        self._total = 0
        self._done = False

    def add(self, ids) -> None:
        """Append one sequence of ids (a list, numpy array or 1-d tensor)."""
        if hasattr(ids, "tolist") and not isinstance(ids, list):
            ids = ids.tolist()
        self._pending.extend(ids)
        self._sizes.append(len(ids))
        if len(self._pending) >= self.FLUSH_IDS:
            self._flush()

    def _flush(self) -> None:
        if not self._pending:
            return
        a = np.frombuffer(self._pending, dtype=np.int64)
        lo, hi = int(a.min()), int(a.max())
        if lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"{self.prefix}: id {lo if lo < 0 else hi} is outside the vocabulary 0..{self.vocab_size - 1}")
        self._bin.write(a.astype(self.dtype).tobytes())
        self._total += len(a)
        self._pending = array.array("q")

    def merge(self, other_prefix: str | os.PathLike) -> None:
        """Append every sequence of another finished dataset (same dtype), e.g. the part written by a worker."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix} ({other.dtype}) into {self.prefix} ({self.dtype})")
        self._flush()
        with open(bin_path(other_prefix), "rb") as f:
            while True:
                chunk = f.read(1 << 24)
                if not chunk:
                    break
                self._bin.write(chunk)
        self._total += int(other.sizes.sum(dtype=np.int64))
        self._sizes.frombytes(np.ascontiguousarray(other.sizes, dtype=np.int32).tobytes())

    def finalize(self) -> None:
        """Write ``.idx`` and move ``.bin`` into place."""
        self._flush()
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int32).astype("<i4") if self._sizes else np.zeros(0, "<i4")
        count = len(sizes)
        offsets = np.zeros(count, dtype="<i8")
        if count > 1:
            np.cumsum(sizes[:-1], dtype=np.int64, out=offsets[1:])
        os.replace(self._tmp_bin, bin_path(self.prefix))
        with atomic_open(idx_path(self.prefix), "wb") as f:
            if self.index_format == "mmap":  # fairseq's MMIDIDX: byte offsets, no total
                f.write(FAIRSEQ_HEADER.pack(FAIRSEQ_MAGIC, 1, _FAIRSEQ_CODES[self.dtype], count))
                f.write(sizes.tobytes())
                f.write((offsets * self.dtype.itemsize).astype("<i8").tobytes())
            else:
                f.write(HEADER.pack(MAGIC, VERSION, _code(self.dtype), count, self._total))
                f.write(sizes.tobytes())
                f.write(b"\0" * (offsets_start(count) - HEADER.size - 4 * count))
                f.write(offsets.tobytes())
        self._done = True

    def discard(self) -> None:
        """Remove the temp file of an unfinished dataset."""
        if not self._bin.closed:
            self._bin.close()
        if not self._done and os.path.exists(self._tmp_bin):
            os.unlink(self._tmp_bin)

    def __enter__(self) -> IndexedDatasetBuilder:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and not self._done:
            self.finalize()
        self.discard()

    def __del__(self):
        try:
            self.discard()
        except Exception:
            pass


class IndexedDataset:
    """Read-only view of ``PREFIX.bin``/``PREFIX.idx``; ``ds[i]`` is a numpy view of sequence ``i``.

    Picklable (it reopens the files), so it can go to data-loader worker processes.
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = str(prefix)
        self._open()

    def _open(self) -> None:
        ip, bp = idx_path(self.prefix), bin_path(self.prefix)
        missing = [p for p in (ip, bp) if not os.path.isfile(p)]
        if missing:
            raise UserError(f"{' and '.join(missing)}: not found; run attnmt preprocess to create the "
                            f"binarized dataset, or check --data / the split name")
        idx_size = os.path.getsize(ip)
        if idx_size < HEADER.size:
            raise UserError(f"{ip}: truncated index ({idx_size} bytes); re-run attnmt preprocess")
        with open(ip, "rb") as f:
            head = f.read(max(HEADER.size, FAIRSEQ_HEADER.size))
        if head.startswith(FAIRSEQ_MAGIC):
            self._open_fairseq(ip, bp, head, idx_size)
            return
        magic, version, code, count, total = HEADER.unpack(head[:HEADER.size])
        if magic != MAGIC:
            raise UserError(f"{ip}: not an attnmt indexed dataset (bad magic {magic!r}); "
                            f"binarize the data with attnmt preprocess")
        if version != VERSION:
            raise UserError(f"{ip}: index format version {version} is not supported (expected {VERSION}); "
                            f"re-run attnmt preprocess with this version of attnmt")
        if code not in _DTYPES:
            raise UserError(f"{ip}: unknown dtype code {code}; the file is corrupt, re-run attnmt preprocess")
        self.dtype = _DTYPES[code]
        expect_idx = offsets_start(count) + 8 * count
        if idx_size != expect_idx:
            raise UserError(f"{ip}: size {idx_size} bytes, expected {expect_idx} for {count} sequences; "
                            f"the file is truncated or corrupt, re-run attnmt preprocess")
        bin_size = os.path.getsize(bp)
        if bin_size != total * self.dtype.itemsize:
            raise UserError(f"{bp}: size {bin_size} bytes, expected {total * self.dtype.itemsize} "
                            f"({total} ids); the file is truncated or corrupt, re-run attnmt preprocess")
        self._count, self._total = count, total
        if count:
            self.sizes = np.memmap(ip, dtype="<i4", mode="r", offset=HEADER.size, shape=(count,))
            self.offsets = np.memmap(ip, dtype="<i8", mode="r", offset=offsets_start(count), shape=(count,))
            self._check_index(ip)
        else:
            self.sizes, self.offsets = np.zeros(0, "<i4"), np.zeros(0, "<i8")
        # numpy cannot map an empty file
        self._data = np.memmap(bp, dtype=self.dtype, mode="r") if total else np.zeros(0, self.dtype)

    def _open_fairseq(self, ip: str, bp: str, head: bytes, idx_size: int) -> None:
        """A fairseq-preprocess index (``MMIDIDX``): byte offsets become id offsets; the same checks apply."""
        _, version, code, count = FAIRSEQ_HEADER.unpack(head[:FAIRSEQ_HEADER.size])
        if version != 1 or code not in _FAIRSEQ_DTYPES:
            raise UserError(f"{ip}: fairseq index version {version}, dtype code {code} is not supported; binarize "
                            f"the data with attnmt preprocess")
        self.dtype = _FAIRSEQ_DTYPES[code]
        start = FAIRSEQ_HEADER.size
        if idx_size < start + 12 * count:
            raise UserError(f"{ip}: size {idx_size} bytes, too small for {count} sequences; the file is truncated, "
                            f"binarize the data again")
        bin_size = os.path.getsize(bp)
        if bin_size % self.dtype.itemsize:
            raise UserError(f"{bp}: {bin_size} bytes is not a whole number of {self.dtype} ids; the file is "
                            f"truncated or corrupt, binarize the data again")
        self._count, self._total = count, bin_size // self.dtype.itemsize
        if count:
            self.sizes = np.memmap(ip, dtype="<i4", mode="r", offset=start, shape=(count,))
            pointers = np.memmap(ip, dtype="<i8", mode="r", offset=start + 4 * count, shape=(count,))
            self.offsets = np.asarray(pointers) // self.dtype.itemsize
            self._check_index(ip)
        else:
            self.sizes, self.offsets = np.zeros(0, "<i4"), np.zeros(0, "<i8")
        self._data = np.memmap(bp, dtype=self.dtype, mode="r") if self._total else np.zeros(0, self.dtype)

    def _check_index(self, ip: str) -> None:
        """Every size >= 0 and every sequence right after the one before it, the last ending at the file's end:
        a damaged index would otherwise read as empty or overlapping sentences."""
        sizes = np.asarray(self.sizes, dtype=np.int64)
        ends = np.cumsum(sizes)
        starts = ends - sizes
        bad = (sizes < 0) | (np.asarray(self.offsets) != starts)
        if bad.any() or ends[-1] != self._total:
            i = int(np.argmax(bad)) if bad.any() else self._count - 1
            raise UserError(f"{ip}: entry {i} (sentence {i + 1}) is corrupt (size {int(self.sizes[i])}, offset "
                            f"{int(self.offsets[i])}); the file is damaged, re-run attnmt preprocess")

    def __len__(self) -> int:
        return self._count

    @property
    def num_tokens_total(self) -> int:
        return self._total

    def __getitem__(self, i: int) -> np.ndarray:
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError(f"index {i} out of range for {self._count} sequences in {self.prefix}")
        start = int(self.offsets[i])
        return self._data[start: start + int(self.sizes[i])]

    def __iter__(self):
        for i in range(self._count):
            yield self[i]

    def check_ids(self, vocab_size: int, dictionary: str = "its dictionary") -> None:
        """A UserError naming the file, the first sequence and the id unless every id is below ``vocab_size``
        (ids of another dictionary would index past the embeddings). Reads the ids in blocks of 16M."""
        block = 1 << 24
        for start in range(0, self._total, block):
            chunk = np.asarray(self._data[start:start + block])
            bad = np.flatnonzero(chunk >= vocab_size)
            if bad.size:
                at = start + int(bad[0])
                seq = int(np.searchsorted(self.offsets, at, side="right")) - 1
                raise UserError(f"{bin_path(self.prefix)}: sentence {seq} holds token id {int(chunk[bad[0]])}, beyond "
                                f"the {vocab_size} symbols of {dictionary}; it was binarized with another "
                                f"dictionary: binarize it again with attnmt preprocess (--srcdict/--tgtdict)")

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.prefix = state["prefix"]
        self._open()
