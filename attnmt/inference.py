"""Load a checkpoint for inference: model, dictionaries and text pipeline, from the checkpoint file alone.

A checkpoint carries everything translation needs (its ``data`` section: languages, both dictionaries, the
SentencePiece model bytes, the tokenizer and lowercasing), so raw text can be translated without the data
directory it was trained from, and with exactly the segmentation the training data had.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from attnmt import checkpoint
from attnmt.backends import backend_for, configure_process, resolve_device, resolve_precision, set_threads
from attnmt.checkpoint.model import model_from_checkpoint
from attnmt.data.dictionary import Dictionary
from attnmt.errors import UserError
from attnmt.generation import shortlist
from attnmt.generation.generator import Generator
from attnmt.generation.search import Symbols
from attnmt.generation.shortlist import projection_maker
from attnmt.models.ensemble import Ensemble
from attnmt.models.interface import EncoderDecoderModel, SearchModel


@dataclass
class InferenceBundle:
    """A model ready to translate, with what turns text into its ids and its ids back into text."""

    model: SearchModel  # a trained model, or an ensemble of them
    src_dict: Any  # attnmt.data.dictionary.Dictionary
    tgt_dict: Any
    src_pipeline: Any  # attnmt.data.subword.TextPipeline: raw source line -> pieces
    tgt_pipeline: Any  # pieces -> target text
    source_lang: str
    target_lang: str
    path: Path
    arch: str = ""
    num_updates: int | None = None
    data: checkpoint.DataSection | None = field(default=None, repr=False)
    remove_bpe: str | None = None  # fairseq's --remove-bpe SYMBOL, for text segmented outside attnmt
    decoder_start: int | None = None  # the decoder's first token (None: EOS)
    source_prefix: list[int] = field(default_factory=list)  # ids before every source (its language token)
    forced_first: int | None = None  # the token forced as the first one generated (the target language's)
    _language_ids: set = field(default_factory=set, repr=False)  # a multilingual model's language tokens

    @property
    def symbols(self) -> Symbols:
        return Symbols.from_dictionary(self.tgt_dict, self.decoder_start, self.forced_first)

    @property
    def languages(self) -> list[str]:
        """The language codes a multilingual model translates between (empty for a single pair)."""
        return sorted((self.data.language_tokens or {}) if self.data is not None else {})

    def set_languages(self, source: str | None, target: str | None) -> None:
        """Choose a multilingual model's language pair (its source token, its forced first target token)."""
        tokens = (self.data.language_tokens if self.data is not None else None) or {}
        if not tokens:
            for given, theirs, what in ((source, self.source_lang, "src"), (target, self.target_lang, "tgt")):
                if given is not None and given != theirs:
                    raise UserError(f"--{what}-lang {given}: {self.path} translates {self.source_lang}->"
                                    f"{self.target_lang} only")
            return
        source, target = source or self.source_lang, target or self.target_lang
        for given, what in ((source, "src"), (target, "tgt")):
            if given not in tokens:
                near = ", ".join(sorted(tokens)[:12]) + (", ..." if len(tokens) > 12 else "")
                raise UserError(f"--{what}-lang {given}: not a language of {self.path.name} ({len(tokens)} "
                                f"languages: {near})")
        self.source_lang, self.target_lang = source, target
        self._language_ids = {self.tgt_dict.index(t) for t in tokens.values()}
        self.source_prefix = [self.src_dict.index(tokens[source])]
        self.forced_first = self.tgt_dict.index(tokens[target])

    def max_source_positions(self) -> int:
        return int(self.model.max_positions()[0])

    def encode_source(self, line: str) -> list[int]:
        """A raw source line -> ids (final EOS included), segmented as the training data was."""
        return self._with_prefix(self.src_dict.encode_line(self.src_pipeline.encode(line)))

    def encode_sources(self, lines: list[str], source: str | None = None) -> list[list[int]]:
        """Raw source lines -> ids; ``source``: a multilingual model's source language for these lines (default:
        the one chosen)."""
        prefix = self.source_prefix
        if source is not None and source != self.source_lang:
            prefix = [self.src_dict.index(self.language_token(source, "src"))]
        pieces = self.src_pipeline.encode_batch(lines) if lines else []
        return [self._with_prefix(self.src_dict.encode_line(p), prefix) for p in pieces]

    def _with_prefix(self, ids: list[int], prefix: list[int] | None = None) -> list[int]:
        # a blank line stays blank (its translation is empty): no language token before its EOS alone
        prefix = self.source_prefix if prefix is None else prefix
        return prefix + ids if prefix and len(ids) > 1 else ids

    def language_token(self, code: str, what: str = "tgt") -> str:
        """The token of a multilingual model's language ``code`` (a UserError naming the choices otherwise)."""
        tokens = (self.data.language_tokens if self.data is not None else None) or {}
        if not tokens:
            raise UserError(f"--{what}-lang {code}: {self.path.name} translates {self.source_lang}->"
                            f"{self.target_lang} only")
        if code not in tokens:
            near = ", ".join(sorted(tokens)[:12]) + (", ..." if len(tokens) > 12 else "")
            raise UserError(f"--{what}-lang {code}: not a language of {self.path.name} ({len(tokens)} languages: "
                            f"{near})")
        return tokens[code]

    def symbols_for(self, target: str | None) -> Symbols:
        """The search's symbols for the target language ``target`` (None: the one chosen)."""
        if target is None or target == self.target_lang:
            return self.symbols
        forced = self.tgt_dict.index(self.language_token(target))
        return Symbols.from_dictionary(self.tgt_dict, self.decoder_start, forced)

    def target_pieces(self, ids) -> str:
        """Target ids -> space-separated pieces (special symbols and the forced language token dropped)."""
        if self.forced_first is not None:  # language tokens are not text (as transformers' skip_special_tokens)
            ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
            ids = [i for i in ids if i not in self._language_ids]
        return self.tgt_dict.string(ids)

    def target_text(self, ids) -> str:
        """The detokenized text of target ids (a hypothesis' tokens)."""
        return self.detokenize(self.target_pieces(ids))

    def detokenize(self, pieces: str) -> str:
        """Pieces -> target text (subwords merged, tokenization undone)."""
        return self.tgt_pipeline.decode(pieces)

    def source_pieces(self, ids) -> str:
        return self.src_dict.string(ids)

    def hypothesis_pieces(self, pieces: str) -> str:
        """What the ``H-`` line of ``--format fairseq`` shows: the pieces, without markers under ``--remove-bpe``."""
        return self.tgt_pipeline.bpe.decode(pieces) if self.remove_bpe else pieces

    def with_remove_bpe(self, symbol: str | None) -> str | None:
        """Apply fairseq's ``--remove-bpe SYMBOL`` to the text this bundle decodes; the note to print, if any.

        It matters for a model trained on text segmented outside attnmt (preprocessed with ``--bpe none``). A model
        with attnmt's own subword model already outputs words, so the option then changes nothing.
        """
        if symbol is None:
            return None
        if self.tgt_pipeline.merges_subwords():
            return (f"--remove-bpe {symbol.strip()}: the text pipeline of {self.path.name} already merges subwords "
                    f"(its own subword model); the option changes nothing")
        self.remove_bpe = symbol
        self.src_pipeline = self.src_pipeline.removing_markers(symbol)
        self.tgt_pipeline = self.tgt_pipeline.removing_markers(symbol)
        return None


def ensemble_paths(path: str | os.PathLike) -> list[str]:
    """fairseq's ``--path a.pt:b.pt``: the checkpoints of an ensemble (one path unless it names several)."""
    text = str(path)
    if os.pathsep not in text or Path(text).exists():
        return [text]
    return [p for p in text.split(os.pathsep) if p]


def load_for_inference(path: str | os.PathLike, device: str | torch.device = "cpu") -> InferenceBundle:
    """Everything needed to translate raw text with the checkpoint at ``path`` (a file or a ``model.pt`` dir), or
    with the ensemble of ``a.pt:b.pt`` (the members must share their dictionaries and text pipeline)."""
    paths = ensemble_paths(path)
    if len(paths) > 1:
        bundles = [load_for_inference(p, device) for p in paths]
        first = bundles[0]
        for b in bundles[1:]:
            differ = [k for k in checkpoint.DataSection.IDENTITY if getattr(b.data, k) != getattr(first.data, k)]
            if differ:
                raise UserError(f"{b.path}: cannot join an ensemble with {first.path}: their {', '.join(differ)} "
                                f"differ (the members must share dictionaries and text pipeline)")
        return replace(first, model=Ensemble([b.model for b in bundles]), arch="ensemble of " + ", ".join(
            b.arch for b in bundles))
    p = checkpoint.resolve(path)
    ckpt = checkpoint.load(p)
    data = checkpoint.DataSection.from_dict(ckpt["data"], p)
    src_dict, tgt_dict = data.dictionaries(p)
    src_pipe, tgt_pipe = data.pipelines(p)
    model = model_from_checkpoint(ckpt, src_dict, tgt_dict, p)
    model.to(device if isinstance(device, torch.device) else resolve_device(device))
    train = ckpt.get("train") or {}
    bundle = InferenceBundle(model=model, src_dict=src_dict, tgt_dict=tgt_dict, src_pipeline=src_pipe,
                             tgt_pipeline=tgt_pipe, source_lang=data.source_lang, target_lang=data.target_lang,
                             path=p, arch=str(ckpt.get("arch", "")), num_updates=train.get("num_updates"), data=data)
    if data.decoder_start:
        if data.decoder_start not in tgt_dict:
            raise UserError(f"{p}: the decoder's start symbol {data.decoder_start!r} is not in the target "
                            f"dictionary; the checkpoint is damaged")
        bundle.decoder_start = tgt_dict.index(data.decoder_start)
    if data.language_tokens:
        bundle.set_languages(data.source_lang, data.target_lang)
    return bundle


def check_data_dir(bundle: InferenceBundle, data_bin: str | os.PathLike) -> None:
    """Refuse a binarized directory whose dictionaries differ from the checkpoint's (its ids would mean other words)."""
    for side, lang, d in (("source", bundle.source_lang, bundle.src_dict), ("target", bundle.target_lang,
                                                                           bundle.tgt_dict)):
        f = Path(data_bin) / f"dict.{lang}.txt"
        if not f.is_file():
            raise UserError(f"{f}: not found; DATA_BIN must be the directory written by attnmt preprocess for "
                            f"{bundle.source_lang}-{bundle.target_lang} (or use --input to translate raw text)")
        if Dictionary.load(f).checksum() != d.checksum():
            raise UserError(f"{f}: the {side} dictionary differs from the one {bundle.path} was trained with; "
                            f"binarize the data with that dictionary (preprocess --srcdict/--tgtdict) or "
                            f"translate raw text with --input")


def load_generator(path: str | os.PathLike, search_cfg, gen_cfg):
    """(bundle, Generator) for a checkpoint and the user's search and generation configs.

    Sets the CPU thread count, picks the device and the precision, lets the device's backend prepare the model
    (bf16 cast and packed weights, or ``--quantize int8``, which runs on the CPU: with ``--device auto`` that is
    where the model then stays; its activations in the precision asked for, bf16 under ``auto`` on a CPU with
    native bf16) and starts the ``--workers`` decoding processes, which share the ``--threads``;
    ``generator.close()`` stops them. Process-wide settings are the caller's (``attnmt.backends.configure_process``
    in the commands).
    """
    set_threads(gen_cfg.threads)
    if gen_cfg.quantize == "int8":
        if gen_cfg.device not in ("auto", "cpu"):
            raise UserError(f"--quantize int8 runs on the CPU only; drop --device {gen_cfg.device} or --quantize")
        device = torch.device("cpu")
        precision = resolve_precision(gen_cfg.precision, device, mode="generate")  # of the activations
    else:
        device = resolve_device(gen_cfg.device)
        precision = resolve_precision(gen_cfg.precision, device, mode="generate")
    backend = backend_for(device, precision)
    bundle = load_for_inference(path, device)
    if gen_cfg.src_lang or gen_cfg.tgt_lang:
        bundle.set_languages(gen_cfg.src_lang, gen_cfg.tgt_lang)
    make_projection = None
    if gen_cfg.shortlist:
        make_projection = shortlist_projection(bundle.model, backend, gen_cfg.quantize)
    bundle.model = backend.prepare_inference(bundle.model, gen_cfg.quantize)
    longest = bundle.model.max_positions()[1] - 1  # target positions, the end of sentence included
    if search_cfg.min_len > longest:
        raise UserError(f"--min-len {search_cfg.min_len} is above the longest translation the model can write "
                        f"({longest} tokens); lower --min-len")
    generator = Generator(bundle.model, bundle.symbols, search_cfg, backend,
                          max_source_positions=bundle.max_source_positions(),
                          truncate_source=gen_cfg.truncate_source, target_text=bundle.target_text)
    if make_projection is not None:
        generator.use_shortlist(shortlist.read(gen_cfg.shortlist, bundle.src_dict, bundle.tgt_dict), make_projection,
                                len(bundle.tgt_dict))
    if gen_cfg.workers > 1:
        each = max(1, (gen_cfg.threads or torch.get_num_threads()) // gen_cfg.workers)
        generator.start_workers(gen_cfg.workers, each,
                                functools.partial(load_worker_generator, str(path), search_cfg, gen_cfg, each))
    return bundle, generator


def shortlist_projection(model, backend, quantize: str):
    """``--shortlist``: how a batch's rows of the output projection become a layer run as the backend runs the
    model's (taken before the backend prepares the model; a one-line error for a model without one projection)."""
    if not isinstance(model, EncoderDecoderModel):
        raise UserError("--shortlist takes one model, not an ensemble; translate with one checkpoint")
    weight = model.output_projection_weight().detach()
    return projection_maker(weight, lambda m: backend.prepare_inference(m, quantize))


def load_worker_generator(path: str, search_cfg, gen_cfg, threads: int):
    """What a spawned decoding worker translates with (the picklable ``load`` of ``WorkerPool``): the checkpoint
    loaded as ``load_generator`` loads it, for one process."""
    configure_process("generate", gen_cfg.device)  # a spawned worker is a fresh process
    return load_generator(path, search_cfg, replace(gen_cfg, workers=1, threads=threads))[1]
