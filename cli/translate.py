"""``attnmt translate``: raw sentences on stdin -> translations on stdout, in order, as they come.

Each batch takes the lines already waiting on stdin (up to ``--buffer-size``) but never waits for more: typed or
piped one at a time, every line is answered at once; a whole file piped in is read ahead a buffer at a time, and
each buffer is sorted by length and cut into ``--max-tokens`` search batches (as CTranslate2's ``read_batch_size``
and Marian's ``--maxi-batch`` do), so that a file's batches are large and of even length: few search steps are
spent on a batch's last long sentences.
"""

from __future__ import annotations

import codecs
import os
import select
import sys
import time
from collections import deque
from collections.abc import Iterator

import click

from attnmt.backends import configure_process
from attnmt.cli.generate import configs, guidance_options, print_summary, read_guidance, remove_bpe_option
from attnmt.config import add_options
from attnmt.errors import UserError
from attnmt.generation.generator import GenerationConfig, format_result, write_lines
from attnmt.generation.options import search_option_classes
from attnmt.inference import load_generator
from attnmt.interop.hub import resolve


def _fileno(stream) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, OSError, ValueError):
        return None


def line_batches(stream, limit: int, name: str = "stdin") -> Iterator[list[str]]:
    """Batches of lines from ``stream``: wait for one line, then add every complete line already available.

    Reads the file descriptor directly (a text wrapper's hidden buffer would hide waiting lines from
    ``select``); a stream without one (tests, wrappers) is read ``limit`` lines at a time. ``name``: the
    stream's name in error messages (a file's path, or stdin).
    """
    fd = _fileno(stream)
    if fd is None:
        batch: list[str] = []
        for line in stream:
            batch.append(line.rstrip("\n").rstrip("\r"))
            if len(batch) == limit:
                yield batch
                batch = []
        if batch:
            yield batch
        return
    decoder = codecs.getincrementaldecoder("utf-8")()
    pending: deque[str] = deque()
    buf, eof, lineno = "", False, 0

    def waiting() -> bool:
        return bool(select.select([fd], [], [], 0)[0])

    while True:
        while not eof and (not pending or (len(pending) < limit and waiting())):
            chunk = os.read(fd, 1 << 16)
            try:
                text = decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                bad = lineno + len(pending) + bytes(e.object[: e.start]).count(b"\n") + 1
                raise UserError(f"{name}:{bad}: not valid UTF-8; {'send' if name == 'stdin' else 'give'} UTF-8 "
                                f"text") from None
            if not chunk:
                eof = True
                if buf + text:
                    pending.append(buf + text)
                buf = ""
                break
            *complete, buf = (buf + text).split("\n")
            pending.extend(complete)
        if not pending:
            return
        batch = [pending.popleft().rstrip("\r") for _ in range(min(limit, len(pending)))]
        lineno += len(batch)
        yield batch


@click.command("translate")
@click.option("--path", "path", required=True, metavar="CKPT",
              help="Checkpoint to translate with (or a directory holding model.pt); a.pt:b.pt: an ensemble.")
@click.option("--buffer-size", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Most lines read ahead and translated together, sorted by length into --max-tokens batches "
                   "(only lines already waiting on stdin are taken; the output keeps the input's order).")
@click.option("--format", "fmt", type=click.Choice(["plain", "fairseq"]), default="plain", show_default=True,
              help="plain: one translation per line; fairseq: S-/H-/D-/P- lines.")
@click.option("--quiet", is_flag=True, help="No summary on stderr.")
@remove_bpe_option
@guidance_options
def command(path, buffer_size, fmt, quiet, remove_bpe, constraints, prefix_field, suppress, **params):
    """Translate raw sentences from stdin (one per line) to stdout with the checkpoint --path.

    \b
    echo "A man is riding a bike." | attnmt translate --path checkpoints/checkpoint_best.pt
    attnmt translate --path model.pt --beam 5 --precision auto < input.en > output.de
    """
    start = time.perf_counter()
    search_cfg, gen_cfg = configs(params)
    configure_process("generate", gen_cfg.device)  # allocator settings for decoding (attnmt/backends)

    bundle, generator = load_generator(resolve(path), search_cfg, gen_cfg)
    note = bundle.with_remove_bpe(remove_bpe)
    if note and not quiet:
        click.echo(f"attnmt translate: {note}", err=True)
    if sys.stdin.isatty() and not quiet:
        click.echo(f"attnmt translate: {bundle.source_lang}->{bundle.target_lang}, type a sentence per line "
                   f"(Ctrl-D ends)", err=True)
    first = 0
    out = sys.stdout
    try:
        for lines in line_batches(sys.stdin, buffer_size):
            lines, guide = read_guidance(bundle, lines, prefix_field, constraints, suppress, "stdin", first)
            sources = bundle.encode_sources(lines)
            for i, hyps in generator.generate(sources, gen_cfg.max_tokens, gen_cfg.batch_size, first_id=first,
                                              where="stdin", guide=guide):
                write_lines(out, format_result(first + i, hyps, bundle, fmt, source=lines[i]))
            out.flush()
            first += len(lines)
    finally:
        generator.close()
    if not quiet:
        print_summary("translate", generator, search_cfg, start)


add_options(command, [*search_option_classes(), GenerationConfig])
