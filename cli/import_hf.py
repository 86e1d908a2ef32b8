"""``attnmt import-hf DIR``: a Hugging Face translation model (MarianMT/OPUS-MT, FSMT, M2M-100) as an attnmt checkpoint.

The result translates (``translate``, ``generate``, ``interactive``, ``serve``, the Python API), exports
(``export --to ctranslate2|huggingface``), quantizes and fine-tunes (``train --finetune-from``) like any attnmt
checkpoint; it carries the model's vocabularies and SentencePiece models, so raw text goes in and out.
"""

from __future__ import annotations

import click


@click.command("import-hf")
@click.argument("model_dir", metavar="DIR")
@click.option("-s", "--source-lang", metavar="LANG",
              help="Source language: a multilingual model's default one (M2M-100: en, de, ...), else a name.")
@click.option("-t", "--target-lang", metavar="LANG",
              help="Target language: a multilingual model's default one, else a name.")
@click.option("--output", "-o", required=True, metavar="FILE", help="The attnmt checkpoint to write.")
def command(model_dir, source_lang, target_lang, output):
    """Convert the Hugging Face model directory DIR (config.json, model.safetensors or pytorch_model.bin, the
    tokenizer's files, as save_pretrained writes them) into an attnmt checkpoint.

    \b
    attnmt import-hf opus-mt-en-de/ -o opus-mt-en-de.pt
    echo "A man is riding a bike." | attnmt translate --path opus-mt-en-de.pt
    attnmt import-hf m2m100_418M/ -s en -t de -o m2m100.pt   # --src-lang/--tgt-lang choose others later
    """
    from attnmt import checkpoint
    from attnmt.fileio import check_output_file
    from attnmt.interop.huggingface import import_model

    check_output_file(output, "--output")
    ckpt = import_model(model_dir, source_lang, target_lang)
    checkpoint.save(ckpt, output)
    cfg, data = ckpt["model_config"], ckpt["data"]
    click.echo(f"attnmt import-hf: wrote {output}: {ckpt['imported_from']['model_type']} "
               f"{data['source_lang']}->{data['target_lang']}, {cfg['encoder_layers']}+{cfg['decoder_layers']} "
               f"layers, d {cfg['encoder_embed_dim']}, vocabularies {len(data['src_dict']['symbols'])}/"
               f"{len(data['tgt_dict']['symbols'])}", err=True)
