"""Exact resume: N updates + restart + N updates == 2N updates straight, bitwise, through the CLI entry point."""

import pytest
import torch
from helpers import TINY_MODEL, make_data_bin

from attnmt import checkpoint as ckpts
from attnmt.cli import main


def _train(data, save_dir, max_update, *extra):
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(save_dir), "--max-tokens", "256",
          "--max-update", str(max_update), "--lr", "2e-3", "--warmup-updates", "5", "--log-interval", "3",
          "--progress", "none", "--seed", "3", *extra])


def _weights(save_dir):
    return ckpts.load(save_dir / ckpts.LAST)["model"]


@pytest.mark.parametrize("n, extra", [
    (5, ()),                                   # restart in the middle of epoch 1 (8 batches per epoch)
    (11, ("--update-freq", "2")),              # restart in the middle of epoch 3 with accumulation
    (8, ("--save-interval-updates", "3")),     # restart exactly at an epoch end, interval checkpoints
])
def test_restart_gives_bitwise_identical_weights(tmp_path, n, extra):
    data = make_data_bin(tmp_path / "bin")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(data, straight, 2 * n, *extra)
    _train(data, resumed, n, *extra)
    first = ckpts.load(resumed / ckpts.LAST)["train"]
    assert first["num_updates"] == n
    _train(data, resumed, 2 * n, *extra)
    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    sa = ckpts.load(straight / ckpts.LAST)["train"]
    sb = ckpts.load(resumed / ckpts.LAST)["train"]
    assert sa["num_updates"] == sb["num_updates"] == 2 * n
    assert sa["iterator"] == sb["iterator"]
    for k, v in sa["optimizer"]["state"].items():
        assert torch.equal(v["exp_avg_sq"], sb["optimizer"]["state"][k]["exp_avg_sq"])


def test_dropout_is_on_so_the_rng_state_matters(tmp_path):
    """Guard for the test above: without restoring RNG states the continuation would differ."""
    data = make_data_bin(tmp_path / "bin")
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(data, straight, 10)
    _train(data, resumed, 5)
    ck = ckpts.load(resumed / ckpts.LAST)
    ck["train"]["rng"]["torch"] = torch.manual_seed(12345).get_state()  # perturb the dropout RNG
    torch.save(ck, resumed / ckpts.LAST)
    _train(data, resumed, 10)
    a, b = _weights(straight), _weights(resumed)
    assert any(not torch.equal(a[k], b[k]) for k in a)
