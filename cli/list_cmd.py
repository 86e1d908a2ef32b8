"""``attnmt list``: everything registered, with one-line descriptions."""

from __future__ import annotations

import click

from attnmt import registry


@click.command("list")
@click.argument("kind", required=False, type=click.Choice(registry.KINDS))
@click.option("--options", "show_options", is_flag=True, help="Also list each component's options and defaults.")
def command(kind, show_options):
    """List registered models, architectures, tasks, criterions, optimizers, LR schedulers and tokenizers/BPE."""
    from attnmt.config import fields_of, option_name

    for k in [kind] if kind else registry.KINDS:
        reg = registry.REGISTRIES[k]
        click.echo(f"{k}:")
        if not reg.entries:
            click.echo("  (none)")
        width = max((len(n) for n in reg.entries), default=0)
        for name in reg.choices():
            e = reg.entries[name]
            extra = f" [model: {e.model}]" if e.model else ""
            click.echo(f"  {name.ljust(width)}  {e.description}{extra}")
            if show_options and e.config is not None:
                for fname, (f, _tp) in fields_of(e.config).items():
                    default = f.default if f.default is not __import__("dataclasses").MISSING else "(required)"
                    click.echo(f"      {option_name(fname)} = {default!r}  {f.metadata.get('help', '')}")
        click.echo()
    if not kind:
        from attnmt.backends import report

        click.echo("hardware:")
        for line in report():
            click.echo(f"  {line}")
