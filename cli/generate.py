"""``attnmt generate``: translate a binarized test split (DATA_BIN) or raw text (--input) with a checkpoint.

Output goes to stdout (or ``--output FILE``, written atomically) in input order: one detokenized translation per
line, which ``attnmt score`` reads from a pipe, or fairseq's ``S/T/H/D/P`` lines with ``--format fairseq``.
Progress and a speed summary go to stderr.
"""

from __future__ import annotations

import contextlib
import sys
import time

import click

from attnmt.config import add_options, given_options
from attnmt.errors import UserError
from attnmt.generation.alignment import STYLES
from attnmt.generation.generator import GenerationConfig
from attnmt.generation.options import generation_configs, search_option_classes
from attnmt.generation.search import Guidance, SearchConfig

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
    from attnmt.generation.guidance import LineGuidance, suppressed

    return LineGuidance(prefix_field, constraints).split(lines, bundle, where, first, suppressed(bundle, suppress))


def print_summary(command: str, generator, search_cfg: SearchConfig, start: float) -> None:
    """The end-of-run lines on stderr: speed, then the search and its scoring formula."""
    click.echo(f"attnmt {command}: {generator.stats.summary(time.perf_counter() - start)}", err=True)
    click.echo(f"attnmt {command}: search: {search_cfg.describe()}", err=True)


def fairseq_reference(bundle, ids) -> str:
    """fairseq-generate's ``T-`` string of a reference: its pieces, an unknown word as ``<<unk>>``, the subword
    markers removed (its ``--post-process`` for the model's subword model), not detokenized."""
    from attnmt.data.subword import remove_bpe

    d = bundle.tgt_dict
    skip = {d.eos(), d.pad(), d.bos()}
    pieces = " ".join("<<unk>>" if i == d.unk() else d[i] for i in map(int, ids) if i not in skip)
    return remove_bpe(pieces, getattr(bundle.tgt_pipeline.bpe, "fairseq_post_process", "none"))


def _binarized_split(bundle, data_bin: str, subset: str, fairseq_refs: bool = False):
    """(source id lists, reference texts or None, source texts, reference id lists or None) of split ``subset``
    of ``data_bin``; ``fairseq_refs``: the references as fairseq-generate prints them (``fairseq_reference``)."""
    from attnmt.data.indexed import IndexedDataset, exists, pair_prefix
    from attnmt.inference import check_data_dir

    check_data_dir(bundle, data_bin)
    src, tgt = bundle.source_lang, bundle.target_lang
    prefix = pair_prefix(data_bin, subset, src, tgt)
    if not exists(f"{prefix}.{src}"):
        raise UserError(f"{prefix}.{src}.bin/.idx: split '{subset}' not found in {data_bin}; choose another "
                        f"--gen-subset or binarize it with attnmt preprocess --testpref")
    src_ds = IndexedDataset(f"{prefix}.{src}")
    src_ds.check_ids(len(bundle.src_dict), f"the checkpoint's {src} dictionary")
    sources = [src_ds[i].tolist() for i in range(len(src_ds))]
    refs = ref_ids = None
    if exists(f"{prefix}.{tgt}"):
        tgt_ds = IndexedDataset(f"{prefix}.{tgt}")
        if len(tgt_ds) != len(src_ds):
            raise UserError(f"{prefix}.{tgt}.idx: {len(tgt_ds)} sentences but the source has {len(src_ds)}; "
                            f"re-run attnmt preprocess")
        tgt_ds.check_ids(len(bundle.tgt_dict), f"the checkpoint's {tgt} dictionary")
        ref_ids = [tgt_ds[i].tolist() for i in range(len(tgt_ds))]
        refs = [fairseq_reference(bundle, tgt_ds[i]) if fairseq_refs else
                bundle.detokenize(bundle.tgt_dict.string(tgt_ds[i])) for i in range(len(tgt_ds))]
    texts = [bundle.src_pipeline.decode(bundle.source_pieces(s)) for s in sources]
    return sources, refs, texts, ref_ids


def _alignments(bundle, generator, source_ids, hyps, style: str) -> list[str]:
    """The ``A-`` line text of each hypothesis of one sentence (``attnmt.generation.alignment``)."""
    import torch

    from attnmt.generation.alignment import alignment_line, attention_rows

    with torch.inference_mode(), generator.autocast():
        rows = attention_rows(bundle.model, list(source_ids), [list(h.tokens) for h in hyps], bundle.symbols.pad,
                              bundle.symbols.first, generator.device)
    return [alignment_line(w, style) for w in rows]


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
    from attnmt.backends import configure_process
    from attnmt.fileio import atomic_open, check_output_file
    from attnmt.generation.generator import format_result, write_lines
    from attnmt.inference import load_generator
    from attnmt.progress import SentenceProgress
    from attnmt.scoring import read_lines

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
    if results_path is not None:
        if output:
            raise UserError(f"--results-path {results_path} and --output {output} both say where to write; give one")
        from pathlib import Path

        Path(results_path).mkdir(parents=True, exist_ok=True)
        output = str(Path(results_path) / f"generate-{gen_subset if input_path is None else 'input'}.txt")
    if output:
        check_output_file(output, "--output")  # before translating, not at the final rename

    configure_process("generate", gen_cfg.device)  # allocator settings for decoding (attnmt/backends)
    from attnmt.interop.hub import resolve

    bundle, generator = load_generator(resolve(path), search_cfg, gen_cfg)
    note = bundle.with_remove_bpe(remove_bpe)
    if note and not quiet:
        click.echo(f"attnmt generate: {note}", err=True)
    for flag, given, theirs in (("-s", source_lang, bundle.source_lang), ("-t", target_lang, bundle.target_lang)):
        if given is not None and given != theirs:
            generator.close()
            raise UserError(f"{flag} {given}: {bundle.path} translates {bundle.source_lang}->{bundle.target_lang} "
                            f"(a model translates one direction); drop {flag} or give that model's languages")
    try:
        if (constraints or prefix_field) and input_path is None:
            raise UserError("--constraints and --prefix read TAB fields of raw input lines: give --input FILE|- "
                            "(for a DATA_BIN split, --prefix-size forces the references' first tokens)")
        if input_path is not None:
            where = "stdin" if input_path == "-" else input_path
            texts = read_lines(input_path, "input")
            texts, guide = read_guidance(bundle, texts, prefix_field, constraints, suppress, where)
            sources, refs, ref_ids = bundle.encode_sources(texts), None, None
        else:
            where = f"{data_bin}/{gen_subset}"
            sources, refs, texts, ref_ids = _binarized_split(bundle, data_bin, gen_subset,
                                                             fairseq_refs=fairseq_mode)
        if input_path is None:
            from attnmt.generation.guidance import suppressed

            guide = Guidance(suppress=suppressed(bundle, suppress))
        if prefix_size:
            if ref_ids is None:
                raise UserError(f"--prefix-size forces the references' first tokens, and "
                                f"{'--input has none' if input_path is not None else where + ' has no target side'}; "
                                f"give a DATA_BIN split binarized with both languages")
            guide.prefixes = [list(r[:-1][:prefix_size]) for r in ref_ids]
        if score_reference and ref_ids is None:
            raise UserError(f"--score-reference scores the references of a binarized split, and "
                            f"{'--input has none' if input_path is not None else where + ' has no target side'}; "
                            f"give a DATA_BIN split binarized with both languages")

        keep = list(range(len(sources)))
        if skip_invalid:
            src_limit, tgt_limit = bundle.model.max_positions()
            too_long = [i for i in keep if len(sources[i]) > src_limit
                        or (score_reference and len(ref_ids[i]) > tgt_limit)]
            keep = sorted(set(keep) - set(too_long))
            if too_long and not quiet:
                shown = ", ".join(str(i + 1) for i in too_long[:10]) + (" ..." if len(too_long) > 10 else "")
                click.echo(f"attnmt generate: {len(too_long)} sentence(s) longer than the model accepts ({src_limit} "
                           f"source{f', {tgt_limit} target' if score_reference else ''} tokens) skipped "
                           f"(--skip-invalid-size-inputs-valid-test): {'line' if len(too_long) == 1 else 'lines'} "
                           f"{shown} of {where} (ids {', '.join(map(str, too_long[:10]))})", err=True)
        progress = SentenceProgress(len(keep), "translating", quiet=quiet)
        sink = atomic_open(output, "w") if output else contextlib.nullcontext(sys.stdout)
        best: list[str] = []
        try:
            with sink as out:
                if score_reference:
                    from attnmt.generation.forced import score_references

                    results = score_references(generator, [sources[i] for i in keep], [ref_ids[i] for i in keep],
                                               gen_cfg.max_tokens, gen_cfg.batch_size, where, progress)
                else:
                    results = generator.generate([sources[i] for i in keep], gen_cfg.max_tokens, gen_cfg.batch_size,
                                                 where=where, progress=progress, guide=guide.subset(keep))
                for j, hyps in results:
                    i = keep[j]
                    alignments = None
                    if print_alignment is not None:
                        alignments = _alignments(bundle, generator, sources[i], hyps, print_alignment)
                    write_lines(out, format_result(i, hyps, bundle, fmt, source=texts[i],
                                                   reference=refs[i] if refs is not None else None,
                                                   alignments=alignments))
                    if fairseq_mode:
                        best.append(bundle.detokenize(bundle.target_pieces(hyps[0].tokens)) if hyps else "")
                if fairseq_mode and refs is not None:  # fairseq-generate's closing line: in fairseq's output
                    from attnmt.scoring import fairseq_generate_bleu  # only (plain output holds translations only)

                    line = (f"Generate {gen_subset} with beam={search_cfg.beam}: "
                            f"{fairseq_generate_bleu(best, [refs[i] for i in keep])}")
                    if fmt == "fairseq":
                        out.write(line + "\n")
                    else:
                        click.echo(f"attnmt generate: {line}", err=True)
                out.flush()
        finally:
            progress.close()
    finally:
        generator.close()
    if not quiet:
        print_summary("generate", generator, search_cfg, start)


add_options(command, [*search_option_classes(), GenerationConfig])
