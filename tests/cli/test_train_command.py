"""``attnmt train`` end to end on tiny data: the loss falls, train.jsonl has the figures, errors are one line."""

import json
import subprocess
import sys

import pytest
import torch
from helpers import TINY_MODEL, make_data_bin, make_pairs

from attnmt.cli import main
from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDatasetBuilder


def _records(save_dir, kind):
    lines = (save_dir / "train.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["type"] == kind]


def test_short_run_loss_falls_and_jsonl_has_the_fields(tmp_path, capsys):
    data = make_data_bin(tmp_path / "bin", n_train=200, long_pairs=3)
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--max-source-positions", "32", "--max-target-positions", "32",
          "--save-dir", str(ck), "--max-tokens", "256", "--max-update", "120", "--lr", "3e-3",
          "--warmup-updates", "20", "--log-interval", "10", "--progress", "lines", "--threads", "1"])
    err = capsys.readouterr().err
    # start-up report: model size, effective batch, data sizes, skipped overlong pairs with examples
    assert "parameters" in err
    assert "effective batch = max-tokens x world size x update-freq = 256 x 1 x 1 = 256 padded tokens" in err
    assert "train: 200 pairs" in err and "valid: 24 pairs" in err
    assert "3 sentence(s) skipped (longer than the model's max positions (source 32, target 32)" in err
    assert "line index(es) 200, 201, 202" in err
    assert "loss" in err and "wps" in err and "eta" in err  # plain progress lines (not a TTY)

    train = _records(ck, "train")
    assert [r["num_updates"] for r in train] == list(range(10, 121, 10))
    for r in train:
        assert {"epoch", "loss", "nll_loss", "ppl", "lr", "wps", "ups", "gnorm", "eta_s"} <= set(r)
        assert r["ppl"] == pytest.approx(2 ** r["nll_loss"])
    assert train[-1]["loss"] < train[0]["loss"] - 1.0  # the smoothed training loss falls
    valid = _records(ck, "valid")
    assert valid and {"loss", "nll_loss", "ppl", "best_loss", "num_updates"} <= set(valid[0])
    assert valid[-1]["loss"] < valid[0]["loss"]
    summary = _records(ck, "summary")[-1]
    assert summary["num_updates"] == 120 and summary["stop_reason"] == "max_update"
    assert summary["best"] == min(v["loss"] for v in valid)


@pytest.mark.precision
def test_automatic_precision_run_and_max_epoch(tmp_path):
    """--precision auto: bf16 (fused oneDNN layers) where the CPU runs it natively, fp32 elsewhere."""
    from conftest import NATIVE_BF16

    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--max-epoch", "2",
          "--precision", "auto", "--progress", "none", "--update-freq", "2", "--clip-norm", "0.5"])
    start = _records(ck, "start")[0]
    assert start["precision"] == ("bf16" if NATIVE_BF16 else "fp32") and start["hardware"], start
    s = _records(ck, "summary")[-1]
    assert s["stop_reason"] == "max_epoch" and s["epoch"] == 2
    c = torch.load(ck / "checkpoint_last.pt", weights_only=True)
    assert c["train"]["epoch"] == 2 and c["train"]["iterator"]["offset"] > 0  # the epoch's end
    assert all(v.dtype == torch.float32 for v in c["model"].values() if v.is_floating_point())


def test_patience_stops_early(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    # an lr below fp32 resolution leaves the weights (and the validation loss) exactly as they are
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--max-epoch", "20",
          "--lr", "1e-30", "--warmup-updates", "0", "--patience", "2", "--progress", "none"])
    s = _records(ck, "summary")[-1]
    assert s["stop_reason"] == "patience" and s["epoch"] == 3  # best at epoch 1, no improvement at 2 and 3


def _run_cli(*args):
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "train", *map(str, args)], capture_output=True, text=True)
    return r.returncode, r.stderr.strip()


@pytest.mark.parametrize("extra, message", [
    (["--fp16", "--cpu"], "--fp16 needs a CUDA GPU"),
    (["--label-smoothing", "0.2", "--criterion", "cross_entropy"],
     "--label-smoothing does not apply to the chosen components"),
    (["--warmup-updates", "10", "--lr-scheduler", "fixed"], "it is an option of lr scheduler inverse_sqrt"),
    (["--bf16", "--fp16"], "--bf16 and --fp16 exclude each other"),
    (["--bf16", "--precision", "fp16"], "--bf16 and --precision fp16 disagree"),
    (["--optimizer", "lamb"], "unknown optimizer 'lamb'; valid choices: adam"),
    (["--best-checkpoint-metric", "bleu"], "--best-checkpoint-metric bleu needs --eval-bleu"),
    (["--lr-scheduler", "polynomial_decay", "--total-num-update", "5", "--warmup-updates", "10"],
     "--total-num-update 5 must exceed --warmup-updates 10"),
    (["--rdrop-alpha", "5"], "--rdrop-alpha does not apply to the chosen components"),
    (["--criterion", "label_smoothed_cross_entropy_with_rdrop", "--rdrop-alpha", "-1"],
     "--rdrop-alpha -1.0 is negative; use 0 (off) or a positive weight such as 5"),
    (["--sampled-segmentations"], "needs the BPE-dropout segmentations of the training split (train_sample1, ...); "
     "preprocess with --bpe-dropout 0.1, or train without --sampled-segmentations"),
])
def test_bad_options_are_one_line_errors(tmp_path, extra, message):
    data = make_data_bin(tmp_path / "bin", n_train=16)
    code, err = _run_cli(data, *TINY_MODEL, "--save-dir", tmp_path / "ck", "--max-update", "1", *extra)
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("attnmt: error: ") and message in err, err


def test_polynomial_decay_ends_at_max_update_unless_told(tmp_path, capsys):
    """fairseq's default: --total-num-update is --max-update; the learning rate reaches 0 at the last update."""
    data = make_data_bin(tmp_path / "bin", n_train=64)
    code, err = _run_cli(data, *TINY_MODEL, "--save-dir", tmp_path / "none", "--lr-scheduler", "polynomial_decay")
    assert code == 1 and err == ("attnmt: error: --lr-scheduler polynomial_decay decays to its end over a known "
                                 "number of updates: give --total-num-update N or --max-update N"), err
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "128", "--max-update", "20",
          "--lr-scheduler", "polynomial_decay", "--lr", "1e-3", "--warmup-updates", "4", "--log-interval", "4",
          "--progress", "none", "--no-save"])
    lrs = {r["num_updates"]: r["lr"] for r in _records(ck, "train")}
    assert lrs[4] == pytest.approx(1e-3) and lrs[12] == pytest.approx(5e-4) and lrs[20] == 0.0, lrs


def test_polynomial_decay_with_total_train_minutes_ends_when_the_clock_does(tmp_path):
    """--total-train-minutes: the training clock moves the decay on when it is ahead of the update count; here the
    minutes (12 ms) are up long before update 20 of a decay planned for 1,000."""
    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "128", "--max-update", "20",
          "--lr-scheduler", "polynomial_decay", "--lr", "1e-3", "--total-num-update", "1000",
          "--total-train-minutes", "0.0002", "--log-interval", "4", "--progress", "none", "--no-save"])
    lrs = {r["num_updates"]: r["lr"] for r in _records(ck, "train")}
    assert all(lr <= 1e-3 * (1 - n / 1000) for n, lr in lrs.items()), lrs  # never behind the update count
    assert lrs[20] == 0.0 and _records(ck, "summary")[-1]["lr"] == 0.0, lrs


def test_rdrop_run_learns_and_its_checkpoint_resumes_it(tmp_path):
    """R-Drop from the command line (fairseq's criterion and option names): the loss falls, the checkpoint records
    the criterion, and a resumed run goes on with it."""
    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    args = ["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--lr", "3e-3",
            "--warmup-updates", "10", "--log-interval", "10", "--progress", "none", "--threads", "1",
            "--criterion", "label_smoothed_cross_entropy_with_rdrop", "--rdrop-alpha", "5", "--dropout", "0.1"]
    main([*args, "--max-update", "60"])
    train = _records(ck, "train")
    assert train[-1]["loss"] < train[0]["loss"] - 1.0
    c = torch.load(ck / "checkpoint_last.pt", weights_only=True)
    assert c["train"]["criterion"] == "label_smoothed_cross_entropy_with_rdrop"
    assert c["train"]["criterion_config"] == {"label_smoothing": 0.1, "rdrop_alpha": 5.0}
    main([*args, "--max-update", "70"])
    assert _records(ck, "summary")[-1]["num_updates"] == 70


def test_missing_data_bin_is_a_user_error(tmp_path):
    code, err = _run_cli(tmp_path / "nope", "--arch", "transformer_small", "--save-dir", tmp_path / "ck")
    assert code == 1 and "no such data directory" in err and len(err.splitlines()) == 1


def test_eval_bleu_picks_the_best_checkpoint(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--max-epoch", "2",
          "--progress", "none", "--eval-bleu", "--eval-bleu-max-sentences", "6", "--eval-bleu-beam", "2",
          "--eval-bleu-max-len-b", "3", "--best-checkpoint-metric", "bleu", "--maximize-best-checkpoint-metric"])
    valid = _records(ck, "valid")
    assert len(valid) == 2
    for r in valid:
        assert 0.0 <= r["bleu"] <= 100.0 and r["bleu_sentences"] == 6 and "best_bleu" in r
    best = torch.load(ck / "checkpoint_best.pt", weights_only=True)["train"]["best"]
    assert best["metric"] == "bleu" and best["maximize"] is True and best["value"] == max(r["bleu"] for r in valid)


def test_time_limits_stop_and_save(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=64)
    ck = tmp_path / "ck"
    # a tiny time budget: training stops after its first update; every update is past the save interval
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--max-epoch", "5",
          "--max-time-minutes", "1e-6", "--save-interval-minutes", "1e-6", "--progress", "none"])
    s = _records(ck, "summary")[-1]
    assert s["stop_reason"] == "max_time" and s["num_updates"] == 1
    assert (ck / "checkpoint_last.pt").exists()
    # the time already spent counts on resume: nothing more to do
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "256", "--max-epoch", "5",
          "--max-time-minutes", "1e-6", "--progress", "none"])
    assert _records(ck, "summary")[-1]["num_updates"] == 1


@pytest.mark.precision
def test_bf16_without_native_bf16_is_a_one_line_error(tmp_path, no_native_bf16):
    data = make_data_bin(tmp_path / "bin", n_train=16)
    code, err = _run_cli(data, *TINY_MODEL, "--save-dir", tmp_path / "ck", "--max-update", "1", "--bf16")
    assert code == 1 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert "--bf16: no native bf16 on this CPU (ATTNMT_CPU_BF16=0 is set)" in err and "--precision auto" in err, err
    assert not (tmp_path / "ck" / "checkpoint_last.pt").exists()


def test_sampled_segmentations_are_read_one_epoch_each_in_turn(tmp_path, capsys):
    """Epoch e trains on train_sample((e - 1) mod n + 1): here versions of 64 and 128 pairs, so the epochs
    alternate between the update counts of the two."""
    data = make_data_bin(tmp_path / "bin", n_train=64)
    d = Dictionary.load(data / "dict.en.txt")
    for k, pairs in ((1, make_pairs(64, 0)), (2, make_pairs(128, 7))):
        for lang, side in (("en", 0), ("de", 1)):
            b = IndexedDatasetBuilder(str(data / f"train_sample{k}.en-de.{lang}"), len(d))
            for p in pairs:
                b.add(d.encode_line(" ".join(p[side])))
            b.finalize()
    ck = tmp_path / "ck"
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(ck), "--max-tokens", "128", "--max-epoch", "4",
          "--sampled-segmentations", "--progress", "lines", "--no-save", "--threads", "1"])
    err = capsys.readouterr().err
    assert "data: 2 BPE-dropout segmentations of the training split in turn, the first: 64 pairs" in err
    ends = [r["num_updates"] for r in _records(ck, "valid")]
    per_epoch = [b - a for a, b in zip([0] + ends, ends)]
    assert len(per_epoch) == 4 and per_epoch[0] == per_epoch[2] and per_epoch[1] == per_epoch[3]
    assert per_epoch[1] > 1.5 * per_epoch[0]
