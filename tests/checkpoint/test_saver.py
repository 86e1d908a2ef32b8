"""Checkpoints written in the background: the state of the update they were taken at, atomic, errors not lost."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from helpers import TINY_MODEL, make_data_bin

from attnmt import checkpoint as ckpts
from attnmt.backends.base import HostStaging
from attnmt.checkpoint.saver import CheckpointSaver, snapshot
from attnmt.cli import main
from attnmt.errors import UserError


def test_snapshot_is_the_state_at_save_time_and_keeps_ties(tmp_path):
    w = torch.randn(6, 4)
    state = {"model": {"embed": w, "out": w, "bias": torch.zeros(4)}, "train": {"step": torch.tensor(3), "n": 7,
                                                                                   "moments": [torch.ones(2)]}}
    saver = CheckpointSaver(tmp_path, HostStaging(), background=True)
    saver.save(state, ["checkpoint_last.pt", "checkpoint1.pt"])
    expected = w.clone()
    w.add_(1.0)  # training goes on while the file is written
    state["train"]["moments"][0].mul_(5)
    saver.close()
    for name in ("checkpoint_last.pt", "checkpoint1.pt"):
        got = torch.load(tmp_path / name, weights_only=True)
        assert torch.equal(got["model"]["embed"], expected) and got["train"]["n"] == 7
        assert torch.equal(got["train"]["moments"][0], torch.ones(2))
        assert got["model"]["embed"].data_ptr() == got["model"]["out"].data_ptr()  # one tensor, stored once


def test_staging_buffers_are_reused_from_save_to_save():
    staging = HostStaging()
    a = snapshot({"w": torch.randn(3, 3)}, staging)["w"]
    b = snapshot({"w": torch.randn(3, 3)}, staging)["w"]
    assert a.data_ptr() == b.data_ptr()


def test_a_failed_background_write_is_raised_at_the_next_save(tmp_path):
    target = tmp_path / "sd"
    target.write_text("a file where the checkpoint directory should be")
    saver = CheckpointSaver(target, HostStaging(), background=True)
    saver.save({"w": torch.ones(2)}, ["checkpoint_last.pt"])
    with pytest.raises((UserError, OSError)):
        saver.save({"w": torch.ones(2)}, ["checkpoint_last.pt"])
    saver.close()  # the error was reported once


def test_prune_runs_after_the_write(tmp_path):
    seen = []
    saver = CheckpointSaver(tmp_path, HostStaging(), background=True,
                            after_write=lambda: seen.append((tmp_path / "checkpoint_last.pt").exists()))
    saver.save({"w": torch.ones(2)}, ["checkpoint_last.pt"])
    saver.close()
    assert seen == [True]


def _train(data, save_dir, *extra):
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(save_dir), "--max-tokens", "256", "--max-update", "10",
          "--lr", "2e-3", "--warmup-updates", "5", "--save-interval-updates", "3", "--keep-interval-updates", "2",
          "--progress", "none", "--seed", "3", *extra])


def test_background_and_foreground_saves_write_the_same_checkpoints(tmp_path):
    data = make_data_bin(tmp_path / "bin")
    _train(data, tmp_path / "bg")
    _train(data, tmp_path / "fg", "--no-background-save")
    names = sorted(p.name for p in (tmp_path / "bg").glob("*.pt"))
    assert names == sorted(p.name for p in (tmp_path / "fg").glob("*.pt"))
    assert "checkpoint_1_3.pt" not in names  # pruned after the later interval saves
    for name in names:
        a, b = ckpts.load(tmp_path / "bg" / name), ckpts.load(tmp_path / "fg" / name)
        assert a["train"]["num_updates"] == b["train"]["num_updates"]
        for k in a["model"]:
            assert torch.equal(a["model"][k], b["model"][k]), (name, k)
        for k, v in a["train"]["optimizer"]["state"].items():
            assert torch.equal(v["exp_avg"], b["train"]["optimizer"]["state"][k]["exp_avg"]), (name, k)


WRITER = textwrap.dedent("""
    import sys, time, torch
    from attnmt import fileio
    from attnmt.backends.base import HostStaging
    from attnmt.checkpoint.saver import CheckpointSaver

    def stuck(fd):  # the data is written, the file not yet renamed over the old one: hang here
        print("writing", flush=True)
        time.sleep(600)

    fileio.os.fsync = stuck
    saver = CheckpointSaver(sys.argv[1], HostStaging(), background=True)
    saver.save({"w": torch.full((1000, 1000), 2.0)}, ["checkpoint_last.pt"])
    time.sleep(600)
""")


def test_a_crash_mid_write_leaves_the_previous_checkpoint(tmp_path):
    torch.save({"w": torch.ones(3)}, tmp_path / "checkpoint_last.pt")
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert torch.equal(torch.load(tmp_path / "checkpoint_last.pt", weights_only=True)["w"], torch.ones(3))
    partial = list(tmp_path.glob(".checkpoint_last.pt.*.tmp"))
    assert len(partial) == 1  # what the next run's start removes
    assert ckpts.remove_partial_files(tmp_path) == partial


def test_the_run_waits_for_its_last_write(tmp_path, monkeypatch):
    """A slow disk: the command returns only once the final checkpoint is complete."""
    from attnmt import checkpoint

    real = checkpoint.save_as

    def slow(state, save_dir, names):
        time.sleep(0.3)
        return real(state, save_dir, names)

    monkeypatch.setattr(checkpoint, "save_as", slow)
    data = make_data_bin(tmp_path / "bin")
    _train(data, tmp_path / "run")
    assert ckpts.load(tmp_path / "run" / ckpts.LAST)["train"]["num_updates"] == 10
