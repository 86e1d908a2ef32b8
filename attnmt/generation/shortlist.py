"""Vocabulary shortlists: the target tokens a batch may produce, so that the projection to the vocabulary, the
largest product of a decoding step on a big vocabulary, runs over their union only.

A :class:`Shortlist` maps source n-grams (token ids) to target tokens, plus tokens that are always candidates;
the batch's candidates are those of every n-gram of its sources, the always-candidates, the special symbols and
the tokens of its prefixes and constraints. Its file format is CTranslate2's vocabulary map (``vmap.txt``): one
line per source n-gram, ``SOURCE PIECES<TAB>TARGET PIECES``, pieces separated by spaces, the line with no source
pieces listing the always-candidates; so ``attnmt export --to ctranslate2 --shortlist`` carries the same map to
CTranslate2 (``use_vmap=True``). :func:`build` learns one from a binarized training split by co-occurrence.

During the search, :class:`ShortlistedModel` wraps the model: its logits are those of the candidates, every other
token at -inf, so every rule of the search (prefixes, constraints, suppressed sequences, the length limit) works
unchanged, and a shortlist holding the whole vocabulary translates exactly as no shortlist does. Where the rules
are the same for every row (most steps), the search scores and selects over the candidates alone, in their own
ids, and maps the chosen tokens back.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from torch import Tensor, nn

from attnmt.errors import UserError
from attnmt.models.interface import Candidates, SearchModel
from attnmt.models.kernels import DecodingKernels


@dataclass
class Shortlist:
    """``always``: target ids that are always candidates; ``rules``: source n-gram (a tuple of ids) -> target ids."""

    always: list[int] = field(default_factory=list)
    rules: dict[tuple[int, ...], list[int]] = field(default_factory=dict)

    def __post_init__(self):
        self.orders = sorted({len(k) for k in self.rules})

    def candidates(self, sources: Iterable[Sequence[int]], extra: Iterable[int] = ()) -> list[int]:
        """The sorted target ids the batch ``sources`` may produce, ``extra`` included."""
        out = set(self.always)
        out.update(extra)
        for src in sources:
            src = [int(i) for i in src]
            for n in self.orders:
                for i in range(len(src) - n + 1):
                    out.update(self.rules.get(tuple(src[i:i + n]), ()))
        return sorted(out)

    def write(self, path: str | os.PathLike, src_dict, tgt_dict) -> None:
        """Write the map as CTranslate2's ``vmap.txt`` (pieces), atomically."""
        from attnmt.fileio import atomic_open

        lines = ["\t" + " ".join(tgt_dict[i] for i in self.always)]
        for key in sorted(self.rules):
            lines.append(" ".join(src_dict[i] for i in key) + "\t" + " ".join(tgt_dict[i] for i in self.rules[key]))
        with atomic_open(path) as f:
            f.write("\n".join(lines) + "\n")


def read(path: str | os.PathLike, src_dict, tgt_dict) -> Shortlist:
    """A vocabulary map file (CTranslate2's ``vmap.txt`` format) in the model's ids; a ``UserError`` naming the
    file and line of a malformed entry or of a piece the model's dictionaries do not hold."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: no such shortlist file; build one with attnmt build-shortlist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{path}: cannot read the shortlist ({e}); give a UTF-8 vocabulary map") from None
    always: list[int] = []
    rules: dict[tuple[int, ...], list[int]] = {}

    def ids(pieces: list[str], d, side: str, ln: int) -> list[int]:
        out = []
        for p in pieces:
            i = d.index(p)
            if i == d.unk() and p != d[d.unk()]:
                raise UserError(f"{path}:{ln}: {side} piece {p[:40]!r} is not in the model's {side} dictionary; "
                                f"the shortlist was built for another model (rebuild it with attnmt build-shortlist)")
            out.append(i)
        return out

    for ln, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if "\t" not in line:
            raise UserError(f"{path}:{ln}: no TAB; a shortlist line is SOURCE PIECES<TAB>TARGET PIECES "
                            f"(CTranslate2's vocabulary map)")
        key, values = line.split("\t", 1)
        source = ids(key.split(), src_dict, "source", ln)
        targets = ids(values.split(), tgt_dict, "target", ln)
        if source:
            rules.setdefault(tuple(source), []).extend(targets)
        else:
            always.extend(targets)
    if not always and not rules:
        raise UserError(f"{path}: the shortlist is empty; build one with attnmt build-shortlist")
    return Shortlist(sorted(set(always)), {k: sorted(set(v)) for k, v in rules.items()})


def build(pairs: Iterable[tuple[np.ndarray, np.ndarray]], src_size: int, tgt_size: int, specials: Sequence[int],
          top_k: int = 50, frequent: int = 100, chunk: int = 20000) -> Shortlist:
    """A shortlist learned from (source ids, target ids) pairs: the ``frequent`` most frequent target tokens are
    always candidates; each source token lists the ``top_k`` others it co-occurs with most strongly (Dice's
    coefficient, 2 c(s, t) / (c(s) + c(t)), over sentence pairs; ties to the more frequent target token).
    ``specials`` (ids never counted) are left to the search, which always adds them."""
    skip = np.zeros(max(src_size, tgt_size), dtype=bool)
    skip[list(specials)] = True
    src_count = np.zeros(src_size, dtype=np.int64)
    tgt_count = np.zeros(tgt_size, dtype=np.int64)
    keys: list[np.ndarray] = []
    merged_keys = np.zeros(0, dtype=np.int64)
    merged_counts = np.zeros(0, dtype=np.int64)

    def merge() -> None:
        nonlocal merged_keys, merged_counts, keys
        if not keys:
            return
        k, c = np.unique(np.concatenate(keys), return_counts=True)
        allk = np.concatenate([merged_keys, k])
        allc = np.concatenate([merged_counts, c])
        merged_keys, inv = np.unique(allk, return_inverse=True)
        merged_counts = np.bincount(inv, weights=allc).astype(np.int64)
        keys = []

    for n, (s, t) in enumerate(pairs, 1):
        us = np.unique(np.asarray(s, dtype=np.int64))
        ut = np.unique(np.asarray(t, dtype=np.int64))
        us, ut = us[~skip[us]], ut[~skip[ut]]
        src_count[us] += 1
        tgt_count[ut] += 1
        keys.append((us[:, None] * tgt_size + ut[None, :]).ravel())
        if n % chunk == 0:
            merge()
    merge()
    order = np.lexsort((-np.arange(tgt_size), tgt_count))[::-1]  # most frequent first, ties to the lower id
    always = sorted(int(i) for i in order[:frequent] if tgt_count[i] > 0)
    is_always = np.zeros(tgt_size, dtype=bool)
    is_always[always] = True
    src_of, tgt_of = merged_keys // tgt_size, merged_keys % tgt_size
    keep = ~is_always[tgt_of]
    src_of, tgt_of, both = src_of[keep], tgt_of[keep], merged_counts[keep]
    dice = 2.0 * both / (src_count[src_of] + tgt_count[tgt_of])
    # per source token, best first: by Dice, then the more frequent target, then the lower id
    rank = np.lexsort((tgt_of, -tgt_count[tgt_of], -dice, src_of))
    src_of, tgt_of = src_of[rank], tgt_of[rank]
    starts = np.flatnonzero(np.r_[True, src_of[1:] != src_of[:-1]]) if src_of.size else np.zeros(0, dtype=np.int64)
    ends = np.r_[starts[1:], src_of.size]
    rules = {(int(src_of[a]),): sorted(int(x) for x in tgt_of[a:min(b, a + top_k)]) for a, b in zip(starts, ends)}
    return Shortlist(always, rules)


class ShortlistedModel(SearchModel):
    """``model`` whose logits are computed for the ``ids`` (sorted target ids) only, by ``projection`` (a linear
    layer over their rows of the output projection), the other tokens' at -inf: what the search of one batch
    runs with a shortlist. The search scores the candidates alone (``candidate_logits``) wherever its rules are
    the same for every row; everything else is the model's."""

    def __init__(self, model: SearchModel, ids: Tensor, projection: nn.Module, vocab: int):
        super().__init__()
        self.model, self.projection, self.vocab = model, projection, vocab
        self.register_buffer("ids", ids, persistent=False)

    def output_candidates(self) -> Candidates:
        return Candidates(self.ids, self.vocab)

    def candidate_logits(self, features: Tensor) -> Tensor:
        return self.projection(features)

    def encode(self, src_tokens: Tensor, src_lengths: Tensor):
        return self.model.encode(src_tokens, src_lengths)

    def decode_features(self, prev_output_tokens: Tensor, enc, cache=None) -> Tensor:
        return self.model.decode_features(prev_output_tokens, enc, cache)

    def output_layer(self, features: Tensor) -> Tensor:
        return Candidates(self.ids, self.vocab).widen(self.projection(features))

    def decode(self, prev_output_tokens: Tensor, enc, cache=None) -> Tensor:
        return self.output_layer(self.decode_features(prev_output_tokens, enc, cache))

    def new_cache(self, beam: int = 1, kernels: DecodingKernels = DecodingKernels()):
        return self.model.new_cache(beam, kernels)

    def reorder(self, enc, cache, new_order: Tensor, sentences: Tensor | None = None):
        return self.model.reorder(enc, cache, new_order, sentences)

    def max_positions(self) -> tuple[int, int]:
        return self.model.max_positions()


class _Holder(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.linear = linear


def projection_maker(weight: Tensor, prepare: Callable[[nn.Module], nn.Module]) -> Callable[[Tensor], nn.Module]:
    """How a batch's projection is made: the rows ``ids`` of the output projection ``weight`` (V, D) as a linear
    layer, prepared as the backend prepared the model's (``prepare``: its ``prepare_inference`` with the run's
    quantization), so that a shortlisted product runs as the full one would (int8, bf16, packed)."""

    def make(ids: Tensor) -> nn.Module:
        rows = weight.index_select(0, ids)
        linear = nn.Linear(rows.size(1), rows.size(0), bias=False, device=rows.device, dtype=rows.dtype)
        linear.weight = nn.Parameter(rows, requires_grad=False)
        return prepare(_Holder(linear)).linear

    return make
