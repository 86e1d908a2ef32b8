import hashlib
import json

import numpy as np
import pytest

from attnmt.data.dictionary import Dictionary
from attnmt.errors import UserError


def build(counts: dict[str, int]) -> Dictionary:
    d = Dictionary()
    for sym, n in counts.items():
        d.add_symbol(sym, n)
    return d


def test_special_symbols_come_first_in_fairseq_order():
    d = Dictionary()
    assert (d.bos(), d.pad(), d.eos(), d.unk()) == (0, 1, 2, 3)
    assert d.symbols == ["<s>", "<pad>", "</s>", "<unk>"]
    assert len(d) == 4
    assert d.index("never-seen") == d.unk()
    assert d[999] == "<unk>"


def test_add_symbol_accumulates_counts():
    d = Dictionary()
    a = d.add_symbol("a")
    assert d.add_symbol("a", 4) == a == 4
    assert d.counts[a] == 5


def test_finalize_sorts_by_count_then_symbol_independent_of_insertion_order():
    counts = {"b": 3, "a": 3, "z": 9, "c": 1}
    d1, d2 = build(counts), build(dict(reversed(list(counts.items()))))
    d1.finalize(padding_factor=1)
    d2.finalize(padding_factor=1)
    assert d1.symbols[4:] == ["z", "a", "b", "c"]
    assert d1 == d2
    assert d1.checksum() == d2.checksum()


def test_finalize_threshold_nwords_and_padding():
    counts = {f"w{i}": 100 - i for i in range(20)}  # w0 most frequent
    d = build(counts)
    d.finalize(threshold=91)  # keeps counts >= 91: w0..w9
    assert d.symbols[4:14] == [f"w{i}" for i in range(10)]
    assert len(d) == 16 and d.symbols[14:] == ["madeupword0000", "madeupword0001"]
    assert d.counts[14:] == [0, 0]

    d = build(counts)
    d.finalize(nwords=10, padding_factor=1)  # special symbols included in nwords (fairseq)
    assert len(d) == 10 and d.symbols[4:] == [f"w{i}" for i in range(6)]

    d = build(counts)
    d.finalize(padding_factor=8)
    assert len(d) == 24 and len(d) % 8 == 0

    d = build(counts)
    d.finalize(threshold=1000)
    assert d.symbols == ["<s>", "<pad>", "</s>", "<unk>", "madeupword0000", "madeupword0001", "madeupword0002",
                         "madeupword0003"]


def test_save_load_round_trip(tmp_path):
    d = build({"▁Hallo": 7, "welt": 3, "<tag>": 2, "x y": 1, "ü": 1})  # a symbol may hold a space (rpartition)
    d.finalize(padding_factor=8)
    path = tmp_path / "dict.de.txt"
    d.save(path)
    text = path.read_text(encoding="utf-8")
    assert text.splitlines()[0] == "▁Hallo 7"
    assert "<unk>" not in text and "</s>" not in text  # special symbols are implied, not written
    assert "madeupword0000 0" in text
    e = Dictionary.load(path)
    assert e.symbols == d.symbols and e.counts == d.counts and len(e) == len(d) == 16
    assert (e.bos(), e.pad(), e.eos(), e.unk()) == (0, 1, 2, 3)
    assert e.checksum() == d.checksum() == hashlib.sha256(path.read_bytes()).hexdigest()
    assert not [p for p in tmp_path.iterdir() if p.name != "dict.de.txt"]  # no temp file left


def test_load_accepts_fairseq_overwrite_flag(tmp_path):
    p = tmp_path / "dict.txt"
    p.write_text("a 5\nb 2\na 9 #fairseq:overwrite\n", encoding="utf-8")
    d = Dictionary.load(p)
    assert d.symbols[4:] == ["a", "b"] and d.counts[d.index("a")] == 9


@pytest.mark.parametrize("content,lineno", [
    ("a 5\nb\n", 2),
    ("a 5\nb x\n", 2),
    ("a 5\n\nc 1\n", 2),
    ("a 5\nb 1\na 2\n", 3),
    ("<unk> 3\n", 1),
])
def test_load_bad_line_names_file_and_line(tmp_path, content, lineno):
    p = tmp_path / "dict.en.txt"
    p.write_text(content, encoding="utf-8")
    with pytest.raises(UserError) as e:
        Dictionary.load(p)
    msg = str(e.value)
    assert msg.startswith(f"{p}:{lineno}:") and "\n" not in msg


def test_load_missing_file(tmp_path):
    with pytest.raises(UserError, match="not found"):
        Dictionary.load(tmp_path / "nope.txt")


def test_encode_line_and_string():
    d = build({"▁a": 3, "b": 2})
    d.finalize(padding_factor=1)
    ids = d.encode_line("  ▁a b   zz ")
    assert ids == [d.index("▁a"), d.index("b"), d.unk(), d.eos()]
    assert d.encode_line("▁a", append_eos=False) == [d.index("▁a")]
    assert d.encode_line("") == [d.eos()]
    assert d.string(ids) == "▁a b <unk>"
    padded = np.array([d.bos(), *ids, d.pad(), d.pad()])
    assert d.string(padded) == "▁a b <unk>"
    tail = [d.index("▁a"), d.eos(), d.index("b"), d.eos()]
    assert d.string(tail) == "▁a"
    assert d.string(tail, stop_at_eos=False) == "▁a b"


def test_state_round_trip_is_plain_data():
    d = build({"x": 2, "y": 1})
    d.finalize()
    state = d.to_state()
    assert json.loads(json.dumps(state)) == state  # plain lists/strings: safe in a weights-only checkpoint
    e = Dictionary.from_state(state)
    assert e == d and e.checksum() == d.checksum() and e.index("y") == d.index("y")
