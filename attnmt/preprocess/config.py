"""The options of ``attnmt preprocess`` and the constants of its output format."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnmt.errors import UserError

FORMAT_VERSION = 1
ENCODE_BATCH = 10_000
MAX_PART_LINES = 100 * 1024  # bounds a worker's memory: a part's text and pieces are held in RAM
# options that do not change the output (so they do not make a destdir "different")
NEUTRAL_OPTIONS = ("destdir", "workers", "trainpref", "validpref", "testpref", "srcdict", "tgtdict", "spm_model",
                   "bpe_codes")


@dataclass
class PreprocessConfig:
    source_lang: str | None = field(default=None, metadata={"help": "source language suffix of the input files",
                                                             "aliases": ("-s",)})
    target_lang: str | None = field(default=None, metadata={"help": "target language suffix of the input files",
                                                             "aliases": ("-t",)})
    trainpref: str | None = field(default=None, metadata={
        "help": "training files prefix: reads PREFIX.SRC and PREFIX.TGT (or PREFIX.LANG.gz)"})
    validpref: str | None = field(default=None, metadata={
        "help": "validation files prefix(es), comma-separated: splits valid, valid1, ..."})
    testpref: str | None = field(default=None, metadata={
        "help": "test files prefix(es), comma-separated: splits test, test1, ..."})
    destdir: str = field(default="data-bin", metadata={"help": "output directory"})
    workers: int = field(default=1, metadata={"help": "number of parallel processes"})
    bpe: str = field(default="none", metadata={
        "help": "subword model: sentencepiece (learn a joint BPE model), subword_nmt (learn joint subword-nmt BPE "
                "codes, '@@ ' pieces) or none (text is already segmented)"})
    vocab_size: int = field(default=8000, metadata={
        "help": "number of subword pieces (--bpe sentencepiece) or merge operations (--bpe subword_nmt) to learn"})
    bpe_max_sentences: int = field(default=1_000_000, metadata={
        "help": "learn the subword model on at most this many sentences (a fixed-seed sample; 0 = all)"})
    spm_model: str | None = field(default=None, metadata={
        "help": "reuse this SentencePiece model instead of learning one (e.g. to binarize new test data)"})
    bpe_codes: str | None = field(default=None, metadata={
        "help": "reuse these subword-nmt codes (fairseq's bpecodes) instead of learning them (--bpe subword_nmt)"})
    bpe_dropout: float = field(default=0.0, metadata={
        "help": "also write --bpe-dropout-samples segmentations of the training split with BPE-dropout (Provilkov "
                "et al., 2020): each merge is skipped with this probability (0.1 in the paper), so words come in "
                "finer pieces; attnmt train --sampled-segmentations trains each epoch on the next one (--bpe "
                "sentencepiece; 0: off)"})
    bpe_dropout_samples: int = field(default=20, metadata={
        "help": "how many BPE-dropout segmentations of the training split to write (splits train_sample1, ...)"})
    tokenizer: str = field(default="none", metadata={"help": "word tokenizer applied before subwords: moses or none"})
    lowercase: bool = field(default=False, metadata={"help": "lowercase the text (after tokenization)"})
    joined_dictionary: bool = field(default=False, metadata={
        "help": "one dictionary for both languages (needed to share embeddings)"})
    from_model: str | None = field(default=None, metadata={
        "help": "binarize for fine-tuning this attnmt checkpoint (e.g. one of attnmt import-hf): its subword "
                "models, dictionaries, tokenizer and language tokens, instead of learning or choosing them"})
    srcdict: str | None = field(default=None, metadata={"help": "reuse this source dictionary"})
    tgtdict: str | None = field(default=None, metadata={"help": "reuse this target dictionary"})
    thresholdsrc: int = field(default=0, metadata={"help": "drop source symbols seen fewer times than this"})
    thresholdtgt: int = field(default=0, metadata={"help": "drop target symbols seen fewer times than this"})
    nwordssrc: int = field(default=-1, metadata={
        "help": "source dictionary size, special symbols included (-1 = all)"})
    nwordstgt: int = field(default=-1, metadata={
        "help": "target dictionary size, special symbols included (-1 = all)"})
    padding_factor: int = field(default=8, metadata={"help": "pad dictionary sizes to a multiple of this"})
    dataset_impl: str = field(default="attnmt", metadata={
        "help": "index format of the .idx files: attnmt (its own; it also detects a truncated .bin) or mmap "
                "(fairseq-preprocess's, so that fairseq reads the data-bin too); the .bin files are the same"})
    max_len: int = field(default=1024, metadata={
        "help": "skip training pairs with a side longer than this many tokens (end-of-sentence included)"})

    def __post_init__(self) -> None:
        if not self.source_lang or not self.target_lang:
            raise UserError("give the languages with -s/--source-lang and -t/--target-lang (e.g. -s en -t de)")
        if self.source_lang == self.target_lang:
            raise UserError(f"source and target language are both '{self.source_lang}'; give two different "
                            f"suffixes with -s and -t")
        if not (self.trainpref or self.validpref or self.testpref):
            raise UserError("nothing to preprocess; give --trainpref and/or --validpref/--testpref")
        for name in ("workers", "vocab_size", "max_len", "padding_factor"):
            if getattr(self, name) < 1:
                raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.dataset_impl not in ("attnmt", "mmap"):
            raise UserError(f"--dataset-impl {self.dataset_impl}: attnmt writes memory-mapped data-bins, with its "
                            f"own index (attnmt, the default) or fairseq's (mmap); use one of those")
        if self.bpe_max_sentences < 0:
            raise UserError(f"--bpe-max-sentences must be >= 0 (0 = all), got {self.bpe_max_sentences}")
        if not 0.0 <= self.bpe_dropout < 1.0:
            raise UserError(f"--bpe-dropout is the probability of skipping a merge: give a value in [0, 1) (0.1 is "
                            f"usual), got {self.bpe_dropout}")
        if self.bpe_dropout > 0:
            if self.bpe != "sentencepiece":
                raise UserError(f"--bpe-dropout needs --bpe sentencepiece, got --bpe {self.bpe}")
            if not self.trainpref:
                raise UserError("--bpe-dropout segments the training split again; give --trainpref")
            if self.bpe_dropout_samples < 1:
                raise UserError(f"--bpe-dropout-samples must be at least 1, got {self.bpe_dropout_samples}")
        if self.from_model:
            clash = [f"--{n.replace('_', '-')}" for n in ("spm_model", "bpe_codes", "srcdict", "tgtdict")
                     if getattr(self, n)]
            if clash or self.bpe_dropout:
                raise UserError(f"--from-model takes the subword models and dictionaries from the checkpoint; "
                                f"drop {', '.join(clash) or '--bpe-dropout'}")
            return
        if self.spm_model and self.bpe != "sentencepiece":
            raise UserError("--spm-model needs --bpe sentencepiece")
        if self.bpe_codes and self.bpe != "subword_nmt":
            raise UserError("--bpe-codes needs --bpe subword_nmt")
        if not self.trainpref:
            if not (self.srcdict and (self.tgtdict or self.joined_dictionary)):
                raise UserError("without --trainpref there is nothing to build dictionaries from; pass --srcdict "
                                "and --tgtdict (or --srcdict with --joined-dictionary) of an earlier preprocessing")
            if self.bpe == "sentencepiece" and not self.spm_model:
                raise UserError("without --trainpref there is nothing to learn SentencePiece from; pass the "
                                "--spm-model of an earlier preprocessing")
            if self.bpe == "subword_nmt" and not self.bpe_codes:
                raise UserError("without --trainpref there is nothing to learn BPE codes from; pass --bpe-codes")
