"""Checkpoint files: names, pruning, contents loadable with weights_only=True, refusal of a different setup."""

import subprocess
import sys

import pytest
import torch
from helpers import TINY_MODEL, make_data_bin

from attnmt import checkpoint as ckpts
from attnmt.cli import main


def _train(data, save_dir, *extra):
    main(["train", str(data), *TINY_MODEL, "--save-dir", str(save_dir), "--max-tokens", "256", "--lr", "2e-3",
          "--warmup-updates", "5", "--progress", "none", *extra])


def _names(d):
    return sorted(p.name for p in d.iterdir() if p.suffix == ".pt")


def test_names_and_pruning(tmp_path):
    data = make_data_bin(tmp_path / "bin")  # 8 batches per epoch at --max-tokens 256
    ck = tmp_path / "ck"
    _train(data, ck, "--max-epoch", "3", "--save-interval-updates", "5", "--keep-interval-updates", "2",
           "--keep-last-epochs", "2")
    # interval checkpoints at updates 5, 10, 15, 20 (epochs end at 8, 16, 24): the newest two are kept
    assert _names(ck) == ["checkpoint2.pt", "checkpoint3.pt", "checkpoint_2_15.pt", "checkpoint_3_20.pt",
                          "checkpoint_best.pt", "checkpoint_last.pt"]
    last = ckpts.load(ck / "checkpoint_last.pt")
    assert last["train"]["num_updates"] == 24 and last["train"]["epoch"] == 3
    assert ckpts.load(ck / "checkpoint_3_20.pt")["train"]["num_updates"] == 20
    assert ckpts.load(ck / "checkpoint2.pt")["train"]["num_updates"] == 16
    best = ckpts.load(ck / "checkpoint_best.pt")["train"]["best"]
    assert best["metric"] == "loss" and best["value"] is not None


def test_no_epoch_checkpoints(tmp_path):
    data = make_data_bin(tmp_path / "bin")
    ck = tmp_path / "ck"
    _train(data, ck, "--max-epoch", "2", "--no-epoch-checkpoints")
    assert _names(ck) == ["checkpoint_best.pt", "checkpoint_last.pt"]


def test_contents_follow_the_contract_and_load_with_weights_only(tmp_path):
    data = make_data_bin(tmp_path / "bin")
    (data / "spm.model").write_bytes(b"\x00\x01fake-sentencepiece-bytes")
    ck = tmp_path / "ck"
    _train(data, ck, "--max-update", "3")
    c = torch.load(ck / "checkpoint_last.pt", map_location="cpu", weights_only=True)
    assert c["format"] == "attnmt-checkpoint" and c["version"] == 1
    assert c["model_name"] == "transformer" and c["arch"] == "transformer_small"
    assert c["model_config"]["encoder_embed_dim"] == 16 and c["model_config"]["share_all_embeddings"] is True
    assert all(v.dtype == torch.float32 for v in c["model"].values() if v.is_floating_point())
    d = c["data"]
    assert d["source_lang"] == "en" and d["target_lang"] == "de" and d["joint_dictionary"] is True
    assert d["src_dict"]["symbols"][:4] == ["<s>", "<pad>", "</s>", "<unk>"]
    assert len(d["src_dict_sha256"]) == 64 and d["src_dict_sha256"] == d["tgt_dict_sha256"]
    assert d["bpe_model"].dtype == torch.uint8 and bytes(d["bpe_model"].tolist()) == (data / "spm.model").read_bytes()
    assert d["tokenizer"] == "none" and d["lowercase"] is False
    t = c["train"]
    assert t["num_updates"] == 3 and t["epoch"] == 1
    assert t["iterator"]["epoch"] == 1 and t["iterator"]["offset"] == 3
    assert set(t["rng"]) >= {"python", "numpy", "torch"}
    assert "state" in t["optimizer"] and t["lr_scheduler"] == {"start_update": 0, "start_time": 0.0}
    assert t["scaler"] is None
    assert t["criterion"] == "label_smoothed_cross_entropy" and t["criterion_config"] == {"label_smoothing": 0.1}
    assert t["optimizer_config"]["adam_betas"] == [0.9, 0.98]
    assert t["train_config"]["max_tokens"] == 256


def test_mismatched_config_on_resume_is_refused(tmp_path):
    data = make_data_bin(tmp_path / "bin")
    ck = tmp_path / "ck"
    _train(data, ck, "--max-update", "2")
    args = [sys.executable, "-m", "attnmt.cli", "train", str(data), *TINY_MODEL, "--encoder-layers", "2",
            "--save-dir", str(ck), "--max-update", "4", "--max-tokens", "256"]
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 1
    err = r.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "--encoder-layers: checkpoint 1, now 2" in err
    assert "--save-dir" in err and "--finetune-from" in err


def test_mismatched_dictionary_on_resume_is_refused(tmp_path, capsys):
    ck = tmp_path / "ck"
    _train(make_data_bin(tmp_path / "bin"), ck, "--max-update", "2")
    other = make_data_bin(tmp_path / "bin2", extra_symbol="zzz")
    with pytest.raises(SystemExit) as e:
        _train(other, ck, "--max-update", "4")
    assert e.value.code == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("attnmt: error: ") and "source dictionary: checkpoint sha256" in err
    assert "different --save-dir" in err


def test_reset_flags_and_finetune(tmp_path):
    data = make_data_bin(tmp_path / "bin")
    ck = tmp_path / "ck"
    _train(data, ck, "--max-update", "4")
    before = ckpts.load(ck / ckpts.LAST)["train"]["train_time"]
    # --reset-optimizer: same update count, fresh Adam moments (step counters restart)
    _train(data, ck, "--max-update", "5", "--reset-optimizer", "--reset-lr-scheduler", "--reset-dataloader")
    t = ckpts.load(ck / ckpts.LAST)["train"]
    assert t["num_updates"] == 5
    assert all(float(s["step"]) == 1.0 for s in t["optimizer"]["state"].values())
    assert t["lr_scheduler"] == {"start_update": 4, "start_time": before}  # the schedule restarted there
    assert t["iterator"]["epoch"] == 1 and t["iterator"]["offset"] == 1
    # --finetune-from: weights only, in a new save dir
    ft = tmp_path / "ft"
    _train(data, ft, "--max-update", "1", "--finetune-from", str(ck / ckpts.LAST))
    a = ckpts.load(ck / ckpts.LAST)["model"]
    b = ckpts.load(ft / ckpts.LAST)["model"]
    assert ckpts.load(ft / ckpts.LAST)["train"]["num_updates"] == 1
    # update 1 of a fresh warm-up runs at lr 0: the weights are exactly the fine-tuned-from ones
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_restore_file_with_reset_optimizer_counts_updates_from_zero_as_fairseq_does(tmp_path):
    """fairseq's fine-tuning idiom, --restore-file X --reset-optimizer: the update count (kept with the optimizer's
    state in fairseq) starts again at 0, so --max-update counts the new run's updates; a restart of that run
    resumes its own progress. Without --reset-optimizer the count goes on from X's."""
    data = make_data_bin(tmp_path / "bin")
    base = tmp_path / "base"
    _train(data, base, "--max-update", "4")
    ft = tmp_path / "ft"
    _train(data, ft, "--restore-file", str(base / ckpts.LAST), "--reset-optimizer", "--max-update", "3")
    t = ckpts.load(ft / ckpts.LAST)["train"]
    assert t["num_updates"] == 3
    assert all(float(s["step"]) == 3.0 for s in t["optimizer"]["state"].values())  # 3 updates of a fresh Adam
    assert t["lr_scheduler"]["start_update"] == 0
    _train(data, ft, "--restore-file", str(base / ckpts.LAST), "--reset-optimizer", "--max-update", "5")
    t = ckpts.load(ft / ckpts.LAST)["train"]
    assert t["num_updates"] == 5 and all(float(s["step"]) == 5.0 for s in t["optimizer"]["state"].values())
    go_on = tmp_path / "go_on"
    _train(data, go_on, "--restore-file", str(base / ckpts.LAST), "--max-update", "6")
    t = ckpts.load(go_on / ckpts.LAST)["train"]
    assert t["num_updates"] == 6 and all(float(s["step"]) == 6.0 for s in t["optimizer"]["state"].values())


def test_a_checkpoint_of_todays_format_loads_after_a_format_change(tmp_path, monkeypatch):
    """A format change raises VERSION and registers an upgrade step; a checkpoint written before it (today's
    format, version 1) is upgraded as it is read, with the same weights; a file newer than this attnmt, or one
    whose version has no upgrade step, is a one-line error."""
    data = make_data_bin(tmp_path / "bin")
    ck = tmp_path / "ck"
    _train(data, ck, "--max-update", "3")
    path = ck / "checkpoint_last.pt"
    before = ckpts.load(path)

    def move_the_language_pair(c):  # a made-up version 2: the pair moves out of the data section
        c["data"] = dict(c["data"])
        c["pair"] = [c["data"].pop("source_lang"), c["data"].pop("target_lang")]
        return c

    monkeypatch.setattr(ckpts, "VERSION", 2)
    monkeypatch.setattr(ckpts, "UPGRADES", {})
    ckpts.upgrade_from(1)(move_the_language_pair)
    after = ckpts.load(path)
    assert after["version"] == 2 and after["pair"] == ["en", "de"] and "source_lang" not in after["data"]
    assert after["model"].keys() == before["model"].keys()
    assert all(torch.equal(after["model"][k], before["model"][k]) for k in before["model"])

    monkeypatch.setattr(ckpts, "UPGRADES", {})
    with pytest.raises(ckpts.UserError, match="version 1 has no upgrade to version 2"):
        ckpts.load(path)
    monkeypatch.setattr(ckpts, "VERSION", 1)
    newer = tmp_path / "newer.pt"
    torch.save(dict(before, version=2), newer)
    with pytest.raises(ckpts.UserError, match="version 2 is not supported .* versions 1 to 1"):
        ckpts.load(newer)
