"""Command-line interface: a thin layer over fp8convert's Python API.

Errors are mapped to exit codes in one place (`main`): an FP8ConvertError prints one line and exits 1;
Ctrl-C exits 130 and leaves a resumable output.
"""
from __future__ import annotations

import sys

import typer

from ..errors import FP8ConvertError
from . import cluster, convert, publish, verify

app = typer.Typer(name="fp8convert", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  rich_markup_mode="markdown",
                  help="Convert BF16 Hugging Face checkpoints to FP8 (e4m3) for vLLM, SGLang and transformers.")
for commands in (convert, verify, publish, cluster):
    commands.register(app)


INTERRUPTED = "interrupted: rerun the same command to resume"


def main(argv: list[str] | None = None) -> int:
    try:
        # With standalone_mode=False typer returns exit codes instead of raising them; in particular
        # it turns Ctrl-C inside a command into a returned 130.
        rc = app(args=argv, standalone_mode=False)
    except FP8ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        print(INTERRUPTED, file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # usage errors: unknown option, bad value, missing argument
        e.show()
        return getattr(e, "exit_code", 2)
    if rc == 130:
        print(INTERRUPTED, file=sys.stderr)
    return rc if isinstance(rc, int) else 0
