"""Command-line interface: a thin layer over fp8convert's Python API.

Errors are mapped to exit codes in one place (`main`): an FP8ConvertError prints one line and exits 1;
Ctrl-C exits 130 and leaves a resumable output.
"""
from __future__ import annotations

import sys

import typer

from ..errors import FP8ConvertError
from . import convert

app = typer.Typer(name="fp8convert", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Convert BF16 Hugging Face checkpoints to FP8 (e4m3) for vLLM, SGLang and transformers.")
convert.register(app)


def main(argv: list[str] | None = None) -> int:
    try:
        app(args=argv, standalone_mode=False)
    except FP8ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
    except typer.Exit as e:
        return e.exit_code
    except typer.TyperException as e:  # usage errors: unknown option, bad value, missing argument
        e.show()
        return getattr(e, "exit_code", 2)
    return 0
