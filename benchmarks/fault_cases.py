"""Faulty and hostile uses of every command, run as a user would run them, each with a verdict.

    python benchmarks/fault_cases.py --data ../shared/data/multi30k [--python PYTHON] [--only KIND] [--work DIR]

Builds a small real pipeline first (2,000 Multi30k pairs, SentencePiece, a small model trained for 40 updates),
then runs each case in a fresh directory and prints a markdown table: kind, case, command, exit status, verdict.
A case is clean when the command did what docs/failure-modes.md promises: for a user error, exit 1 with one
``attnmt: error:`` line and no traceback; for a fault attnmt must absorb, exit 0 with the right output; plus each
case's own check (nothing lost, nothing left behind, no process left running). ``--python`` runs another
installation of attnmt (``PYTHON -m attnmt.cli``), e.g. an older checkout's, to compare.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

TINY = ("--arch transformer_small --encoder-layers 1 --decoder-layers 1 --encoder-embed-dim 32 "
        "--decoder-embed-dim 32 --encoder-ffn-embed-dim 64 --decoder-ffn-embed-dim 64 "
        "--encoder-attention-heads 2 --decoder-attention-heads 2")


@dataclass
class Result:
    rc: int
    out: str
    err: str
    cwd: Path

    @property
    def traceback(self) -> bool:
        return "Traceback (most recent call last)" in self.err

    @property
    def user_error(self) -> bool:
        lines = [x for x in self.err.strip().splitlines() if x.strip()]
        return self.rc == 1 and bool(lines) and lines[-1].startswith("attnmt: error:") and not self.traceback


@dataclass
class Case:
    kind: str
    name: str
    command: str  # shell; $A is attnmt, $BIN the data-bin, $MODEL the checkpoint, $RAW the raw text prefix
    check: Callable[[Result], str | None]  # None: clean, else what went wrong
    setup: Callable[[Path], None] | None = None
    env: dict | None = None
    timeout: float = 180


def expect_error(*words: str) -> Callable[[Result], str | None]:
    """Clean: exit 1, one 'attnmt: error:' line naming each of ``words``, no traceback."""
    def check(r: Result) -> str | None:
        if r.traceback:
            return "traceback"
        if r.rc == 2 and "Error:" in r.err:  # click's usage error names the option too
            last = r.err.strip().splitlines()[-1]
            return None if all(w.lower() in last.lower() for w in words) else "usage error without the option"
        if not r.user_error:
            return f"exit {r.rc}, no one-line error"
        last = r.err.strip().splitlines()[-1]
        missing = [w for w in words if w.lower() not in last.lower()]
        return f"the error does not name {', '.join(missing)}" if missing else None
    return check


def expect_ok(extra: Callable[[Result], str | None] | None = None) -> Callable[[Result], str | None]:
    def check(r: Result) -> str | None:
        if r.traceback:
            return "traceback"
        if r.rc != 0:
            return f"exit {r.rc}: {(r.err.strip().splitlines() or [''])[-1][:80]}"
        return extra(r) if extra else None
    return check


def both(*checks):
    def check(r: Result) -> str | None:
        for c in checks:
            bad = c(r)
            if bad:
                return bad
        return None
    return check


def no_files(pattern: str, where: str = "."):
    def check(r: Result) -> str | None:
        left = sorted(str(p.relative_to(r.cwd)) for p in (r.cwd / where).rglob(pattern))
        return f"left behind: {', '.join(left[:3])}" if left else None
    return check


def says(text: str):
    def check(r: Result) -> str | None:
        return None if text.lower() in r.err.lower() else f"stderr does not say {text!r}"
    return check


# ------------------------------------------------------------------------------------------------ the pipeline


def build_fixture(work: Path, data: Path, attnmt: str) -> dict[str, str]:
    raw = work / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for split, src, n in (("train", "train", 2000), ("valid", "val", 100), ("test", "test_2016_flickr", 100)):
        for lang in ("en", "de"):
            with gzip.open(data / f"{src}.{lang}.gz", "rt", encoding="utf-8") as f:
                lines = [next(f) for _ in range(n)]
            (raw / f"{split}.{lang}").write_text("".join(lines), encoding="utf-8")
    bin_ = work / "bin"
    ckpt = work / "ckpt"
    if not (ckpt / "checkpoint_last.pt").exists():
        run(f"{attnmt} preprocess -q -s en -t de --trainpref raw/train --validpref raw/valid --testpref raw/test "
            f"--destdir bin --bpe sentencepiece --vocab-size 600 --joined-dictionary", work, check=True)
        run(f"{attnmt} train bin {TINY} --max-tokens 2048 --lr 2e-3 --warmup-updates 10 --max-update 40 "
            f"--save-dir ckpt --progress none --threads 2", work, check=True, timeout=600)
    return {"BIN": str(bin_), "MODEL": str(ckpt / "checkpoint_last.pt"), "RAW": str(raw)}


def run(command: str, cwd: Path, env: dict | None = None, check: bool = False, timeout: float = 180) -> Result:
    """``command`` in bash, in its own process group, under a 12 GiB address-space limit (a case that would
    exhaust the machine's memory fails instead); past ``timeout`` the whole group is killed."""
    limited = f"ulimit -v {12 << 20}; {command}"
    p = subprocess.Popen(["bash", "-c", limited], cwd=cwd, env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise
    r = Result(p.returncode, out, err, cwd)
    if check and p.returncode:
        raise SystemExit(f"fixture step failed: {command}\n{err[-2000:]}")
    return r


# ------------------------------------------------------------------------------------------------ the cases


def _truncate_library(cache: Path) -> None:
    for so in cache.glob("*.so"):
        so.write_bytes(so.read_bytes()[: so.stat().st_size // 3])


def _foreign_library(cache: Path) -> None:
    for so in cache.glob("*.so"):
        c = so.with_suffix(".c")
        c.write_text("int unrelated(void) { return 1; }\n")
        subprocess.run(["cc", "-shared", "-fPIC", str(c), "-o", str(so)], check=True)
        c.unlink()


def kernel_cases() -> list[Case]:
    translate = "echo 'A man is riding a bike.' | $A translate --path $MODEL --threads 2"

    def warm(corrupt):
        def setup(d: Path) -> None:
            run(translate.replace("$A", os.environ["_A"]).replace("$MODEL", os.environ["_MODEL"]), d,
                env={"ATTNMT_CACHE_DIR": str(d / "cache")}, check=True)
            corrupt(d / "cache")
        return setup

    def translated(r: Result) -> str | None:
        return None if r.out.strip() else "no translation"

    def rebuilt(r: Result) -> str | None:
        return None if any((r.cwd / "cache").glob("*.so")) else "no library in the cache afterwards"

    env = {"ATTNMT_CACHE_DIR": "cache"}
    return [
        Case("kernels", "truncated cached library", translate, both(expect_ok(translated), rebuilt),
             setup=warm(_truncate_library), env=env),
        Case("kernels", "cached library that is not ours", translate, both(expect_ok(translated), rebuilt),
             setup=warm(_foreign_library), env=env),
        Case("kernels", "CC that does not parse", translate, both(expect_ok(translated), says("kernels")),
             env={**env, "CC": "gcc 'unbalanced"}),
        Case("kernels", "a compiler that hangs (build limit 5 s)",
             f"{translate} && {translate}",
             both(expect_ok(translated), says("kernels"),
                  lambda r: None if r.err.lower().count("kernels") <= 3 else "waited again on the second run"),
             env={**env, "CC": "sh -c 'sleep 30' cc", "ATTNMT_KERNEL_BUILD_TIMEOUT": "5"}, timeout=170),
        Case("kernels", "a failing build is said", translate, both(expect_ok(translated), says("kernels")),
             env={**env, "CC": "false"}),
    ]


def _write(path: str, text: str | bytes):
    def setup(d: Path) -> None:
        p = d / path
        p.parent.mkdir(parents=True, exist_ok=True)
        (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    return setup


def _copy_ckpt(d: Path) -> None:
    import shutil

    shutil.copytree(Path(os.environ["_MODEL"]).parent, d / "ckpt")


def _kill_first_save(d: Path) -> None:
    """A run killed after its first update-interval checkpoint and before checkpoint_last.pt."""
    import shutil

    shutil.copytree(os.environ["_BIN"], d / "bin")
    run(f"{os.environ['_A']} train bin {TINY} --max-tokens 2048 --max-update 4 --save-interval-updates 2 "
        f"--save-dir ckpt --progress none --threads 2 --no-background-save --log-interval 1", d, check=True)
    (d / "ckpt" / "checkpoint_last.pt").unlink()
    for p in (d / "ckpt").glob("checkpoint*.pt"):
        if p.name != "checkpoint_1_2.pt":
            p.unlink()


def _log_consistent(r: Result) -> str | None:
    updates = [rec["num_updates"] for rec in map(json.loads, (r.cwd / "ckpt" / "train.jsonl").read_text(
        encoding="utf-8").splitlines()) if rec.get("type") == "train"]
    return None if updates == sorted(set(updates)) else f"train.jsonl repeats updates: {updates}"


def checkpoint_cases() -> list[Case]:
    train = (f"$A train bin {TINY} --max-tokens 2048 --max-update 6 --save-interval-updates 2 --save-dir ckpt "
             f"--progress none --threads 2 --log-interval 1")

    def copy_bin_and(*more):
        def setup(d: Path) -> None:
            import shutil

            shutil.copytree(os.environ["_BIN"], d / "bin")
            for m in more:
                m(d)
        return setup

    def unterminated(d: Path) -> None:
        run(train.replace("$A", os.environ["_A"]).replace("--max-update 6", "--max-update 2"), d, check=True)
        with open(d / "ckpt" / "train.jsonl", "a", encoding="utf-8") as f:
            f.write('{"kind": "train", "upd')

    def bad_utf8(d: Path) -> None:
        run(train.replace("$A", os.environ["_A"]).replace("--max-update 6", "--max-update 2"), d, check=True)
        with open(d / "ckpt" / "train.jsonl", "ab") as f:
            f.write(b'{"kind": "note", "text": "\xff\xfe"}\n')

    return [
        Case("checkpoints", "kill during the first save, then resume", train, both(expect_ok(), _log_consistent),
             setup=_kill_first_save),
        Case("checkpoints", "resume after an unterminated train.jsonl line, then plot",
             f"{train} && $A plot curves --log ckpt/train.jsonl --out curves.png", expect_ok(),
             setup=copy_bin_and(unterminated)),
        Case("checkpoints", "resume with a non-UTF-8 byte in train.jsonl", train, expect_ok(),
             setup=copy_bin_and(bad_utf8)),
    ]


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def _stale(name: str):
    """A temp file (or, for a name ending in /, a temp directory) left by a killed attnmt process."""
    def setup(d: Path) -> None:
        p = d / name.replace("PID", str(_dead_pid()))
        if name.endswith("/"):
            p.mkdir(parents=True)
            (p / "train.en-de.en.bin").write_text("half")
        else:
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text("half")
    return setup


def temp_cases() -> list[Case]:
    prep = ("$A preprocess -q -s en -t de --trainpref $RAW/train --validpref $RAW/valid --destdir out "
            "--bpe sentencepiece --vocab-size 600 --joined-dictionary")
    return [
        Case("temp files", "stale temp files of a killed preprocess", prep, both(expect_ok(), no_files(".out.*.x1")),
             setup=_stale(".out.PID.x1/")),
        Case("temp files", "stale temp file of a killed generate --output",
             "$A generate $BIN --path $MODEL --gen-subset test --output out.txt --quiet",
             both(expect_ok(), no_files("*.tmp")), setup=_stale(".out.txt.PID.x1.tmp")),
        Case("temp files", "stale temp file of a killed average-checkpoints",
             "$A average-checkpoints --inputs ckpt/checkpoint1.pt ckpt/checkpoint_last.pt --output avg.pt",
             both(expect_ok(), no_files("*.tmp")), setup=lambda d: (_copy_ckpt(d), _stale(".avg.pt.PID.x1.tmp")(d))),
        Case("temp files", "export into a full disk (ulimit -f), then export again",
             "(ulimit -f 64; $A export --path $MODEL --to ctranslate2 --output-dir ct2); "
             "$A export --path $MODEL --to ctranslate2 --output-dir ct2", expect_ok()),
        Case("temp files", "preprocess past the file-size limit names the file",
             f"ulimit -f 8; {prep}", expect_error("out:", "ulimit")),
    ]


def lock_cases() -> list[Case]:
    train = (f"$A train bin {TINY} --max-tokens 2048 --max-update 1000 --save-interval-updates 5 --save-dir ckpt "
             f"--progress none --threads 1")

    def copy_bin(d: Path) -> None:
        import shutil

        shutil.copytree(os.environ["_BIN"], d / "bin")

    # The second run starts once the first has saved (so holds the lock), whatever the machine's speed.
    two = (f"({train} > first.out 2> first.err; echo $? > first.rc) & "
           f"until [ -e ckpt/checkpoint_last.pt ] || [ -e first.rc ]; do sleep 0.2; done; {train}; rc=$?; wait; "
           f"echo first=$(cat first.rc) >&2; tail -2 first.err >&2; exit $rc")

    def second_refused(r: Result) -> str | None:
        first = r.err.split("first=")[-1]
        if "Traceback" in first:
            return "the first run died with a traceback"
        if not first.startswith("0"):
            return f"the first run ended with exit {first[:3]}"
        return None

    prep = ("$A preprocess -q -s en -t de --trainpref $RAW/train --validpref $RAW/valid --destdir out "
            "--bpe sentencepiece --vocab-size 600 --joined-dictionary --workers 1")
    return [
        Case("locks", "a second train into the same --save-dir", two,
             both(lambda r: None if r.rc == 1 and "in use" in r.err else f"second run: exit {r.rc}, not refused",
                  second_refused), setup=copy_bin, timeout=400),
        Case("locks", "two preprocess into the same --destdir at once",
             f"({prep}) 2> a.err & ({prep}) 2> b.err; wait; cat a.err b.err >&2; ls out/dict.en.txt",
             lambda r: "traceback" if r.traceback else (None if "in use" in r.err or r.rc == 0 else "no lock")),
    ]


def _hostile_checkpoint(edit):
    def setup(d: Path) -> None:
        import torch

        ck = torch.load(os.environ["_MODEL"], weights_only=True)
        edit(ck)
        torch.save(ck, d / "bad.pt")
    return setup


def hostile_cases() -> list[Case]:
    def huge(ck):
        ck["model_config"]["encoder_ffn_embed_dim"] = 2**40

    def no_specials(ck):
        ck["data"]["src_dict"].pop("specials", None)

    def bad_symbols(ck):
        ck["data"]["src_dict"]["symbols"] = 42

    tr = "echo 'A man.' | $A translate --path bad.pt"
    return [
        Case("hostile checkpoints", "huge dimensions in the stored config", tr, expect_error("bad.pt"),
             setup=_hostile_checkpoint(huge)),
        Case("hostile checkpoints", "a dictionary without a field", tr, expect_error("bad.pt"),
             setup=_hostile_checkpoint(no_specials)),
        Case("hostile checkpoints", "a dictionary of the wrong type", tr, expect_error("bad.pt"),
             setup=_hostile_checkpoint(bad_symbols)),
    ]


def option_cases() -> list[Case]:
    train = f"$A train $BIN {TINY} --max-tokens 2048 --max-update 1 --save-dir ckpt --progress none"
    gen = "$A generate $BIN --path $MODEL --gen-subset test --quiet"
    cases = []
    for opt in ("--lr nan", "--adam-eps nan", "--weight-decay nan", "--seed -1", f"--seed {2**70}",
                "--eval-bleu --eval-bleu-beam 0", "--eval-bleu --eval-bleu-lenpen nan", "--clip-norm nan",
                "--warmup-init-lr nan", "--max-time-minutes nan", "--save-interval-minutes nan",
                "--required-batch-size-multiple -8", "--lr inf", "--dropout nan", "--label-smoothing 1.5"):
        cases.append(Case("options", f"train {opt}", f"{train} {opt}", expect_error(opt.split()[-2])))
    for opt in ("--threads 1e20", f"--threads {10**20}", "--max-len-a nan", "--max-len-a inf", "--unkpen nan",
                "--sampling --temperature nan", "--sampling --temperature inf", "--lenpen nan",
                "--min-len 100000", "--search beam --sampling", "--beam 20000", "--beam 0"):
        cases.append(Case("options", f"generate {opt}", f"{gen} {opt}", expect_error(opt.split()[-2])))
    return cases


def _none_left(r: Result) -> str | None:
    left = next((line.split("=", 1)[1] for line in r.out.splitlines() if line.startswith("left=")), "?")
    return None if left == "0" else f"{left} process(es) of the killed command still running"


def worker_cases() -> list[Case]:
    out = []
    for delay in (2, 3, 4, 5):  # spawned workers (several threads each) starting up, then translating
        out.append(Case("workers", f"SIGKILL to translate --workers 2 --threads 4 {delay} s after its start",
                        "setsid bash -c 'exec $PY -m attnmt.cli translate --path $MODEL --workers 2 --threads 4 "
                        f"< in.txt > /dev/null' & pid=$!; sleep {delay}; kill -9 $pid; sleep 10; "
                        "echo left=$(pgrep -s $pid | wc -l); pkill -9 -s $pid; exit 0",
                        _none_left, setup=_write("in.txt", "A man is riding a bike.\n" * 2000), timeout=120))
    return out


def output_cases() -> list[Case]:
    gen = "$A generate $BIN --path $MODEL --gen-subset test --quiet"

    def fifo(d: Path) -> None:
        os.mkfifo(d / "pipe")

    def link(d: Path) -> None:
        (d / "real.txt").write_text("old\n")
        (d / "link.txt").symlink_to("real.txt")

    return [
        Case("outputs", "--output into a FIFO", f"cat pipe > got.txt & {gen} --output pipe; wait; wc -l < got.txt",
             expect_ok(lambda r: None if r.out.strip() == "100" else f"the reader got {r.out.strip()} lines"),
             setup=fifo, timeout=60),
        Case("outputs", "--output to a symlink", f"{gen} --output link.txt; test -L link.txt; wc -l < real.txt",
             expect_ok(lambda r: None if r.out.strip() == "100" else "the link was replaced"), setup=link),
        Case("outputs", "--output /dev/fd/1 (a pipe)", f"{gen} --output /dev/fd/1 | wc -l",
             expect_ok(lambda r: None if r.out.strip() == "100" else f"{r.out.strip()} lines")),
        Case("outputs", "translate with stdout closed", "echo 'A man.' | $A translate --path $MODEL >&-",
             expect_error("stdout")),
        Case("outputs", "translate with stdin closed", "$A translate --path $MODEL <&-", expect_error("stdin")),
        Case("outputs", "score with stdin closed", "$A score --ref $RAW/test.de <&-", expect_error("stdin")),
        Case("outputs", "translate --format fairseq with PYTHONIOENCODING=ascii",
             "head -20 $RAW/test.de | $A translate --path $MODEL --format fairseq",
             expect_ok(lambda r: None if "ü" in r.out and sum(x.startswith("H-") for x in r.out.splitlines()) == 20
                       else "lines lost"),
             env={"PYTHONIOENCODING": "ascii"}),
        Case("outputs", "score with PYTHONIOENCODING=ascii", "$A score --ref $RAW/test.de < $RAW/test.de",
             expect_ok(), env={"PYTHONIOENCODING": "ascii"}),
        Case("outputs", "interactive --input FILE with bad UTF-8", "$A interactive --path $MODEL --input bad.txt",
             expect_error("bad.txt"), setup=_write("bad.txt", b"A man \xff\xfe.\n")),
    ]


def plugin_cases() -> list[Case]:
    return [
        Case("plugins", "a plugin named like a dependency", "$A --user-dir sacrebleu.py list",
             expect_error("sacrebleu"), setup=_write("sacrebleu.py", "x = 1\n")),
        Case("plugins", "a plugin raising BaseException", "$A --user-dir evil.py list", expect_error("evil"),
             setup=_write("evil.py", "raise BaseException('boom')\n")),
    ]


def _foreign_ids(d: Path) -> None:
    """The data-bin with its test split's ids written against a dictionary twice as large."""
    import shutil

    import numpy as np

    shutil.copytree(os.environ["_BIN"], d / "bin")
    for side in ("en", "de"):
        path = d / "bin" / f"test.en-de.{side}.bin"
        ids = np.fromfile(path, dtype=np.uint16)
        ids[5] = 65000
        ids.tofile(path)


def data_cases() -> list[Case]:
    return [
        Case("data", "generate on ids beyond the dictionary",
             "$A generate bin --path $MODEL --gen-subset test --quiet", expect_error("test.en-de"),
             setup=_foreign_ids),
        Case("data", "train on ids beyond the dictionary",
             f"cp bin/test.en-de.en.bin bin/train.en-de.en.bin; cp bin/test.en-de.en.idx bin/train.en-de.en.idx; "
             f"cp bin/test.en-de.de.bin bin/train.en-de.de.bin; cp bin/test.en-de.de.idx bin/train.en-de.de.idx; "
             f"$A train bin {TINY} --max-tokens 2048 --max-update 2 --save-dir ckpt --progress none",
             expect_error("train.en-de"), setup=_foreign_ids),
    ]


def _user_dir(name: str, files: dict[str, str]):
    def setup(d: Path) -> None:
        for rel, text in files.items():
            f = d / name / rel
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(text)
    return setup


def _kept(path: str, text: str):
    def check(r: Result) -> str | None:
        f = r.cwd / path
        return None if f.is_file() and f.read_text() == text else f"{path} was lost or changed"
    return check


def _no_traceback(r: Result) -> str | None:
    return "traceback" if r.traceback else None


def _digests(d: Path) -> dict[str, str]:
    import hashlib

    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.rglob("*"))
            if p.is_file()}


def directory_cases() -> list[Case]:
    export = "$A export --path $MODEL --to ctranslate2"

    def first_export(d: Path) -> None:
        run(f"{os.environ['_A']} export --path {os.environ['_MODEL']} --to huggingface --output-dir hf", d,
            check=True)
        (d / "before.json").write_text(json.dumps(_digests(d / "hf")))

    def whole(r: Result) -> str | None:
        before = json.loads((r.cwd / "before.json").read_text())
        return None if _digests(r.cwd / "hf") == before else "the directory is neither the old export nor a new one"

    def dangling(d: Path) -> None:
        (d / "ct2").symlink_to(d / "nowhere")

    def names_user_path(r: Result) -> str | None:
        last = (r.err.strip().splitlines() or [""])[-1]
        return f"the error names a temp directory: {last[:100]}" if ".ct2." in last else None

    return [
        Case("directory outputs", "export --force over a directory of the user's", f"{export} --output-dir mine --force",
             both(expect_error("mine"), _kept("mine/notes.txt", "precious\n")),
             setup=_user_dir("mine", {"notes.txt": "precious\n"})),
        Case("directory outputs", "export --force --output-dir . (the working directory)",
             f"cd here && {export} --output-dir . --force", both(expect_error("."), _kept("here/notes.txt", "mine\n")),
             setup=_user_dir("here", {"notes.txt": "mine\n"})),
        Case("directory outputs", "export --force over an earlier export", f"{export} --output-dir ct2 && "
             f"{export} --output-dir ct2 --force && test -f ct2/model.bin", expect_ok()),
        Case("directory outputs", "export to a dangling symlink", f"{export} --output-dir ct2",
             both(expect_error("ct2"), names_user_path), setup=dangling),
        Case("directory outputs", "export --to huggingface --force into a full disk over an earlier export",
             "(ulimit -f 64; $A export --path $MODEL --to huggingface --output-dir hf --force); exit 0",
             whole, setup=first_export),
    ]


def _fairseq_file(d: Path, name: str = "fs.pt", edit=None, raw=None) -> None:
    """The fixture's model as fairseq-train 0.12 would have written it (options as a dict, fairseq's names)."""
    import torch

    from attnmt.interop.fairseq import SAME_FIELDS, convert_to_fairseq

    ck = torch.load(os.environ["_MODEL"], weights_only=True)
    cfg = ck["model_config"]
    options = {k: cfg[k] for k in SAME_FIELDS} | {"arch": "transformer", "encoder_learned_pos": True,
                                                  "decoder_learned_pos": True, "activation_fn": "relu"}
    fs = {"args": None, "cfg": {"model": options, "task": {"source_lang": "en", "target_lang": "de"}},
          "model": convert_to_fairseq(ck, pad=1)}
    if edit:
        edit(fs)
    torch.save(fs if raw is None else raw, d / name)


def _flip_bytes(path: Path, count: int = 200) -> None:
    data = bytearray(path.read_bytes())
    start = len(data) // 2
    for i in range(start, start + count):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def integrity_cases() -> list[Case]:
    tr = "echo 'A man.' | $A translate --path bad.pt"
    imp = "$A import-fairseq fs.pt --data $BIN -o model.pt"

    def nan_attnmt(d: Path) -> None:
        _hostile_checkpoint(lambda ck: ck["model"]["decoder.layers.0.ffn.fc1.weight"].fill_(float("nan")))(d)

    def flipped_attnmt(d: Path) -> None:
        import shutil

        shutil.copy(os.environ["_MODEL"], d / "bad.pt")
        _flip_bytes(d / "bad.pt")

    def nan_fairseq(d: Path) -> None:
        _fairseq_file(d, edit=lambda fs: fs["model"]["decoder.layers.0.fc1.weight"].fill_(float("nan")))

    def flipped_fairseq(d: Path) -> None:
        _fairseq_file(d)
        _flip_bytes(d / "fs.pt")

    def copy_fairseq(d: Path) -> None:
        _fairseq_file(d)
        (d / "before.json").write_text(json.dumps(_digests(d)))

    def original_kept(r: Result) -> str | None:
        before = json.loads((r.cwd / "before.json").read_text())
        return None if _digests(r.cwd).get("fs.pt") == before["fs.pt"] else "the fairseq checkpoint was replaced"

    return [
        Case("checkpoint integrity", "a checkpoint with NaN weights", tr, expect_error("bad.pt", "NaN"),
             setup=nan_attnmt),
        Case("checkpoint integrity", "a checkpoint with 200 flipped bytes", tr, expect_error("bad.pt"),
             setup=flipped_attnmt),
        Case("checkpoint integrity", "import-fairseq of NaN weights", imp, expect_error("fs.pt", "NaN"),
             setup=nan_fairseq),
        Case("checkpoint integrity", "import-fairseq of a checkpoint with 200 flipped bytes", imp,
             expect_error("fs.pt"), setup=flipped_fairseq),
        Case("checkpoint integrity", "import-fairseq --output equal to its input",
             "$A import-fairseq fs.pt --data $BIN -o fs.pt", both(expect_error("fs.pt"), original_kept),
             setup=copy_fairseq),
        Case("checkpoint integrity", "import-fairseq, then translate (a valid checkpoint still works)",
             f"{imp} && echo 'A man.' | $A translate --path model.pt", expect_ok(), setup=_fairseq_file),
    ]


def import_cases() -> list[Case]:
    imp = "$A import-fairseq fs.pt --data $BIN -o model.pt"

    def edited(edit=None, raw=None):
        return lambda d: _fairseq_file(d, edit=edit, raw=raw)

    def drop(key):
        return edited(lambda fs: fs["model"].pop(key))

    def setcfg(**kv):
        return edited(lambda fs: fs["cfg"]["model"].update(kv))

    def args_as(value):
        def edit(fs):
            fs["args"], fs["cfg"] = value, None
        return edited(edit)

    def non_tensor(fs):
        fs["model"]["encoder.embed_tokens.weight"] = [[0.0] * 4] * 3

    def empty(d: Path) -> None:
        (d / "fs.pt").write_bytes(b"")

    def truncated(d: Path) -> None:
        _fairseq_file(d)
        data = (d / "fs.pt").read_bytes()
        (d / "fs.pt").write_bytes(data[: len(data) // 2])

    cases = [
        ("a missing weight", drop("decoder.layers.0.fc1.weight")),
        ("missing embeddings", drop("encoder.embed_tokens.weight")),
        ("args as a dict", args_as({"arch": "transformer"})),
        ("args as an int", args_as(7)),
        ("cfg.model as a list", edited(lambda fs: fs["cfg"].update(model=[1, 2]))),
        ("a list instead of a dict", edited(raw=[1, 2, 3])),
        ("an empty file", empty),
        ("a truncated file", truncated),
        ("non-tensor embeddings", edited(non_tensor)),
        ("encoder_layers -2", setcfg(encoder_layers=-2)),
        ("encoder_layers as a string", setcfg(encoder_layers="six")),
        ("decoder_embed_dim 2**40", setcfg(decoder_embed_dim=2**40)),
    ]
    out = []
    for name, setup in cases:
        def check(r: Result) -> str | None:
            bad = expect_error("fs.pt")(r)
            if bad:
                return bad
            last = r.err.strip().splitlines()[-1]
            if "--encoder-layers" in last or "--decoder-embed-dim" in last:
                return "the error reads as a command-line option"
            return None
        out.append(Case("hostile fairseq checkpoints", name, imp, both(check, no_files("model.pt")), setup=setup))
    return out


def lockfile_cases() -> list[Case]:
    train = f"$A train bin {TINY} --max-tokens 2048 --max-update 1 --save-dir ckpt --progress none --threads 2"
    prep = ("$A preprocess -q -s en -t de --trainpref $RAW/train --validpref $RAW/valid --destdir out "
            "--bpe sentencepiece --vocab-size 600 --joined-dictionary --workers 1")

    def linked(lock: str):
        def setup(d: Path) -> None:
            import shutil

            shutil.copytree(os.environ["_BIN"], d / "bin")
            (d / "ckpt").mkdir()
            (d / "victim.txt").write_text("precious\n")
            (d / lock).symlink_to(d / "victim.txt")
        return setup

    return [
        Case("lock files", "train: --save-dir's .attnmt.lock is a symlink to a user's file", train,
             both(_kept("victim.txt", "precious\n"), _no_traceback), setup=linked("ckpt/.attnmt.lock")),
        Case("lock files", "preprocess: .DESTDIR.lock is a symlink to a user's file", prep,
             both(_kept("victim.txt", "precious\n"), _no_traceback), setup=linked(".out.lock")),
    ]


def generate_output_cases() -> list[Case]:
    gen = "$A generate $BIN --path $MODEL --gen-subset test --quiet"

    def long_line(d: Path) -> None:
        lines = ["A man is riding a bike."] * 5
        lines[2] = " ".join(["word"] * 2000)
        (d / "in.txt").write_text("\n".join(lines) + "\n")

    return [
        Case("generate output", "generate --fairseq --format plain writes one line a sentence",
             f"{gen} --fairseq --format plain --output out.txt && wc -l < out.txt",
             expect_ok(lambda r: None if r.out.strip() == "100" else f"{r.out.strip()} lines for 100 sentences")),
        Case("generate output", "--skip-invalid-size-inputs-valid-test names the line",
             "$A generate --input in.txt --path $MODEL --skip-invalid-size-inputs-valid-test > out.txt",
             both(expect_ok(), says("line 3")), setup=long_line),
    ]


def _held_lock(d: Path) -> None:
    """A warm kernel cache, its library removed, and its lock held by another process for 300 s."""
    run(f"echo 'A man.' | {os.environ['_A']} translate --path {os.environ['_MODEL']}", d,
        env={"ATTNMT_CACHE_DIR": str(d / "cache")}, check=True)
    for so in (d / "cache").glob("kernels-*.so"):
        so.unlink()
        lock = so.with_suffix(".lock")
        lock.touch()
        subprocess.Popen(["flock", str(lock), "sleep", "300"], start_new_session=True)


def _dead_build(d: Path) -> None:
    run(f"echo 'A man.' | {os.environ['_A']} translate --path {os.environ['_MODEL']}", d,
        env={"ATTNMT_CACHE_DIR": str(d / "cache")}, check=True)
    for so in (d / "cache").glob("kernels-*.so"):
        so.unlink()
        old = d / "cache" / "tmpdead0123.so.tmp"  # as builds before the pid was in the name left them, 2 h ago
        old.write_bytes(b"\x7fELF half")
        os.utime(old, (time.time() - 7200, time.time() - 7200))
        (d / "cache" / f".{so.name}.{_dead_pid()}.x1.tmp").write_bytes(b"\x7fELF half")


def kernel_cache_cases() -> list[Case]:
    translate = "echo 'A man is riding a bike.' | $A translate --path $MODEL --threads 2"
    env = {"ATTNMT_CACHE_DIR": "cache", "ATTNMT_KERNEL_BUILD_TIMEOUT": "10"}

    def release(r: Result) -> str | None:
        subprocess.run(["pkill", "-f", f"flock {r.cwd}/cache"], check=False)
        return None

    return [
        Case("kernel cache", "a cache entry's lock held by another process (build limit 10 s)", translate,
             both(release, expect_ok(lambda r: None if r.out.strip() else "no translation"), says("kernels")),
             setup=_held_lock, env=env, timeout=60),
        Case("kernel cache", "temp files of a killed build", translate,
             both(expect_ok(), no_files("*.tmp", "cache")), setup=_dead_build, env=env),
    ]


FORK = """
import os, sys
from attnmt import Translator
t = Translator(sys.argv[1], threads=2)
print(t.translate("A man is riding a bike."), flush=True)
pid = os.fork()
if pid == 0:
    print(t.translate("A woman is walking."), flush=True)
    os._exit(0)
_, status = os.waitpid(pid, 0)
sys.exit(os.waitstatus_to_exitcode(status))
"""


def process_cases() -> list[Case]:
    def two_lines(r: Result) -> str | None:
        return None if len(r.out.strip().splitlines()) == 2 else "the forked child did not translate"

    def serve(first: str, second: str) -> str:  # five times, the second signal 0-300 ms after the first
        return ("for gap in 0 0.02 0.05 0.1 0.3; do "
                "$A serve --path $MODEL --port 0 > serve.out 2> serve.err & pid=$!; "
                "until grep -q serving serve.err || ! kill -0 $pid 2>/dev/null; do sleep 0.2; done; "
                f"kill -{first} $pid; sleep $gap; kill -{second} $pid; wait $pid; echo rc=$? >&2; cat serve.err >&2; "
                "done")

    def stopped(r: Result) -> str | None:
        if r.traceback:
            return f"traceback ({r.err.count('Traceback')} of 5 runs)"
        bad = [line for line in r.err.splitlines() if line.startswith("rc=") and line not in ("rc=0", "rc=130",
                                                                                               "rc=143")]
        return f"{bad[0]}" if bad else None

    return [
        Case("processes", "a process forked from one holding a Translator translates",
             "$PY fork.py $MODEL", expect_ok(two_lines), setup=_write("fork.py", FORK), timeout=90),
        Case("processes", "serve: two SIGINTs (5 runs, 0-300 ms apart)", serve("INT", "INT"), stopped, timeout=240),
        Case("processes", "serve: SIGTERM, then SIGINT (5 runs, 0-300 ms apart)", serve("TERM", "INT"), stopped,
             timeout=240),
    ]


def _log_line(line: str | bytes):
    def setup(d: Path) -> None:
        good = json.dumps({"type": "train", "num_updates": 1, "loss": 5.0}) + "\n"
        data = good.encode() + (line if isinstance(line, bytes) else line.encode("utf-8", "surrogatepass")) + b"\n"
        (d / "train.jsonl").write_bytes(data + (json.dumps({"type": "train", "num_updates": 2, "loss": 4.0}) +
                                                "\n").encode())
    return setup


def plot_cases() -> list[Case]:
    plot = "$A plot curves --log train.jsonl --out curves.png"

    def short(r: Result) -> str | None:
        return None if len(r.err) < 2000 else f"{len(r.err):,} characters on stderr"

    deep = "[" * 100_000 + "]" * 100_000
    return [
        Case("plots", "a deeply nested line", plot, both(expect_error("train.jsonl:2"), short),
             setup=_log_line(deep)),
        Case("plots", "a 5,000-digit integer", plot, both(expect_error("train.jsonl:2"), short),
             setup=_log_line('{"type": "train", "num_updates": ' + "9" * 5000 + ', "loss": 1}')),
        Case("plots", "a lone surrogate in a subset name", plot, expect_ok(),
             setup=_log_line('{"type": "valid", "subset": "\\ud800", "num_updates": 2, "loss": 1.0}')),
        Case("plots", "a 5 MB value in the error", plot, both(expect_error("train.jsonl:2"), short),
             setup=_log_line('{"type": "train", "num_updates": 3, "loss": "' + "x" * 5_000_000 + '"}')),
    ]


KINDS = {"kernels": kernel_cases, "checkpoints": checkpoint_cases, "temp files": temp_cases, "locks": lock_cases,
         "hostile checkpoints": hostile_cases, "options": option_cases, "workers": worker_cases,
         "outputs": output_cases, "plugins": plugin_cases, "data": data_cases,
         "directory outputs": directory_cases, "checkpoint integrity": integrity_cases,
         "hostile fairseq checkpoints": import_cases, "lock files": lockfile_cases,
         "generate output": generate_output_cases, "kernel cache": kernel_cache_cases, "processes": process_cases,
         "plots": plot_cases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default="../shared/data/multi30k", help="the Multi30k .gz files")
    ap.add_argument("--python", default=sys.executable, help="the Python whose attnmt runs the cases")
    ap.add_argument("--only", default="", help="comma-separated kinds to run (default: all)")
    ap.add_argument("--work", default="", help="keep the fixture and the cases' directories here")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="attnmt-faults-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    attnmt = f"{shlex.quote(args.python)} -m attnmt.cli"
    paths = build_fixture(work, Path(args.data).resolve(), attnmt)
    os.environ.update({"_A": attnmt, "_MODEL": paths["MODEL"], "_BIN": paths["BIN"], "_RAW": paths["RAW"]})
    wanted = [k for k in args.only.split(",") if k] or list(KINDS)
    print("| kind | case | command | exit | verdict |\n|---|---|---|---|---|")
    clean = total = 0
    for kind in wanted:
        for i, case in enumerate(KINDS[kind]()):
            d = work / "cases" / f"{kind.replace(' ', '_')}-{i}"
            if d.exists():
                subprocess.run(["rm", "-rf", str(d)])
            d.mkdir(parents=True)
            env = {"PY": args.python, "A": attnmt, **paths, **(case.env or {})}
            if "ATTNMT_CACHE_DIR" in env:
                env["ATTNMT_CACHE_DIR"] = str(d / env["ATTNMT_CACHE_DIR"])
            try:
                if case.setup:
                    case.setup(d)
                r = run(case.command, d, env=env, timeout=case.timeout)
                verdict = case.check(r)
            except subprocess.TimeoutExpired:
                r, verdict = Result(-1, "", "", d), f"still running after {case.timeout:.0f} s"
            total += 1
            clean += verdict is None
            shown = textwrap.shorten(case.command.replace("$A", "attnmt"), 110, placeholder=" ...")
            print(f"| {kind} | {case.name} | `{shown}` | {r.rc} | {'clean' if verdict is None else verdict} |",
                  flush=True)
            if verdict and os.environ.get("FAULT_CASES_VERBOSE"):
                print(textwrap.indent(r.err[-1500:], "    "), file=sys.stderr)
    print(f"\n{clean} of {total} clean")


if __name__ == "__main__":
    main()
