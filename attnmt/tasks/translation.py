"""The ``translation`` task: a DATA_BIN written by ``attnmt preprocess`` -> dictionaries, pair datasets, model.

What it reads from DATA_BIN: ``dict.{src}.txt``, ``dict.{tgt}.txt``, ``{split}.{src}-{tgt}.{lang}.bin/.idx``,
``preprocess.json`` (languages, joined dictionary, tokenizer, lowercase) and ``spm.model`` when present. The
languages come from ``--source-lang/--target-lang``, else from preprocess.json, else from the two ``dict.*.txt``
files. The checkpoint's ``data`` section (:meth:`TranslationTask.data_state`) copies everything inference needs,
so a checkpoint translates raw text without the data directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from attnmt.checkpoint import DataSection
from attnmt.config import fields_of
from attnmt.criterions import build_criterion
from attnmt.data.dictionary import Dictionary
from attnmt.data.indexed import IndexedDataset, exists, pair_prefix
from attnmt.data.meta import DataBinInfo
from attnmt.data.pairs import LanguagePairDataset
from attnmt.errors import UserError
from attnmt.models.interface import EncoderDecoderModel, build_model
from attnmt.registry import arch_config, get, register


@dataclass
class TranslationConfig:
    source_lang: str | None = field(default=None, metadata={
        "help": "source language (default: from DATA_BIN/preprocess.json)", "aliases": ("-s",)})
    target_lang: str | None = field(default=None, metadata={
        "help": "target language (default: from DATA_BIN/preprocess.json)", "aliases": ("-t",)})
    train_subset: str = field(default="train", metadata={"help": "split to train on"})
    valid_subset: str = field(default="valid", metadata={
        "help": "split(s) to validate on, comma-separated; the first one decides the best checkpoint"})


@register("task", "translation", config=TranslationConfig)
class TranslationTask:
    """Sentence-level translation from a binarized parallel corpus (DATA_BIN written by attnmt preprocess)."""

    def __init__(self, cfg: TranslationConfig, data_bin: str | Path):
        self.cfg = cfg
        self.data_bin = Path(data_bin)
        if not self.data_bin.is_dir():
            if ":" in str(data_bin) and all(Path(p).is_dir() for p in str(data_bin).split(":") if p):
                raise UserError(f"{data_bin}: sharded data directories (fairseq's DIR1:DIR2:...) are not supported; "
                                f"binarize the corpus into one directory (attnmt preprocess reads it in a stream, "
                                f"the training data is memory-mapped)")
            raise UserError(f"{data_bin}: no such data directory; pass the --destdir of attnmt preprocess")
        self.meta = DataBinInfo.read(self.data_bin)
        self.src_lang, self.tgt_lang = self._languages()
        paths = [self.data_bin / f"dict.{lang}.txt" for lang in (self.src_lang, self.tgt_lang)]
        for p in paths:
            if not p.exists():
                raise UserError(f"{p}: dictionary not found; run attnmt preprocess -s {self.src_lang} "
                                f"-t {self.tgt_lang} --destdir {data_bin} first")
        self.src_dict = Dictionary.load(paths[0])
        self.tgt_dict = Dictionary.load(paths[1])
        if (self.src_dict.pad(), self.src_dict.eos()) != (self.tgt_dict.pad(), self.tgt_dict.eos()):
            raise UserError(f"{paths[1]}: pad/eos ids differ from {paths[0]}; re-run attnmt preprocess")
        joined = self.meta.joined_dictionary
        self.joint_dictionary = joined if joined is not None else self.src_dict == self.tgt_dict
        if self.joint_dictionary and self.src_dict != self.tgt_dict:
            raise UserError(f"{self.data_bin / 'preprocess.json'}: says the dictionary is joined but "
                            f"{paths[0].name} and {paths[1].name} differ; re-run attnmt preprocess")

    def _languages(self) -> tuple[str, str]:
        src = self.cfg.source_lang or self.meta.source_lang
        tgt = self.cfg.target_lang or self.meta.target_lang
        if src and tgt:
            return str(src), str(tgt)
        # a data-bin without preprocess.json (fairseq-preprocess's): the direction from its file names
        pairs = {p.name.split(".")[-3] for p in self.data_bin.glob("*.*-*.*.idx")}
        pairs = {p for p in pairs if (not src or p.startswith(f"{src}-")) and (not tgt or p.endswith(f"-{tgt}"))}
        if len(pairs) == 1:
            a, b = next(iter(pairs)).split("-", 1)
            return str(src or a), str(tgt or b)
        langs = sorted(p.name[len("dict."):-len(".txt")] for p in self.data_bin.glob("dict.*.txt"))
        if len(langs) != 2:
            raise UserError(f"{self.data_bin}: cannot tell the languages (found dictionaries for {langs or 'none'}); "
                            f"pass --source-lang and --target-lang")
        others = [lang for lang in langs if lang not in (src, tgt)]
        src = src or others.pop(0)
        tgt = tgt or others.pop(0)
        return str(src), str(tgt)

    # ------------------------------------------------------------------------------------------------ data

    @property
    def pad(self) -> int:
        return self.tgt_dict.pad()

    def split_prefix(self, split: str, lang: str) -> Path:
        """The ``lang`` side of ``split`` (written as this pair, or as the reverse pair)."""
        return Path(f"{pair_prefix(self.data_bin, split, self.src_lang, self.tgt_lang)}.{lang}")

    def dataset(self, split: str, pad_to_multiple: int = 1) -> LanguagePairDataset:
        """The binarized ``split`` as (source, target) pairs; batches padded to a multiple of ``pad_to_multiple``."""
        prefixes = [self.split_prefix(split, lang) for lang in (self.src_lang, self.tgt_lang)]
        for p in prefixes:
            if not exists(str(p)):
                raise UserError(f"{p}.bin/.idx: split '{split}' not found in {self.data_bin}; binarize it with "
                                f"attnmt preprocess (--trainpref/--validpref) or choose another --train-subset/"
                                f"--valid-subset")
        src, tgt = IndexedDataset(str(prefixes[0])), IndexedDataset(str(prefixes[1]))
        if len(src) != len(tgt):
            raise UserError(f"{prefixes[1]}.idx: {len(tgt)} sentences but {prefixes[0]}.idx has {len(src)}; "
                            f"re-run attnmt preprocess")
        src.check_ids(len(self.src_dict), f"dict.{self.src_lang}.txt")
        tgt.check_ids(len(self.tgt_dict), f"dict.{self.tgt_lang}.txt")
        return LanguagePairDataset(src, tgt, pad=self.src_dict.pad(), eos=self.decoder_start(),
                                   pad_to_multiple=pad_to_multiple)

    def decoder_start(self) -> int:
        """The token the decoder starts from: EOS, or the fine-tuned model's own (Marian's ``<pad>``)."""
        start = (self.meta.model or {}).get("decoder_start")
        return self.tgt_dict.index(start) if start else self.tgt_dict.eos()

    def valid_subsets(self) -> list[str]:
        return [s.strip() for s in self.cfg.valid_subset.split(",") if s.strip()]

    def data_state(self) -> DataSection:
        """The checkpoint's ``data`` section: what inference needs without DATA_BIN."""
        spm = self.data_bin / (self.meta.bpe_model or "spm.model")
        bpe = self.meta.bpe or ("sentencepiece" if spm.exists() else "none")
        bpe_model = None
        if spm.exists():
            bpe_model = torch.frombuffer(bytearray(spm.read_bytes()), dtype=torch.uint8).clone()
        model = self.meta.model or {}
        tgt_spm = self.data_bin / model["tgt_bpe_model"] if model.get("tgt_bpe_model") else None
        tgt_bpe_model = None
        if tgt_spm is not None and tgt_spm.exists():
            tgt_bpe_model = torch.frombuffer(bytearray(tgt_spm.read_bytes()), dtype=torch.uint8).clone()
        return DataSection(
            source_lang=self.src_lang, target_lang=self.tgt_lang, joint_dictionary=bool(self.joint_dictionary),
            src_dict=self.src_dict.to_state(), tgt_dict=self.tgt_dict.to_state(),
            src_dict_sha256=self.src_dict.checksum(), tgt_dict_sha256=self.tgt_dict.checksum(),
            bpe=bpe, bpe_model=bpe_model, tokenizer=self.meta.tokenizer, lowercase=self.meta.lowercase,
            tgt_bpe_model=tgt_bpe_model, decoder_start=str(model.get("decoder_start") or ""),
            language_tokens=model.get("language_tokens") or None)

    # ------------------------------------------------------------------------------------------------ model

    def model_config(self, arch: str, overrides: dict) -> tuple[str, object, list[str]]:
        """(model name, config, notes) for ``--arch`` plus the user's options.

        With a joined dictionary the embeddings are shared (paper 3.4) unless the user says
        ``--no-share-all-embeddings`` or the widths differ; without one, a preset's sharing is turned off.
        """
        model_name = get("arch", arch).model
        model_cls = get("model", model_name).config
        notes: list[str] = []
        overrides = dict(overrides)
        cfg = arch_config(arch, overrides)
        if "share_all_embeddings" in fields_of(model_cls) and "share_all_embeddings" not in overrides:
            same_dim = getattr(cfg, "encoder_embed_dim", 0) == getattr(cfg, "decoder_embed_dim", 0)
            want = self.joint_dictionary and same_dim
            if want != cfg.share_all_embeddings:
                overrides["share_all_embeddings"] = want
                cfg = arch_config(arch, overrides)
                notes.append("sharing all embeddings (joined dictionary; fairseq shares only with "
                             "--share-all-embeddings, --no-share-all-embeddings turns it off)" if want else
                             "not sharing embeddings: the dictionaries are not joined")
        return model_name, cfg, notes

    def build_model(self, model_name: str, cfg) -> EncoderDecoderModel:
        return build_model(model_name, cfg, len(self.src_dict), len(self.tgt_dict), self.src_dict.pad(),
                           joint_vocab=self.joint_dictionary)

    def build_criterion(self, name: str, cfg):
        return build_criterion(name, cfg, self.tgt_dict.pad())
