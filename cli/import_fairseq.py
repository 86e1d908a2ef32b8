"""``attnmt import-fairseq CHECKPOINT``: a fairseq transformer checkpoint as an attnmt checkpoint.

The result translates (``generate``, ``translate``, ``interactive``), averages, exports and fine-tunes
(``train --finetune-from``) like any attnmt checkpoint; its data section holds the fairseq dictionaries and, with
``--spm``, the SentencePiece model the text was segmented with (then raw text can be translated directly).
"""

from __future__ import annotations

from pathlib import Path

import click

from attnmt.errors import UserError


@click.command("import-fairseq")
@click.argument("fairseq_checkpoint", metavar="CHECKPOINT")
@click.option("--data", "data_dir", metavar="DIR",
              help="The fairseq data-bin the model was trained on: its dict.SRC.txt and dict.TGT.txt are used.")
@click.option("--srcdict", metavar="FILE", help="The source dictionary (instead of --data).")
@click.option("--tgtdict", metavar="FILE", help="The target dictionary (instead of --data).")
@click.option("-s", "--source-lang", metavar="LANG", help="Source language [default: the checkpoint's].")
@click.option("-t", "--target-lang", metavar="LANG", help="Target language [default: the checkpoint's].")
@click.option("--spm", "spm_model", metavar="FILE",
              help="The SentencePiece model the training text was segmented with: attnmt then segments raw input "
                   "and merges the output itself. Without it the model reads and writes pieces (use --remove-bpe).")
@click.option("--tokenizer", type=click.Choice(["none", "moses"]), default="none", show_default=True,
              help="The word tokenizer applied before the subword model (fairseq's --tokenizer moses).")
@click.option("--output", "-o", required=True, metavar="FILE", help="The attnmt checkpoint to write.")
def command(fairseq_checkpoint, data_dir, srcdict, tgtdict, source_lang, target_lang, spm_model, tokenizer, output):
    """Convert the fairseq transformer CHECKPOINT into an attnmt checkpoint.

    \b
    attnmt import-fairseq checkpoints/checkpoint_best.pt --data data-bin/wmt16_en_de -o model.pt
    attnmt generate data-bin/wmt16_en_de --path model.pt --lenpen-style fairseq --remove-bpe
    """
    from attnmt import checkpoint
    from attnmt.fileio import check_output_file
    from attnmt.interop.fairseq import import_checkpoint, read_checkpoint

    check_output_file(output, "--output")
    if Path(output).exists() and Path(fairseq_checkpoint).exists() and Path(output).samefile(fairseq_checkpoint):
        raise UserError(f"{output}: --output is the fairseq checkpoint being imported, which would be replaced; "
                        f"write the attnmt checkpoint elsewhere (e.g. -o model.pt)")
    options, _ = read_checkpoint(fairseq_checkpoint)
    src = source_lang or options.get("source_lang")
    tgt = target_lang or options.get("target_lang")
    if (not src or not tgt) and data_dir:  # as fairseq does: from the data-bin's file names (SPLIT.SRC-TGT.LANG)
        pairs = {p.name.split(".")[-3] for p in Path(data_dir).glob("*.*-*.*.idx")}
        if len(pairs) == 1:
            src, tgt = (src or next(iter(pairs)).split("-")[0]), (tgt or next(iter(pairs)).split("-")[1])
    if not src or not tgt:
        raise UserError(f"{fairseq_checkpoint}: the checkpoint does not name its languages; give -s SRC -t TGT")
    if data_dir is None and (srcdict is None or tgtdict is None):
        raise UserError("give the model's dictionaries: --data DIR (a fairseq data-bin) or --srcdict and --tgtdict")
    srcdict = srcdict or str(Path(data_dir) / f"dict.{src}.txt")
    tgtdict = tgtdict or str(Path(data_dir) / f"dict.{tgt}.txt")
    ckpt = import_checkpoint(fairseq_checkpoint, srcdict, tgtdict, src, tgt, spm_model=spm_model, tokenizer=tokenizer)
    checkpoint.save(ckpt, output)
    cfg = ckpt["model_config"]
    click.echo(f"attnmt import-fairseq: wrote {output}: {src}->{tgt}, {cfg['encoder_layers']}+{cfg['decoder_layers']} "
               f"layers, d {cfg['encoder_embed_dim']}, dictionaries {len(ckpt['data']['src_dict']['symbols'])}/"
               f"{len(ckpt['data']['tgt_dict']['symbols'])} symbols; fairseq's --lenpen is --lenpen-style fairseq",
               err=True)
