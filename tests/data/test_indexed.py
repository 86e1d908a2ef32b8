import pickle
import struct

import numpy as np
import pytest

from attnmt.data.indexed import (
    HEADER,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
    exists,
    offsets_start,
)
from attnmt.errors import UserError


def test_best_dtype_boundaries():
    assert best_dtype(1) == np.uint8
    assert best_dtype(256) == np.uint8
    assert best_dtype(257) == np.uint16
    assert best_dtype(65536) == np.uint16
    assert best_dtype(65537) == np.int32
    assert best_dtype(2**31) == np.int32
    with pytest.raises(ValueError):
        best_dtype(2**31 + 1)


def sequences(vocab: int, n: int = 50, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    seqs = [rng.integers(0, vocab, size=int(rng.integers(0, 30))).tolist() for _ in range(n)]
    seqs[3] = [vocab - 1, 0, vocab - 1]  # both ends of the id range
    seqs[7] = []  # empty sequences are allowed
    return seqs


def write(prefix, vocab, seqs):
    b = IndexedDatasetBuilder(str(prefix), vocab)
    for s in seqs:
        b.add(s)
    b.finalize()


@pytest.mark.parametrize("vocab,dtype", [(256, np.uint8), (257, np.uint16), (65536, np.uint16),
                                         (65537, np.int32), (3_000_000, np.int32)])
def test_round_trip_exact_ids_for_each_dtype(tmp_path, vocab, dtype):
    seqs = sequences(vocab)
    prefix = tmp_path / "train.en-de.en"
    write(prefix, vocab, seqs)
    assert exists(str(prefix))
    ds = IndexedDataset(str(prefix))
    assert len(ds) == len(seqs)
    assert ds.dtype == dtype
    assert isinstance(ds.sizes, np.memmap) and ds.sizes.dtype == np.int32
    assert ds.sizes.tolist() == [len(s) for s in seqs]
    for i, s in enumerate(seqs):
        assert ds[i].tolist() == s
    assert ds[-1].tolist() == seqs[-1]
    with pytest.raises(IndexError):
        ds[len(seqs)]
    # .bin holds exactly the ids, nothing else
    assert (tmp_path / "train.en-de.en.bin").stat().st_size == sum(map(len, seqs)) * np.dtype(dtype).itemsize


@pytest.mark.parametrize("vocab", [200, 60000, 100000])
def test_layout_is_readable_with_plain_numpy_memmap(tmp_path, vocab):
    """The documented .idx layout is all a reader needs."""
    seqs = sequences(vocab, n=9)  # odd count: offsets are padded to an 8-byte boundary
    prefix = tmp_path / "x"
    write(prefix, vocab, seqs)
    idx = (tmp_path / "x.idx").read_bytes()
    magic, version, code, count, total = struct.unpack("<8sIB3xQQ", idx[:32])
    assert magic == b"ATNMIDX\x00" and version == 1 and count == 9 and total == sum(map(len, seqs))
    dtype = {1: "<u1", 2: "<u2", 3: "<i4"}[code]
    sizes = np.memmap(tmp_path / "x.idx", dtype="<i4", mode="r", offset=32, shape=(count,))
    off_at = 32 + 4 * count + (4 if count % 2 else 0)
    assert off_at == offsets_start(count) and off_at % 8 == 0
    offsets = np.memmap(tmp_path / "x.idx", dtype="<i8", mode="r", offset=off_at, shape=(count,))
    data = np.memmap(tmp_path / "x.bin", dtype=dtype, mode="r")
    got = [data[o:o + n].tolist() for o, n in zip(offsets, sizes)]
    assert got == seqs
    assert len(idx) == off_at + 8 * count


def test_merge_equals_single_writer(tmp_path):
    seqs = sequences(1000, n=40)
    write(tmp_path / "whole", 1000, seqs)
    write(tmp_path / "p0", 1000, seqs[:13])
    write(tmp_path / "p1", 1000, [])
    write(tmp_path / "p2", 1000, seqs[13:])
    b = IndexedDatasetBuilder(str(tmp_path / "merged"), 1000)
    for p in ("p0", "p1", "p2"):
        b.merge(str(tmp_path / p))
    b.finalize()
    for ext in (".bin", ".idx"):
        assert (tmp_path / f"merged{ext}").read_bytes() == (tmp_path / f"whole{ext}").read_bytes()


def test_accepts_numpy_arrays_and_rejects_out_of_vocab_ids(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "a"), 10)
    b.add(np.array([1, 2, 9], dtype=np.int64))
    b.add([10])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        b.finalize()
    b.discard()
    assert not exists(str(tmp_path / "a"))
    assert list(tmp_path.iterdir()) == []  # the temp .bin is gone


def test_empty_dataset(tmp_path):
    write(tmp_path / "e", 50, [])
    ds = IndexedDataset(str(tmp_path / "e"))
    assert len(ds) == 0 and ds.sizes.tolist() == []


def test_pickle_reopens_instead_of_copying(tmp_path):
    seqs = sequences(300)
    write(tmp_path / "d", 300, seqs)
    ds = IndexedDataset(str(tmp_path / "d"))
    blob = pickle.dumps(ds)
    assert len(blob) < 500
    ds2 = pickle.loads(blob)
    assert [ds2[i].tolist() for i in range(len(ds2))] == seqs


def test_missing_and_corrupt_files_raise_user_errors(tmp_path):
    with pytest.raises(UserError, match=r"nope\.idx.*not found"):
        IndexedDataset(str(tmp_path / "nope"))
    write(tmp_path / "d", 300, sequences(300))
    idx = tmp_path / "d.idx"
    good = idx.read_bytes()

    idx.write_bytes(b"XXXXXXXX" + good[8:])
    with pytest.raises(UserError, match=r"d\.idx.*bad magic"):
        IndexedDataset(str(tmp_path / "d"))

    idx.write_bytes(good[:8] + struct.pack("<I", 99) + good[12:])
    with pytest.raises(UserError, match=r"d\.idx.*version 99"):
        IndexedDataset(str(tmp_path / "d"))

    idx.write_bytes(good[:-3])
    with pytest.raises(UserError, match=r"d\.idx.*truncated"):
        IndexedDataset(str(tmp_path / "d"))

    idx.write_bytes(good)
    binf = tmp_path / "d.bin"
    binf.write_bytes(binf.read_bytes()[:-4])
    with pytest.raises(UserError, match=r"d\.bin.*truncated"):
        IndexedDataset(str(tmp_path / "d"))

    idx.write_bytes(good[:HEADER.size - 1])
    with pytest.raises(UserError, match=r"d\.idx.*truncated"):
        IndexedDataset(str(tmp_path / "d"))
