"""Guidance given as text: target prefixes, constraint phrases and suppressed sequences, segmented as the target
side of the model was, into :class:`~attnmt.generation.search.Guidance` ids.

The line format of ``--constraints`` and ``--prefix`` (``translate``, ``interactive``) is fairseq-interactive's:
the source, then TAB-separated fields; with ``--prefix`` the first field after the source is the target prefix,
and with ``--constraints`` the (other) fields are the target phrases every translation must contain.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from attnmt.errors import UserError
from attnmt.generation.search import Guidance

CONSTRAINT_ORDERS = ("unordered", "ordered")


def target_ids(bundle, text: str, what: str) -> list[int]:
    """``text`` as target ids (no EOS), segmented as the training targets were; a ``UserError`` naming ``what``
    for a text of no pieces or of pieces the model's target dictionary does not hold."""
    pieces = bundle.tgt_pipeline.encode(text)
    ids = bundle.tgt_dict.encode_line(pieces, append_eos=False)
    if not ids:
        raise UserError(f"{what} {text!r} holds no target piece; give a word or drop it")
    unknown = [p for p, i in zip(pieces.split(), ids) if i == bundle.tgt_dict.unk_index]
    if unknown:
        shown = " ".join(unknown[:5])[:80]
        raise UserError(f"{what} {text[:80]!r} has pieces the model's target vocabulary does not hold ({shown}); "
                        f"rephrase it with words the model knows")
    return ids


@dataclass
class LineGuidance:
    """What the command lines read from TAB fields: ``prefix`` (the first field is the target prefix) and
    ``constraints`` (None, or the order the phrases must appear in)."""

    prefix: bool = False
    constraints: str | None = None

    def __bool__(self) -> bool:
        return self.prefix or self.constraints is not None

    def split(self, lines: Sequence[str], bundle, where: str, first: int, suppress=()) -> tuple[list[str], Guidance]:
        """The sources of ``lines`` and their guidance (a ``UserError`` naming the line of a bad field)."""
        sources, prefixes, constraints = [], [], []
        for k, line in enumerate(lines):
            at = f"{where}:{first + k + 1}"
            source, *fields = line.split("\t")
            if not self:
                source, fields = line, []
            elif not self.constraints and len(fields) > 1:
                raise UserError(f"{at}: {len(fields) + 1} TAB-separated fields, but --prefix reads the source and "
                                f"one target prefix; add --constraints for more phrases, or remove the TABs")
            prefix = []
            if self.prefix:
                text = fields.pop(0) if fields else ""
                prefix = target_ids(bundle, text, f"{at}: the prefix") if text.strip() else []
            phrases = [target_ids(bundle, f, f"{at}: the constraint") for f in fields if f.strip()]
            sources.append(source)
            prefixes.append(prefix)
            constraints.append(phrases)
        return sources, Guidance(prefixes if self.prefix else None, constraints if self.constraints else None,
                                 tuple(suppress), self.constraints == "ordered")


def suppressed(bundle, texts: Sequence[str] = (), ids: Sequence[Sequence[int]] = ()) -> tuple[tuple[int, ...], ...]:
    """Suppressed sequences from texts (segmented as targets) and id lists (checked against the vocabulary)."""
    out = [tuple(target_ids(bundle, t, "suppressed text")) for t in texts]
    size = len(bundle.tgt_dict)
    for seq in ids:
        seq = tuple(int(i) for i in seq)
        if not seq or not all(0 <= i < size for i in seq):
            raise UserError(f"suppressed sequence {list(seq)[:8]}: give token ids between 0 and {size - 1}, at least "
                            f"one")
        out.append(seq)
    return tuple(out)
