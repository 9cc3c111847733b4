"""How a failed command ends: one line on stderr (FP8CONVERT_DEBUG=1 adds the traceback), an exit code, and
with --json an error object. Ctrl-C and SIGTERM (how Slurm and Kubernetes stop a job) end alike: a line
saying what a rerun does, exit 130 or 143."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import sys
import threading
import traceback
from types import SimpleNamespace

import typer

from ..errors import FP8ConvertError, first_line
from ..options import DEFAULT_MAX_RESIDENT
from ..source.hub import CHECK_AND_RERUN, is_network_error
from ..units import format_size, size_option

DEBUG_ENV = "FP8CONVERT_DEBUG"
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
SIGINT_EXIT = 130


def _smaller_batch(error: BaseException) -> str:
    """Half the memory budget the run used (the pipeline notes it on the error), at least 256 MiB."""
    budget = getattr(error, "max_resident", None) or DEFAULT_MAX_RESIDENT["cuda"]
    return f"try a smaller batch: --max-resident {size_option(max(256 << 20, budget // 2))}"


def _disk_full_line(error: OSError) -> str:
    free = need = ""
    if error.filename and os.path.isdir(directory := os.path.dirname(os.path.abspath(error.filename))):
        free = f" ({format_size(shutil.disk_usage(directory).free)} free there)"
    if needed := getattr(error, "bytes_needed", None):  # the writer notes it
        need = f"; {format_size(needed)} more is needed"
    where = error.filename or "a file"
    return f"{where}: no space left on the device{free}{need}; free space and rerun the same command to resume"


def describe(error: BaseException) -> tuple[str, int]:
    """(one line, exit code) for any exception a command raised."""
    if isinstance(error, FP8ConvertError):  # its message is one line already
        return str(error), error.exit_code
    if type(error).__name__ == "OutOfMemoryError" and type(error).__module__.startswith("torch"):
        line = f"CUDA out of memory ({first_line(error)}); {_smaller_batch(error)}"
    elif isinstance(error, MemoryError):
        line = f"out of host memory ({type(error).__name__}); {_smaller_batch(error)}, or free memory"
    elif isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
        line = _disk_full_line(error)
    elif is_network_error(error):  # before OSError: a refused connection is an OSError too
        line = f"network error ({type(error).__name__}: {first_line(error)}); {CHECK_AND_RERUN}"
    elif isinstance(error, OSError) and error.filename:
        where = f"{error.filename} -> {error.filename2}" if error.filename2 else error.filename
        line = f"{where}: {error.strerror or first_line(error)}"
    elif isinstance(error, OSError):
        line = f"{error.strerror or first_line(error)} ({type(error).__name__})"
    else:
        return (
            f"unexpected {type(error).__name__}: {first_line(error)} (run with {DEBUG_ENV}=1 to see where; "
            "please report it)"
        ), 1
    return " ".join(line.split()), 1


def report(error: BaseException, json_wanted: bool, json_printed: bool) -> int:
    """Print the failure and return its exit code: click's usage lines for a command line it refused (exit 2),
    else one `error:` line; with --json, also an error object on stdout unless the command printed its own."""
    if isinstance(error, typer.TyperException):
        error.show()
        line, code = " ".join(error.format_message().split()), error.exit_code
    else:
        line, code = describe(error)
        if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
            traceback.print_exception(error, file=sys.stderr)
        print(f"error: {line}", file=sys.stderr)
    if json_wanted and not json_printed:
        # stdout itself may be what failed (a full disk, a closed pipe): the line on stderr said so
        with contextlib.suppress(OSError):
            print(json.dumps({"ok": False, "error": line, "exit_code": code}))
    return code


# ------------------------------------------------------------------------------- stopping

RESUME = "rerun the same command to resume"
RERUN = dict.fromkeys(("quantize", "dequantize", "demo"), RESUME) | {
    "batch": f"{RESUME} (finished jobs are skipped)",
    "finalize": "rerun the same command to finish",
    "push": "rerun the same push to resume the upload",
    "verify": "nothing was changed; rerun it to verify",
    "inspect": "nothing was changed",
}


def stop_line(command: str | None, terminated: bool) -> str:
    what = "terminated (SIGTERM)" if terminated else "interrupted"
    rerun = RERUN.get(command or "")
    return f"{what}: {rerun}" if rerun else what


@contextlib.contextmanager
def stop_on_sigterm():
    """While active, SIGTERM raises KeyboardInterrupt in the main thread, so every cleanup of Ctrl-C runs too
    (threads stopped, partial shards kept, the finalize claim released); `received` says it was SIGTERM.
    Only the main thread can set signal handlers: elsewhere this does nothing."""
    state = SimpleNamespace(received=False)

    def handle(signum, frame):
        state.received = True
        raise KeyboardInterrupt

    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, handle) if main_thread else None
    try:
        yield state
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
