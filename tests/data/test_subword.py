import random

import pytest

from attnmt.cli import load_components
from attnmt.data.subword import (
    MosesTokenizer,
    NoBPE,
    NoTokenizer,
    SentencePieceBPE,
    TextPipeline,
    build_tokenizer,
)
from attnmt.errors import UserError
from attnmt.registry import get

WORDS = ("man woman child dog cat street house water ball red blue green small big young old runs walks "
         "plays sits stands jumps holds looks near with under over the a in on at").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(3, 12))]
        out.append(" ".join(words).capitalize() + ".")
    return out


@pytest.fixture(scope="module")
def train_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("spm") / "train.txt"
    p.write_text("\n".join(corpus(400)) + "\n", encoding="utf-8")
    return p


def test_registered():
    load_components()
    assert get("bpe", "sentencepiece").obj is SentencePieceBPE
    assert get("bpe", "none").obj is NoBPE
    assert get("tokenizer", "moses").obj is MosesTokenizer
    assert get("tokenizer", "none").obj is NoTokenizer
    with pytest.raises(UserError, match="valid choices: moses, moses_wmt19, none"):
        build_tokenizer("nltk", "en")


def test_sentencepiece_training_is_deterministic_and_round_trips(train_file, tmp_path):
    a = SentencePieceBPE.train([str(train_file)], 120, str(tmp_path / "a" / "spm"), max_sentences=1000)
    b = SentencePieceBPE.train([str(train_file)], 120, str(tmp_path / "b" / "spm"), max_sentences=1000)
    assert a.model_bytes() == b.model_bytes() == (tmp_path / "a" / "spm.model").read_bytes()
    assert a.piece_size() == 120
    assert a.training_sentences == 400
    for line in corpus(50, seed=7):  # unseen sentences of the same words
        pieces = a.encode(line)
        assert " " not in "".join(pieces.split()) and pieces.split()[0].startswith("▁")
        assert a.decode(pieces) == line
    batch = corpus(20, seed=3)
    assert a.encode_batch(batch) == [a.encode(s) for s in batch]
    c = SentencePieceBPE.from_bytes(a.model_bytes())
    assert c.encode(batch[0]) == a.encode(batch[0])
    d = SentencePieceBPE.load(tmp_path / "a" / "spm.model")
    assert d.encode(batch[1]) == a.encode(batch[1])


def test_sentence_cap_samples_deterministically(train_file, tmp_path):
    a = SentencePieceBPE.train([str(train_file)], 80, str(tmp_path / "a"), max_sentences=100)
    b = SentencePieceBPE.train([str(train_file)], 80, str(tmp_path / "b"), max_sentences=100)
    full = SentencePieceBPE.train([str(train_file)], 80, str(tmp_path / "c"), max_sentences=0)
    assert a.training_sentences == 100 and full.training_sentences == 400
    assert a.model_bytes() == b.model_bytes()
    assert a.pieces() != full.pieces()


def test_sentencepiece_errors(train_file, tmp_path):
    with pytest.raises(UserError, match="--vocab-size"):
        SentencePieceBPE.train([str(train_file)], 100000, str(tmp_path / "big"), max_sentences=1000)
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"not a model")
    with pytest.raises(UserError, match="bad.model: not a valid SentencePiece model"):
        SentencePieceBPE.load(bad)
    with pytest.raises(UserError, match="not found"):
        SentencePieceBPE.load(tmp_path / "missing.model")


def test_no_bpe_is_whitespace_normalised_identity():
    b = NoBPE()
    assert b.encode("  a  b\tc ") == "a b c"
    assert b.decode("a  b") == "a b"
    assert b.model_bytes() == b""


def test_moses_tokenizer_round_trip():
    t = MosesTokenizer("en")
    tok = t.encode('He said "it\'s 3.5 & <fine>".')
    assert tok == 'He said " it \'s 3.5 & < fine > " .'  # escape=False: no &quot; etc.
    assert t.decode("Two young , White males are outside .") == "Two young, White males are outside."
    assert NoTokenizer().encode("a ,b") == "a ,b"


def test_text_pipeline(train_file, tmp_path):
    spm = SentencePieceBPE.train([str(train_file)], 100, str(tmp_path / "m"), max_sentences=1000)
    p = TextPipeline(MosesTokenizer("en"), spm)
    line = "  The dog runs, near the water.  "
    pieces = p.encode(line)
    assert "," in pieces.replace("▁", " ").split()  # Moses split the comma before subwords
    assert p.decode(pieces) == line.strip()
    assert p.encode_batch([line, ""]) == [pieces, ""]
    lower = TextPipeline(NoTokenizer(), NoBPE(), lowercase=True)
    assert lower.encode(" The DOG ") == "the dog"


def test_fastbpe_applies_merges_by_rank_with_an_end_of_word_marker():
    """The subwords of fairseq's WMT'19 models (FSMT's merges.txt): merges apply best rank first, ``</w>`` marks a
    word's last piece, and decoding joins the pieces back into the words."""
    from attnmt.data.subword import FastBPE

    bpe = FastBPE(b"l o 5\nlo w</w> 4\ne r</w> 3\nlo w 2\n")
    assert bpe.encode("low lower lowest") == "low</w> low er</w> low e s t</w>"
    assert bpe.decode(bpe.encode("low lower lowest")) == "low lower lowest"
    with pytest.raises(UserError, match=r"merges.txt:2: expected 'first second \[count\]'"):
        FastBPE(b"a b\nc\n", "merges.txt")
    with pytest.raises(UserError, match="--bpe fastbpe applies the merges of an imported model"):
        FastBPE.train([], 10, "x")


def test_subword_nmt_word_cache_stays_bounded(monkeypatch):
    """A stream of new words (a service's inputs) does not grow subword-nmt's cache without end."""
    pytest.importorskip("subword_nmt")
    from attnmt.data.subword import SubwordNmtBPE

    bpe = SubwordNmtBPE(b"#version: 0.2\nt h\nth e</w>\n")
    monkeypatch.setattr(SubwordNmtBPE, "CACHE", 50)
    assert bpe.encode("the") == "the"
    for k in range(400):
        line = f"the w{k}"
        assert bpe.decode(bpe.encode(line)) == line
        assert len(bpe._bpe.cache) <= 50 + 2  # emptied once over the bound (a line adds at most two words)
