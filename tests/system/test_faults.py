"""Fault injection: bad targets, full disks, broken pipes, corrupt files, hostile plugins, bad values.

Each case asserts what the user sees: the exit status, one line naming the path and the fix, no traceback, and that
what existed before is intact. A full disk is simulated with a file-size limit (RLIMIT_FSIZE: writes past it fail
with EFBIG, as they fail with ENOSPC on a full disk, through the same code); a read-only file system with a
read-only bind mount where this process may mount one (root), else those cases skip.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import TINY_MODEL, make_data_bin

from attnmt.cli import main

TRAIN = [*TINY_MODEL, "--max-tokens", "256", "--progress", "none", "--threads", "1"]


def attnmt(*args: str, file_limit: int | None = None, stdin: str | None = None, env: dict | None = None,
           stdout: Path | None = None) -> subprocess.CompletedProcess:
    """The command in its own process (exit status and stderr as a user sees them); ``stdout``: a file to
    redirect the output to (a file-size limit applies to files, not to pipes)."""

    def limit():
        if file_limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_limit, file_limit))

    out = open(stdout, "w") if stdout is not None else subprocess.PIPE  # noqa: SIM115
    try:
        return subprocess.run([sys.executable, "-m", "attnmt.cli", *args], stdout=out, stderr=subprocess.PIPE,
                              text=True, input=stdin, preexec_fn=limit, env={**os.environ, **(env or {})})
    finally:
        if stdout is not None:
            out.close()


def one_line_error(r: subprocess.CompletedProcess, *fragments: str) -> None:
    assert r.returncode == 1, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("attnmt: error: "), r.stderr
    for f in fragments:
        assert f in last, (f, last)


def in_process(argv: list[str], capsys) -> tuple[int, str]:
    """Run ``attnmt argv`` in this process; any exception but SystemExit (a traceback) fails the test."""
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        code = int(e.code or 0)
    return code, capsys.readouterr().err


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return make_data_bin(tmp_path_factory.mktemp("data") / "bin", n_train=64, n_valid=8)


@pytest.fixture(scope="module")
def ckpt(data, tmp_path_factory) -> Path:
    ck = tmp_path_factory.mktemp("ckpt")
    main(["train", str(data), *TRAIN, "--save-dir", str(ck), "--max-update", "2"])
    return ck / "checkpoint_last.pt"


@pytest.fixture
def read_only(tmp_path):
    """A directory on a read-only mount (skips where this process cannot mount)."""
    src, ro = tmp_path / "ro_src", tmp_path / "ro"
    src.mkdir()
    ro.mkdir()
    ok = subprocess.run(["mount", "--bind", str(src), str(ro)], capture_output=True).returncode == 0
    ok = ok and subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], capture_output=True).returncode == 0
    if not ok:
        subprocess.run(["umount", str(ro)], capture_output=True)
        pytest.skip("cannot make a read-only mount here (needs root)")
    yield ro
    subprocess.run(["umount", str(ro)], capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A 64 KB file system (skips where this process cannot mount one)."""
    d = tmp_path / "small"
    d.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    yield d
    subprocess.run(["umount", str(d)], capture_output=True)


# ------------------------------------------------------------------------------------------ output targets


def test_save_dir_that_is_a_file_or_under_one(data, tmp_path, capsys):
    f = tmp_path / "notadir"
    f.write_text("keep me")
    for target, says in ((f, "--save-dir is a file, not a directory"), (f / "sub", "is under")):
        code, err = in_process(["train", str(data), *TRAIN, "--save-dir", str(target), "--max-update", "1"], capsys)
        assert code == 1 and says in err.strip().splitlines()[-1], err
    assert f.read_text() == "keep me"


def test_read_only_targets_fail_before_any_work(data, ckpt, read_only, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3\n")
    cases = [
        (["train", str(data), *TRAIN, "--save-dir", str(read_only / "ck"), "--max-update", "1"], "--save-dir"),
        (["generate", "--path", str(ckpt), "--input", str(src), "--output", str(read_only / "out.txt")],
         "--output"),
        (["average-checkpoints", "--inputs", str(ckpt), "--output", str(read_only / "avg.pt")], "--output"),
        (["preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "in"), "--destdir",
          str(read_only / "bin"), "--bpe", "none"], "--destdir"),
    ]
    (tmp_path / "in.en").write_text("w1 w2\n")
    (tmp_path / "in.de").write_text("w3 w4\n")
    for argv, option in cases:
        code, err = in_process(argv, capsys)
        last = err.strip().splitlines()[-1]
        assert code == 1 and f"cannot write {option} (Read-only file system)" in last, (argv[0], err)


def test_generate_output_directory_or_under_a_file_fails_before_translating(ckpt, tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3\n")
    d = tmp_path / "outdir"
    d.mkdir()
    code, err = in_process(["generate", "--path", str(ckpt), "--input", str(src), "--output", str(d)], capsys)
    assert code == 1 and "--output is a directory; give a file name" in err and "translated" not in err
    code, err = in_process(["generate", "--path", str(ckpt), "--input", str(src), "--output",
                            str(src / "x.txt")], capsys)
    assert code == 1 and f"--output is under {src}, which is a file" in err
    assert src.read_text() == "w1 w2 w3\n"


@pytest.mark.slow
def test_checkpoint_write_on_a_full_disk(data, tmp_path):
    ck = tmp_path / "ck"
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(ck), "--max-update", "1", file_limit=20_000)
    one_line_error(r, "checkpoint_", "cannot write", "File too large")
    assert not list(ck.glob(".*.tmp")), "a partial checkpoint was left behind"


@pytest.mark.slow
def test_checkpoint_write_on_a_full_file_system(data, small_disk):
    """ENOSPC inside torch's zip writer (reported by torch as "unexpected pos") is one line naming the file."""
    r = attnmt("train", str(data), *TRAIN, "--save-dir", str(small_disk / "ck"), "--max-update", "1")
    one_line_error(r, "checkpoint_", "cannot write")
    assert not list((small_disk / "ck").glob(".*.tmp"))


def test_generate_output_on_a_full_disk_keeps_the_old_file(ckpt, tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3 w4 w5 w6 w7 w8\n" * 3000)
    out = tmp_path / "out.txt"
    out.write_text("the old translations\n")
    r = attnmt("generate", "--path", str(ckpt), "--input", str(src), "--output", str(out), "--quiet",
               file_limit=1024)
    one_line_error(r, str(out), "cannot write", "File too large")
    assert out.read_text() == "the old translations\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.txt", "out.txt"]


def test_translate_to_a_full_disk(ckpt, tmp_path):
    r = attnmt("translate", "--path", str(ckpt), file_limit=1024, stdin="w1 w2 w3\n" * 3000,
               stdout=tmp_path / "out.txt")
    one_line_error(r, "stdout: cannot write", "File too large", "ulimit -f")


@pytest.mark.slow
def test_preprocess_on_a_full_disk_leaves_no_output(tmp_path):
    for lang in ("en", "de"):
        (tmp_path / f"big.{lang}").write_text("w1 w2 w3 w4 w5 w6\n" * 20000)
    r = attnmt("preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "big"), "--destdir",
               str(tmp_path / "bin"), "--bpe", "none", "--workers", "1", file_limit=100_000)
    one_line_error(r, "(File too large)")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.de", "big.en"]


def test_broken_pipe_is_not_an_error(ckpt, tmp_path):
    """``attnmt translate ... | head -1``: the reader goes away; exit 0 and nothing on stderr."""
    p = subprocess.Popen([sys.executable, "-m", "attnmt.cli", "translate", "--path", str(ckpt)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    p.stdin.write("w1 w2 w3\n" * 20000)
    p.stdin.close()
    p.stdout.readline()
    p.stdout.close()  # as head does after its line
    err = p.stderr.read()
    assert p.wait() == 0 and "Traceback" not in err and "error" not in err, err


# ------------------------------------------------------------------------------------------ bad values, bad data


@pytest.mark.parametrize("option,value", [("--save-interval-updates", "-1"), ("--validate-interval-updates", "-5"),
                                          ("--save-interval", "0"), ("--keep-last-epochs", "-2")])
def test_bad_interval_values_are_refused(data, tmp_path, capsys, option, value):
    code, err = in_process(["train", str(data), *TRAIN, "--save-dir", str(tmp_path / "ck"), option, value], capsys)
    assert code == 1 and option in err.strip().splitlines()[-1], err
    assert not (tmp_path / "ck").exists() or not list((tmp_path / "ck").iterdir())


def test_empty_validation_split_is_refused(tmp_path, capsys):
    from attnmt.data.indexed import IndexedDatasetBuilder

    d = make_data_bin(tmp_path / "bin", n_train=32, n_valid=4)
    for lang in ("en", "de"):
        IndexedDatasetBuilder(str(d / f"valid.en-de.{lang}"), 64).finalize()
    code, err = in_process(["train", str(d), *TRAIN, "--save-dir", str(tmp_path / "ck"), "--max-update", "1"],
                           capsys)
    assert code == 1 and "validation split 'valid': it is empty" in err and "--disable-validation" in err


def test_preprocess_of_an_empty_corpus_is_refused(tmp_path, capsys):
    for lang in ("en", "de"):
        (tmp_path / f"empty.{lang}").write_text("")
    code, err = in_process(["preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / "empty"),
                            "--destdir", str(tmp_path / "bin"), "--bpe", "none", "--workers", "1"], capsys)
    assert code == 1 and "the training text is empty" in err and not (tmp_path / "bin").exists()


def test_corrupt_index_is_refused(data, ckpt, tmp_path, capsys):
    bad = tmp_path / "bin"
    shutil.copytree(data, bad)
    idx = bad / "valid.en-de.en.idx"
    with open(idx, "r+b") as f:
        f.seek(-64, os.SEEK_END)
        f.write(b"\xff" * 64)
    code, err = in_process(["generate", str(bad), "--path", str(ckpt), "--gen-subset", "valid"], capsys)
    assert code == 1 and f"{idx}: entry" in err and "is corrupt" in err


# ------------------------------------------------------------------------------------------ plugins


def test_plugins_that_shadow_a_module_or_exit_are_refused(tmp_path):
    (tmp_path / "json.py").write_text("x = 1\n")
    r = attnmt("--user-dir", str(tmp_path / "json.py"), "list")
    one_line_error(r, "module name 'json' is already taken by a standard module")
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    r = attnmt("--user-dir", str(tmp_path / "exits.py"), "list")
    one_line_error(r, "the plugin called sys.exit(3)")
    r = attnmt("list", env={"ATTNMT_USER_DIR": str(tmp_path / "nope")})
    one_line_error(r, "ATTNMT_USER_DIR", "no such file or directory")


# ------------------------------------------------------------------------------------------ checkpoints, logs


def test_checkpoint_names_never_share_a_file(data, tmp_path, capsys):
    ck = tmp_path / "ck"
    code, _ = in_process(["train", str(data), *TRAIN, "--save-dir", str(ck), "--max-epoch", "1"], capsys)
    assert code == 0
    names = ["checkpoint1.pt", "checkpoint_best.pt", "checkpoint_last.pt"]
    inodes = {n: (ck / n).stat().st_ino for n in names}
    assert len(set(inodes.values())) == 3, inodes
    best = (ck / "checkpoint_best.pt").read_bytes()
    shutil.copyfile(ck / "checkpoint1.pt", ck / "checkpoint_last.pt")  # a user restoring with cp
    with open(ck / "checkpoint_last.pt", "r+b") as f:
        f.truncate(10)
    assert (ck / "checkpoint_best.pt").read_bytes() == best


def test_resume_cleans_partial_files_and_repeated_log_records(data, tmp_path, capsys):
    ck = tmp_path / "ck"
    code, _ = in_process(["train", str(data), *TRAIN, "--save-dir", str(ck), "--max-update", "2"], capsys)
    assert code == 0
    (ck / ".checkpoint_last.pt.abc123.tmp").write_bytes(b"partial")  # a save killed mid-write
    with open(ck / "train.jsonl", "a") as f:  # a record of an update the checkpoint does not hold
        f.write(json.dumps({"type": "train", "num_updates": 3, "loss": 1.0}) + "\n")
    code, err = in_process(["train", str(data), *TRAIN, "--save-dir", str(ck), "--max-update", "4",
                            "--log-interval", "1", "--progress", "lines"], capsys)
    assert code == 0 and "removed 1 partial checkpoint file(s)" in err and "dropped 1 record(s)" in err
    assert not list(ck.glob(".*.tmp"))
    updates = [json.loads(ln).get("num_updates") for ln in (ck / "train.jsonl").read_text().splitlines()]
    train_updates = [u for u in updates if u]
    assert train_updates.count(3) == 1


def test_failed_start_writes_no_log(data, tmp_path, capsys):
    ck = tmp_path / "ck"
    code, err = in_process(["train", str(data), *TRAIN, "--save-dir", str(ck), "--finetune-from",
                            str(tmp_path / "missing.pt")], capsys)
    assert code == 1 and "missing.pt" in err
    assert not (ck / "train.jsonl").exists()


# ------------------------------------------------------------------------------------------ signals


def _start(args: list[str], stdin_text: str | None = None, stdout=subprocess.DEVNULL) -> subprocess.Popen:
    import signal

    p = subprocess.Popen([sys.executable, "-m", "attnmt.cli", *args], stdin=subprocess.PIPE if stdin_text else None,
                         stdout=stdout, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    if stdin_text:
        import threading

        def feed():
            try:
                p.stdin.write(stdin_text)
                p.stdin.close()
            except BrokenPipeError:
                pass

        threading.Thread(target=feed, daemon=True).start()
    return p


@pytest.mark.slow
def test_sigterm_stops_generate_cleanly_and_keeps_the_old_output(ckpt, tmp_path):
    import signal
    import time

    src = tmp_path / "in.txt"
    src.write_text("w1 w2 w3 w4 w5\n" * 100000)
    out = tmp_path / "out.txt"
    out.write_text("old\n")
    p = _start(["generate", "--path", str(ckpt), "--input", str(src), "--output", str(out), "--max-tokens", "64"])
    time.sleep(5)
    assert p.poll() is None, p.stderr.read()
    p.send_signal(signal.SIGTERM)
    err = p.stderr.read()
    assert p.wait() == 143 and "attnmt: terminated by SIGTERM" in err and "Traceback" not in err, err
    assert out.read_text() == "old\n" and sorted(x.name for x in tmp_path.iterdir()) == ["in.txt", "out.txt"]


@pytest.mark.slow
def test_sigterm_to_translate_keeps_what_it_finished_and_workers_die_with_their_parent(ckpt, tmp_path):
    import signal
    import time

    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        p = _start(["translate", "--path", str(ckpt), "--max-tokens", "64"], "w1 w2 w3\n" * 100000, stdout=f)
        time.sleep(6)
        p.send_signal(signal.SIGTERM)
        err = p.stderr.read()
        assert p.wait() == 143 and "attnmt: terminated by SIGTERM" in err, err
    assert len(out.read_text().splitlines()) > 0  # the translations finished before the signal were flushed

    p = _start(["translate", "--path", str(ckpt), "--max-tokens", "64", "--workers", "2"], "w1 w2 w3\n" * 100000)
    time.sleep(8)
    kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
    assert len(kids) == 2, kids
    p.kill()
    p.wait()

    def running(pid: str) -> bool:  # a zombie waiting to be reaped is not running
        stat = subprocess.run(["ps", "-o", "stat=", "-p", pid], capture_output=True, text=True).stdout.strip()
        return bool(stat) and not stat.startswith("Z")

    for _ in range(30):
        alive = [k for k in kids if running(k)]
        if not alive:
            break
        time.sleep(0.1)
    assert alive == [], "decoding workers outlived their killed parent"


def test_divergence_is_warned_and_an_unreachable_min_len_refused(data, tmp_path, capsys):
    code, err = in_process(["train", str(data), *TRAIN, "--save-dir", str(tmp_path / "ck"), "--max-update", "20",
                            "--lr", "1000", "--warmup-updates", "1", "--log-interval", "5", "--progress", "lines",
                            "--disable-validation"], capsys)
    assert code == 0 and err.count("training is diverging; lower --lr") == 1, err
    code, err = in_process(["translate", "--path", str(tmp_path / "ck" / "checkpoint_last.pt"), "--max-len-a", "0",
                            "--max-len-b", "5", "--min-len", "8"], capsys)
    assert code == 1 and "--min-len 8 is above the length limit --max-len-b 5" in err
