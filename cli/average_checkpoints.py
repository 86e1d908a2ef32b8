"""``attnmt average-checkpoints``: average the parameters of the last N checkpoints of a run."""

from __future__ import annotations

import click


@click.command("average-checkpoints")
@click.option("--inputs", multiple=True, metavar="DIR_OR_FILE",
              help="A checkpoint directory (with --num-*-checkpoints) or checkpoint files; more files may follow "
                   "as arguments: --inputs a.pt b.pt c.pt.")
@click.argument("more_inputs", nargs=-1, metavar="[FILES]...")
@click.option("--output", required=True, metavar="FILE", help="Where to write the averaged checkpoint.")
@click.option("--num-update-checkpoints", type=int, default=None, metavar="N",
              help="From a directory: the last N checkpoint_{epoch}_{updates}.pt by update number.")
@click.option("--num-epoch-checkpoints", type=int, default=None, metavar="N",
              help="From a directory: the last N checkpoint{epoch}.pt by epoch number.")
@click.option("--checkpoint-upper-bound", type=int, default=None, metavar="N",
              help="With --num-*-checkpoints: only checkpoints up to epoch (or update) N (fairseq's option).")
def command(inputs, more_inputs, output, num_update_checkpoints, num_epoch_checkpoints, checkpoint_upper_bound):
    """Average model parameters of several checkpoints of one run (the paper averages the last 5 or 20).

    \b
    attnmt average-checkpoints --inputs checkpoints/ --num-update-checkpoints 5 --output averaged.pt
    attnmt average-checkpoints --inputs checkpoint_9_9000.pt checkpoint_10_10000.pt --output averaged.pt

    The result keeps the model, its configuration and the dictionaries of the last input and drops the training
    state; generate, translate and train --finetune-from load it.
    """
    from attnmt.checkpoint.averaging import average_to_file, resolve_inputs

    paths = resolve_inputs([*inputs, *more_inputs], num_update_checkpoints, num_epoch_checkpoints,
                           checkpoint_upper_bound)
    click.echo(f"averaging {len(paths)} checkpoint(s):", err=True)
    average_to_file(paths, output, log=lambda msg: click.echo(f"  {msg}", err=True))
    click.echo(f"wrote {output} (averaged from {len(paths)} checkpoint(s))", err=True)
