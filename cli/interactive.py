"""``attnmt interactive``: fairseq-interactive's lines (``S-``, ``W-``, ``H-``, ``D-``, ``P-``) for raw input.

The same translation as ``attnmt translate --format fairseq`` (lines batched as they arrive, up to
``--buffer-size``), plus fairseq's ``W-i<TAB>seconds`` line: the time the sentence's batch took. ``DATA`` (fairseq's
positional data directory) is optional, since the checkpoint carries its dictionaries; when given, its
``dict.LANG.txt`` files must be the checkpoint's.
"""

from __future__ import annotations

import os
import sys
import time

import click

from attnmt.backends import configure_process
from attnmt.cli.generate import (
    configs,
    fairseq_defaults,
    guidance_options,
    print_summary,
    read_guidance,
    remove_bpe_option,
)
from attnmt.cli.translate import line_batches
from attnmt.config import add_options
from attnmt.data.subword import NoTokenizer, SentencePieceBPE, SubwordNmtBPE, TextPipeline, build_tokenizer
from attnmt.errors import UserError
from attnmt.generation.generator import GenerationConfig, format_result, write_lines
from attnmt.generation.options import search_option_classes
from attnmt.inference import check_data_dir, load_generator
from attnmt.interop.hub import resolve


def _segmentation(bundle, tokenizer: str | None, bpe: str | None, spm_model: str | None,
                  bpe_codes: str | None) -> None:
    """Apply fairseq-interactive's --tokenizer/--bpe to a checkpoint that reads pieces (imported from fairseq)."""
    if bpe in (None, "none") and tokenizer in (None, "none"):
        return
    if bundle.src_pipeline.merges_subwords() or not isinstance(bundle.src_pipeline.tokenizer, NoTokenizer):
        return  # the checkpoint segments (and tokenizes) raw text itself, as it was trained
    bpe_model = None
    if bpe == "subword_nmt":
        if not bpe_codes:
            raise UserError("--bpe subword_nmt needs --bpe-codes FILE (the codes the training text was segmented "
                            "with)")
        bpe_model = SubwordNmtBPE.load(bpe_codes)
    if bpe == "sentencepiece":
        if not spm_model:
            raise UserError("--bpe sentencepiece needs --sentencepiece-model FILE (the model the training text was "
                            "segmented with)")
        bpe_model = SentencePieceBPE.load(spm_model)
    for side, lang in (("src_pipeline", bundle.source_lang), ("tgt_pipeline", bundle.target_lang)):
        tok = build_tokenizer(tokenizer or "none", lang)
        setattr(bundle, side, TextPipeline(tok, bpe_model, lowercase=getattr(bundle, side).lowercase))


@click.command("interactive")
@click.argument("data_dir", required=False, metavar="[DATA]")
@click.option("--path", "path", required=True, metavar="CKPT", help="Checkpoint to translate with; a.pt:b.pt: an ensemble.")
@click.option("--input", "input_path", default="-", show_default=True, metavar="FILE|-",
              help="Read sentences from this file instead of stdin.")
@click.option("--buffer-size", type=click.IntRange(min=1), default=64, show_default=True,
              help="Most lines translated together (only lines already waiting are batched).")
@click.option("-s", "--source-lang", metavar="LANG", help="Checked against the checkpoint's source language.")
@click.option("-t", "--target-lang", metavar="LANG", help="Checked against the checkpoint's target language.")
@click.option("--tokenizer", type=click.Choice(["none", "moses"]), help="For a checkpoint that reads pieces (an "
              "imported fairseq model): tokenize raw input with Moses first.")
@click.option("--bpe", type=click.Choice(["none", "sentencepiece", "subword_nmt"]),
              help="For a checkpoint that reads pieces: segment raw input with this subword model.")
@click.option("--sentencepiece-model", metavar="FILE", help="The SentencePiece model of --bpe sentencepiece.")
@click.option("--bpe-codes", metavar="FILE", help="The subword-nmt codes of --bpe subword_nmt.")
@click.option("--fairseq", "fairseq_mode", is_flag=True,
              help="fairseq-interactive's search defaults: beam 5, length normalisation (--lenpen 1 --lenpen-style "
                   "fairseq), --early-stop beam, at most 200 tokens (options given explicitly win).")
@click.option("--quiet", is_flag=True, help="No summary on stderr.")
@remove_bpe_option
@guidance_options
def command(data_dir, path, input_path, buffer_size, source_lang, target_lang, tokenizer, bpe, sentencepiece_model,
            bpe_codes, fairseq_mode, quiet, remove_bpe, constraints, prefix_field, suppress, **params):
    """Translate raw sentences (stdin or --input) to fairseq-interactive's S-/W-/H-/D-/P- lines.

    \b
    echo "A man is riding a bike." | attnmt interactive --path checkpoints/checkpoint_best.pt
    attnmt interactive data-bin/wmt16_en_de --path model.pt --beam 5 --remove-bpe < input.tok.bpe.en
    """
    start = time.perf_counter()
    if fairseq_mode:
        fairseq_defaults(params)
    search_cfg, gen_cfg = configs(params)
    configure_process("generate", gen_cfg.device)

    bundle, generator = load_generator(resolve(path), search_cfg, gen_cfg)
    try:
        for given, theirs, what in ((source_lang, bundle.source_lang, "source"),
                                    (target_lang, bundle.target_lang, "target")):
            if given and given != theirs:
                raise UserError(f"--{what}-lang {given}: {bundle.path} translates {bundle.source_lang}->"
                                f"{bundle.target_lang}")
        if data_dir:
            check_data_dir(bundle, data_dir)
        _segmentation(bundle, tokenizer, bpe, sentencepiece_model, bpe_codes)
        note = bundle.with_remove_bpe(remove_bpe)
        if note and not quiet:
            click.echo(f"attnmt interactive: {note}", err=True)
        if sys.stdin.isatty() and input_path == "-" and not quiet:
            click.echo("attnmt interactive: type the input sentence and press return (Ctrl-D ends):", err=True)
        if input_path != "-" and not os.path.isfile(input_path):
            raise UserError(f"{input_path}: --input not found; give a text file, or - for stdin")
        stream = sys.stdin if input_path == "-" else open(input_path, encoding="utf-8")  # noqa: SIM115
        first, out = 0, sys.stdout
        try:
            for lines in line_batches(stream, buffer_size, "stdin" if input_path == "-" else input_path):
                t0 = time.perf_counter()
                where = "stdin" if input_path == "-" else input_path
                lines, guide = read_guidance(bundle, lines, prefix_field, constraints, suppress, where, first)
                results = dict(generator.generate(bundle.encode_sources(lines), gen_cfg.max_tokens,
                                                  gen_cfg.batch_size, first_id=first, where="input", guide=guide))
                seconds = time.perf_counter() - t0
                for i, line in enumerate(lines):
                    rows = format_result(first + i, results.get(i, []), bundle, "fairseq", source=line)
                    write_lines(out, rows[:1] + [f"W-{first + i}\t{seconds:.3f}\tseconds"] + rows[1:])
                out.flush()
                first += len(lines)
        finally:
            if stream is not sys.stdin:
                stream.close()
    finally:
        generator.close()
    if not quiet:
        print_summary("interactive", generator, search_cfg, start)


add_options(command, [*search_option_classes(), GenerationConfig])
