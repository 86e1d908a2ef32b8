"""``attnmt generate``: translate a binarized test split (DATA_BIN) or raw text (--input) with a checkpoint.

Output goes to stdout (or ``--output FILE``, written atomically) in input order: one detokenized translation per
line, which ``attnmt score`` reads from a pipe, or fairseq's ``S/T/H/D/P`` lines with ``--format fairseq``.
Progress and a speed summary go to stderr.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path

import click

from attnmt.backends import configure_process
from attnmt.config import add_options, given_options
from attnmt.errors import UserError
from attnmt.fileio import atomic_open, check_output_file
from attnmt.generation.alignment import STYLES, alignment_lines
from attnmt.generation.forced import score_references
from attnmt.generation.generator import GenerationConfig, format_result, write_lines
from attnmt.generation.guidance import LineGuidance, suppressed
from attnmt.generation.inputs import Inputs, read_split, read_text, too_long
from attnmt.generation.options import generation_configs, search_option_classes
from attnmt.generation.search import SearchConfig
from attnmt.inference import load_generator
from attnmt.interop.hub import resolve
from attnmt.progress import SentenceProgress
from attnmt.scoring import fairseq_generate_bleu

# fairseq-generate's defaults, for --fairseq (each only where the command line leaves it out)
FAIRSEQ_GENERATE = {"beam": 5, "lenpen": 1.0, "lenpen_style": "fairseq", "early_stop": "beam", "max_len_a": 0.0,
                    "max_len_b": 200}


def configs(params: dict) -> tuple[SearchConfig, GenerationConfig]:
    """The typed search and generation configs from the options the user gave."""
    return generation_configs(given_options(params))


def fairseq_defaults(params: dict) -> None:
    """fairseq-generate's (and fairseq-interactive's) search defaults, for the options the command line leaves
    out."""
    sampling = params.get("sampling") or params.get("search") not in (None, "beam")
    for name, value in FAIRSEQ_GENERATE.items():
        if params.get(name) is None and not (sampling and name == "early_stop"):  # early_stop: beam search's
            params[name] = value


def remove_bpe_option(command):
    """fairseq's ``--remove-bpe [SYMBOL]`` (and its newer name ``--post-process``), for generate and translate."""
    return click.option(
        "--remove-bpe", "--post-process", "remove_bpe", is_flag=False, flag_value="@@ ", default=None,
        metavar="[SYMBOL]",
        help="For a model trained on text segmented outside attnmt (preprocess --bpe none): a bare --remove-bpe "
             "joins subword-nmt's '@@ ' pieces, --remove-bpe=sentencepiece merges SentencePiece pieces, another "
             "SYMBOL is removed with what follows it (fairseq's meaning). Models with attnmt's own subword model "
             "output words without it.")(command)


def guidance_options(command):
    """``--constraints [ordered|unordered]``, ``--prefix`` (TAB fields of the input lines) and ``--suppress``."""
    command = click.option(
        "--suppress", multiple=True, metavar="TEXT",
        help="Never generate this text (segmented as the targets; repeat for more): CTranslate2's "
             "suppress_sequences.")(command)
    command = click.option(
        "--prefix", "prefix_field", is_flag=True,
        help="Each input line is SOURCE<TAB>PREFIX: the translation starts with the target PREFIX (forced, each "
             "token keeping its log-probability; an empty field: no prefix).")(command)
    return click.option(
        "--constraints", type=click.Choice(["ordered", "unordered"]), is_flag=False, flag_value="ordered",
        default=None, metavar="[ordered|unordered]",
        help="fairseq's lexically constrained decoding: each input line is SOURCE<TAB>PHRASE<TAB>PHRASE...; every "
             "translation contains every phrase (ordered, the default as in fairseq: in the given order; unordered: in any order).")(command)


def read_guidance(bundle, lines, prefix_field: bool, constraints: str | None, suppress, where: str, first: int = 0):
    """The sources of ``lines`` and their guidance (:mod:`attnmt.generation.guidance`)."""
    return LineGuidance(prefix_field, constraints).split(lines, bundle, where, first, suppressed(bundle, suppress))


def print_summary(command: str, generator, search_cfg: SearchConfig, start: float) -> None:
    """The end-of-run lines on stderr: speed, then the search and its scoring formula."""
    click.echo(f"attnmt {command}: {generator.stats.summary(time.perf_counter() - start)}", err=True)
    click.echo(f"attnmt {command}: search: {search_cfg.describe()}", err=True)


def _output_path(results_path: str | None, output: str | None, name: str) -> str | None:
    """Where the output goes: ``--output``, ``--results-path DIR`` (fairseq's ``DIR/generate-NAME.txt``) or stdout
    (None); checked before translating, not at the final rename."""
    if results_path is not None:
        if output:
            raise UserError(f"--results-path {results_path} and --output {output} both say where to write; give one")
        Path(results_path).mkdir(parents=True, exist_ok=True)
        output = str(Path(results_path) / f"generate-{name}.txt")
    if output:
        check_output_file(output, "--output")
    return output


def _inputs(bundle, data_bin, gen_subset, input_path, fields: LineGuidance, suppress, prefix_size: int,
            score_reference: bool, fairseq_refs: bool) -> Inputs:
    """The sentences to translate and their guidance, with the options that need references checked."""
    if fields and input_path is None:
        raise UserError("--constraints and --prefix read TAB fields of raw input lines: give --input FILE|- "
                        "(for a DATA_BIN split, --prefix-size forces the references' first tokens)")
    if input_path is not None:
        inputs = read_text(bundle, input_path, fields, suppress)
    else:
        inputs = read_split(bundle, data_bin, gen_subset, suppress, fairseq_refs=fairseq_refs)
    no_refs = "--input has none" if input_path is not None else inputs.where + " has no target side"
    if prefix_size and inputs.ref_ids is None:
        raise UserError(f"--prefix-size forces the references' first tokens, and {no_refs}; give a DATA_BIN split "
                        f"binarized with both languages")
    if prefix_size:
        inputs.guide.prefixes = [list(r[:-1][:prefix_size]) for r in inputs.ref_ids]
    if score_reference and inputs.ref_ids is None:
        raise UserError(f"--score-reference scores the references of a binarized split, and {no_refs}; give a "
                        f"DATA_BIN split binarized with both languages")
    return inputs


def _kept(bundle, inputs: Inputs, skip_invalid: bool, score_reference: bool, quiet: bool) -> list[int]:
    """The indices of the sentences to translate: all, or with --skip-invalid-size-inputs-valid-test those the
    model accepts (the others named on stderr)."""
    if not skip_invalid:
        return list(range(len(inputs.sources)))
    skipped = too_long(bundle, inputs, with_references=score_reference)
    if skipped and not quiet:
        src_limit, tgt_limit = bundle.model.max_positions()
        shown = ", ".join(str(i + 1) for i in skipped[:10]) + (" ..." if len(skipped) > 10 else "")
        click.echo(f"attnmt generate: {len(skipped)} sentence(s) longer than the model accepts ({src_limit} "
                   f"source{f', {tgt_limit} target' if score_reference else ''} tokens) skipped "
                   f"(--skip-invalid-size-inputs-valid-test): {'line' if len(skipped) == 1 else 'lines'} "
                   f"{shown} of {inputs.where} (ids {', '.join(map(str, skipped[:10]))})", err=True)
    return sorted(set(range(len(inputs.sources))) - set(skipped))


def _write(out, results, keep: list[int], inputs: Inputs, bundle, generator, fmt: str, print_alignment,
           fairseq_line: str | None) -> None:
    """Each sentence's lines in input order; with ``fairseq_line`` (``Generate SPLIT with beam=N``) and references,
    fairseq-generate's closing BLEU line (in fairseq's output; on stderr for plain output, which holds
    translations only)."""
    best: list[str] = []
    for j, hyps in results:
        i = keep[j]
        alignments = None
        if print_alignment is not None:
            alignments = alignment_lines(bundle, generator, inputs.sources[i], hyps, print_alignment)
        write_lines(out, format_result(i, hyps, bundle, fmt, source=inputs.texts[i],
                                       reference=inputs.refs[i] if inputs.refs is not None else None,
                                       alignments=alignments))
        if fairseq_line is not None:
            best.append(bundle.detokenize(bundle.target_pieces(hyps[0].tokens)) if hyps else "")
    if fairseq_line is not None and inputs.refs is not None:
        line = f"{fairseq_line}: {fairseq_generate_bleu(best, [inputs.refs[i] for i in keep])}"
        if fmt == "fairseq":
            out.write(line + "\n")
        else:
            click.echo(f"attnmt generate: {line}", err=True)
    out.flush()


@click.command("generate")
@click.argument("data_bin", required=False, metavar="[DATA_BIN]")
@click.option("--path", "path", required=True, metavar="CKPT",
              help="Checkpoint to translate with (or a directory holding model.pt); it carries the dictionaries "
                   "and the subword model. a.pt:b.pt: an ensemble (the models' probabilities averaged).")
@click.option("--gen-subset", default="test", show_default=True, help="Binarized split of DATA_BIN to translate.")
@click.option("--input", "input_path", metavar="FILE|-",
              help="Translate raw text (one sentence per line; .gz allowed; '-' is stdin) instead of DATA_BIN.")
@click.option("--format", "fmt", type=click.Choice(["plain", "fairseq"]), default="plain", show_default=True,
              help="plain: one translation per line; fairseq: S-/T-/H-/D-/P- lines.")
@click.option("--output", metavar="FILE", help="Write here (atomically) instead of stdout.")
@click.option("--results-path", metavar="DIR",
              help="fairseq's: write DIR/generate-SUBSET.txt (atomically) instead of stdout.")
@click.option("-s", "--source-lang", metavar="LANG", help="fairseq's: checked against the checkpoint's source language.")
@click.option("-t", "--target-lang", metavar="LANG", help="fairseq's: checked against the checkpoint's target language.")
@click.option("--fairseq", "fairseq_mode", is_flag=True,
              help="fairseq-generate's defaults and output: beam 5, length normalisation (--lenpen 1 "
                   "--lenpen-style fairseq), --early-stop beam, at most 200 tokens, S-/T-/H-/D-/P- lines and its "
                   "closing BLEU4 line (options given explicitly win).")
@click.option("--print-alignment", type=click.Choice(STYLES), is_flag=False, flag_value="hard", default=None,
              help="fairseq's: an A- line after each hypothesis (--format fairseq) from the last decoder layer's "
                   "attention: hard (default): SRC-TGT, the source token each target token attends to most; soft: "
                   "every weight.")
@click.option("--skip-invalid-size-inputs-valid-test", "skip_invalid", is_flag=True,
              help="fairseq's: leave out sentences longer than the model accepts (named on stderr) instead of "
                   "refusing them; their lines are missing from the output.")
@click.option("--score-reference", is_flag=True,
              help="fairseq's: score the references instead of translating: each becomes the hypothesis, with "
                   "its mean log-probability per token as the score and its per-token log-probabilities.")
@click.option("--prefix-size", type=click.IntRange(min=0), default=0, show_default=True,
              help="fairseq's: force the first N tokens of each reference (a DATA_BIN split's) as the translation's "
                   "start.")
@click.option("--quiet", is_flag=True, help="No progress and no summary on stderr.")
@remove_bpe_option
@guidance_options
def command(data_bin, path, gen_subset, input_path, fmt, output, results_path, source_lang, target_lang,
            fairseq_mode, print_alignment, skip_invalid, score_reference, prefix_size, quiet, remove_bpe,
            constraints, prefix_field, suppress, **params):
    """Translate DATA_BIN's --gen-subset, or raw text with --input, with the checkpoint --path.

    \b
    attnmt generate data-bin/multi30k --path checkpoints/checkpoint_best.pt > test.hyp
    attnmt generate --path model.pt --input test.en | attnmt score --ref test.de
    attnmt generate data-bin/multi30k --path model.pt --format fairseq --beam 5 --nbest 5
    """
    start = time.perf_counter()
    if fairseq_mode:
        fairseq_defaults(params)
        if click.get_current_context().get_parameter_source("fmt") != click.core.ParameterSource.COMMANDLINE:
            fmt = "fairseq"
    if print_alignment is not None and fmt != "fairseq":
        raise UserError("--print-alignment writes fairseq's A- lines, which only --format fairseq has: add "
                        "--format fairseq (or --fairseq)")
    search_cfg, gen_cfg = configs(params)
    if input_path is None and data_bin is None:
        raise UserError("nothing to translate: give DATA_BIN (a directory written by attnmt preprocess) or "
                        "--input FILE|- for raw text")
    if input_path is not None and data_bin is not None:
        raise UserError(f"give either DATA_BIN ({data_bin}) or --input ({input_path}), not both")
    output = _output_path(results_path, output, gen_subset if input_path is None else "input")

    configure_process("generate", gen_cfg.device)  # allocator settings for decoding (attnmt/backends)
    bundle, generator = load_generator(resolve(path), search_cfg, gen_cfg)
    note = bundle.with_remove_bpe(remove_bpe)
    if note and not quiet:
        click.echo(f"attnmt generate: {note}", err=True)
    try:
        for flag, given in (("-s", source_lang), ("-t", target_lang)):
            if given is not None and given != (bundle.source_lang if flag == "-s" else bundle.target_lang):
                raise UserError(f"{flag} {given}: {bundle.path} translates {bundle.source_lang}->"
                                f"{bundle.target_lang} (a model translates one direction); drop {flag} or give "
                                f"that model's languages")
        inputs = _inputs(bundle, data_bin, gen_subset, input_path, LineGuidance(prefix_field, constraints), suppress,
                         prefix_size, score_reference, fairseq_refs=fairseq_mode)
        keep = _kept(bundle, inputs, skip_invalid, score_reference, quiet)
        sources = [inputs.sources[i] for i in keep]
        progress = SentenceProgress(len(keep), "translating", quiet=quiet)
        try:
            with atomic_open(output, "w") if output else contextlib.nullcontext(sys.stdout) as out:
                if score_reference:
                    results = score_references(generator, sources, [inputs.ref_ids[i] for i in keep],
                                               gen_cfg.max_tokens, gen_cfg.batch_size, inputs.where, progress)
                else:
                    results = generator.generate(sources, gen_cfg.max_tokens, gen_cfg.batch_size, where=inputs.where,
                                                 progress=progress, guide=inputs.guide.subset(keep))
                _write(out, results, keep, inputs, bundle, generator, fmt, print_alignment,
                       f"Generate {gen_subset} with beam={search_cfg.beam}" if fairseq_mode else None)
        finally:
            progress.close()
    finally:
        generator.close()
    if not quiet:
        print_summary("generate", generator, search_cfg, start)

add_options(command, [*search_option_classes(), GenerationConfig])
