"""attnmt score: sacreBLEU / chrF agreement, generate-output parsing, tokenized BLEU, errors, JSON output."""

from __future__ import annotations

import gzip
import io
import json
import math
import random
from collections import Counter

import pytest
import sacrebleu

from attnmt import scoring
from attnmt.cli import main
from attnmt.errors import UserError


def run(argv, capsys, monkeypatch, stdin: str | None = None):
    """Run the CLI; return (exit code, stdout, stderr)."""
    if stdin is not None:
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(stdin.encode("utf-8")), encoding="utf-8"))
    code = 0
    try:
        main(argv)
    except SystemExit as e:
        code = e.code or 0
    out, err = capsys.readouterr()
    return code, out, err


def write(path, lines):
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return str(path)


REFS = [
    "The cat sat on the mat.",
    "It is raining in Berlin today, isn't it?",
    "Die Bundes-Länder haben 3 neue Gesetze beschlossen.",
    "A short one.",
]
HYPS = [
    "The cat sat on a mat.",
    "Today it rains in Berlin, doesn't it?",
    "Die Bundes-Länder beschlossen drei neue Gesetze.",
    "A short one.",
]


# ------------------------------------------------------------------------------------------------- sacreBLEU

def test_identical_is_100(tmp_path, capsys, monkeypatch):
    assert scoring.corpus_bleu(REFS, REFS).score == pytest.approx(100.0)
    ref = write(tmp_path / "ref.txt", REFS)
    code, out, err = run(["score", "--ref", ref, "--sys", ref], capsys, monkeypatch)
    assert code == 0, err
    assert out.startswith("BLEU|nrefs:1|case:mixed|eff:no|tok:13a|")
    assert " = 100.00 " in out


def test_hand_checked_case_matches_sacrebleu_api():
    # 13a leaves these tokens as they are: p1..p4 = 5/6, 3/5, 2/4, 1/3, equal lengths -> BP 1
    r = scoring.corpus_bleu(["the cat sat on the mat"], ["the cat sat on a mat"])
    assert r.counts == [5, 3, 2, 1] and r.totals == [6, 5, 4, 3]
    assert r.bp == 1.0
    assert r.score == pytest.approx(100 * (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25)
    assert r.score == pytest.approx(sacrebleu.corpus_bleu(["the cat sat on the mat"], [["the cat sat on a mat"]]).score)
    # a multi-line corpus with punctuation, case and a brevity penalty: same as sacreBLEU's own API
    for lc in (False, True):
        ours = scoring.corpus_bleu(HYPS, REFS, lowercase=lc)
        theirs = sacrebleu.corpus_bleu(HYPS, [REFS], lowercase=lc)
        assert ours.score == pytest.approx(theirs.score)
        assert ours.signature.startswith("nrefs:1|case:" + ("lc" if lc else "mixed"))
    intl = scoring.corpus_bleu(HYPS, REFS, tokenize="intl")
    assert intl.score == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS], tokenize="intl").score)
    assert "tok:intl" in intl.signature


def test_unknown_tokenizer_is_user_error():
    with pytest.raises(UserError, match="unknown sacreBLEU tokenizer 'bogus'; valid: .*13a"):
        scoring.corpus_bleu(HYPS, REFS, tokenize="bogus")


def test_chrf(tmp_path, capsys, monkeypatch):
    r = scoring.corpus_chrf(HYPS, REFS)
    assert r.metric == "chrf" and r.counts is None
    assert r.score == pytest.approx(sacrebleu.corpus_chrf(HYPS, [REFS]).score)
    assert scoring.corpus_chrf(REFS, REFS).score == pytest.approx(100.0)
    ref = write(tmp_path / "ref.txt", REFS)
    code, out, err = run(["score", "--ref", ref, "--metric", "chrf", "--json"], capsys, monkeypatch,
                         stdin="\n".join(HYPS) + "\n")
    assert code == 0, err
    d = json.loads(out)
    assert d["metric"] == "chrf" and d["score"] == pytest.approx(r.score) and d["signature"].startswith("nrefs:1")


# ------------------------------------------------------------------------------------------- generate output

def test_generate_output_h_lines_shuffled_ids_first_hypothesis(tmp_path, capsys, monkeypatch):
    ids = list(range(len(HYPS)))
    random.Random(3).shuffle(ids)
    lines = ["2024-01-01 | INFO | generate | loading model"]
    for i in ids:
        lines += [f"S-{i}\tsource {i}", f"T-{i}\t{REFS[i]}", f"H-{i}\t-0.25\t{HYPS[i]}", f"P-{i}\t-0.1 -0.2",
                  f"H-{i}\t-0.90\tsecond best {i}"]
    lines.append("Generate test with beam=4: BLEU4 = 1.00")
    assert scoring.parse_system_lines(lines) == HYPS
    ref = write(tmp_path / "ref.txt", REFS)
    gen = write(tmp_path / "gen.out", lines)
    code, out, err = run(["score", "--ref", ref, "--sys", gen, "--json"], capsys, monkeypatch)
    assert code == 0, err
    assert json.loads(out)["score"] == pytest.approx(sacrebleu.corpus_bleu(HYPS, [REFS]).score)


def test_generate_output_prefers_d_lines():
    lines = []
    for i in (1, 0):
        lines += [f"H-{i}\t-0.5\ttok@@ enized {i}", f"D-{i}\t-0.5\tdetok {i}", f"D-{i}\t-0.9\tworse {i}"]
    assert scoring.parse_system_lines(lines) == ["detok 0", "detok 1"]
    # an empty hypothesis keeps its line
    assert scoring.parse_system_lines(["H-1\t-1.0\tb", "H-0\t-2.0\t"]) == ["", "b"]


def test_plain_lines_are_not_mistaken_for_generate_output():
    lines = ["H-Milch ist gut.", "Hallo\tWelt"]
    assert scoring.parse_system_lines(lines) == lines


def test_malformed_generate_line_names_the_line():
    with pytest.raises(UserError, match=r"gen.out:2: malformed H- line"):
        scoring.parse_system_lines(["H-0\t-0.1\tok", "H-1\tnot-a-score\ttext"], "gen.out")


# --------------------------------------------------------------------------------------------------- errors

def test_line_count_mismatch_states_both_counts_and_files(tmp_path, capsys, monkeypatch):
    ref = write(tmp_path / "ref.txt", REFS)
    hyp = write(tmp_path / "hyp.txt", HYPS[:3])
    code, out, err = run(["score", "--ref", ref, "--sys", hyp], capsys, monkeypatch)
    assert code == 1 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("attnmt: error: line-count mismatch")
    assert f"system {hyp} has 3 lines" in err and f"reference {ref} has 4 lines" in err


def test_empty_input_is_an_error(tmp_path, capsys, monkeypatch):
    ref = write(tmp_path / "ref.txt", REFS)
    code, out, err = run(["score", "--ref", ref], capsys, monkeypatch, stdin="")
    assert code == 1 and err.count("\n") == 1
    assert "empty input: system stdin has 0 lines, reference" in err and "has 4 lines" in err
    with pytest.raises(UserError, match="empty input"):
        scoring.tokenized_bleu([], [])


def test_bad_files_are_one_line_errors(tmp_path, capsys, monkeypatch):
    code, _, err = run(["score", "--ref", str(tmp_path / "missing.txt")], capsys, monkeypatch, stdin="x\n")
    assert code == 1 and "missing.txt: no such file" in err
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"ok\nM\xfcller\n")
    code, _, err = run(["score", "--ref", str(bad)], capsys, monkeypatch, stdin="a\nb\n")
    assert code == 1 and "latin1.txt:2: not valid UTF-8" in err
    ref = write(tmp_path / "ref.txt", REFS)
    code, _, err = run(["score", "--ref", ref, "--compound-split"], capsys, monkeypatch, stdin="x\n")
    assert code == 1 and "--compound-split only applies to --tokenized-bleu" in err


def test_gzipped_reference_and_crlf(tmp_path, capsys, monkeypatch):
    gz = tmp_path / "ref.txt.gz"
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write("".join(r + "\r\n" for r in REFS))
    assert scoring.read_lines(str(gz), "reference") == REFS
    code, out, err = run(["score", "--ref", str(gz), "--sys", "-"], capsys, monkeypatch, stdin="\n".join(REFS))
    assert code == 0, err
    assert " = 100.00 " in out


def test_json_fields(tmp_path, capsys, monkeypatch):
    ref = write(tmp_path / "ref.txt", REFS)
    hyp = write(tmp_path / "hyp.txt", HYPS)
    code, out, err = run(["score", "--ref", ref, "--sys", hyp, "--json"], capsys, monkeypatch)
    assert code == 0, err
    d = json.loads(out)
    assert set(d) == {"metric", "score", "signature", "counts", "totals", "precisions", "bp", "sys_len", "ref_len",
                      "n_lines", "mode"}
    theirs = sacrebleu.corpus_bleu(HYPS, [REFS])
    assert d["metric"] == "bleu" and d["mode"] == "sacrebleu" and d["n_lines"] == 4
    assert d["score"] == pytest.approx(theirs.score)
    assert d["counts"] == list(theirs.counts) and d["totals"] == list(theirs.totals)
    assert d["sys_len"] == theirs.sys_len and d["ref_len"] == theirs.ref_len and d["bp"] == pytest.approx(theirs.bp)
    assert "tok:13a" in d["signature"]


# ---------------------------------------------------------------------------------------------- tokenized BLEU

def multi_bleu_reference(hyps, refs):
    """The multi-bleu.perl formula, written independently: clipped n-gram matches, BP, log(0) -> score 0."""
    match, total, c, r = [0] * 4, [0] * 4, 0, 0
    for h, ref in zip(hyps, refs):
        h, ref = h.split(), ref.split()
        c, r = c + len(h), r + len(ref)
        for n in range(1, 5):
            hn = Counter(tuple(h[i:i + n]) for i in range(len(h) - n + 1))
            rn = Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
            match[n - 1] += sum((hn & rn).values())
            total[n - 1] += sum(hn.values())
    if min(match) == 0:
        return 0.0
    bp = math.exp(1 - r / c) if c < r else 1.0
    return 100 * bp * math.exp(sum(math.log(m / t) for m, t in zip(match, total)) / 4)


def test_tokenized_bleu_equals_multi_bleu_formula(tmp_path, capsys, monkeypatch):
    refs = ["the quick brown fox jumps over the lazy dog .", "a b c d e f g", "one two three four five six"]
    hyps = ["the quick brown fox jumped over the lazy dog .", "a b c d x f", "one two three four"]  # shorter: BP<1
    r = scoring.tokenized_bleu(hyps, refs)
    expected = multi_bleu_reference(hyps, refs)
    assert 0 < expected < 100 and r.bp < 1
    assert r.score == pytest.approx(expected)
    assert r.sys_len == 20 and r.ref_len == 23
    assert r.counts[0] == 9 + 5 + 4
    # no tokenization of its own: "dog." is one token and no longer matches "dog ."
    assert scoring.tokenized_bleu(["the dog."], ["the dog ."]).counts[0] == 1
    # cased by default; --lowercase folds both sides
    assert scoring.tokenized_bleu(["The Dog"], ["the dog"]).counts[0] == 0
    assert scoring.tokenized_bleu(["The Dog"], ["the dog"], lowercase=True).counts[0] == 2
    # a missing 4-gram match gives 0, as multi-bleu.perl does
    assert scoring.tokenized_bleu(["a b c"], ["a b c"]).score == 0.0

    ref = write(tmp_path / "ref.txt", refs)
    code, out, err = run(["score", "--ref", ref, "--tokenized-bleu", "--json"], capsys, monkeypatch,
                         stdin="\n".join(hyps) + "\n")
    assert code == 0, err
    d = json.loads(out)
    assert d["mode"] == "tokenized" and d["score"] == pytest.approx(expected)
    code, out, err = run(["score", "--ref", ref, "--tokenized-bleu"], capsys, monkeypatch, stdin="\n".join(hyps))
    assert "NOT comparable to sacreBLEU" in out and "mode:tokenized" in out


def test_compound_split():
    assert scoring.split_compounds("Bundes-Land") == "Bundes ##AT##-##AT## Land"
    assert scoring.split_compounds("a - b") == "a - b"  # a free-standing dash is no compound
    assert scoring.split_compounds("a-b-c") == "a ##AT##-##AT## b-c"  # non-overlapping, as the Perl one-liner
    tok = scoring.moses_tokenize("Das Bundes-Land, \"ja\".", "de")
    assert tok == "Das Bundes-Land , &quot; ja &quot; ."
    r = scoring.tokenized_bleu(["Das Bundes-Land hat Science-Fiction gern."],
                               ["Das Bundes-Land hat Science-Fiction gern."], compound_split=True)
    # Das Bundes ##AT##-##AT## Land hat Science ##AT##-##AT## Fiction gern .
    assert r.sys_len == 10 and r.score == pytest.approx(100.0)
    assert r.mode == "tokenized+compound-split" and "compound:atat" in r.signature
    # splitting rewards a correct compound with three matching tokens instead of one
    hyp, ref = ["Er mag Science-Fiction sehr"], ["Er mag Science-Fiction nicht"]
    assert scoring.tokenized_bleu(hyp, ref, compound_split=True).score > scoring.tokenized_bleu(hyp, ref).score


def test_compound_split_cli_warns_on_tokenized_reference(tmp_path, capsys, monkeypatch):
    ref = write(tmp_path / "ref.tok", ["Das ist &quot; gut &quot; ."])
    code, out, err = run(["score", "--ref", ref, "--tokenized-bleu", "--compound-split"], capsys, monkeypatch,
                         stdin="Das ist \"gut\".\n")
    assert code == 0
    assert "looks Moses-tokenized already" in err and "tokenized+compound-split" in out


def test_fairseq_score_bleu_reproduces_fairseq_scores_hash_collisions():
    """fairseq-score hashes n-grams of dictionary ids with sign-extended bytes, so 'x y' (ids 125, 126) matches
    'p q' (ids 141, 142) here; the expected line is fairseq-score 0.12.2's on these two files. Exact n-gram
    matching (--tokenized-bleu) gives 98.4 bigram precision instead of 100.0."""
    from attnmt.scoring import fairseq_score_bleu

    filler = " ".join(f"a{i}" for i in range(4, 125))  # ids 4..124 of a fresh fairseq Dictionary
    hyps = [filler, "x y z"]
    refs = [filler, " ".join(f"b{i}" for i in range(127, 141)) + " p q z"]
    assert fairseq_score_bleu(hyps, refs) == ("BLEU4 = 88.78, 98.4/100.0/99.2/100.0 (BP=0.893, ratio=0.899, "
                                              "syslen=124, reflen=138)")
    assert scoring.tokenized_bleu(hyps, refs).precisions[1] == pytest.approx(100 * 120 / 122)
