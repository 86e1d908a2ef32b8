"""Text normalisation and subword segmentation: raw text <-> space-separated pieces.

Two registered kinds, each with a ``none`` pass-through:

* ``tokenizer`` (``moses``, ``none``): word-level tokenisation before subwords, undone after decoding.
* ``bpe`` (``sentencepiece``, ``none``): subword segmentation. ``sentencepiece`` learns one joint BPE model on
  both languages, which lets source and target share one dictionary and one embedding matrix.

``TextPipeline`` chains them (strip -> tokenizer -> lowercase -> bpe) and is what both ``attnmt preprocess``
and inference use, so a sentence typed at ``attnmt translate`` is segmented exactly as the training data was.
"""

from __future__ import annotations

import io
import os
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from attnmt.data.meta import DataBinInfo
from attnmt.errors import UserError
from attnmt.fileio import atomic_open
from attnmt.registry import get, register

# ----------------------------------------------------------------------------------------------- tokenizers


@dataclass
class MosesTokenizerConfig:
    lang: str = field(default="en", metadata={"help": "language code for Moses' language-specific rules"})


@register("tokenizer", "moses", config=MosesTokenizerConfig)
class MosesTokenizer:
    """Moses tokenizer/detokenizer (sacremoses), no XML escaping."""

    def __init__(self, lang: str = "en"):
        from sacremoses import MosesDetokenizer
        from sacremoses import MosesTokenizer as _Tok

        self.lang = lang
        self._tok = _Tok(lang=lang)
        self._detok = MosesDetokenizer(lang=lang)

    def encode(self, text: str) -> str:
        return self._tok.tokenize(text, escape=False, return_str=True)

    def decode(self, text: str) -> str:
        return self._detok.detokenize(text.split(), return_str=True)


@register("tokenizer", "moses_wmt19", config=MosesTokenizerConfig)
class MosesWmt19Tokenizer:
    """fairseq's WMT'19 pipeline (FSMT): Unicode punctuation replaced, punctuation normalized, non-printing
    characters removed, then Moses tokenization with aggressive dash splits and XML escaping (sacremoses)."""

    def __init__(self, lang: str = "en"):
        from sacremoses import MosesDetokenizer, MosesPunctNormalizer
        from sacremoses import MosesTokenizer as _Tok

        self.lang = lang
        self._norm = MosesPunctNormalizer(lang=lang, pre_replace_unicode_punct=True, post_remove_control_chars=True)
        self._tok = _Tok(lang=lang)
        self._detok = MosesDetokenizer(lang=lang)

    def encode(self, text: str) -> str:
        return " ".join(self._tok.tokenize(self._norm.normalize(text), aggressive_dash_splits=True, escape=True))

    def decode(self, text: str) -> str:
        return self._detok.detokenize(text.split())


@dataclass
class NoTokenizerConfig:
    lang: str = field(default="en", metadata={"help": "unused; accepted for a uniform interface"})


@register("tokenizer", "none", config=NoTokenizerConfig)
class NoTokenizer:
    """No tokenisation: text passes through unchanged."""

    def __init__(self, lang: str = "en"):
        self.lang = lang

    def encode(self, text: str) -> str:
        return text

    def decode(self, text: str) -> str:
        return text


def build_tokenizer(name: str, lang: str):
    """The registered tokenizer ``name`` for language ``lang`` (UserError listing the choices if unknown)."""
    return get("tokenizer", name).obj(lang=lang)


# ----------------------------------------------------------------------------------------------- BPE


class SubwordModel(ABC):
    """What a registered ``bpe`` provides (preprocess learns or loads it; checkpoints store its bytes)."""

    @classmethod
    @abstractmethod
    def train(cls, files: list[str], vocab_size: int, model_path_prefix: str, max_sentences: int = 1_000_000,
              cfg: object = None) -> SubwordModel:
        """Learn a model of ``vocab_size`` pieces from the text ``files``."""

    @classmethod
    @abstractmethod
    def load(cls, model_path: str | os.PathLike) -> SubwordModel: ...

    @classmethod
    @abstractmethod
    def from_bytes(cls, data: bytes, what: str = "subword model") -> SubwordModel: ...

    @abstractmethod
    def encode(self, text: str) -> str:
        """Text -> space-separated pieces."""

    @abstractmethod
    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]: ...

    def sample_batch(self, lines: list[str], dropout: float, seed: int) -> list[str]:
        """``encode_batch`` with BPE-dropout (Provilkov et al., 2020): each merge is skipped with probability
        ``dropout``, so a word gets one of its finer segmentations; the same ``seed`` gives the same pieces."""
        raise UserError(f"--bpe-dropout needs --bpe sentencepiece (this data uses {type(self).__name__}); "
                        f"preprocess with --bpe sentencepiece or leave --bpe-dropout out")

    @abstractmethod
    def decode(self, pieces: str) -> str:
        """Space-separated pieces -> text."""

    @abstractmethod
    def model_bytes(self) -> bytes:
        """The model file's bytes (empty: nothing to store)."""

    def describe(self) -> dict:
        """What preprocess.json records about the model."""
        return {}


@dataclass
class SentencePieceConfig:
    vocab_size: int = field(default=8000, metadata={"help": "number of SentencePiece pieces to learn"})
    max_sentences: int = field(default=1_000_000, metadata={
        "help": "train on at most this many sentences (a fixed-seed sample of both languages)"})
    character_coverage: float = field(default=1.0, metadata={"help": "fraction of characters the model covers"})
    normalization_rule_name: str = field(default="nmt_nfkc", metadata={
        "help": "SentencePiece normalisation applied before segmentation (nmt_nfkc, nfkc, identity, ...)"})
    seed: int = field(default=1, metadata={"help": "seed of the sentence sample"})
    num_threads: int = field(default=4, metadata={
        "help": "trainer threads; stored in the model file, so fixed for byte-identical models everywhere"})


@register("bpe", "sentencepiece", config=SentencePieceConfig)
class SentencePieceBPE(SubwordModel):
    """Joint SentencePiece BPE model (model_type=bpe), deterministic training."""

    def __init__(self, processor, model_bytes: bytes):
        self._sp = processor
        self._bytes = model_bytes
        self.training_sentences: int | None = None  # set by train()

    # ---- construction
    @classmethod
    def train(cls, files: list[str], vocab_size: int, model_path_prefix: str, max_sentences: int = 1_000_000,
              cfg: SentencePieceConfig | None = None) -> SentencePieceBPE:
        """Learn a BPE model on the lines of ``files``; write ``model_path_prefix.model``; return it loaded.

        When the files hold more than ``max_sentences`` non-empty lines, a sample of that many is drawn with a
        fixed seed (here, not inside SentencePiece, whose own sampling is not reproducible); the trainer is
        then never asked to sample. Sentences are streamed to the trainer and the model comes back as bytes, so
        no file path is recorded in it: the same text gives a byte-identical model wherever it is trained.
        """
        import sentencepiece as spm

        cfg = cfg or SentencePieceConfig(vocab_size=vocab_size, max_sentences=max_sentences)
        total = sum(1 for _ in _nonempty_lines(files))
        n = min(total, max_sentences) if max_sentences > 0 else total
        if n == 0:
            raise UserError(f"{', '.join(map(str, files))}: no non-empty lines to learn SentencePiece from; "
                            f"check the training files")
        writer = io.BytesIO()
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=_sample(files, total, n, cfg.seed), model_writer=writer,
                vocab_size=vocab_size, model_type="bpe", character_coverage=cfg.character_coverage,
                # the sample is already capped: the trainer takes all of it and does not sample again
                input_sentence_size=0, shuffle_input_sentence=False, num_threads=cfg.num_threads,
                normalization_rule_name=cfg.normalization_rule_name,
                unk_id=0, bos_id=-1, eos_id=-1, pad_id=-1, minloglevel=2,
            )
        except (RuntimeError, OSError) as e:
            msg = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise UserError(f"SentencePiece training on {n} sentences failed: {msg}; "
                            f"lower --vocab-size or give more training data") from None
        data = writer.getvalue()
        with atomic_open(f"{model_path_prefix}.model", "wb") as f:
            f.write(data)
        model = cls.from_bytes(data)
        model.training_sentences = n
        return model

    @classmethod
    def load(cls, model_path: str | os.PathLike) -> SentencePieceBPE:
        try:
            data = Path(model_path).read_bytes()
        except FileNotFoundError:
            raise UserError(f"{model_path}: SentencePiece model not found; pass the spm.model written by "
                            f"attnmt preprocess") from None
        return cls.from_bytes(data, what=str(model_path))

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "SentencePiece model") -> SentencePieceBPE:
        """Rebuild from ``model_bytes()`` (e.g. stored inside a checkpoint)."""
        import sentencepiece as spm

        sp = spm.SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(data)
        except (RuntimeError, OSError, TypeError) as e:
            raise UserError(f"{what}: not a valid SentencePiece model ({e}); pass the spm.model written by "
                            f"attnmt preprocess") from None
        return cls(sp, bytes(data))

    # ---- use
    def encode(self, text: str) -> str:
        return " ".join(self._sp.encode(text, out_type=str))

    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]:
        """``encode`` for many lines at once (SentencePiece's C++ batch, multi-threaded)."""
        return [" ".join(p) for p in self._sp.encode(lines, out_type=str, num_threads=num_threads)]

    def sample_batch(self, lines: list[str], dropout: float, seed: int) -> list[str]:
        import sentencepiece as spm

        spm.set_random_generator_seed(seed)  # one thread: the draws follow the seed in line order
        return [" ".join(p) for p in self._sp.encode(lines, out_type=str, enable_sampling=True, alpha=dropout,
                                                      num_threads=1)]

    def decode(self, pieces: str) -> str:
        return self._sp.decode(pieces.split())

    fairseq_post_process = "sentencepiece"  # fairseq's --post-process for these pieces

    def model_bytes(self) -> bytes:
        return self._bytes

    def piece_size(self) -> int:
        return self._sp.get_piece_size()

    def describe(self) -> dict:
        """What preprocess.json records about the model: its size and the sentences it was learned from."""
        info: dict = {"pieces": self.piece_size()}
        if self.training_sentences is not None:
            info["sentences_used"] = self.training_sentences
        return info

    def pieces(self) -> list[str]:
        return [self._sp.id_to_piece(i) for i in range(self._sp.get_piece_size())]


@dataclass
class SubwordNmtConfig:
    vocab_size: int = field(default=8000, metadata={"help": "number of BPE merge operations to learn"})
    max_sentences: int = field(default=1_000_000, metadata={
        "help": "learn on at most this many sentences (a fixed-seed sample of both languages)"})
    seed: int = field(default=1, metadata={"help": "seed of the sentence sample"})


def _subword_nmt():
    try:
        from subword_nmt import apply_bpe, learn_bpe
    except ImportError:
        raise UserError("--bpe subword_nmt needs the subword-nmt package: pip install 'attnmt[subword-nmt]' (or "
                        "subword-nmt)") from None
    return apply_bpe, learn_bpe


@register("bpe", "subword_nmt", config=SubwordNmtConfig)
class SubwordNmtBPE(SubwordModel):
    """Joint BPE of Sennrich et al. (2016) through the subword-nmt package: ``@@ `` marks a word's inner pieces,
    the codes file is what fairseq's ``--bpe subword_nmt --bpe-codes`` reads."""

    def __init__(self, codes: bytes):
        apply_bpe, _ = _subword_nmt()
        self._codes = bytes(codes)
        try:
            self._bpe = apply_bpe.BPE(io.StringIO(self._codes.decode("utf-8")))
        except (ValueError, IndexError, UnicodeDecodeError) as e:
            raise UserError(f"not a subword-nmt codes file ({e}); pass the codes written by subword-nmt learn-bpe "
                            f"or attnmt preprocess --bpe subword_nmt") from None
        self.training_sentences: int | None = None

    @classmethod
    def train(cls, files: list[str], vocab_size: int, model_path_prefix: str, max_sentences: int = 1_000_000,
              cfg: SubwordNmtConfig | None = None) -> SubwordNmtBPE:
        """Learn ``vocab_size`` merges on the lines of ``files`` (sampled as for SentencePiece); write
        ``model_path_prefix.codes``."""
        _, learn_bpe = _subword_nmt()
        cfg = cfg or SubwordNmtConfig(vocab_size=vocab_size, max_sentences=max_sentences)
        total = sum(1 for _ in _nonempty_lines(files))
        n = min(total, max_sentences) if max_sentences > 0 else total
        if n == 0:
            raise UserError(f"{', '.join(map(str, files))}: no non-empty lines to learn BPE from; check the "
                            f"training files")
        text = io.StringIO("".join(line.rstrip("\n") + "\n" for line in _sample(files, total, n, cfg.seed)))
        codes = io.StringIO()
        learn_bpe.learn_bpe(text, codes, vocab_size, min_frequency=2, verbose=False)
        data = codes.getvalue().encode("utf-8")
        with atomic_open(f"{model_path_prefix}.codes", "wb") as f:
            f.write(data)
        model = cls(data)
        model.training_sentences = n
        return model

    @classmethod
    def load(cls, model_path: str | os.PathLike) -> SubwordNmtBPE:
        try:
            data = Path(model_path).read_bytes()
        except FileNotFoundError:
            raise UserError(f"{model_path}: subword-nmt codes not found; pass the codes file of subword-nmt "
                            f"learn-bpe (fairseq's bpecodes)") from None
        return cls(data)

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "subword-nmt codes") -> SubwordNmtBPE:
        return cls(data)

    CACHE = 100_000  # words subword-nmt remembers (its own cache grows with every new word: emptied at this size)

    def encode(self, text: str) -> str:
        if len(self._bpe.cache) > self.CACHE:
            self._bpe.cache.clear()
        return self._bpe.segment(text.strip())

    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]:
        return [self.encode(line) for line in lines]

    def decode(self, pieces: str) -> str:
        return remove_bpe(" ".join(pieces.split()), "@@ ")

    fairseq_post_process = "@@ "

    def model_bytes(self) -> bytes:
        return self._codes

    def describe(self) -> dict:
        info: dict = {"merges": sum(1 for ln in self._codes.decode("utf-8").splitlines()
                                    if ln and not ln.startswith("#version"))}
        if self.training_sentences is not None:
            info["sentences_used"] = self.training_sentences
        return info


def _nonempty_lines(files: list[str]) -> Iterator[str]:
    for p in files:
        with open(p, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    yield line


def _sample(files: list[str], total: int, n: int, seed: int) -> Iterator[str]:
    """``n`` of the ``total`` non-empty lines of ``files``: all of them, or a fixed-seed sample (in file order)."""
    import numpy as np

    if n >= total:
        yield from _nonempty_lines(files)
        return
    keep = np.zeros(total, dtype=bool)
    keep[np.random.default_rng(seed).choice(total, size=n, replace=False)] = True
    for i, line in enumerate(_nonempty_lines(files)):
        if keep[i]:
            yield line


@dataclass
class FastBpeConfig:
    pass


@register("bpe", "fastbpe", config=FastBpeConfig)
class FastBPE(SubwordModel):
    """BPE with an end-of-word marker (``</w>`` on a word's last piece), applied by the ranks of a merges file
    (``first second [count]`` per line, best first): the subwords of fastBPE, XLM and fairseq's WMT'19 models (FSMT's
    ``merges.txt``). attnmt applies such codes; it learns its own subwords with sentencepiece or subword_nmt."""

    CACHE = 100_000  # words remembered (a bounded cache: a stream of new words does not grow it)

    def __init__(self, merges: bytes, what: str = "merges file"):
        try:
            text = bytes(merges).decode("utf-8")
        except UnicodeDecodeError as e:
            raise UserError(f"{what}: not UTF-8 ({e.reason} at byte {e.start}); pass a merges file") from None
        ranks = {}
        for lineno, line in enumerate(text.split("\n"), 1):
            parts = line.split()
            if not parts:
                continue
            if len(parts) < 2 or (len(parts) > 2 and not parts[2].isdigit()):
                raise UserError(f"{what}:{lineno}: expected 'first second [count]', got {line[:80]!r}")
            ranks.setdefault((parts[0], parts[1]), len(ranks))
        self._bytes, self._ranks = bytes(merges), ranks
        self._cache: dict[str, str] = {}

    @classmethod
    def train(cls, files, vocab_size, model_path_prefix, max_sentences=1_000_000, cfg=None) -> FastBPE:
        raise UserError("--bpe fastbpe applies the merges of an imported model; to learn subwords use --bpe "
                        "sentencepiece or --bpe subword_nmt")

    @classmethod
    def load(cls, model_path: str | os.PathLike | None = None) -> FastBPE:
        if model_path is None:
            raise UserError("--bpe fastbpe needs its merges file; it comes with an imported model")
        try:
            return cls(Path(model_path).read_bytes(), str(model_path))
        except FileNotFoundError:
            raise UserError(f"{model_path}: merges file not found") from None

    @classmethod
    def from_bytes(cls, data: bytes, what: str = "merges file") -> FastBPE:
        return cls(data, what)

    def _word(self, word: str) -> str:
        got = self._cache.get(word)
        if got is not None:
            return got
        pieces = list(word[:-1]) + [word[-1] + "</w>"]
        ranks = self._ranks
        while len(pieces) > 1:
            best, at = None, -1
            for i in range(len(pieces) - 1):
                r = ranks.get((pieces[i], pieces[i + 1]))
                if r is not None and (best is None or r < best):
                    best, at = r, i
            if best is None:
                break
            first, second = pieces[at], pieces[at + 1]
            merged, i = [], 0
            while i < len(pieces):  # every occurrence of the best pair, left to right
                if i < len(pieces) - 1 and pieces[i] == first and pieces[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(pieces[i])
                    i += 1
            pieces = merged
        out = " ".join(pieces)
        if len(self._cache) < self.CACHE:
            self._cache[word] = out
        return out

    def encode(self, text: str) -> str:
        return " ".join(self._word(w) for w in text.split())

    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]:
        return [self.encode(line) for line in lines]

    def decode(self, pieces: str) -> str:
        return " ".join("".join(pieces.split()).replace("</w>", " ").split())

    def model_bytes(self) -> bytes:
        return self._bytes

    def describe(self) -> dict:
        return {"merges": len(self._ranks)}


@dataclass
class NoBPEConfig:
    pass


@register("bpe", "none", config=NoBPEConfig)
class NoBPE(SubwordModel):
    """No subword model: the text is already segmented; pieces are its whitespace-separated tokens."""

    @classmethod
    def train(cls, files: list[str], vocab_size: int, model_path_prefix: str, max_sentences: int = 0,
              cfg: object = None) -> NoBPE:
        return cls()

    @classmethod
    def load(cls, model_path: str | os.PathLike | None = None) -> NoBPE:
        return cls()

    @classmethod
    def from_bytes(cls, data: bytes = b"", what: str = "") -> NoBPE:
        return cls()

    def encode(self, text: str) -> str:
        return " ".join(text.split())

    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]:
        return [" ".join(s.split()) for s in lines]

    def decode(self, pieces: str) -> str:
        return " ".join(pieces.split())

    fairseq_post_process = "none"

    def model_bytes(self) -> bytes:
        return b""


# ----------------------------------------------------------------------------------------------- --remove-bpe

# fairseq's names for the continuation marker of subword-nmt BPE
_MARKER_ALIASES = {"subword_nmt": "@@ ", "@@": "@@ "}


def remove_bpe(pieces: str, symbol: str) -> str:
    """fairseq's ``--remove-bpe SYMBOL`` (its ``post_process``) on space-separated pieces.

    ``sentencepiece``: drop the spaces, then U+2581 marks the word starts; ``subword_nmt`` (or ``@@ ``, the value of
    a bare ``--remove-bpe``): join ``piece@@ next``; any other symbol is removed with what follows it, as fairseq does.
    """
    if symbol == "none":
        return pieces
    if symbol == "sentencepiece":
        return pieces.replace(" ", "").replace("\u2581", " ").strip()
    marker = _MARKER_ALIASES.get(symbol, symbol)
    return (pieces + " ").replace(marker, "").rstrip()


class MarkedPieces(NoBPE):
    """Text segmented outside attnmt (a data-bin of subword-nmt or SentencePiece pieces): encoding keeps the pieces,
    decoding removes the markers as ``--remove-bpe SYMBOL`` says."""

    def __init__(self, symbol: str):
        self.symbol = symbol
        self.fairseq_post_process = symbol

    def decode(self, pieces: str) -> str:
        return remove_bpe(" ".join(pieces.split()), self.symbol)


# ----------------------------------------------------------------------------------------------- pipeline


class TextPipeline:
    """raw text -> pieces (strip, tokenize, optionally lowercase, segment) and pieces -> text (the inverse).

    Lowercasing cannot be undone: ``decode`` then returns lowercased text.
    """

    def __init__(self, tokenizer=None, bpe=None, lowercase: bool = False):
        self.tokenizer = tokenizer or NoTokenizer()
        self.bpe = bpe or NoBPE()
        self.lowercase = lowercase

    def normalize(self, line: str) -> str:
        """What the subword model sees: stripped, tokenized, maybe lowercased text."""
        text = self.tokenizer.encode(line.strip())
        return text.lower() if self.lowercase else text

    def encode(self, line: str) -> str:
        return self.bpe.encode(self.normalize(line))

    def encode_batch(self, lines: list[str], num_threads: int = -1) -> list[str]:
        return self.bpe.encode_batch([self.normalize(s) for s in lines], num_threads=num_threads)

    def decode(self, pieces: str) -> str:
        return self.tokenizer.decode(self.bpe.decode(pieces))

    def merges_subwords(self) -> bool:
        """Whether ``decode`` already turns pieces into words (a subword model of attnmt's, or ``--remove-bpe``)."""
        return type(self.bpe) is not NoBPE

    def removing_markers(self, symbol: str) -> TextPipeline:
        """This pipeline for text segmented outside attnmt, decoded as ``--remove-bpe SYMBOL`` says."""
        return TextPipeline(self.tokenizer, MarkedPieces(symbol), lowercase=self.lowercase)

    @classmethod
    def from_data_dir(cls, data_dir: str | os.PathLike, lang: str) -> TextPipeline:
        """The pipeline ``attnmt preprocess`` used for language ``lang`` of ``data_dir`` (reads preprocess.json)."""
        info = DataBinInfo.read(data_dir, required=True)
        langs = [x for x in (info.source_lang, info.target_lang) if x]
        if lang not in langs:
            raise UserError(f"{Path(data_dir) / 'preprocess.json'}: language '{lang}' was not preprocessed "
                            f"(languages: {', '.join(langs)})")
        bpe_cls = get("bpe", info.bpe or "none").obj
        bpe = bpe_cls.load(Path(data_dir) / info.bpe_model) if info.bpe_model else bpe_cls.load()
        return cls(build_tokenizer(info.tokenizer, lang), bpe, lowercase=info.lowercase)
