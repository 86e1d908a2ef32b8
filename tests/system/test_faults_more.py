"""Fault injection, second round: option values, locks, killed writers' leftovers, resumes after a kill, outputs
that are not regular files, closed or non-UTF-8 standard streams, hostile checkpoints, plugins, foreign ids.

Each case runs the command as a user does (its own process) and asserts what the user sees and what is left on
disk; ``benchmarks/fault_cases.py`` runs the same kinds on a real pipeline and prints them as a table.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from test_faults import TRAIN, attnmt, ckpt, data, one_line_error  # noqa: F401 (ckpt, data: the fixtures of test_faults.py)


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# ------------------------------------------------------------------------------------------------ option values


@pytest.mark.parametrize("option, value", [
    ("--lr", "nan"), ("--lr", "inf"), ("--adam-eps", "nan"), ("--weight-decay", "nan"), ("--seed", "-1"),
    ("--seed", str(2**70)), ("--clip-norm", "nan"), ("--warmup-init-lr", "nan"), ("--max-time-minutes", "nan"),
    ("--save-interval-minutes", "nan"), ("--required-batch-size-multiple", "-8"), ("--eval-bleu-beam", "0"),
    ("--eval-bleu-lenpen", "nan"), ("--encoder-ffn-embed-dim", str(2**40))])
def test_train_refuses_a_value_out_of_range_before_any_work(data, tmp_path, option, value):
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(tmp_path / "ck"), "--max-update", "1", "--eval-bleu",
               option, value)
    one_line_error(r, option, value)
    assert not (tmp_path / "ck" / "train.jsonl").exists()


@pytest.mark.parametrize("options, named", [
    (["--max-len-a", "nan"], "--max-len-a"), (["--max-len-a", "inf"], "--max-len-a"), (["--unkpen", "nan"], "--unkpen"),
    (["--sampling", "--temperature", "nan"], "--temperature"), (["--sampling", "--temperature", "inf"], "--temperature"),
    (["--threads", str(10**20)], "--threads"), (["--beam", "20000"], "--beam"), (["--min-len", "100000"], "--min-len"),
    (["--search", "beam", "--sampling"], "--sampling")])
def test_generate_refuses_values_that_would_silently_change_the_output(ckpt, tmp_path, options, named):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3\n")
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--quiet", *options)
    one_line_error(r, named)
    assert r.stdout == ""


def test_a_valid_range_is_still_accepted(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3\n")
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--quiet", "--beam", "1", "--max-len-a", "0",
               "--max-len-b", "5", "--unkpen", "-1.5")
    assert r.returncode == 0, r.stderr


# ------------------------------------------------------------------------------------------------ locks


def test_a_second_training_run_into_the_same_save_dir_is_refused_and_the_first_goes_on(data, tmp_path):
    save = tmp_path / "ck"
    first = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "train", str(data), *TRAIN, "--save-dir", str(save),
                              "--max-update", "300", "--save-interval-updates", "5"],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (save / "train.jsonl").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        second = attnmt("train", str(data), *TRAIN, "--save-dir", str(save), "--max-update", "300")
        one_line_error(second, str(save), "in use by attnmt train", f"pid {first.pid}")
    finally:
        _, err = first.communicate(timeout=300)
    assert first.returncode == 0 and "Traceback" not in err, err
    records = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines()]
    assert [r["type"] for r in records].count("start") == 1


def test_a_lock_left_by_a_killed_run_blocks_nothing(data, tmp_path):
    save = tmp_path / "ck"
    save.mkdir()
    (save / ".attnmt.lock").write_text(json.dumps({"pid": dead_pid(), "command": "train x"}))
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(save), "--max-update", "1")
    assert r.returncode == 0, r.stderr


def test_preprocess_into_a_destdir_in_use_is_refused(tmp_path):
    from attnmt.fileio import exclusive

    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("a b c\nd e f\n")
    dest = tmp_path / "out"
    with exclusive(tmp_path / ".out.lock", f"--destdir {dest}", "wait"):
        r = attnmt("preprocess", "-q", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--destdir",
                   str(dest))
    one_line_error(r, "--destdir", "in use by")
    assert not dest.exists()
    r = attnmt("preprocess", "-q", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--destdir",
               str(dest))
    assert r.returncode == 0 and (dest / "preprocess.json").exists(), r.stderr


# ------------------------------------------------------------------------------------------------ leftovers


def test_killed_writers_temp_files_are_removed_and_live_ones_kept(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2\n")
    dead = tmp_path / f".out.txt.{dead_pid()}.abc.tmp"
    live = tmp_path / f".out.txt.{os.getpid()}.abc.tmp"  # this process: alive
    dead.write_text("half")
    live.write_text("half")
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--output", str(tmp_path / "out.txt"), "--quiet")
    assert r.returncode == 0, r.stderr
    assert not dead.exists() and live.exists() and (tmp_path / "out.txt").read_text().count("\n") == 1


def test_a_killed_preprocess_leaves_nothing_behind_for_the_next_one(tmp_path):
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("a b c\nd e f\n" * 50)
    half = tmp_path / f".out.{dead_pid()}.x1y2"
    half.mkdir()
    (half / "train.en-de.en.bin").write_bytes(b"\0" * 10)
    r = attnmt("preprocess", "-q", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--destdir",
               str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    assert not half.exists()


def test_preprocess_past_the_file_size_limit_names_the_destdir_and_the_limit(tmp_path):
    for lang in ("en", "de"):
        (tmp_path / f"train.{lang}").write_text("a b c d e f g h\n" * 4000)
    r = attnmt("preprocess", "-q", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "train"), "--destdir",
               str(tmp_path / "out"), file_limit=16 * 1024)
    one_line_error(r, "out: cannot write --destdir", "ulimit -f")
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.") and not p.name.endswith(".lock")] == []


def test_training_killed_before_its_first_checkpoint_leaves_no_records_in_the_next_runs_log(data, tmp_path):
    save = tmp_path / "ck"
    save.mkdir()
    dead_run = [{"type": "start"}, *({"type": "train", "num_updates": n, "loss": 9.0} for n in range(1, 6))]
    (save / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in dead_run) + '{"type": "tra')
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(save), "--max-update", "3", "--log-interval", "1")
    assert r.returncode == 0, r.stderr
    records = [json.loads(x) for x in (save / "train.jsonl").read_text().splitlines()]  # every line whole
    updates = [x["num_updates"] for x in records if x["type"] == "train"]
    assert updates == [1, 2, 3]


def test_a_resume_repairs_a_log_with_a_partial_line_and_bad_bytes(data, tmp_path):
    save = tmp_path / "ck"
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(save), "--max-update", "2", "--log-interval", "1")
    assert r.returncode == 0, r.stderr
    with open(save / "train.jsonl", "ab") as f:
        f.write(b'{"type": "note", "text": "\xff"}\n{"type": "train", "num_upd')
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(save), "--max-update", "4", "--log-interval", "1")
    assert r.returncode == 0, r.stderr
    lines = (save / "train.jsonl").read_bytes().decode("utf-8").splitlines()
    assert [json.loads(x).get("num_updates") for x in lines if json.loads(x)["type"] == "train"] == [1, 2, 3, 4]
    r = attnmt("plot", "curves", "--log", str(save / "train.jsonl"), "--out", str(tmp_path / "c.png"))
    assert r.returncode == 0, r.stderr


def test_the_last_checkpoint_is_written_before_the_other_names_of_a_save(tmp_path):
    from attnmt import checkpoint

    written = []
    real = checkpoint.save

    def spy(state, path):
        written.append(Path(path).name)
        real(state, path)

    checkpoint.save = spy
    try:
        paths = checkpoint.save_as({"x": torch.zeros(1)}, tmp_path, ["checkpoint_1_4.pt", "checkpoint_last.pt"])
    finally:
        checkpoint.save = real
    assert written == ["checkpoint_last.pt"] and paths[0].name == "checkpoint_last.pt" and len(paths) == 2


# ------------------------------------------------------------------------------------------------ outputs


def test_output_into_a_fifo_and_a_symlink_and_a_device(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2\nw3 w4\n")
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE, text=True)
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--output", str(fifo), "--quiet")
    assert r.returncode == 0, r.stderr
    assert reader.communicate(timeout=60)[0].count("\n") == 2 and fifo.is_fifo()

    real, link = tmp_path / "real.txt", tmp_path / "link.txt"
    real.write_text("old\n")
    link.symlink_to(real.name)
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--output", str(link), "--quiet")
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and real.read_text().count("\n") == 2

    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--output", "/dev/null", "--quiet")
    assert r.returncode == 0 and Path("/dev/null").is_char_device(), r.stderr


@pytest.mark.parametrize("closed, stream", [(0, "stdin"), (1, "stdout")])
def test_a_closed_standard_stream_is_a_one_line_error(ckpt, tmp_path, closed, stream):
    (tmp_path / "in.txt").write_text("w1 w2\n")
    fd = os.open(tmp_path / "in.txt", os.O_RDONLY)
    try:
        def close():
            os.close(closed)

        r = subprocess.run([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt)],
                           stdin=fd if closed else None, stderr=subprocess.PIPE, text=True, preexec_fn=close,
                           stdout=None if closed else subprocess.PIPE)
    finally:
        os.close(fd)
    one_line_error(r, f"{stream} is closed")


def test_text_is_utf8_whatever_pythonioencoding_says(ckpt, tmp_path):
    ref = tmp_path / "ref.txt"
    ref.write_text("Zwei Männer stehen am Herd.\n", encoding="utf-8")
    r = attnmt("score", "--ref", str(ref), stdin="Zwei Männer stehen am Herd.\n", env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and "= 100.00" in r.stdout, r.stderr
    r = attnmt("translate", "--path", str(ckpt), stdin="w1 ä\n", env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and r.stdout.count("\n") == 1, r.stderr


def test_interactive_names_the_input_file_with_bad_utf8(ckpt, tmp_path):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"w1 w2\nw3 \xff\n")
    r = attnmt("interactive", "--path", str(ckpt), "--input", str(bad))
    one_line_error(r, f"{bad}:2", "UTF-8")


# ------------------------------------------------------------------------------------------------ hostile checkpoints


@pytest.mark.parametrize("damage", ["huge", "shape", "no_specials", "symbols_not_a_list", "bad_count"])
def test_a_hostile_checkpoint_is_refused_before_anything_is_allocated(ckpt, tmp_path, damage):
    ck = torch.load(ckpt, weights_only=True)
    if damage == "huge":
        ck["model_config"]["encoder_ffn_embed_dim"] = 2**40
    elif damage == "shape":
        ck["model_config"]["encoder_ffn_embed_dim"] = 200_000  # in range, but not what the weights hold
    elif damage == "no_specials":
        del ck["data"]["src_dict"]["specials"]
    elif damage == "symbols_not_a_list":
        ck["data"]["src_dict"]["symbols"] = 42
    else:
        ck["data"]["tgt_dict"]["counts"][5] = "x"
    bad = tmp_path / "bad.pt"
    torch.save(ck, bad)
    r = attnmt("translate", "--path", str(bad), stdin="w1 w2\n")
    one_line_error(r, str(bad))


# ------------------------------------------------------------------------------------------------ plugins and data


def test_a_plugin_named_like_an_installed_module_or_raising_baseexception_is_refused(tmp_path):
    (tmp_path / "sacrebleu.py").write_text("x = 1\n")
    r = attnmt("--user-dir", str(tmp_path / "sacrebleu.py"), "list")
    one_line_error(r, "sacrebleu", "installed module", "rename")
    (tmp_path / "evil.py").write_text("raise BaseException('boom')\n")
    r = attnmt("--user-dir", str(tmp_path / "evil.py"), "list")
    one_line_error(r, "evil.py", "BaseException: boom")


def test_ids_beyond_the_dictionary_are_refused_naming_the_file(ckpt, data, tmp_path):
    import shutil

    other = tmp_path / "bin"
    shutil.copytree(data, other)
    for split in ("train", "valid"):
        path = other / f"{split}.en-de.en.bin"
        ids = np.fromfile(path, dtype=np.uint8)
        ids[3] = 250  # beyond the toy dictionary
        ids.tofile(path)
    r = attnmt("train", str(other), *TRAIN, "--save-dir", str(tmp_path / "ck"), "--max-update", "1")
    one_line_error(r, "train.en-de.en.bin", "token id 250", "another dictionary")
    r = attnmt("generate", str(other), "--path", str(ckpt), "--gen-subset", "valid", "--quiet")
    one_line_error(r, "valid.en-de.en.bin", "token id 250")


# ------------------------------------------------------------------------------------------------ workers


@pytest.mark.slow
@pytest.mark.parametrize("delay", [0.3, 1.5])
def test_spawned_workers_die_with_a_parent_killed_while_they_start(ckpt, tmp_path, delay):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3\n" * 2000)
    with open(src) as stdin:
        parent = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt), "--workers",
                                   "2", "--threads", "2"], stdin=stdin, stdout=subprocess.DEVNULL,
                                  start_new_session=True)
    time.sleep(delay)
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        children = subprocess.run(["pgrep", "-s", str(parent.pid)], capture_output=True, text=True).stdout.split()
        if not children:
            break
        time.sleep(0.5)
    for pid in children:
        os.kill(int(pid), signal.SIGKILL)
    assert children == [], "processes of the killed command still run"
