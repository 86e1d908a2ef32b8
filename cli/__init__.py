"""The ``attnmt`` command line: a click group whose subcommands are thin (options -> config -> library call).

Plugins are loaded before the commands are built, so that a plugin's components and their options appear in
``--help`` and in ``attnmt list``: built-ins, then the ``attnmt.plugins`` entry points, then ``--user-dir``.
"""

from __future__ import annotations

import importlib
import io
import os
import sys

import click

from attnmt import settings
from attnmt.errors import UserError
from attnmt.signals import Terminated

# subcommand name -> module (inside attnmt.cli) that defines ``command``
COMMANDS = {
    "list": "list_cmd",
    "preprocess": "preprocess",
    "score": "score",
    "average-checkpoints": "average_checkpoints",
    "train": "train",
    "generate": "generate",
    "translate": "translate",
    "plot": "plot",
    "export": "export",
    "import-fairseq": "import_fairseq",
    "import-hf": "import_hf",
    "interactive": "interactive",
    "serve": "serve",
    "build-shortlist": "build_shortlist",
}


# the packages and modules whose import registers the built-in components, one per kind (a package registers
# its own modules in its __init__); tests/test_registry.py checks that every registering module is reached
COMPONENTS = ("attnmt.models", "attnmt.tasks", "attnmt.criterions", "attnmt.optim", "attnmt.data.subword",
              "attnmt.generation")


def load_components() -> None:
    """Register the built-in components: import the packages that hold them."""
    for name in COMPONENTS:
        importlib.import_module(name)


def _user_dirs(argv: list[str]) -> tuple[list[str], list[str]]:
    """The plugin paths of ``--user-dir`` options and of the ``ATTNMT_USER_DIR`` environment variable."""
    dirs = []
    for i, a in enumerate(argv):
        if a == "--user-dir" and i + 1 < len(argv):
            dirs.append(argv[i + 1])
        elif a.startswith("--user-dir="):
            dirs.append(a.split("=", 1)[1])
    return dirs, list(settings.current().user_dirs)


class LazyGroup(click.Group):
    """Imports a subcommand's module only when that subcommand runs (keeps ``attnmt score`` fast)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except BrokenPipeError:  # click's main would turn it into exit 1
            raise _PipeClosed() from None
        except click.NoSuchOption as e:  # every option the command does not take, at once; fairseq's with a hint
            from attnmt.cli.fairseq_flags import refusals

            if e.ctx is None or e.ctx.command is ctx.command:
                raise
            lines = refusals(e.ctx.command, ctx.meta.get("attnmt.argv", []), e.option_name)
            if len(lines) == 1 and not lines[0].endswith("no such option"):
                raise click.UsageError(lines[0], ctx=e.ctx) from None
            if len(lines) == 1:
                raise
            raise click.UsageError(f"{len(lines)} options that attnmt {e.ctx.info_name} does not take: "
                                   + "; ".join(lines), ctx=e.ctx) from None

    def parse_args(self, ctx, args):
        ctx.meta["attnmt.argv"] = list(args)  # to report every option a command does not take at once
        return super().parse_args(ctx, args)

    def list_commands(self, ctx):
        return sorted(COMMANDS)

    def get_command(self, ctx, name):
        if name not in COMMANDS:
            return None
        module = importlib.import_module(f"attnmt.cli.{COMMANDS[name]}")
        command = module.command
        if not any(p.name == "user_dir" for p in command.params):
            # fairseq puts --user-dir after the command name; the plugins were loaded from the whole command line
            command.params.append(click.Option(["--user-dir"], multiple=True, expose_value=False, hidden=True))
        return command


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--user-dir", multiple=True, metavar="PATH",
              help="Import a local plugin module or package (repeatable); its registrations become available.")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=lambda ctx, _p, v: _version(ctx, v),
              help="Show the version, the hardware attnmt found and the compiled kernels' state, and exit.")
def cli(user_dir):
    """attnmt: neural machine translation with the Transformer of Vaswani et al. (2017).

    \b
    Pipeline:  preprocess -> train -> average-checkpoints -> generate | score
    """


def _version(ctx: click.Context, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    import platform
    from importlib.metadata import version

    import torch

    from attnmt.backends import report

    click.echo(f"attnmt {version('attnmt')} (torch {torch.__version__}, Python {platform.python_version()})")
    for line in report():
        click.echo(line)
    ctx.exit()


class _PipeClosed(Exception):
    """The reader of our output went away (``attnmt generate ... | head``): carried past click's own handler."""


def _quiet_exit(code: int) -> None:
    """Exit without flushing into a closed pipe (which would print an error at interpreter shutdown)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    sys.exit(code)


class _ClosedStream(io.TextIOBase):
    """Stands for a standard stream the process was started without (``<&-``, ``>&-``): any use is a one-line
    error naming it, instead of output that silently goes nowhere or a traceback."""

    def __init__(self, name: str, redirect: str):
        self.name, self.redirect = name, redirect

    def _closed(self, *args, **kwargs):
        raise UserError(f"{self.name} is closed (the command was started with {self.redirect}); give it an open "
                        f"{self.name}, e.g. a file or a pipe")

    read = readline = readlines = write = writelines = fileno = _closed
    buffer = property(_closed)

    def flush(self) -> None:  # nothing was written; the interpreter flushes stdout as it exits
        pass

    def isatty(self) -> bool:
        return False

    def readable(self) -> bool:
        return self.name == "stdin"

    def writable(self) -> bool:
        return self.name == "stdout"


def _standard_streams() -> None:
    """attnmt reads and writes UTF-8 text whatever the locale or ``PYTHONIOENCODING`` say (a translation's
    characters must not depend on them); stderr escapes what its encoding cannot show; closed streams become
    :class:`_ClosedStream`."""
    for name, redirect in (("stdin", "<&-"), ("stdout", ">&-")):
        stream = getattr(sys, name)
        if stream is None:
            setattr(sys, name, _ClosedStream(name, redirect))
        elif isinstance(stream, io.TextIOWrapper) and stream.encoding.lower().replace("-", "") != "utf8":
            stream.reconfigure(encoding="utf-8")
    if isinstance(sys.stderr, io.TextIOWrapper) and sys.stderr.encoding.lower().replace("-", "") != "utf8":
        sys.stderr.reconfigure(errors="backslashreplace")


def _launcher_rank(argv: list[str]) -> list[str]:
    """``python -m torch.distributed.launch ... $(which attnmt) train ...`` (fairseq's getting-started line) puts
    ``--local-rank=K`` (or ``--local_rank K``) before the subcommand: taken off here, as LOCAL_RANK."""
    i = 0
    while i < len(argv) and argv[i].startswith("--local"):
        name, _, value = argv[i].partition("=")
        if name not in ("--local-rank", "--local_rank"):
            break
        if not value and i + 1 < len(argv):
            i += 1
            value = argv[i]
        os.environ.setdefault("LOCAL_RANK", value)
        i += 1
    return argv[i:]


def main(argv: list[str] | None = None) -> None:
    argv = _launcher_rank(list(sys.argv[1:] if argv is None else argv))
    _standard_streams()
    try:
        from attnmt import signals
        from attnmt.registry import load_plugins

        signals.install()  # SIGTERM/SIGHUP unwind like Ctrl-C (attnmt/signals.py)
        load_components()
        load_plugins(*_user_dirs(argv))
        cli.main(args=argv, prog_name="attnmt", standalone_mode=False)
    except UserError as e:
        click.echo(f"attnmt: error: {e}", err=True)
        sys.exit(1)
    except click.exceptions.Abort:
        click.echo("attnmt: aborted", err=True)
        sys.exit(130)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except click.exceptions.Exit as e:
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        click.echo("attnmt: interrupted", err=True)
        sys.exit(130)
    except Terminated as e:
        click.echo(f"attnmt: terminated by {e.name}", err=True)
        sys.exit(e.exit_code)
    except (_PipeClosed, BrokenPipeError):
        _quiet_exit(0)  # e.g. `attnmt generate ... | head`: not an error of ours
    except OSError as e:
        from attnmt.fileio import WRITE_ERRNOS, write_error

        if e.errno not in WRITE_ERRNOS:
            raise
        click.echo(f"attnmt: error: {write_error(e.filename or 'stdout', e)}", err=True)
        sys.exit(1)
