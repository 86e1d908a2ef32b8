"""Vocabulary shortlists: learned from a binarized split, read and written in CTranslate2's vmap format, used by the
search (a shortlist of the whole vocabulary translates exactly as none; a narrow one keeps every output token among
the batch's candidates and still meets constraints), carried to CTranslate2 by the export, and refused in one line
when malformed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import WORDS, make_checkpoint, make_data_bin, sentence_lines

from attnmt.errors import UserError
from attnmt.generation import shortlist as shortlists


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("shortlist"))


@pytest.fixture(scope="module")
def bundle(ckpt):
    from attnmt.inference import load_for_inference

    return load_for_inference(ckpt)


LINES = sentence_lines(12, 5)


def full_map(bundle, path: Path) -> Path:
    d = bundle.tgt_dict
    specials = {d.bos(), d.pad(), d.eos(), d.unk()}
    shortlists.Shortlist([i for i in range(len(d)) if i not in specials]).write(path, bundle.src_dict, d)
    return path


def narrow_map(bundle, path: Path) -> shortlists.Shortlist:
    """Each source piece maps to itself (the dictionary is joined) and the first 10 corpus pieces are always in."""
    d = bundle.tgt_dict
    first = d.nspecial
    sl = shortlists.Shortlist(list(range(first, first + 10)), {(i,): [i] for i in range(first, len(d))})
    sl.write(path, bundle.src_dict, d)
    return sl


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_a_shortlist_of_the_whole_vocabulary_translates_as_none(ckpt, bundle, tmp_path, quantize):
    from attnmt import Translator

    vmap = full_map(bundle, tmp_path / "full.vmap")
    opts = dict(max_len_b=16, threads=1, beam=4, nbest=2, quantize=quantize)
    with Translator(str(ckpt), **opts) as plain, Translator(str(ckpt), shortlist=str(vmap), **opts) as short:
        want = plain.translate(LINES, details=True)
        got = short.translate(LINES, details=True)
        assert [[h.tokens for h in t.hypotheses] for t in got] == [[h.tokens for h in t.hypotheses] for t in want]
        assert [t.score for t in got] == pytest.approx([t.score for t in want], abs=1e-5)


def test_a_narrow_shortlist_keeps_outputs_among_the_candidates_and_meets_constraints(ckpt, bundle, tmp_path):
    from attnmt import Translator

    sl = narrow_map(bundle, tmp_path / "narrow.vmap")
    d = bundle.tgt_dict
    with Translator(str(ckpt), shortlist=str(tmp_path / "narrow.vmap"), max_len_b=16, threads=1) as t:
        got = t.translate(LINES, details=True)  # one batch: its candidates are the union of its sentences'
        allowed = set(sl.candidates(t.encode_batch(LINES)))
        assert len(allowed) < len(d) - 10
        for r in got:
            assert {d.index(p) for p in r.tokens} <= allowed | {d.eos(), d.unk()}
        cons = [["dog"]] * len(LINES)  # "dog" may be outside a sentence's shortlist: the constraint brings it in
        for r in t.translate(LINES, constraints=cons, details=True):
            assert "dog" in r.text


def test_build_shortlist_learns_each_words_translation(tmp_path):
    data = make_data_bin(tmp_path / "bin", n_train=400)
    out = tmp_path / "toy.vmap"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "build-shortlist", str(data), "-o", str(out),
                        "--top-k", "1", "--frequent", "0"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "24 source tokens" in r.stderr
    from attnmt.data.dictionary import Dictionary

    d = Dictionary.load(data / "dict.en.txt")
    sl = shortlists.read(out, d, d)
    assert sl.always == []
    assert {d[k[0]]: [d[i] for i in v] for k, v in sl.rules.items()} == {w: [w.upper()] for w in WORDS}
    # the file round-trips: written again from what was read, byte for byte
    again = tmp_path / "again.vmap"
    sl.write(again, d, d)
    assert again.read_text(encoding="utf-8") == out.read_text(encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "build-shortlist", str(data), "-o", str(out),
                        "--frequent", "3"], capture_output=True, text=True)
    sl = shortlists.read(out, d, d)
    assert len(sl.always) == 3 and all(d[i].isupper() for i in sl.always)
    assert all(len(v) == 21 for v in sl.rules.values())  # every target word co-occurs with each source word
    assert all(d.index(d[k[0]].upper()) in v + sl.always for k, v in sl.rules.items())


@pytest.mark.parametrize("content, message", [
    ("▁a ▁the\n", ":1: no TAB"),
    ("\t▁zzzqqq\n", ":1: target piece '▁zzzqqq' is not in the model's target dictionary"),
    ("\t\n▁nope\t▁a\n", ":2: source piece '▁nope' is not in the model's source dictionary"),
    ("\n\n", "the shortlist is empty"),
])
def test_a_malformed_shortlist_is_one_line_naming_the_line(ckpt, bundle, tmp_path, content, message):
    bad = tmp_path / "bad.vmap"
    bad.write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        shortlists.read(bad, bundle.src_dict, bundle.tgt_dict)
    out = tmp_path / "out.txt"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "generate", "--path", str(ckpt), "--input", "-",
                        "--shortlist", str(bad), "--output", str(out)], input="A dog.\n", capture_output=True,
                       text=True)
    assert r.returncode == 1 and "Traceback" not in r.stderr and message in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not out.exists()


def test_the_export_carries_the_shortlist_to_ctranslate2(ckpt, bundle, tmp_path):
    ctranslate2 = pytest.importorskip("ctranslate2")
    vmap = tmp_path / "narrow.vmap"
    narrow_map(bundle, vmap)
    out = tmp_path / "ct2"
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "export", "--path", str(ckpt), "--to", "ctranslate2",
                        "--output-dir", str(out), "--shortlist", str(vmap)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (out / "vmap.txt").read_text(encoding="utf-8") == vmap.read_text(encoding="utf-8")
    tr = ctranslate2.Translator(str(out), device="cpu")
    pieces = [bundle.source_pieces(s).split() for s in bundle.encode_sources(LINES)]
    results = tr.translate_batch(pieces, use_vmap=True, beam_size=4, max_decoding_length=16)
    sl = shortlists.read(vmap, bundle.src_dict, bundle.tgt_dict)
    d = bundle.tgt_dict
    allowed = set(sl.candidates(bundle.encode_sources(LINES))) | {d.eos(), d.unk(), d.bos(), d.pad()}
    for res in results:  # CTranslate2 keeps to the same candidates (the batch's union, as attnmt's)
        assert {d.index(p) for p in res.hypotheses[0]} <= allowed
    bad = tmp_path / "bad.vmap"
    bad.write_text("no tab here\n", encoding="utf-8")
    r = subprocess.run([sys.executable, "-m", "attnmt.cli", "export", "--path", str(ckpt), "--to", "ctranslate2",
                        "--output-dir", str(tmp_path / "ct2b"), "--shortlist", str(bad)], capture_output=True,
                       text=True)
    assert r.returncode == 1 and ":1: no TAB" in r.stderr and not (tmp_path / "ct2b").exists()
