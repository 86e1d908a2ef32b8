"""``attnmt build-shortlist``: a vocabulary shortlist learned from a binarized training split."""

from __future__ import annotations

import click


@click.command("build-shortlist")
@click.argument("data_bin", type=click.Path(file_okay=False))
@click.option("-o", "--output", required=True, metavar="FILE",
              help="Where to write the shortlist (CTranslate2's vmap.txt format).")
@click.option("-s", "--source-lang", default=None, help="Source language [default: DATA_BIN's preprocess.json].")
@click.option("-t", "--target-lang", default=None, help="Target language [default: DATA_BIN's preprocess.json].")
@click.option("--subset", default="train", show_default=True, help="The binarized split to learn from.")
@click.option("--top-k", type=click.IntRange(min=1), default=50, show_default=True,
              help="Target tokens listed per source token (those it co-occurs with most strongly).")
@click.option("--frequent", type=click.IntRange(min=0), default=100, show_default=True,
              help="The most frequent target tokens, always candidates.")
def command(data_bin, output, source_lang, target_lang, subset, top_k, frequent):
    """Learn a vocabulary shortlist from DATA_BIN's binarized SUBSET: the --frequent most frequent target tokens
    and, per source token, the --top-k target tokens that co-occur with it most strongly (Dice's coefficient over
    sentence pairs). ``translate``/``generate``/``serve --shortlist FILE`` then search each batch over the target
    tokens of its source words; ``export --to ctranslate2 --shortlist FILE`` gives CTranslate2 the same map.

    \b
    attnmt build-shortlist data-bin/wmt14 -o wmt14.vmap --top-k 50 --frequent 100
    """
    from attnmt.fileio import check_output_file
    from attnmt.generation.shortlist import build
    from attnmt.tasks.translation import TranslationConfig, TranslationTask

    check_output_file(output, "--output")
    task = TranslationTask(TranslationConfig(source_lang=source_lang, target_lang=target_lang), data_bin)
    data = task.dataset(subset)  # the split's two sides, checked against the dictionaries
    sd, td = task.src_dict, task.tgt_dict
    specials = sorted({i for d in (sd, td) for i in (d.bos(), d.pad(), d.eos(), d.unk()) if i is not None})
    pairs = ((data.src[i], data.tgt[i]) for i in range(len(data)))
    shortlist = build(pairs, len(sd), len(td), specials, top_k=top_k, frequent=frequent)
    shortlist.write(output, sd, td)
    sizes = [len(v) for v in shortlist.rules.values()]
    click.echo(f"wrote {output}: {len(shortlist.always)} always-candidates, {len(shortlist.rules)} source tokens "
               f"with up to {max(sizes, default=0)} target tokens each, from {len(data):,} {subset} pairs",
               err=True)
