"""``attnmt score``: corpus BLEU / chrF of a system output against a reference."""

from __future__ import annotations

import json
import sys

import click

from attnmt.errors import UserError


@click.command("score")
@click.option("--ref", "ref", required=True, metavar="FILE",
              help="Reference translations, one per line (plain text or .gz), untokenized.")
@click.option("--sys", "sys_path", default="-", show_default=True, metavar="FILE|-",
              help="System output: plain lines or generate output (H-/D- lines, D preferred); '-' reads stdin.")
@click.option("--metric", type=click.Choice(["bleu", "chrf"]), default="bleu", show_default=True,
              help="sacreBLEU BLEU or chrF.")
@click.option("--lowercase", is_flag=True, help="Case-insensitive scoring (default: cased).")
@click.option("--tokenize", default=None, metavar="NAME",
              help="sacreBLEU tokenizer for BLEU: 13a (default), intl, zh, char, none, ja-mecab, ko-mecab, spm, ...")
@click.option("--tokenized-bleu", is_flag=True,
              help="COMPATIBILITY MODE: multi-bleu.perl BLEU on whitespace tokens of the text as given. "
                   "Not comparable to sacreBLEU; see docs/evaluation.md.")
@click.option("--compound-split", is_flag=True,
              help="With --tokenized-bleu: Moses-tokenize both sides and split compounds a-b -> a ##AT##-##AT## b "
                   "(tensor2tensor get_ende_bleu.sh, as for the paper's WMT14 En-De 27.3 / 28.4).")
@click.option("--lang", default="de", show_default=True, help="Moses tokenizer language for --compound-split.")
@click.option("--fairseq", "fairseq_mode", is_flag=True,
              help="fairseq-score's BLEU4 line: BLEU of the whitespace tokens as given, an <unk> of the reference "
                   "matching nothing (fairseq's scorer, the number fairseq-score prints).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object instead of the score line.")
def command(ref, sys_path, metric, lowercase, tokenize, tokenized_bleu, compound_split, lang, fairseq_mode, as_json):
    """Score SYS against REF with sacreBLEU (13a, cased), or in the tokenized-BLEU compatibility mode.

    \b
    attnmt score --ref newstest2014.de --sys gen.out
    attnmt generate ... | attnmt score --ref test.de --json
    attnmt score --ref newstest2014.de --sys gen.out --tokenized-bleu --compound-split
    """
    from attnmt import scoring

    if compound_split and not tokenized_bleu:
        raise UserError("--compound-split only applies to --tokenized-bleu; add --tokenized-bleu, or drop "
                        "--compound-split for sacreBLEU")
    if tokenized_bleu and metric != "bleu":
        raise UserError("--tokenized-bleu computes BLEU; drop --metric chrf or drop --tokenized-bleu")
    if tokenized_bleu and tokenize is not None:
        raise UserError("--tokenize is a sacreBLEU option; --tokenized-bleu scores the whitespace tokens as given "
                        "(use --compound-split for Moses tokenization)")
    if metric == "chrf" and tokenize is not None:
        raise UserError("--tokenize applies to BLEU only; chrF works on characters")

    if fairseq_mode and (tokenized_bleu or compound_split or metric != "bleu" or tokenize or lowercase or as_json):
        raise UserError("--fairseq prints fairseq-score's BLEU4 line of the tokens as given; drop --tokenized-bleu, "
                        "--compound-split, --metric, --tokenize, --lowercase and --json, or drop --fairseq")
    refs = scoring.read_lines(ref, "reference")  # first: a missing reference fails before stdin is awaited
    sys_name = "stdin" if sys_path == "-" else sys_path
    if sys_path == "-" and sys.stdin.isatty():
        click.echo("attnmt: reading the system output from stdin (end with Ctrl-D; or give --sys FILE)", err=True)
    hyps = scoring.parse_system_lines(scoring.read_lines(sys_path, "system output"), sys_name)
    scoring.check_pair(len(hyps), len(refs), sys_name, ref)

    if fairseq_mode:
        click.echo(scoring.fairseq_score_bleu(hyps, refs))
        return
    if tokenized_bleu:
        if compound_split:
            for name, lines in ((ref, refs), (sys_name, hyps)):
                if scoring.looks_tokenized(lines):
                    click.echo(f"attnmt: warning: {name} looks Moses-tokenized already (&quot;, @-@ or ##AT##); "
                               f"--compound-split tokenizes it again: give detokenized text", err=True)
        result = scoring.tokenized_bleu(hyps, refs, compound_split=compound_split, lang=lang, lowercase=lowercase)
    elif metric == "chrf":
        result = scoring.corpus_chrf(hyps, refs, lowercase=lowercase)
    else:
        result = scoring.corpus_bleu(hyps, refs, lowercase=lowercase, tokenize=tokenize or "13a")

    if as_json:
        click.echo(json.dumps(result.to_dict(), ensure_ascii=False))
    else:
        click.echo(result.format())
