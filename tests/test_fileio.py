"""Atomic writes: the target is the old file or the complete new one, never a half-written one."""

from __future__ import annotations

import os

import pytest
import torch

from attnmt.fileio import atomic_open, atomic_torch_save


def test_atomic_open_replaces_the_file_and_leaves_no_temp(tmp_path):
    target = tmp_path / "sub" / "out.txt"
    with atomic_open(target) as f:
        f.write("new\n")
        assert not target.exists()  # nothing visible until the write completes
    assert target.read_text() == "new\n"
    assert os.listdir(target.parent) == ["out.txt"]
    assert oct(target.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_failed_write_keeps_the_old_file(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError), atomic_open(target) as f:
        f.write("half")
        raise RuntimeError("disk full")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["out.txt"]


def test_atomic_torch_save_round_trips(tmp_path):
    obj = {"w": torch.arange(6.0).view(2, 3), "n": 3}
    atomic_torch_save(obj, tmp_path / "x.pt")
    back = torch.load(tmp_path / "x.pt", weights_only=True)
    assert back["n"] == 3 and torch.equal(back["w"], obj["w"])


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
