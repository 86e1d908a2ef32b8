"""``--eval-bleu``: decode the validation set with beam search during training and score it with sacreBLEU.

A validator is a callable ``validator(model) -> {"bleu": float, ...}`` that the loop runs after the loss-based
validation of the first ``--valid-subset``; this module provides the BLEU one.

Hypotheses and references are both detokenized through the data pipeline of DATA_BIN (SentencePiece pieces ->
text, then the Moses detokenizer when preprocessing tokenized): the references are the binarized validation
targets decoded back to text, i.e. the raw references up to SentencePiece normalisation and unknown pieces.
The score is sacreBLEU's default (13a tokenization, cased), as ``attnmt score`` reports.

fairseq's options for data segmented outside attnmt: ``--eval-bleu-remove-bpe [SYMBOL]`` removes subword markers,
``--eval-bleu-detok moses`` then runs the Moses detokenizer of the target language, ``--eval-tokenized-bleu`` scores
with sacreBLEU's ``tokenize none``; ``--eval-bleu-print-samples`` logs the first sentence's hypothesis and reference.

With several training processes every rank decodes every W-th sentence and the hypotheses are gathered, so
that each rank scores the whole set (the same BLEU everywhere) for 1/W of the decoding time.
"""

from __future__ import annotations

import time

import torch

from attnmt.data.subword import build_tokenizer
from attnmt.generation.generator import Generator
from attnmt.generation.search import SearchConfig, Symbols
from attnmt.scoring import corpus_bleu
from attnmt.training import distributed


class BleuValidator:
    """Beam-search the validation sources and return corpus BLEU against the validation targets."""

    def __init__(self, task, cfg, backend):
        self.task = task
        # the run's backend; fp16 training validates in fp32
        self.backend = backend if backend.precision != "fp16" else backend.with_precision("fp32")
        self.max_tokens = cfg.max_tokens
        self.batch_size = cfg.batch_size
        split = task.valid_subsets()[0]
        data = task.dataset(split)
        n = len(data) if cfg.eval_bleu_max_sentences <= 0 else min(len(data), cfg.eval_bleu_max_sentences)
        self.sources = [data.src[i].astype("int64").tolist() for i in range(n)]
        _, self.tgt_pipeline = task.data_state().pipelines(task.data_bin)
        if cfg.eval_bleu_remove_bpe is not None and not self.tgt_pipeline.merges_subwords():
            self.tgt_pipeline = self.tgt_pipeline.removing_markers(cfg.eval_bleu_remove_bpe)
        self.detok = None
        if cfg.eval_bleu_detok == "moses":
            self.detok = build_tokenizer("moses", task.tgt_lang)
        self.tokenize = "none" if cfg.eval_tokenized_bleu else "13a"
        self.print_samples = cfg.eval_bleu_print_samples
        self.samples: tuple[str, str] | None = None
        self.refs = [self.text(task.tgt_dict.string(data.tgt[i])) for i in range(n)]
        self.search_cfg = SearchConfig(beam=cfg.eval_bleu_beam, lenpen=cfg.eval_bleu_lenpen,
                                       max_len_a=cfg.eval_bleu_max_len_a, max_len_b=cfg.eval_bleu_max_len_b)
        start = task.decoder_start() if hasattr(task, "decoder_start") else task.tgt_dict.eos()
        self.symbols = Symbols.from_dictionary(task.tgt_dict, start=None if start == task.tgt_dict.eos() else start)

    def text(self, pieces: str) -> str:
        """Pieces -> the text BLEU is computed on."""
        text = self.tgt_pipeline.decode(pieces)
        return self.detok.decode(text) if self.detok is not None else text

    def __call__(self, model: torch.nn.Module) -> dict:
        t0 = time.perf_counter()
        was_training = model.training
        model.eval()
        try:
            gen = Generator(model, self.symbols, self.search_cfg, self.backend,
                            max_source_positions=model.max_positions()[0], truncate_source=True)
            mine = list(range(distributed.rank(), len(self.sources), distributed.world_size()))
            local = {}
            for i, h in gen.generate([self.sources[j] for j in mine], max_tokens=self.max_tokens,
                                     batch_size=self.batch_size, where="validation"):
                local[mine[i]] = self.text(self.task.tgt_dict.string(h[0].tokens)) if h else ""
        finally:
            model.train(was_training)
        hyps = [""] * len(self.sources)
        for part in distributed.all_gather(local):
            for i, text in part.items():
                hyps[i] = text
        result = corpus_bleu(hyps, self.refs, tokenize=self.tokenize)
        out = {"bleu": float(result.score), "bleu_sentences": len(hyps), "bleu_seconds": time.perf_counter() - t0}
        if self.print_samples and hyps:
            out["sample_hypothesis"], out["sample_reference"] = hyps[0], self.refs[0]
        return out
