"""The symbol <-> id mapping of one side of a translation pair (fairseq-compatible).

The layout is fairseq's, so that dictionaries can be exchanged with it: the special symbols come first
(``<s>``=0, ``<pad>``=1, ``</s>``=2, ``<unk>``=3), then the corpus symbols by decreasing count. The file format
is fairseq's too: one ``symbol count`` per line, special symbols not written.

An imported model keeps its own vocabulary as it is (``from_vocabulary``: every symbol at its model's id, the
special symbols wherever that model put them, Marian's ``</s>`` = 0 and ``<pad>`` last, no ``<s>`` at all). Its
file starts with one ``#attnmt:vocabulary`` line naming the special symbols' ids and then lists every symbol.

``finalize`` breaks count ties by the symbol itself, so a dictionary depends only on the counts and never on the
order in which the corpus was read (which is what makes preprocessing with any number of workers give identical
files). The size is padded to a multiple of ``padding_factor`` with ``madeupwordNNNN`` symbols: embedding and
output-projection matrices whose size is a multiple of 8 map well onto tensor cores / AMX tiles.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from typing import Any

from attnmt.errors import UserError
from attnmt.fileio import atomic_open

VOCABULARY_HEADER = "#attnmt:vocabulary"


class Dictionary:
    """Symbols, their counts, and the special symbols bos/pad/eos/unk at ids 0..3."""

    def __init__(self, bos: str = "<s>", pad: str = "<pad>", eos: str = "</s>", unk: str = "<unk>"):
        self.bos_word, self.pad_word, self.eos_word, self.unk_word = bos, pad, eos, unk
        self._symbols: list[str] = []
        self._counts: list[int] = []
        self._indices: dict[str, int] = {}
        self.bos_index = self.add_symbol(bos)
        self.pad_index = self.add_symbol(pad)
        self.eos_index = self.add_symbol(eos)
        self.unk_index = self.add_symbol(unk)
        self.nspecial = len(self._symbols)
        self.fixed = False  # a model's own vocabulary (from_vocabulary): ids as that model has them

    @classmethod
    def from_vocabulary(cls, symbols: list[str], pad: str, eos: str, unk: str, bos: str | None = None,
                        counts: list[int] | None = None) -> Dictionary:
        """A model's own vocabulary, every symbol at its id (``symbols[i]`` has id i), the special symbols where
        the model put them (``bos`` None: the model has none)."""
        d = cls.__new__(cls)
        d._symbols, d._counts, d._indices = [], [], {}
        for i, sym in enumerate(symbols):
            if sym in d._indices:
                raise UserError(f"the vocabulary holds {sym!r} twice (ids {d._indices[sym]} and {i}); give the "
                                f"model's own vocabulary file")
            d._indices[sym] = i
            d._symbols.append(sym)
            d._counts.append(1 if counts is None else int(counts[i]))
        for what, sym in (("padding", pad), ("end-of-sentence", eos), ("unknown-word", unk)):
            if sym not in d._indices:
                raise UserError(f"the vocabulary has no {what} symbol {sym!r}; give the model's own vocabulary file")
        d.bos_word, d.pad_word, d.eos_word, d.unk_word = bos or "", pad, eos, unk
        d.bos_index = d._indices.get(bos) if bos else None
        d.pad_index, d.eos_index, d.unk_index = d._indices[pad], d._indices[eos], d._indices[unk]
        d.nspecial = 0
        d.fixed = True
        return d

    # ------------------------------------------------------------------ lookups
    def __len__(self) -> int:
        return len(self._symbols)

    def __getitem__(self, i: int) -> str:
        if 0 <= i < len(self._symbols):
            return self._symbols[i]
        return self.unk_word

    def __contains__(self, sym: str) -> bool:
        return sym in self._indices

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Dictionary) and self.to_state() == other.to_state()

    def __repr__(self) -> str:
        return f"Dictionary({len(self)} symbols)"

    def index(self, sym: str) -> int:
        """The id of ``sym``; the unk id when it is not in the dictionary."""
        return self._indices.get(sym, self.unk_index)

    def bos(self) -> int:
        return self.bos_index

    def pad(self) -> int:
        return self.pad_index

    def eos(self) -> int:
        return self.eos_index

    def unk(self) -> int:
        return self.unk_index

    @property
    def symbols(self) -> list[str]:
        return self._symbols

    @property
    def counts(self) -> list[int]:
        return self._counts

    # ------------------------------------------------------------------ building
    def add_symbol(self, sym: str, n: int = 1) -> int:
        """Add ``n`` occurrences of ``sym``; return its id."""
        idx = self._indices.get(sym)
        if idx is not None:
            self._counts[idx] += n
            return idx
        idx = len(self._symbols)
        self._indices[sym] = idx
        self._symbols.append(sym)
        self._counts.append(n)
        return idx

    def update(self, counts: dict[str, int] | Iterable[tuple[str, int]]) -> None:
        """Add many (symbol, count) pairs at once (e.g. a ``collections.Counter`` from a corpus)."""
        items = counts.items() if isinstance(counts, dict) else counts
        for sym, n in items:
            self.add_symbol(sym, n)

    def finalize(self, threshold: int = -1, nwords: int = -1, padding_factor: int = 8) -> None:
        """Sort by count (desc) then symbol, drop symbols seen fewer than ``threshold`` times, keep at most
        ``nwords`` symbols in total (special symbols included, as fairseq), pad to a multiple of ``padding_factor``.
        """
        if nwords <= 0:
            nwords = len(self)
        special = list(zip(self._symbols[: self.nspecial], self._counts[: self.nspecial]))
        rest = sorted(zip(self._symbols[self.nspecial:], self._counts[self.nspecial:]), key=lambda sc: (-sc[1], sc[0]))
        kept = [(s, c) for s, c in rest if c >= threshold][: max(0, nwords - self.nspecial)]
        self._symbols, self._counts, self._indices = [], [], {}
        for s, c in special + kept:
            self.add_symbol(s, c)
        if padding_factor > 1:
            i = 0
            while len(self) % padding_factor != 0:
                sym = f"madeupword{i:04d}"
                if sym not in self._indices:
                    self.add_symbol(sym, 0)
                i += 1

    # ------------------------------------------------------------------ text <-> ids
    def encode_line(self, line: str, append_eos: bool = True) -> list[int]:
        """Whitespace-split ``line`` into symbols and map them to ids (unknown symbols -> unk)."""
        get, unk = self._indices.get, self.unk_index
        ids = [get(sym, unk) for sym in line.split()]
        if append_eos:
            ids.append(self.eos_index)
        return ids

    def string(self, ids: Any, stop_at_eos: bool = True) -> str:
        """Symbols of ``ids`` joined by spaces; bos, pad and eos are left out; stops at the first eos if asked.

        ``ids`` may be a list, a numpy array or a 1-d torch tensor.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        out = []
        skip = (self.bos_index, self.pad_index)
        for i in ids:
            i = int(i)
            if i == self.eos_index:
                if stop_at_eos:
                    break
                continue
            if i in skip:
                continue
            out.append(self[i])
        return " ".join(out)

    # ------------------------------------------------------------------ persistence
    def _text(self) -> str:
        head = ""
        if self.fixed:
            bos = "-" if self.bos_index is None else self.bos_index
            head = f"{VOCABULARY_HEADER} bos={bos} pad={self.pad_index} eos={self.eos_index} unk={self.unk_index}\n"
        return head + "".join(f"{s} {c}\n" for s, c in zip(self._symbols[self.nspecial:], self._counts[self.nspecial:]))

    def save(self, path: str | os.PathLike) -> None:
        """Write ``symbol count`` lines (fairseq format) atomically."""
        with atomic_open(path, "w") as f:
            f.write(self._text())

    def checksum(self) -> str:
        """sha256 (hex) of the saved text: identical dictionaries have identical checksums."""
        return hashlib.sha256(self._text().encode("utf-8")).hexdigest()

    @classmethod
    def load(cls, path: str | os.PathLike) -> Dictionary:
        """Read a dictionary file written by ``save`` (or by fairseq); a bad line raises UserError naming it."""
        d = cls()
        try:
            f = open(path, encoding="utf-8")
        except FileNotFoundError:
            raise UserError(f"{path}: dictionary file not found; pass an existing dict.LANG.txt") from None
        with f:
            try:
                first = f.readline()
                if first.startswith(VOCABULARY_HEADER):
                    return cls._load_vocabulary(first, f, path)
                f.seek(0)
                for lineno, raw in enumerate(f, 1):
                    d._add_line(raw.rstrip("\n").rstrip("\r"), path, lineno)
            except UnicodeDecodeError as e:
                raise UserError(f"{path}: dictionary is not valid UTF-8 ({e.reason} at byte {e.start}); "
                                f"pass a dictionary written by attnmt preprocess or fairseq") from None
        return d

    @classmethod
    def _load_vocabulary(cls, header: str, f, path) -> Dictionary:
        """The rest of a ``#attnmt:vocabulary`` file: every symbol, at its id."""
        try:
            ids = dict(kv.split("=", 1) for kv in header.split()[1:])
            special = {k: (None if ids[k] == "-" else int(ids[k])) for k in ("bos", "pad", "eos", "unk")}
        except (KeyError, ValueError):
            raise UserError(f"{path}:1: a malformed {VOCABULARY_HEADER} line; it must name bos=, pad=, eos= and "
                            f"unk= ids") from None
        symbols, counts = [], []
        for lineno, raw in enumerate(f, 2):
            sym, sep, count = raw.rstrip("\n").rstrip("\r").rpartition(" ")
            if not sep or not count.isdigit():
                raise UserError(f"{path}:{lineno}: expected 'symbol count', got {raw.rstrip()!r}")
            symbols.append(sym)
            counts.append(int(count))
        for k, i in special.items():
            if i is not None and not 0 <= i < len(symbols):
                raise UserError(f"{path}:1: the {k} id {i} is outside the vocabulary's {len(symbols)} symbols")
        name = {k: (None if i is None else symbols[i]) for k, i in special.items()}
        return cls.from_vocabulary(symbols, name["pad"], name["eos"], name["unk"], name["bos"], counts)

    def _add_line(self, line: str, path, lineno: int) -> None:
        if not line.strip():
            raise UserError(f"{path}:{lineno}: empty line in dictionary; each line must be 'symbol count'")
        flag = ""
        if line.endswith(" #fairseq:overwrite"):
            line, flag = line[: -len(" #fairseq:overwrite")], "overwrite"
        sym, sep, count = line.rpartition(" ")
        if not sep or not sym or not count.isdigit():
            raise UserError(f"{path}:{lineno}: expected 'symbol count', got {line!r}; "
                            f"each line must be a symbol, a space and a non-negative integer count")
        if sym in self._indices and flag != "overwrite":
            what = "a special symbol" if self._indices[sym] < self.nspecial else "a duplicate"
            raise UserError(f"{path}:{lineno}: symbol {sym!r} is {what}; remove this line "
                            f"(or end it with ' #fairseq:overwrite')")
        if sym in self._indices:
            self._counts[self._indices[sym]] = int(count)
        else:
            self.add_symbol(sym, int(count))

    def to_state(self) -> dict[str, Any]:
        """Plain lists and strings (what a checkpoint stores; no pickled classes)."""
        state = {
            "specials": [self.bos_word, self.pad_word, self.eos_word, self.unk_word],
            "symbols": list(self._symbols),
            "counts": list(self._counts),
        }
        if self.fixed:
            state["layout"] = "vocabulary"
        return state

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Dictionary:
        """The dictionary :meth:`to_state` stored; anything else (a missing field, a wrong type) is a UserError."""
        fields = ("specials", "symbols", "counts")
        if not isinstance(state, dict) or not all(isinstance(state.get(k), (list, tuple)) for k in fields):
            missing = [k for k in fields if not isinstance(state, dict) or not isinstance(state.get(k), (list, tuple))]
            raise UserError(f"dictionary state is malformed (no list of {', '.join(missing)}); the checkpoint was "
                            f"not written by attnmt or is damaged")
        specials, symbols, counts = state["specials"], state["symbols"], state["counts"]
        if (len(specials) != 4 or not all(isinstance(x, str) for x in (*specials, *symbols))
                or not all(isinstance(c, int) and not isinstance(c, bool) for c in counts)):
            raise UserError("dictionary state is malformed (symbols that are not strings or counts that are not "
                            "integers); the checkpoint was not written by attnmt or is damaged")
        bos, pad, eos, unk = specials
        if state.get("layout") == "vocabulary":
            return cls.from_vocabulary(list(symbols), pad, eos, unk, bos or None, list(counts))
        d = cls(bos=bos, pad=pad, eos=eos, unk=unk)
        if list(symbols[: d.nspecial]) != [bos, pad, eos, unk] or len(symbols) != len(counts):
            raise UserError("dictionary state is malformed (special symbols or counts do not match); "
                            "the checkpoint was not written by attnmt")
        d._symbols, d._counts, d._indices = [], [], {}
        for s, c in zip(symbols, counts):
            d.add_symbol(s, int(c))
        return d
