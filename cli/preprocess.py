"""``attnmt preprocess``: learn subwords, build dictionaries and binarize parallel text (fairseq-style flags)."""

from __future__ import annotations

import click

from attnmt.config import add_options, given_options, make_config
from attnmt.preprocess import PreprocessConfig


@click.command("preprocess")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary table.")
def command(quiet, **params):
    """Binarize parallel text for training and evaluation.

    \b
    Reads PREFIX.SRC / PREFIX.TGT (plain or .gz) for each of --trainpref, --validpref and --testpref and writes
    to --destdir: dict.SRC.txt, dict.TGT.txt, spm.model (with --bpe sentencepiece), preprocess.json and
    SPLIT.SRC-TGT.LANG.bin/.idx for SPLIT = train, valid, valid1, ..., test, test1, ...

    \b
    Example (Multi30k en-de, joint SentencePiece BPE, shared vocabulary):
      attnmt preprocess -s en -t de --trainpref data/train --validpref data/val --testpref data/test \\
        --destdir data-bin/m30k --bpe sentencepiece --vocab-size 10000 --joined-dictionary --workers 2
    """
    from attnmt.preprocess import preprocess, print_summary

    cfg = make_config(PreprocessConfig, given_options(params), what="attnmt preprocess")
    summary = preprocess(cfg, quiet=quiet)
    if not quiet:
        print_summary(summary)


add_options(command, [PreprocessConfig])
