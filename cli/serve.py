"""``attnmt serve``: a checkpoint behind an HTTP/JSON service and a page (needs ``pip install 'attnmt[serve]'``)."""

from __future__ import annotations

import time

import click

from attnmt.cli.generate import remove_bpe_option
from attnmt.config import add_options, given_options, make_config
from attnmt.errors import UserError
from attnmt.generation.generator import GenerationConfig
from attnmt.generation.options import search_option_classes
from attnmt.serve.config import ServeConfig


@click.command("serve")
@click.option("--path", "path", required=True, metavar="CKPT",
              help="Checkpoint to serve (or a directory holding model.pt); a.pt:b.pt: an ensemble.")
@remove_bpe_option
def command(path, remove_bpe, **params):
    """Serve the checkpoint --path over HTTP: LibreTranslate's POST /translate, POST /v1/translate (n-best,
    scores, attention), GET /health, /metrics, and a page at / to try sentences.

    \b
    attnmt serve --path checkpoints/checkpoint_best.pt --port 5000
    curl -s localhost:5000/translate -H 'Content-Type: application/json' -d '{"q": "A man rides a bike."}'
    """
    from attnmt.serve import missing_dependencies

    missing = missing_dependencies()
    if missing:
        raise UserError(missing)
    from attnmt.api import Translator
    from attnmt.serve import serve

    given = given_options(params)
    serve_names = set(ServeConfig.__dataclass_fields__)
    cfg = make_config(ServeConfig, {k: v for k, v in given.items() if k in serve_names})
    from attnmt.serve.access import Access, parse_origins

    Access(cfg.api_keys, cfg.req_limit)  # the options' files and values, checked before the model loads
    parse_origins(cfg.cors_origins)
    start = time.perf_counter()
    translator = Translator(path, remove_bpe=remove_bpe, **{k: v for k, v in given.items() if k not in serve_names})
    if translator.note:
        click.echo(f"attnmt serve: {translator.note}", err=True)
    click.echo(f"attnmt serve: {translator!r}, loaded in {time.perf_counter() - start:.1f} s", err=True)
    try:
        done = serve(translator, cfg, announce=lambda line: click.echo(f"attnmt serve: {line}", err=True))
    finally:
        translator.close()
    lat = done["latency_seconds"]
    click.echo(f"attnmt serve: stopped{' by ' + done['signal'] if done['signal'] else ''}; {done['requests']} "
               f"requests, {done['sentences']} sentences, {done['target_tokens']} target tokens; latency p50 "
               f"{lat['p50']:.3f} s, p99 {lat['p99']:.3f} s", err=True)


add_options(command, [ServeConfig, *search_option_classes(), GenerationConfig])
