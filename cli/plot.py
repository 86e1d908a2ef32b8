"""``attnmt plot``: training curves and encoder-decoder attention heat maps as PNG files (needs matplotlib)."""

from __future__ import annotations

import click

from attnmt.config import add_options, given_options
from attnmt.generation.options import search_config, search_option_classes


@click.group("plot")
def command():
    """Draw PNG plots: training curves from train.jsonl, attention heat maps of a checkpoint.

    \b
    attnmt plot curves --log checkpoints/train.jsonl --out curves.png
    attnmt plot attention --path checkpoints/checkpoint_best.pt --input "A man rides a bike." --out attn.png

    Needs matplotlib: pip install 'attnmt[plots]'.
    """


@command.command("curves")
@click.option("--log", "log_path", required=True, metavar="JSONL",
              help="The train.jsonl that attnmt train wrote into its --save-dir.")
@click.option("--out", required=True, metavar="PNG", help="Image to write (atomically).")
@click.option("--title", default=None, help="Figure title (default: the log's path).")
@click.option("--dpi", type=click.IntRange(min=30, max=600), default=150, show_default=True, help="Pixels per inch.")
def curves(log_path, out, title, dpi):
    """Train and validation loss over updates, and validation BLEU when logged (--eval-bleu)."""
    from attnmt.plots import plot_curves, read_train_log, save_png

    log = read_train_log(log_path)
    w, h = save_png(plot_curves(log, title), out, dpi)
    valid = ", ".join(f"{k} {len(s)}" for k, s in log.valid_loss.items()) or "none"
    click.echo(f"attnmt plot: wrote {out} ({w}x{h}): {len(log.train_loss)} train points, valid points: {valid}",
               err=True)


@command.command("attention")
@click.option("--path", "path", required=True, metavar="CKPT",
              help="Checkpoint (or a directory holding model.pt).")
@click.option("--input", "source", required=True, metavar="TEXT", help="The raw source sentence.")
@click.option("--reference", default=None, metavar="TEXT",
              help="Force this raw target sentence instead of the model's own translation.")
@click.option("--out", required=True, metavar="PNG", help="Image to write (atomically).")
@click.option("--layer", type=int, default=-1, show_default=True,
              help="Decoder layer, counted from 0 (negative: from the last).")
@click.option("--head", default="mean", show_default=True, metavar="mean|all|N",
              help="mean: average over heads; all: one panel per head; N: head N only.")
@click.option("--device", default="auto", show_default=True, help="auto (cuda when available), cpu, cuda or cuda:N.")
@click.option("--title", default=None, help="Figure title.")
@click.option("--dpi", type=click.IntRange(min=30, max=600), default=150, show_default=True, help="Pixels per inch.")
def attention(path, source, reference, out, layer, head, device, title, dpi, **params):
    """Heat map of the encoder-decoder attention for one sentence: source pieces on x, target pieces on y.

    Without --reference the sentence is translated first (beam search options as in attnmt generate).
    """
    from attnmt.inference import load_for_inference
    from attnmt.plots import cross_attention_dump, parse_head, plot_attention, save_png

    head = parse_head(head)
    search_cfg = search_config(given_options(params))
    bundle = load_for_inference(path, device)
    dump = cross_attention_dump(bundle, source, reference, search_cfg)
    w, h = save_png(plot_attention(dump, layer, head, title), out, dpi)
    click.echo(f"attnmt plot: wrote {out} ({w}x{h}); target ({'reference' if dump.forced else 'translation'}): "
               f"{dump.translation}", err=True)


add_options(attention, search_option_classes(), skip=("nbest",))
