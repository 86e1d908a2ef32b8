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
    import os

    from attnmt.data import indexed
    from attnmt.data.dictionary import Dictionary
    from attnmt.data.meta import DataBinInfo
    from attnmt.errors import UserError
    from attnmt.fileio import check_output_file
    from attnmt.generation.shortlist import build

    info = DataBinInfo.read(data_bin)
    src, tgt = source_lang or info.source_lang, target_lang or info.target_lang
    if not src or not tgt:
        raise UserError(f"{data_bin}: no preprocess.json names the languages; give -s SRC -t TGT")
    check_output_file(output, "--output")
    dicts = [Dictionary.load(os.path.join(data_bin, f"dict.{lang}.txt")) for lang in (src, tgt)]
    prefix = indexed.pair_prefix(data_bin, subset, src, tgt)
    sides = []
    for lang, d in zip((src, tgt), dicts):
        if not indexed.exists(f"{prefix}.{lang}"):
            raise UserError(f"{prefix}.{lang}.bin/.idx: not found; binarize the {subset} split with attnmt "
                            f"preprocess (or give --subset)")
        data = indexed.IndexedDataset(f"{prefix}.{lang}")
        data.check_ids(len(d), f"dict.{lang}.txt")
        sides.append(data)
    if len(sides[0]) != len(sides[1]):
        raise UserError(f"{prefix}: {len(sides[0])} source but {len(sides[1])} target sentences; re-run attnmt "
                        f"preprocess")
    sd, td = dicts
    specials = sorted({i for d in dicts for i in (d.bos(), d.pad(), d.eos(), d.unk()) if i is not None})
    pairs = ((sides[0][i], sides[1][i]) for i in range(len(sides[0])))
    shortlist = build(pairs, len(sd), len(td), specials, top_k=top_k, frequent=frequent)
    shortlist.write(output, sd, td)
    sizes = [len(v) for v in shortlist.rules.values()]
    click.echo(f"wrote {output}: {len(shortlist.always)} always-candidates, {len(shortlist.rules)} source tokens "
               f"with up to {max(sizes, default=0)} target tokens each, from {len(sides[0]):,} {subset} pairs",
               err=True)
