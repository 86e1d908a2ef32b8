"""What a fairseq user types, with fairseq's meaning: --remove-bpe, --lenpen-style fairseq, fairseq's architecture
names and training flags."""

from __future__ import annotations

import random

import pytest
from click.testing import CliRunner

from attnmt import registry
from attnmt.data.subword import remove_bpe


def run(args: list[str], stdin: str = "") -> tuple[int, str, str]:
    from attnmt.cli import cli

    registry.load_plugins()
    r = CliRunner().invoke(cli, args, input=stdin, catch_exceptions=True)
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return r.exit_code, r.stdout, r.stderr


@pytest.mark.parametrize("pieces, symbol, text", [
    ("a bi@@ g dog@@ gy runs", "@@ ", "a big doggy runs"),
    ("a bi@@ g dog@@ gy runs", "subword_nmt", "a big doggy runs"),
    ("end@@", "@@ ", "end"),  # a marker on the last piece goes too, as in fairseq
    ("\u2581a \u2581bi g \u2581dog", "sentencepiece", "a big dog"),
    ("a bi## g", "## ", "a big"),  # any other symbol: removed with what follows it
    ("a bi@@ g", "none", "a bi@@ g"),
])
def test_remove_bpe_as_fairseq(pieces, symbol, text):
    assert remove_bpe(pieces, symbol) == text


def _bpe_corpus(root, n: int = 60):
    """Parallel text already segmented by subword-nmt (``@@ `` markers), as a fairseq user brings it."""
    rng = random.Random(0)
    words = ["hou@@ se", "gar@@ den", "dog", "ca@@ t", "red", "blue", "sm@@ all", "big"]
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) for _ in range(n)]
    for split, part in (("train", lines[:50]), ("valid", lines[50:55]), ("test", lines[55:])):
        (root / f"{split}.en").write_text("\n".join(part) + "\n", encoding="utf-8")
        (root / f"{split}.de").write_text("\n".join(part) + "\n", encoding="utf-8")
    return lines[55:]


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    """A data-bin of subword-nmt text (preprocess --bpe none, fairseq-preprocess's behaviour) and a model on it."""
    from helpers import TINY_MODEL

    root = tmp_path_factory.mktemp("bpe")
    refs = _bpe_corpus(root)
    code, _, err = run(["preprocess", "--source-lang", "en", "--target-lang", "de", "--trainpref", str(root / "train"),
                        "--validpref", str(root / "valid"), "--testpref", str(root / "test"),
                        "--destdir", str(root / "bin"), "--joined-dictionary", "--workers", "1", "--quiet"])
    assert code == 0, err
    code, _, err = run(["train", str(root / "bin"), *TINY_MODEL, "--save-dir", str(root / "ck"), "--max-update", "2",
                        "--max-tokens", "256", "--threads", "1", "--progress", "lines"])
    assert code == 0, err
    return root, refs


def test_remove_bpe_on_a_model_of_presegmented_text(bpe_model):
    root, refs = bpe_model
    ck = str(root / "ck" / "checkpoint_last.pt")
    base = ["generate", str(root / "bin"), "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--format", "fairseq"]
    _, kept, _ = run(base)
    assert "@@ " in "\n".join(ln for ln in kept.splitlines() if ln.startswith("T-"))  # without the option: pieces
    code, out, err = run([*base, "--remove-bpe"])  # bare: subword-nmt's "@@ "
    assert code == 0, err
    rows = [ln.split("\t") for ln in out.splitlines()]
    assert [r[1] for r in rows if r[0].startswith("T-")] == [remove_bpe(t, "@@ ") for t in refs]
    for tag in ("H-", "D-"):
        assert not any("@@" in r[2] for r in rows if r[0].startswith(tag))
    _, plain, _ = run([*base[:-2], "--remove-bpe=subword_nmt", "--quiet"])
    assert plain.splitlines() == [r[2] for r in rows if r[0].startswith("D-")]
    # translate takes it too
    code, out, _ = run(["translate", "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--remove-bpe",
                        "--quiet"], "hou@@ se dog\n")
    assert code == 0 and "@@" not in out


def test_remove_bpe_with_a_subword_model_of_attnmt_changes_nothing(tmp_path):
    from pathlib import Path

    from attnmt.data.subword import SentencePieceBPE, TextPipeline
    from attnmt.inference import InferenceBundle

    corpus = tmp_path / "c.txt"
    corpus.write_text("\n".join(f"the small dog {i} runs in the big garden" for i in range(200)) + "\n")
    pipe = TextPipeline(None, SentencePieceBPE.train([str(corpus)], 40, str(tmp_path / "spm")))
    bundle = InferenceBundle(model=None, src_dict=None, tgt_dict=None, src_pipeline=pipe, tgt_pipeline=pipe,
                             source_lang="en", target_lang="de", path=Path("model.pt"))
    pieces = pipe.encode("the small dog runs")
    note = bundle.with_remove_bpe("@@ ")
    assert "model.pt carries its own subword model" in note and "changes nothing" in note
    assert bundle.detokenize(pieces) == "the small dog runs" and bundle.hypothesis_pieces(pieces) == pieces


def test_lenpen_style_fairseq_is_printed_and_used(bpe_model):
    root, _ = bpe_model
    ck = str(root / "ck" / "checkpoint_last.pt")
    base = ["generate", str(root / "bin"), "--path", ck, "--max-len-a", "0", "--max-len-b", "6", "--format", "fairseq",
            "--beam", "2", "--nbest", "2", "--lenpen", "1.0"]
    code, out, err = run([*base, "--lenpen-style", "fairseq"])
    assert code == 0, err
    assert "score = logprob / length^1 (fairseq)" in err
    for line in out.splitlines():
        if line.startswith("H-"):
            score = float(line.split("\t")[1])
        if line.startswith("P-"):
            pos = [float(x) for x in line.split("\t")[1].split()]
            assert score == pytest.approx(sum(pos) / len(pos), abs=1e-3)  # fairseq's |Y| ** lenpen
    code, _, err = run(base)
    assert "score = logprob / ((5 + length) / 6)^1 (GNMT)" in err
    code, _, err = run([*base, "--lenpen-style", "marian"])
    assert code != 0 and "marian" in err
