"""``attnmt export --to ctranslate2|fairseq|huggingface``: an attnmt checkpoint as another toolkit's model.

``--check FILE`` then translates FILE's first 20 lines with attnmt and has the other toolkit score those
translations token by token; the command fails when a log-probability differs by more than 1e-3.
"""

from __future__ import annotations

import click

from attnmt.errors import UserError

CHECK_TOLERANCE = 1e-3


@click.command("export")
@click.option("--path", "path", required=True, metavar="CKPT", help="The attnmt checkpoint (or a directory holding "
              "model.pt).")
@click.option("--to", "target", type=click.Choice(["ctranslate2", "fairseq", "huggingface"]), required=True,
              help="ctranslate2: a CTranslate2 model directory; fairseq: checkpoint.pt and dictionaries for "
                   "fairseq 0.12 (fairseq must be installed); huggingface: a MarianMT directory for transformers "
                   "(MarianMTModel, MarianTokenizer) and the tools that read it.")
@click.option("--output-dir", required=True, metavar="DIR", help="Where to write the model.")
@click.option("--quantization", type=click.Choice(["int8", "int8_float32", "int16", "float16", "bfloat16"]),
              help="CTranslate2 weight type (default float32).")
@click.option("--force", is_flag=True, help="Replace --output-dir if an earlier attnmt export wrote it (never a "
              "directory of other files); the old one goes only once the new one is complete.")
@click.option("--check", "check_file", metavar="FILE", help="Compare both toolkits' scores on FILE's first 20 lines.")
@click.option("--shortlist", metavar="FILE", help="--to ctranslate2: carry this vocabulary shortlist (attnmt "
              "build-shortlist) as the model's vmap.txt, for CTranslate2's use_vmap=True.")
def command(path, target, output_dir, quantization, force, check_file, shortlist):
    """Export the checkpoint --path to CTranslate2, fairseq or Hugging Face transformers.

    \b
    attnmt export --path checkpoints/averaged.pt --to ctranslate2 --output-dir ct2-model --check test.en
    attnmt export --path checkpoints/averaged.pt --to fairseq --output-dir fairseq-model
    attnmt export --path checkpoints/averaged.pt --to huggingface --output-dir opus-mt-style-model
    """
    from attnmt import checkpoint

    if quantization and target != "ctranslate2":
        raise UserError("--quantization is a CTranslate2 option; drop it with --to fairseq")
    if shortlist and target != "ctranslate2":
        raise UserError(f"--shortlist is carried to CTranslate2 only; drop it with --to {target}")
    p = checkpoint.resolve(path)
    ckpt = checkpoint.load(p)
    if target == "ctranslate2":
        from attnmt.interop.ctranslate2 import check, export_model

        if shortlist:  # malformed or another model's: refused before anything is written
            from attnmt.generation import shortlist as shortlists
            from attnmt.inference import load_for_inference

            bundle = load_for_inference(p)
            shortlists.read(shortlist, bundle.src_dict, bundle.tgt_dict)
        out = export_model(ckpt, output_dir, quantization, force, vmap=shortlist)
    elif target == "huggingface":
        from attnmt.interop.marian_export import check, export_marian

        out = export_marian(ckpt, output_dir, force)
    else:
        from attnmt.interop.fairseq import check, export_checkpoint

        out = str(export_checkpoint(ckpt, output_dir, force))
    click.echo(f"attnmt export: wrote {out}", err=True)
    if check_file:
        from attnmt.scoring import read_lines

        worst = check(p, output_dir, read_lines(check_file, "input")[:20])
        click.echo(f"attnmt export: --check: largest log-probability difference {worst:.2e} "
                   f"(tolerance {CHECK_TOLERANCE:g})", err=True)
        if worst > CHECK_TOLERANCE:
            raise UserError(f"{out}: the exported model scores differently from {p} (by {worst:.2e}); please report "
                            f"this with the checkpoint's options")
