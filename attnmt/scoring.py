"""Corpus-level scoring of translations: sacreBLEU (the reportable number), chrF, and a tokenized-BLEU mode.

Two families of numbers exist and must never be mixed up:

* **sacreBLEU** (``corpus_bleu``, ``corpus_chrf``): detokenized system output against the untouched reference;
  the metric applies its own fixed tokenization and reports a signature that pins down every choice. This is the
  number to report.
* **tokenized BLEU** (``tokenized_bleu``): the ``multi-bleu.perl`` formula on whitespace tokens, optionally after
  the Moses tokenization and compound splitting of tensor2tensor's ``get_ende_bleu.sh``. This is how the
  Transformer paper's WMT14 En-De 27.3 / 28.4 were measured; it exists only to compare against such numbers and is
  labelled as such everywhere. See ``docs/evaluation.md``.

The system text may also be the output of ``attnmt generate`` / ``fairseq-generate`` (``H-``/``D-`` lines);
``parse_system_lines`` extracts the hypotheses in id order.
"""

from __future__ import annotations

import functools
import gzip
import math
import re
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

from attnmt.errors import UserError

MODE_SACREBLEU = "sacrebleu"
MODE_TOKENIZED = "tokenized"
MODE_COMPOUND_SPLIT = "tokenized+compound-split"

TOKENIZED_LABEL = "tokenized BLEU, multi-bleu.perl formula; NOT comparable to sacreBLEU"

MAX_ORDER = 4


@dataclass
class ScoreResult:
    """One corpus score. BLEU fills the n-gram statistics; chrF leaves them ``None``.

    ``precisions`` are percentages (as sacreBLEU and multi-bleu.perl print them); ``score`` is on a 0-100 scale.
    """

    metric: str  # "bleu" | "chrf"
    mode: str  # MODE_SACREBLEU | MODE_TOKENIZED | MODE_COMPOUND_SPLIT
    score: float
    signature: str
    n_lines: int
    counts: list[int] | None = None
    totals: list[int] | None = None
    precisions: list[float] | None = None
    bp: float | None = None
    sys_len: int | None = None
    ref_len: int | None = None
    name: str = field(default="BLEU", repr=False)  # display name, e.g. "BLEU" or "chrF2"

    @property
    def details(self) -> str:
        """The statistics after the score, in the usual ``p1/p2/p3/p4 (BP = ...)`` form ('' for chrF)."""
        if self.precisions is None:
            return ""
        ratio = self.sys_len / self.ref_len if self.ref_len else 0.0
        precs = "/".join(f"{p:.1f}" for p in self.precisions)
        return (f"{precs} (BP = {self.bp:.3f} ratio = {ratio:.3f} "
                f"hyp_len = {self.sys_len} ref_len = {self.ref_len})")

    def format(self) -> str:
        """One human-readable line: name, signature, score and statistics."""
        score = f"{self.score:.2f}"
        if self.mode == MODE_SACREBLEU:
            head = f"{self.name}|{self.signature} = {score}"
        else:
            head = f"{self.name} ({TOKENIZED_LABEL}) = {score}"
        line = f"{head} {self.details}".rstrip()
        if self.mode != MODE_SACREBLEU:
            line += f" [{self.signature}]"
        return line

    def to_dict(self) -> dict:
        """The machine-readable result (``attnmt score --json``)."""
        d = asdict(self)
        d.pop("name")
        return d


# --------------------------------------------------------------------------------------------------------- reading

def read_lines(path: str, what: str) -> list[str]:
    """Read a UTF-8 text file (``.gz`` allowed; ``-`` is stdin) as lines without their line ends."""
    name = "stdin" if path == "-" else path
    try:
        if path == "-":
            raw = sys.stdin.buffer.read()
        elif path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                raw = f.read()
        else:
            with open(path, "rb") as f:
                raw = f.read()
    except FileNotFoundError:
        raise UserError(f"{name}: no such file; give an existing {what} file") from None
    except IsADirectoryError:
        raise UserError(f"{name}: is a directory; give the {what} text file") from None
    except (OSError, EOFError) as e:
        raise UserError(f"{name}: cannot read the {what} file ({e})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise UserError(f"{name}:{line}: not valid UTF-8 (byte {e.start}); convert the {what} file to UTF-8") from None
    if text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the final line end
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


_FAIRSEQ_LINE = re.compile(r"^([HD])-(\d+)\t")


def is_fairseq_output(lines: Sequence[str]) -> bool:
    """True when the text is generate output (has ``H-<id>\\t`` lines) rather than plain hypotheses."""
    return any(ln.startswith("H-") and _FAIRSEQ_LINE.match(ln) for ln in lines)


def parse_system_lines(lines: Sequence[str], name: str = "system") -> list[str]:
    """Plain lines are returned as they are; generate output yields one hypothesis per id, in id order.

    For each id the first hypothesis counts (the best of an n-best list). ``D-`` (detokenized) lines are used when
    the file has any, else ``H-`` lines, as fairseq's generate output is read. Other lines (S-, T-, P-, logs) are
    ignored.
    """
    if not is_fairseq_output(lines):
        return list(lines)
    found: dict[str, dict[int, str]] = {"H": {}, "D": {}}
    for lineno, ln in enumerate(lines, 1):
        m = _FAIRSEQ_LINE.match(ln)
        if not m:
            continue
        parts = ln.split("\t", 2)
        if len(parts) < 2:
            raise UserError(f"{name}:{lineno}: malformed {m.group(1)}- line; expected '{m.group(1)}-<id>\\t<score>\\t<text>'")
        try:
            float(parts[1])
        except ValueError:
            raise UserError(f"{name}:{lineno}: malformed {m.group(1)}- line: score {parts[1]!r} is not a number; "
                            f"expected '{m.group(1)}-<id>\\t<score>\\t<text>'") from None
        text = parts[2] if len(parts) == 3 else ""
        found[m.group(1)].setdefault(int(m.group(2)), text)
    kind = "D" if found["D"] else "H"
    chosen = found[kind]
    if kind == "D":
        missing = sorted(set(found["H"]) - set(chosen))
        if missing:
            raise UserError(f"{name}: has D- lines but none for id(s) {', '.join(map(str, missing[:5]))}"
                            f"{' ...' if len(missing) > 5 else ''}; give complete generate output")
    return [chosen[i] for i in sorted(chosen)]


def check_pair(n_sys: int, n_ref: int, sys_name: str = "system", ref_name: str = "reference") -> None:
    """Refuse empty input and line-count mismatches, naming both sides and both counts."""
    if n_sys == 0 or n_ref == 0:
        raise UserError(f"empty input: system {sys_name} has {n_sys} lines, reference {ref_name} has {n_ref} lines; "
                        f"give one hypothesis per reference line")
    if n_sys != n_ref:
        raise UserError(f"line-count mismatch: system {sys_name} has {n_sys} lines, reference {ref_name} has "
                        f"{n_ref} lines; score the output for exactly this reference (one line per segment)")


# ------------------------------------------------------------------------------------------------------- sacreBLEU

def bleu_tokenizers() -> list[str]:
    """The tokenizer names sacreBLEU accepts for ``--tokenize``."""
    from sacrebleu.metrics.bleu import BLEU

    return list(BLEU.TOKENIZERS)


def _sacre_metric(cls, **kwargs):
    try:
        return cls(**kwargs)
    except KeyError as e:
        raise UserError(f"unknown sacreBLEU tokenizer {e.args[0]!r}; valid: {', '.join(bleu_tokenizers())}") from None
    except (ImportError, RuntimeError, SystemExit) as e:
        raise UserError(f"sacreBLEU cannot set up {kwargs}: {str(e).strip() or type(e).__name__}; "
                        f"install the extra it needs (e.g. pip install 'sacrebleu[ja]') or pick another tokenizer") from None


def corpus_bleu(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False, tokenize: str = "13a") -> ScoreResult:
    """sacreBLEU corpus BLEU of detokenized ``hyps`` against one reference per line (default: 13a, cased)."""
    from sacrebleu.metrics import BLEU

    check_pair(len(hyps), len(refs))
    metric = _sacre_metric(BLEU, lowercase=lowercase, tokenize=tokenize)
    r = metric.corpus_score(list(hyps), [list(refs)])
    return ScoreResult(
        metric="bleu", mode=MODE_SACREBLEU, score=float(r.score), signature=str(metric.get_signature()),
        n_lines=len(hyps), counts=[int(c) for c in r.counts], totals=[int(t) for t in r.totals],
        precisions=[float(p) for p in r.precisions], bp=float(r.bp), sys_len=int(r.sys_len), ref_len=int(r.ref_len),
        name="BLEU",
    )


def corpus_chrf(hyps: Sequence[str], refs: Sequence[str], lowercase: bool = False) -> ScoreResult:
    """sacreBLEU's chrF (character 6-grams, beta 2) of ``hyps`` against one reference per line."""
    from sacrebleu.metrics import CHRF

    check_pair(len(hyps), len(refs))
    metric = _sacre_metric(CHRF, lowercase=lowercase)
    r = metric.corpus_score(list(hyps), [list(refs)])
    return ScoreResult(metric="chrf", mode=MODE_SACREBLEU, score=float(r.score),
                       signature=str(metric.get_signature()), n_lines=len(hyps), name=r.name)


# ------------------------------------------------------------------------------------------------- tokenized BLEU

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(text: str) -> str:
    """``Bundes-Land`` -> ``Bundes ##AT##-##AT## Land``, exactly like get_ende_bleu.sh's ``s{(\\S)-(\\S)}{...}g``.

    Matches do not overlap (as in Perl), so ``a-b-c`` becomes ``a ##AT##-##AT## b-c``: reproducing that quirk keeps
    the numbers comparable with published ones.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


@functools.lru_cache(maxsize=8)
def _moses(lang: str):
    from sacremoses import MosesPunctNormalizer, MosesTokenizer

    return MosesPunctNormalizer(lang=lang), MosesTokenizer(lang=lang)


def moses_tokenize(text: str, lang: str = "de") -> str:
    """replace-unicode-punctuation.perl then tokenizer.perl defaults (escaping on, no aggressive hyphen split)."""
    normalizer, tokenizer = _moses(lang)
    return tokenizer.tokenize(normalizer.replace_unicode_punct(text), return_str=True, escape=True)


_MOSES_ESCAPES = ("&quot;", "&apos;", "&amp;", "&lt;", "&gt;", " @-@ ", "##AT##")


def looks_tokenized(lines: Sequence[str]) -> bool:
    """Heuristic: Moses escapes or hyphen markers mean the text is already tokenized (tokenizing twice is wrong)."""
    return any(esc in ln for ln in lines for esc in _MOSES_ESCAPES)


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def tokenized_bleu(hyps: Sequence[str], refs: Sequence[str], compound_split: bool = False, lang: str = "de",
                   lowercase: bool = False) -> ScoreResult:
    """Corpus BLEU with the multi-bleu.perl formula on whitespace tokens (no smoothing, one reference).

    ``compound_split`` first applies the tensor2tensor ``get_ende_bleu.sh`` treatment to both sides: Moses
    tokenization for ``lang`` and ``##AT##`` compound splitting. Without it the text is scored as given.
    """
    check_pair(len(hyps), len(refs))
    correct = [0] * MAX_ORDER
    total = [0] * MAX_ORDER
    sys_len = ref_len = 0
    for hyp, ref in zip(hyps, refs):
        if compound_split:
            hyp, ref = split_compounds(moses_tokenize(hyp, lang)), split_compounds(moses_tokenize(ref, lang))
        if lowercase:
            hyp, ref = hyp.lower(), ref.lower()
        h, r = hyp.split(), ref.split()
        sys_len += len(h)
        ref_len += len(r)
        for n in range(1, MAX_ORDER + 1):
            hc, rc = _ngrams(h, n), _ngrams(r, n)
            total[n - 1] += max(0, len(h) - n + 1)
            correct[n - 1] += sum(min(c, rc[g]) for g, c in hc.items())
    precisions = [100.0 * c / t if t else 0.0 for c, t in zip(correct, total)]
    if sys_len == 0:
        bp, score = 0.0, 0.0
    else:
        bp = 1.0 if sys_len >= ref_len else math.exp(1.0 - ref_len / sys_len)
        # multi-bleu.perl takes log(0) as -9999999999: any empty n-gram order gives 0
        if all(c > 0 for c in correct):
            score = 100.0 * bp * math.exp(sum(math.log(c / t) for c, t in zip(correct, total)) / MAX_ORDER)
        else:
            score = 0.0
    tok = f"moses-{lang}" if compound_split else "none"
    signature = (f"mode:{MODE_COMPOUND_SPLIT if compound_split else MODE_TOKENIZED}|nrefs:1|"
                 f"case:{'lc' if lowercase else 'mixed'}|tok:{tok}|compound:{'atat' if compound_split else 'no'}|"
                 f"formula:multi-bleu")
    return ScoreResult(
        metric="bleu", mode=MODE_COMPOUND_SPLIT if compound_split else MODE_TOKENIZED, score=score,
        signature=signature, n_lines=len(hyps), counts=correct, totals=total, precisions=precisions, bp=bp,
        sys_len=sys_len, ref_len=ref_len, name="BLEU",
    )


def fairseq_generate_bleu(hyps: Sequence[str], refs: Sequence[str]) -> str:
    """fairseq-generate's closing BLEU, as it prints it: its scorer's BLEU4 over the whitespace tokens of the
    references (``T-`` lines) and the hypotheses (``D-`` lines), where an ``<unk>`` of a reference matches
    nothing."""
    unmatched = (" ".join(f"<unk:{i}:{k}>" if w == "<unk>" else w for k, w in enumerate(r.split()))
                 for i, r in enumerate(refs))
    r = tokenized_bleu(hyps, list(unmatched))
    return bleu4_line(r.score, r.precisions, r.bp, r.sys_len, r.ref_len)


def bleu4_line(score: float, precisions: Sequence[float], bp: float, sys_len: int, ref_len: int) -> str:
    """fairseq's ``BLEU4 = ...`` line (``precisions`` in percent), as fairseq-generate and fairseq-score print it."""
    p = precisions
    ratio = sys_len / ref_len if ref_len else 0.0
    return (f"BLEU4 = {score:2.2f}, {p[0]:2.1f}/{p[1]:2.1f}/{p[2]:2.1f}/{p[3]:2.1f} (BP={bp:.3f}, "
            f"ratio={ratio:.3f}, syslen={sys_len}, reflen={ref_len})")



# fairseq-score: fairseq's BLEU scorer on the ids a fresh fairseq Dictionary gives the words
_FNV_OFFSET, _FNV_PRIME, _U64 = 14695981039346656037, 0x100000001B3, (1 << 64) - 1
_FAIRSEQ_SPECIALS = {"<s>": 0, "<pad>": 1, "</s>": 2, "<unk>": 3}


def _fairseq_ngram_hash(ids: Sequence[int]) -> int:
    """fairseq's libbleu ``bleu_hash``: 64-bit FNV-1a over the ids' little-endian bytes, each byte read as a
    signed char, so that a byte from 128 on flips the high bits. Different n-grams can share a hash, and then
    count as a match: fairseq's numbers depend on the words' ids, which ``fairseq_score_bleu`` reproduces."""
    h = _FNV_OFFSET
    for i in ids:
        for shift in (0, 8, 16, 24):
            b = (i >> shift) & 0xFF
            h = ((h ^ ((b - 256) & _U64 if b > 127 else b)) * _FNV_PRIME) & _U64
    return h


def fairseq_score_bleu(hyps: Sequence[str], refs: Sequence[str]) -> str:
    """fairseq-score's line, exactly: each line pair encoded with one growing fairseq Dictionary (system line
    first; ``<s> <pad> </s> <unk>`` are ids 0-3; ``</s>`` appended), a reference ``<unk>`` matching nothing, the
    trailing ``</s>``/``<pad>`` ids trimmed, and n-grams matched by fairseq's hash."""
    check_pair(len(hyps), len(refs))
    vocab = dict(_FAIRSEQ_SPECIALS)

    def encode(line: str) -> list[int]:
        ids = [vocab.setdefault(w, len(vocab)) for w in line.split()] + [vocab["</s>"]]
        while ids and ids[-1] in (1, 2):  # bleu_rtrim: trailing </s> and <pad>
            ids.pop()
        while ids and ids[0] == 1:  # bleu_ltrim: leading <pad>
            ids.pop(0)
        return ids

    match, count = [0] * MAX_ORDER, [0] * MAX_ORDER
    sys_len = ref_len = 0
    for hyp, ref in zip(hyps, refs):
        h = encode(hyp)
        r = [-999 if i == 3 else i for i in encode(ref)]
        sys_len, ref_len = sys_len + len(h), ref_len + len(r)
        for n in range(1, MAX_ORDER + 1):
            if len(h) < n:
                continue
            count[n - 1] += len(h) - n + 1
            if len(r) < n:
                continue
            seen = Counter(_fairseq_ngram_hash(h[k:k + n]) for k in range(len(h) - n + 1))
            for k in range(len(r) - n + 1):
                key = _fairseq_ngram_hash(r[k:k + n])
                if seen[key] > 0:
                    match[n - 1] += 1
                    seen[key] -= 1
    p = [m / c if c > 0 else 0.0 for m, c in zip(match, count)]
    bp = min(1.0, math.exp(1 - ref_len / sys_len)) if sys_len else 0.0
    score = bp * math.exp(sum(math.log(x) for x in p) / MAX_ORDER) * 100 if all(x > 0 for x in p) else 0.0
    return bleu4_line(score, [100 * x for x in p], bp, sys_len, ref_len)
