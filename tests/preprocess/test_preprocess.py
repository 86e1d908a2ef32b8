"""attnmt preprocess end to end on a small corpus written here: outputs, determinism, round trips, errors."""

import gzip
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from attnmt.cli import main
from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDataset
from attnmt.data.subword import TextPipeline
from attnmt.data.textio import scan
from attnmt.preprocess import PreprocessConfig, preprocess
from attnmt.preprocess.plan import plan_parts as _parts
from attnmt.preprocess.plan import plan_splits as _splits

EN_DE = {"man": "Mann", "woman": "Frau", "child": "Kind", "dog": "Hund", "cat": "Katze", "street": "Straße",
         "house": "Haus", "water": "Wasser", "ball": "Ball", "red": "rot", "blue": "blau", "green": "grün",
         "small": "klein", "big": "groß", "young": "jung", "old": "alt", "runs": "läuft", "walks": "geht",
         "plays": "spielt", "sits": "sitzt", "jumps": "springt", "holds": "hält", "near": "nahe", "with": "mit",
         "under": "unter", "over": "über", "the": "der", "a": "ein", "in": "in", "on": "auf"}
WORDS = sorted(EN_DE)
MAX_LEN = 40


def pair(rng: random.Random, n_words: int | None = None) -> tuple[str, str]:
    words = [rng.choice(WORDS) for _ in range(n_words or rng.randint(3, 12))]
    return (" ".join(words).capitalize() + ".", " ".join(EN_DE[w] for w in words).capitalize() + ".")


def write_split(prefix: Path, pairs, gz: bool = False) -> None:
    for side, lang in ((0, "en"), (1, "de")):
        text = "".join(p[side] + "\n" for p in pairs).encode("utf-8")
        if gz:
            with gzip.open(f"{prefix}.{lang}.gz", "wb") as f:
                f.write(text)
        else:
            Path(f"{prefix}.{lang}").write_bytes(text)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """600 training pairs (with one-sided and two-sided empty lines, an overlong pair, trailing spaces),
    a plain valid set with empty lines and a gzipped test set."""
    root = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    train = [pair(rng) for _ in range(600)]
    train[4] = (train[4][0] + "   ", train[4][1] + " ")  # trailing spaces (as in Multi30k train.de)
    train[9] = ("", train[9][1])  # empty source
    train[19] = ("   ", "")  # both empty after stripping
    train[29] = pair(rng, 60)  # overlong: > MAX_LEN pieces
    write_split(root / "train", train)
    valid = [pair(rng) for _ in range(30)]
    valid[3] = ("", "")
    valid[6] = ("A dog.", "")
    write_split(root / "valid", valid)
    test = [pair(rng) for _ in range(30)]
    write_split(root / "test", test, gz=True)
    return {"root": root, "train": train, "valid": valid, "test": test}


def run_preprocess(corpus, destdir, **kw):
    root = corpus["root"]
    opts = dict(source_lang="en", target_lang="de", trainpref=str(root / "train"), validpref=str(root / "valid"),
                testpref=str(root / "test"), destdir=str(destdir), bpe="sentencepiece", vocab_size=150,
                joined_dictionary=True, max_len=MAX_LEN, workers=1)
    opts.update(kw)
    return preprocess(PreprocessConfig(**opts), quiet=True)


@pytest.fixture(scope="module")
def binarized(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("bin")
    s1 = run_preprocess(corpus, out / "w1", workers=1)
    s2 = run_preprocess(corpus, out / "w2", workers=2)
    return {"w1": out / "w1", "w2": out / "w2", "s1": s1, "s2": s2}


def test_layout_and_summary(binarized, corpus):
    d = binarized["w1"]
    names = sorted(p.name for p in d.iterdir())
    expected = ["dict.de.txt", "dict.en.txt", "preprocess.json", "spm.model"] + sorted(
        f"{split}.en-de.{lang}.{ext}" for split in ("train", "valid", "test") for lang in ("en", "de")
        for ext in ("bin", "idx"))
    assert names == sorted(expected)
    meta = json.loads((d / "preprocess.json").read_text())
    assert meta["source_lang"] == "en" and meta["target_lang"] == "de" and meta["joined_dictionary"] is True
    assert meta["bpe"] == "sentencepiece" and meta["bpe_model"] == "spm.model" and meta["tokenizer"] == "none"
    assert meta["bpe_settings"]["pieces"] == 150
    train = meta["splits"]["train"]
    assert train["lines"] == 600 and train["pairs"] == 597
    assert train["skipped"] == {"empty": 2, "too_long": 1, "max_len": MAX_LEN}
    assert train["skipped_lines_examples"] == {"empty": [10, 20], "too_long": [30]}
    assert meta["splits"]["valid"]["pairs"] == 30 and meta["splits"]["valid"]["empty_lines_kept"] == 2
    assert meta["splits"]["test"]["inputs"]["en"]["path"].endswith("test.en.gz")
    # checksums are of the decompressed text
    assert meta["splits"]["test"]["inputs"]["en"]["sha256"] == scan(corpus["root"] / "test.en.gz").sha256
    dict_en = Dictionary.load(d / "dict.en.txt")
    assert meta["dictionaries"]["en"] == {"file": "dict.en.txt", "size": len(dict_en), "sha256": dict_en.checksum()}
    assert (d / "dict.en.txt").read_bytes() == (d / "dict.de.txt").read_bytes()
    assert len(dict_en) % 8 == 0
    ds = IndexedDataset(str(d / "train.en-de.en"))
    assert len(ds) == 597
    assert train["sides"]["en"]["tokens"] == int(ds.sizes.sum())
    assert train["sides"]["en"]["unk_rate"] == 0.0
    assert meta["options"]["max_len"] == MAX_LEN and meta["options"]["workers"] == 1


def test_two_workers_give_byte_identical_output(binarized, corpus):
    cfg = PreprocessConfig(source_lang="en", target_lang="de", trainpref=str(corpus["root"] / "train"), workers=2)
    split = _splits(cfg)[0]
    assert len(_parts(split, {p: scan(p) for p in split.paths.values()}, 2)) > 1  # the work really was split
    w1, w2 = binarized["w1"], binarized["w2"]
    files = sorted(p.name for p in w1.iterdir())
    assert files == sorted(p.name for p in w2.iterdir())
    for name in files:
        if name != "preprocess.json":
            assert (w1 / name).read_bytes() == (w2 / name).read_bytes(), name
    m1, m2 = (json.loads((w / "preprocess.json").read_text()) for w in (w1, w2))
    for m in (m1, m2):
        del m["elapsed_s"], m["options"]["workers"], m["options"]["destdir"]
    assert m1 == m2


def test_binarized_train_decodes_to_the_input(binarized, corpus):
    d = binarized["w1"]
    kept = [p for i, p in enumerate(corpus["train"]) if i not in (9, 19, 29)]
    for side, lang in ((0, "en"), (1, "de")):
        dictionary = Dictionary.load(d / f"dict.{lang}.txt")
        pipe = TextPipeline.from_data_dir(d, lang)
        ds = IndexedDataset(str(d / f"train.en-de.{lang}"))
        decoded = [pipe.decode(dictionary.string(ds[i])) for i in range(len(ds))]
        assert decoded == [p[side].strip() for p in kept]
        assert all(ds[i][-1] == dictionary.eos() for i in range(len(ds)))


def test_valid_and_test_keep_every_line_in_order(binarized, corpus):
    d = binarized["w1"]
    dictionary = Dictionary.load(d / "dict.en.txt")
    for split in ("valid", "test"):
        for side, lang in ((0, "en"), (1, "de")):
            ds = IndexedDataset(str(d / f"{split}.en-de.{lang}"))
            pipe = TextPipeline.from_data_dir(d, lang)
            assert len(ds) == 30
            assert [pipe.decode(dictionary.string(ds[i])) for i in range(30)] == [p[side] for p in corpus[split]]
    assert IndexedDataset(str(d / "valid.en-de.en"))[3].tolist() == [dictionary.eos()]  # empty line -> </s>
    assert IndexedDataset(str(d / "valid.en-de.de"))[6].tolist() == [dictionary.eos()]


def test_reused_dictionaries_and_model_binarize_new_data_identically(binarized, corpus, tmp_path):
    d = binarized["w1"]
    summary = preprocess(PreprocessConfig(
        source_lang="en", target_lang="de", testpref=str(corpus["root"] / "test"), destdir=str(tmp_path / "t"),
        bpe="sentencepiece", spm_model=str(d / "spm.model"), srcdict=str(d / "dict.en.txt"),
        tgtdict=str(d / "dict.de.txt"), joined_dictionary=True), quiet=True)
    assert summary["splits"]["test"]["pairs"] == 30
    for name in ("test.en-de.en.bin", "test.en-de.en.idx", "test.en-de.de.bin", "dict.en.txt", "spm.model"):
        assert (tmp_path / "t" / name).read_bytes() == (d / name).read_bytes(), name


def test_bpe_none_moses_lowercase_separate_dictionaries(corpus, tmp_path):
    s = run_preprocess(corpus, tmp_path / "o", bpe="none", tokenizer="moses", lowercase=True,
                       joined_dictionary=False, thresholdtgt=1000, nwordssrc=12, padding_factor=1)
    d = tmp_path / "o"
    assert not (d / "spm.model").exists() and s["bpe_model"] is None
    src, tgt = Dictionary.load(d / "dict.en.txt"), Dictionary.load(d / "dict.de.txt")
    assert len(src) == 12 and len(tgt) == 4  # nwords includes the 4 special symbols; threshold drops all
    assert s["splits"]["train"]["sides"]["de"]["unk_rate"] == 1.0
    run_preprocess(corpus, tmp_path / "full", bpe="none", tokenizer="moses", lowercase=True)
    dictionary = Dictionary.load(tmp_path / "full" / "dict.en.txt")
    assert "." in dictionary and "dog" in dictionary and "Dog" not in dictionary  # tokenized, lowercased
    pipe = TextPipeline.from_data_dir(tmp_path / "full", "en")
    ds = IndexedDataset(str(tmp_path / "full" / "test.en-de.en"))
    assert [pipe.decode(dictionary.string(ds[i])) for i in range(30)] == [p[0].lower() for p in corpus["test"]]


# ------------------------------------------------------------------------------------------------ BPE-dropout


@pytest.fixture(scope="module")
def sampled(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("sampled")
    meta = run_preprocess(corpus, out / "w1", bpe_dropout=0.3, bpe_dropout_samples=3, workers=1)
    run_preprocess(corpus, out / "w2", bpe_dropout=0.3, bpe_dropout_samples=3, workers=2)
    return {"w1": out / "w1", "w2": out / "w2", "meta": meta}


def test_bpe_dropout_leaves_the_deterministic_output_as_it_was(binarized, sampled):
    for name in sorted(p.name for p in binarized["w1"].iterdir()):
        if name != "preprocess.json":
            assert (sampled["w1"] / name).read_bytes() == (binarized["w1"] / name).read_bytes(), name
    assert "bpe_dropout" not in binarized["s1"]["fingerprint"]["options"]  # older data-bins stay up to date
    assert sampled["meta"]["fingerprint"]["options"]["bpe_dropout"] == 0.3


def test_bpe_dropout_segmentations_are_the_same_pairs_in_other_pieces(binarized, sampled, corpus):
    d = sampled["w1"]
    meta = sampled["meta"]["bpe_dropout"]
    assert meta["dropout"] == 0.3 and meta["samples"] == 3
    assert meta["splits"] == ["train_sample1", "train_sample2", "train_sample3"]
    kept = [p for i, p in enumerate(corpus["train"]) if i not in (9, 19, 29)]
    dictionary = Dictionary.load(d / "dict.en.txt")
    for side, lang in ((0, "en"), (1, "de")):
        pipe = TextPipeline.from_data_dir(d, lang)
        det = IndexedDataset(str(d / f"train.en-de.{lang}"))
        samples = [IndexedDataset(str(d / f"train_sample{k}.en-de.{lang}")) for k in (1, 2, 3)]
        for ds in samples:
            assert len(ds) == len(kept)
            assert [pipe.decode(dictionary.string(ds[i])) for i in range(len(ds))] == [p[side].strip() for p in kept]
            # pieces missing from the dictionary went to characters
            assert all(dictionary.unk() not in ds[i].tolist() for i in range(len(ds)))
            assert ds.sizes.sum() > det.sizes.sum()  # finer pieces: longer sentences
            assert meta["sides"][lang]["unk"] == 0
        a, b = ([ds[i].tolist() for i in range(len(ds))] for ds in samples[:2])
        assert a != b and a != [det[i].tolist() for i in range(len(det))]
    for name in (p.name for p in d.iterdir()):  # seeded by line, not by worker: any --workers gives the same bytes
        if name != "preprocess.json":
            assert (d / name).read_bytes() == (sampled["w2"] / name).read_bytes(), name


# ------------------------------------------------------------------------------------------------ command line


def cli(args, capsys) -> tuple[int, str]:
    """Run ``attnmt ARGS`` in this process; return (exit code, stderr)."""
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code or 0
    return code, capsys.readouterr().err


def base_args(corpus, destdir):
    root = corpus["root"]
    return ["preprocess", "-s", "en", "-t", "de", "--trainpref", str(root / "train"), "--validpref",
            str(root / "valid"), "--destdir", str(destdir), "--bpe", "sentencepiece", "--vocab-size", "150",
            "--joined-dictionary", "--max-len", str(MAX_LEN)]


def test_cli_rerun_is_a_no_op_and_a_different_one_is_refused(corpus, tmp_path, capsys):
    dest = tmp_path / "bin"
    code, err = cli(base_args(corpus, dest), capsys)
    assert code == 0 and "pairs" in err and "skipped" in err  # the summary table
    mtimes = {p.name: p.stat().st_mtime_ns for p in dest.iterdir()}
    code, err = cli(base_args(corpus, dest), capsys)
    assert code == 0 and "up to date" in err
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == mtimes
    code, err = cli(base_args(corpus, dest) + ["--vocab-size", "140"], capsys)
    lines = err.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in err
    assert str(dest) in lines[0] and "different preprocessing" in lines[0] and "--vocab-size 150 vs 140" in lines[0]
    assert "choose another --destdir or delete" in lines[0]
    assert {p.name: p.stat().st_mtime_ns for p in dest.iterdir()} == mtimes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no temp directory left beside it


def test_cli_refuses_a_foreign_non_empty_destdir(corpus, tmp_path, capsys):
    dest = tmp_path / "bin"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    code, err = cli(base_args(corpus, dest), capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1 and str(dest) in err
    assert sorted(p.name for p in dest.iterdir()) == ["notes.txt"]


def bad_inputs(root: Path) -> dict[str, tuple[str, str]]:
    """name -> (prefix, expected 'file:line' in the message)."""
    (root / "short.en").write_text("a b\nc d\ne f\n")
    (root / "short.de").write_text("x y\nz w\n")
    (root / "latin.en").write_bytes("a b\ncaf\xe9 au lait\n".encode("latin-1"))
    (root / "latin.de").write_text("x\ny\n")
    with gzip.open(root / "gzbad.de.gz", "wb") as f:
        f.write(b"ok\nok\nbroken \xc3\n")
    (root / "gzbad.en").write_text("a\nb\nc\n")
    return {"mismatch": ("short", f"{root / 'short.de'}:3:"),
            "utf8": ("latin", f"{root / 'latin.en'}:2:"),
            "utf8_gz": ("gzbad", f"{root / 'gzbad.de.gz'}:3:"),
            "missing": ("absent", f"{root / 'absent.en'}")}


@pytest.mark.parametrize("case", ["mismatch", "utf8", "utf8_gz", "missing"])
def test_cli_bad_input_is_one_line_naming_file_and_line(tmp_path, capsys, case):
    prefix, where = bad_inputs(tmp_path)[case]
    dest = tmp_path / "out"
    code, err = cli(["preprocess", "-s", "en", "-t", "de", "--trainpref", str(tmp_path / prefix), "--destdir",
                     str(dest), "--workers", "2"], capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("attnmt: error: ") and where in lines[0]
    if case == "mismatch":
        assert "3 lines" in lines[0] and str(tmp_path / "short.en") in lines[0]
    if case.startswith("utf8"):
        assert "invalid UTF-8 at byte" in lines[0]
    if case == "missing":
        assert str(tmp_path / "absent.en.gz") in lines[0]  # both tried paths are named
    assert not dest.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out")]


def test_real_process_reports_bad_input_without_traceback(tmp_path):
    prefix, where = bad_inputs(tmp_path)["mismatch"]
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "preprocess", "-s", "en", "-t", "de", "--trainpref",
                        str(tmp_path / prefix), "--destdir", str(tmp_path / "out")],
                       capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"}, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and where in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("extra, expected", [
    (["--bpe-dropout", "1"], "--bpe-dropout is the probability of skipping a merge: give a value in [0, 1)"),
    (["--bpe-dropout", "0.1", "--bpe", "none"], "--bpe-dropout needs --bpe sentencepiece, got --bpe none"),
    (["--bpe-dropout", "0.1", "--bpe-dropout-samples", "0"], "--bpe-dropout-samples must be at least 1, got 0"),
])
def test_cli_bpe_dropout_options_are_checked(corpus, tmp_path, capsys, extra, expected):
    code, err = cli(base_args(corpus, tmp_path / "bin") + extra, capsys)
    lines = err.strip().splitlines()
    assert code != 0 and len(lines) == 1 and "Traceback" not in err and expected in lines[0], err
    assert not (tmp_path / "bin").exists()


def test_cli_bpe_dropout_summary_names_the_segmentations(corpus, tmp_path, capsys):
    code, err = cli(base_args(corpus, tmp_path / "bin") + ["--bpe-dropout", "0.2", "--bpe-dropout-samples", "2"],
                    capsys)
    assert code == 0, err
    line = next(x for x in err.splitlines() if x.startswith("BPE-dropout"))
    assert line.startswith("BPE-dropout 0.2: 2 segmentations of train (train_sample1, ...), en 1.") and " and de 1." in line
    assert line.endswith("x its tokens")
