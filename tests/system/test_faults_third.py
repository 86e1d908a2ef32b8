"""Fault injection, third round: directory outputs replaced whole and only where attnmt wrote them, lock files that
are symbolic links, damaged and non-finite checkpoints (attnmt's and fairseq's), hostile fairseq checkpoints,
generate's plain output, the kernel cache's held locks and dead builds, forked processes, the service's second
signal, hostile training logs.

``benchmarks/fault_cases.py`` runs the same kinds on a real pipeline and prints them as a table.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_faults import attnmt, ckpt, data, one_line_error  # noqa: F401 (ckpt, data: the fixtures of test_faults.py)

from attnmt import checkpoint
from attnmt.errors import UserError
from attnmt.fileio import MARKER, exclusive, write_directory


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------------ directory outputs


def _writer(files: dict[str, str]):
    def write(tmp: Path) -> None:
        for name, text in files.items():
            (tmp / name).write_text(text)
    return write


def test_force_replaces_what_an_earlier_export_wrote_and_never_a_users_directory(tmp_path):
    out = tmp_path / "model"
    write_directory(out, False, _writer({"model.bin": "1"}))
    assert (out / MARKER).is_file() and (out / "model.bin").read_text() == "1"
    write_directory(out, True, _writer({"model.bin": "2"}))
    assert (out / "model.bin").read_text() == "2"

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    with pytest.raises(UserError, match=r"mine: --force replaces only a directory that attnmt export wrote, and it "
                                        r"holds notes.txt"):
        write_directory(mine, True, _writer({"model.bin": "x"}))
    assert (mine / "notes.txt").read_text() == "precious" and not (mine / "model.bin").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model"]  # no temp directory left


def test_force_recognises_an_export_written_before_markers_by_its_files(tmp_path):
    old = tmp_path / "ct2"
    old.mkdir()
    for name in ("model.bin", "config.json", "shared_vocabulary.json"):
        (old / name).write_text("old")
    known = {"model.bin", "config.json", "shared_vocabulary.json"}.__contains__
    write_directory(old, True, _writer({"model.bin": "new"}), known=known)
    assert (old / "model.bin").read_text() == "new" and not (old / "config.json").exists()


def test_force_refuses_the_working_directory_and_those_above_it(tmp_path, monkeypatch):
    here = tmp_path / "here" / "deeper"
    here.mkdir(parents=True)
    write_directory(tmp_path / "here" / "x", False, _writer({"a": "1"}))
    monkeypatch.chdir(here)
    with pytest.raises(UserError, match=r"^\.: --output-dir is the working directory, which cannot be replaced"):
        write_directory(".", True, _writer({"a": "1"}))
    with pytest.raises(UserError, match="a directory above the working directory"):
        write_directory("..", True, _writer({"a": "1"}))
    assert here.is_dir()


def test_a_symlinked_output_stays_a_link_and_a_dangling_one_is_named(tmp_path):
    real = tmp_path / "real"
    write_directory(real, False, _writer({"model.bin": "1"}))
    link = tmp_path / "link"
    link.symlink_to(real)
    write_directory(link, True, _writer({"model.bin": "2"}))
    assert link.is_symlink() and (real / "model.bin").read_text() == "2"
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError) as e:
        write_directory(dangling, False, _writer({"a": "1"}))
    assert str(e.value).startswith(f"{dangling}: --output-dir is a symbolic link to {tmp_path / 'nowhere'}, which "
                                   f"does not exist")


def test_a_failed_write_leaves_the_old_directory_whole(tmp_path):
    out = tmp_path / "model"
    write_directory(out, False, _writer({"model.bin": "old", "vocab.txt": "old"}))

    def half(tmp: Path) -> None:
        (tmp / "vocab.txt").write_text("new")
        raise OSError(28, "No space left on device")

    with pytest.raises(UserError, match="No space left on device"):
        write_directory(out, True, half)
    assert (out / "model.bin").read_text() == "old" and (out / "vocab.txt").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_export_force_over_a_users_directory_and_the_working_directory(ckpt, tmp_path):
    pytest.importorskip("ctranslate2")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("precious")
    r = attnmt("export", "--path", str(ckpt), "--to", "ctranslate2", "--output-dir", str(mine), "--force")
    one_line_error(r, str(mine), "notes.txt")
    assert (mine / "notes.txt").read_text() == "precious"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "export", "--path", str(ckpt), "--to", "ctranslate2",
                        "--output-dir", ".", "--force"], cwd=mine, capture_output=True, text=True)
    one_line_error(r, "the working directory")


# ------------------------------------------------------------------------------------------------ lock files


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    lock = tmp_path / ".attnmt.lock"
    lock.symlink_to(victim)
    with pytest.raises(UserError, match=r"\.attnmt\.lock: is a symbolic link"), exclusive(lock, "x", "y"):
        pass
    assert victim.read_text() == "precious\n" and lock.is_symlink()


# ------------------------------------------------------------------------------------------------ checkpoints


def _resave(src: Path, dst: Path, edit) -> Path:
    ck = torch.load(src, weights_only=True)
    edit(ck)
    torch.save(ck, dst)
    return dst


def test_a_checkpoint_with_nan_weights_is_refused_naming_the_parameter(ckpt, tmp_path):
    bad = _resave(ckpt, tmp_path / "nan.pt",
                  lambda ck: ck["model"]["decoder.layers.0.ffn.fc1.weight"].view(-1)[:3].fill_(float("nan")))
    with pytest.raises(UserError, match=r"nan.pt: the weights hold NaN or infinite values \(3 of [\d,]+ in "
                                        r"decoder.layers.0.ffn.fc1.weight\)"):
        checkpoint.load(bad)
    r = attnmt("translate", "--path", str(bad), stdin="w1 w2\n")
    one_line_error(r, "nan.pt", "NaN")
    assert r.stdout == ""


def test_a_checkpoint_with_flipped_bytes_is_refused_by_its_checksums(ckpt, tmp_path):
    data = bytearray(ckpt.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 200):
        data[i] ^= 0x5A
    bad = tmp_path / "flipped.pt"
    bad.write_bytes(bytes(data))
    with pytest.raises(UserError, match=r"flipped.pt: the file is damaged \(.*\); it was corrupted on disk or in a "
                                        r"copy"):
        checkpoint.load(bad)


def _fairseq(ck_path: Path, dst: Path, edit=None) -> Path:
    from attnmt.interop.fairseq import SAME_FIELDS, convert_to_fairseq

    ck = checkpoint.load(ck_path)
    cfg = ck["model_config"]
    options = {k: cfg[k] for k in SAME_FIELDS} | {"arch": "transformer", "encoder_learned_pos": True,
                                                  "decoder_learned_pos": True, "activation_fn": "relu"}
    fs = {"args": None, "cfg": {"model": options, "task": {"source_lang": "en", "target_lang": "de"}},
          "model": convert_to_fairseq(ck, pad=1)}
    if edit:
        fs = edit(fs) or fs
    torch.save(fs, dst)
    return dst


def _set(path: str, value):
    def edit(fs):
        *parents, last = path.split("/")
        d = fs
        for p in parents:
            d = d[p]
        if value is KeyError:
            d.pop(last)
        else:
            d[last] = value
    return edit


@pytest.mark.parametrize("edit, says", [
    (_set("model/encoder.embed_tokens.weight", KeyError), "lacks the weights encoder.embed_tokens.weight"),
    (_set("model/encoder.embed_tokens.weight", [[0.0, 1.0]]), "the weight 'encoder.embed_tokens.weight' is a list"),
    (lambda fs: {"args": dict(fs["cfg"]["model"]), "model": fs["model"]}, None),  # args as a dict: the options
    (lambda fs: {"args": 7, "model": fs["model"]}, "its 'args' is a int"),
    (_set("cfg/model", [1, 2]), "its 'cfg.model' is a list"),
    (lambda fs: [1, 2, 3], "not a fairseq checkpoint"),
    (_set("cfg/model/encoder_layers", -2), "its stored option encoder_layers = '-2' is not an integer from 1"),
    (_set("cfg/model/encoder_layers", "six"), "its stored option encoder_layers = 'six' is not an integer"),
    (_set("cfg/model/encoder_layers", 3), "but the file holds the weights of 1 encoder layers"),
    (_set("cfg/model/decoder_embed_dim", 2**40), "its stored option decoder_embed_dim"),
    (_set("cfg/model/dropout", 7.0), "its stored option dropout = '7.0' is not a probability"),
])
def test_import_fairseq_names_the_file_for_each_hostile_field(ckpt, data, tmp_path, edit, says):
    from attnmt.interop.fairseq import import_checkpoint

    fs = _fairseq(ckpt, tmp_path / "fs.pt", edit)
    try:
        import_checkpoint(fs, data / "dict.en.txt", data / "dict.de.txt", "en", "de")
    except UserError as e:
        assert says is not None and str(e).startswith(f"{fs}: ") and says in str(e), str(e)
        assert "--encoder-layers" not in str(e) and "--decoder-embed-dim" not in str(e)
    else:
        assert says is None


def test_import_fairseq_refuses_empty_damaged_and_nan_files(ckpt, data, tmp_path):
    from attnmt.interop.fairseq import import_checkpoint, read_checkpoint

    empty = tmp_path / "empty.pt"
    empty.write_bytes(b"")
    with pytest.raises(UserError, match="empty.pt: cannot be read as a fairseq checkpoint"):
        read_checkpoint(empty)
    fs = _fairseq(ckpt, tmp_path / "fs.pt")
    raw = bytearray(fs.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 200):
        raw[i] ^= 0x5A
    (tmp_path / "flipped.pt").write_bytes(bytes(raw))
    with pytest.raises(UserError, match="flipped.pt: the file is damaged"):
        read_checkpoint(tmp_path / "flipped.pt")
    def infinite(f):
        f["model"]["decoder.layers.0.fc1.weight"].fill_(math.inf)

    nan = _fairseq(ckpt, tmp_path / "nan.pt", infinite)
    with pytest.raises(UserError, match="nan.pt: the weights hold NaN or infinite values .* in "
                                        "decoder.layers.0.ffn.fc1.weight.*import an earlier checkpoint"):
        import_checkpoint(nan, data / "dict.en.txt", data / "dict.de.txt", "en", "de")


def test_import_fairseq_refuses_to_write_over_its_input(ckpt, data, tmp_path):
    fs = _fairseq(ckpt, tmp_path / "fs.pt")
    before = fs.read_bytes()
    r = attnmt("import-fairseq", str(fs), "--data", str(data), "-o", str(fs))
    one_line_error(r, "--output is the fairseq checkpoint being imported")
    assert fs.read_bytes() == before


def test_read_checkpoint_takes_args_as_a_namespace_or_a_dict(ckpt, tmp_path):
    from attnmt.interop.fairseq import read_checkpoint

    state = _fairseq(ckpt, tmp_path / "a.pt")
    model = torch.load(state, weights_only=True)["model"]
    for args in (argparse.Namespace(arch="transformer", encoder_layers=1), {"arch": "transformer",
                                                                            "encoder_layers": 1}):
        torch.save({"args": args, "model": model}, tmp_path / "b.pt")
        options, _ = read_checkpoint(tmp_path / "b.pt")
        assert options["arch"] == "transformer" and options["encoder_layers"] == 1


# ------------------------------------------------------------------------------------------------ generate


def test_generate_fairseq_plain_writes_one_line_per_sentence_and_the_bleu_line_to_stderr(ckpt, data, tmp_path):
    out = tmp_path / "out.txt"
    r = attnmt("generate", str(data), "--path", str(ckpt), "--gen-subset", "valid", "--fairseq", "--format", "plain",
               "--max-len-b", "5", "--output", str(out))
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 8
    assert "Generate valid with beam=5: BLEU4 = " in r.stderr
    r = attnmt("generate", str(data), "--path", str(ckpt), "--gen-subset", "valid", "--fairseq", "--max-len-b", "5")
    assert r.stdout.splitlines()[-1].startswith("Generate valid with beam=5: BLEU4 = ")


def test_skip_invalid_size_names_the_lines_it_skips(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    lines = ["w1 w2"] * 4
    lines[2] = " ".join(["w3"] * 3000)
    src.write_text("\n".join(lines) + "\n")
    r = attnmt("generate", "--input", str(src), "--path", str(ckpt), "--skip-invalid-size-inputs-valid-test",
               "--max-len-b", "3")
    assert r.returncode == 0, r.stderr
    assert f"skipped (--skip-invalid-size-inputs-valid-test): line 3 of {src} (ids 2)" in r.stderr
    assert len(r.stdout.splitlines()) == 3


# ------------------------------------------------------------------------------------------------ kernel cache


def test_a_held_build_lock_is_waited_for_until_the_limit_then_said(tmp_path):
    from attnmt.backends import native

    lock = tmp_path / "kernels-x.lock"
    fd = os.open(lock, os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        with pytest.raises(native.Busy, match="another process has held the build lock"), \
                native._locked(lock, time.monotonic() + 0.5):
            pass
        assert 0.4 < time.monotonic() - start < 5
    finally:
        os.close(fd)
    with native._locked(lock, time.monotonic()):  # free: taken at once, whatever the deadline
        pass


def test_temp_files_of_dead_builds_are_removed_and_live_ones_kept(tmp_path):
    from attnmt.backends import native

    dead = tmp_path / f".kernels-ab.so.{dead_pid()}.x1.tmp"
    live = tmp_path / f".kernels-ab.so.{os.getpid()}.x2.tmp"
    old = tmp_path / "tmpabc.so.tmp"
    recent = tmp_path / "tmpdef.so.tmp"
    for p in (dead, live, old, recent):
        p.write_bytes(b"half")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    native.remove_dead_builds(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, recent.name])


# ------------------------------------------------------------------------------------------------ processes


FORK = """
import os, sys
from attnmt import Translator
t = Translator(sys.argv[1], threads=2, max_len_b=5)
print(t.translate("w1 w2 w3"), flush=True)
pid = os.fork()
if pid == 0:
    print(t.translate("w4 w5"), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def test_a_process_forked_from_one_holding_a_translator_translates(ckpt, tmp_path):
    script = tmp_path / "fork.py"
    script.write_text(FORK)
    r = subprocess.run([sys.executable, str(script), str(ckpt)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.splitlines()) == 2
    assert r.stderr.count("forked from one that computed on 2 threads, and computes on one") == 1


@pytest.mark.slow
@pytest.mark.parametrize("first", [signal.SIGINT, signal.SIGTERM])
def test_serve_stops_without_a_traceback_on_a_second_signal(ckpt, first):
    pytest.importorskip("uvicorn")
    for gap in (0.0, 0.02, 0.05):
        p = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "serve", "--path", str(ckpt), "--port", "0"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        lines = []
        for line in p.stderr:
            lines.append(line)
            if "serving" in line:
                break
        p.send_signal(first)
        time.sleep(gap)
        p.send_signal(signal.SIGINT)
        err = "".join(lines) + p.communicate(timeout=60)[1]
        assert p.returncode == 0, err
        assert "Traceback" not in err and "CancelledError" not in err, err
        assert "attnmt serve: stopped by" in err


# ------------------------------------------------------------------------------------------------ training logs


@pytest.mark.parametrize("line, says", [
    ("[" * 100_000 + "]" * 100_000, "not a record of attnmt train (nested too deeply)"),
    ('{"type": "train", "num_updates": ' + "9" * 5000 + ', "loss": 1}', "not a record of attnmt train (Exceeds"),
    ('{"type": "train", "num_updates": 3, "loss": "' + "x" * 5_000_000 + '"}', "a line of 5,000,0"),
    ('{"type": "train", "num_updates": 3, "loss": "' + "x" * 5_000 + '"}', "without a numeric 'loss' (got 'xxx"),
    ('{"type": "train", "num_updates": ' + "9" * 100 + '.5e9999, "loss": 1}', "without an integer 'num_updates'"),
])
def test_plot_refuses_hostile_log_lines_in_one_short_line(tmp_path, line, says):
    from attnmt.plots import read_train_log

    log = tmp_path / "train.jsonl"
    log.write_text('{"type": "train", "num_updates": 1, "loss": 5.0}\n' + line + "\n")
    with pytest.raises(UserError) as e:
        read_train_log(log)
    assert str(e.value).startswith(f"{log}:2: ") and says in str(e.value), str(e.value)[:300]
    assert len(str(e.value)) < 400


def test_plot_draws_a_subset_named_with_a_lone_surrogate(tmp_path):
    pytest.importorskip("matplotlib")
    log = tmp_path / "train.jsonl"
    log.write_text(json.dumps({"type": "train", "num_updates": 1, "loss": 5.0}) + "\n"
                   + '{"type": "valid", "subset": "\\ud800", "num_updates": 1, "loss": 4.0}\n', encoding="utf-8")
    r = attnmt("plot", "curves", "--log", str(log), "--out", str(tmp_path / "c.png"))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "c.png").stat().st_size > 1000
