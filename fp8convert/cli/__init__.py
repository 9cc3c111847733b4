"""The command line: `main` decides how every command ends (with _failures.py); `run` is the program."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import typer

from .._version import __version__
from ..options import command_line
from ..run.warmup import torch_starting
from . import _failures
from ._options import Command, Group, command, option, printed
from .commands import batch, demo, dequantize, finalize, inspect, push, quantize, verify

app = typer.Typer(
    name="fp8convert",
    cls=Group,
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Convert BF16 Hugging Face checkpoints to FP8 (e4m3) for vLLM, SGLang and transformers.",
)


def _print_version(value: bool) -> None:
    if value:
        print(f"fp8convert {__version__}")
        raise typer.Exit()


@app.callback()
@command("version")
def _top(version: option(bool, "--version", "Print the version and exit.", is_eager=True, callback=_print_version)):
    """The options before a command: --version (the help text is the app's)."""


for function in (quantize, dequantize, inspect, demo, verify, push, finalize, batch):
    app.command(cls=Command)(function)


FLUSH_FAILED_EXIT = 120  # what Python itself exits with when it cannot flush stdout at exit


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    name = next((a for a in argv if not a.startswith("-")), None)  # the command: the first argument that is no option
    printed.json = False
    with _failures.stop_on_sigterm() as sigterm:
        try:
            # With standalone_mode=False typer returns exit codes instead of raising them; in particular
            # it turns Ctrl-C (and so SIGTERM, raised as a KeyboardInterrupt) inside a command into 130.
            with command_line():
                rc = app(args=argv, standalone_mode=False, prog_name="fp8convert")
        except (KeyboardInterrupt, typer.Abort):
            rc = _failures.SIGINT_EXIT
        except typer.Exit as e:
            return e.exit_code
        except Exception as e:  # click's usage errors (typer.TyperException) included
            return _failures.report(e, json_wanted="--json" in argv, json_printed=printed.json)
    if rc == _failures.SIGINT_EXIT:
        line = _failures.stop_line(name, sigterm.received)
        rc = _failures.SIGTERM_EXIT if sigterm.received else _failures.SIGINT_EXIT
        print(line, file=sys.stderr)
        if "--json" in argv and not printed.json:  # a script reading stdout gets a document here too
            with contextlib.suppress(OSError):
                print(json.dumps({"ok": False, "error": line, "exit_code": rc}))
        return rc
    return rc if isinstance(rc, int) else 0


def run(argv: list[str] | None = None) -> None:
    """main(), then exit with its code. Once torch is loaded or loading, skip the interpreter's teardown:
    unloading torch takes a second or so, and a teardown beside an import in progress can abort. main() has
    closed its files and joined its threads, so only the streams are flushed, a failed flush failing the exit."""
    rc = main(argv)
    if "torch" not in sys.modules and not torch_starting():
        sys.exit(rc)
    try:
        sys.stdout.flush()
    except (OSError, ValueError) as e:
        print(f"error: cannot write the output to stdout ({getattr(e, 'strerror', None) or e})", file=sys.stderr)
        rc = rc or FLUSH_FAILED_EXIT
    try:
        sys.stderr.flush()
    except (OSError, ValueError):
        rc = rc or FLUSH_FAILED_EXIT
    os._exit(rc)
