"""How a command that fails ends: one line on stderr, an exit code, and with --json an error object.

fp8convert's own errors already are one line. Everything else is mapped by the one table below
(`RULES`, first match wins) instead of ending in a traceback; FP8CONVERT_DEBUG=1 prints the traceback
as well. Ctrl-C and SIGTERM (how Slurm and Kubernetes stop a job) stop a command the same way: one
line saying what a rerun does for that command, exit 130 or 143.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import FP8ConvertError, UsageError
from ..options import DEFAULT_MAX_RESIDENT
from ..units import format_size, size_option

DEBUG_ENV = "FP8CONVERT_DEBUG"
SIGTERM_EXIT = 128 + signal.SIGTERM  # 143, as a shell reports a process SIGTERM ended
SIGINT_EXIT = 130
USAGE_EXIT = UsageError.exit_code  # 2: the command line itself is wrong (click's code for its usage errors too)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _smaller_budget(error: BaseException) -> str:
    """Half the memory budget the run used (the pipeline notes it on the error), at least 256 MiB."""
    budget = getattr(error, "max_resident", None) or DEFAULT_MAX_RESIDENT["cuda"]
    return size_option(max(256 << 20, budget // 2))


def _oom_line(error: BaseException) -> str:
    return f"CUDA out of memory ({_first_line(error)}); try a smaller batch: --max-resident {_smaller_budget(error)}"


def _host_memory_line(error: BaseException) -> str:
    return (
        f"out of host memory ({type(error).__name__}); try a smaller batch: --max-resident "
        f"{_smaller_budget(error)}, or free memory"
    )


def _disk_full_line(error: OSError) -> str:
    where = error.filename or "a file"
    free = ""
    directory = os.path.dirname(os.path.abspath(error.filename)) if error.filename else None
    if directory and os.path.isdir(directory):
        free = f" ({format_size(shutil.disk_usage(directory).free)} free there)"
    needed = getattr(error, "bytes_needed", None)
    need = f"; {format_size(needed)} more is needed" if needed else ""
    return f"{where}: no space left on the device{free}{need}; free space and rerun the same command to resume"


def _is_network(error: BaseException) -> bool:
    from ..source.hub_calls import is_network_error

    return is_network_error(error)


def _network_line(error: BaseException) -> str:
    return f"network error ({type(error).__name__}: {_first_line(error)}); check the connection and rerun"


def _file_line(error: OSError) -> str:
    what = error.strerror or _first_line(error)
    if error.filename2:
        return f"{error.filename} -> {error.filename2}: {what}"
    return f"{error.filename}: {what}"


@dataclass(frozen=True)
class Rule:
    """Errors `matches` accepts end with `line(error)` and `exit_code`."""

    matches: Callable[[BaseException], bool]
    line: Callable[[BaseException], str]
    exit_code: int = 1


RULES = [
    Rule(lambda e: isinstance(e, FP8ConvertError), str, 1),
    Rule(lambda e: type(e).__name__ == "OutOfMemoryError" and type(e).__module__.startswith("torch"), _oom_line),
    Rule(lambda e: isinstance(e, MemoryError), _host_memory_line),
    Rule(lambda e: isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT), _disk_full_line),
    Rule(_is_network, _network_line),  # before OSError: a refused connection is an OSError too
    Rule(lambda e: isinstance(e, OSError) and bool(e.filename), _file_line),
    Rule(lambda e: isinstance(e, OSError), lambda e: f"{e.strerror or _first_line(e)} ({type(e).__name__})"),
]


def describe(error: BaseException) -> tuple[str, int]:
    """(one line, exit code) for any exception a command raised."""
    for rule in RULES:
        if rule.matches(error):
            line = " ".join(rule.line(error).split())
            return line, (
                getattr(error, "exit_code", rule.exit_code) if isinstance(error, FP8ConvertError) else rule.exit_code
            )
    return (
        f"unexpected {type(error).__name__}: {_first_line(error)} (run with {DEBUG_ENV}=1 to see where; "
        "please report it)"
    ), 1


def report(error: BaseException, json_wanted: bool, json_printed: bool) -> int:
    """Print the failure: the traceback (FP8CONVERT_DEBUG=1), one `error:` line on stderr and, with
    --json when the command printed no JSON of its own, an error object on stdout. Returns the exit code."""
    line, code = describe(error)
    if os.environ.get(DEBUG_ENV, "").strip() not in ("", "0"):
        traceback.print_exception(error, file=sys.stderr)
    print(f"error: {line}", file=sys.stderr)
    if json_wanted and not json_printed:
        _print_error_object(line, code)
    return code


def report_usage(error, json_wanted: bool) -> int:
    """A command line the parser refused (unknown option or command, missing argument, bad number): its
    usage lines on stderr as click prints them and, with --json, the error object. Returns the exit code."""
    error.show()
    code = getattr(error, "exit_code", USAGE_EXIT)
    if json_wanted:
        _print_error_object(" ".join(error.format_message().split()), code)
    return code


def _print_error_object(line: str, code: int) -> None:
    import json

    try:
        print(json.dumps({"ok": False, "error": line, "exit_code": code}))
    except OSError:  # stdout itself is what failed (a full disk, a closed pipe): the line on stderr said so
        pass


# ------------------------------------------------------------------------------- stopping

# What a rerun does, by command: said when the command is interrupted or terminated.
RERUN = {
    "quantize": "rerun the same command to resume",
    "dequantize": "rerun the same command to resume",
    "batch": "rerun the same command to resume (finished jobs are skipped)",
    "finalize": "rerun the same command to finish",
    "demo": "rerun the same command to resume",
    "push": "rerun the same push to resume the upload",
    "verify": "nothing was changed; rerun it to verify",
    "inspect": "nothing was changed",
}


def stop_line(command: str | None, terminated: bool) -> str:
    what = "terminated (SIGTERM)" if terminated else "interrupted"
    rerun = RERUN.get(command or "")
    return f"{what}: {rerun}" if rerun else what


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the main thread is, so that every cleanup Ctrl-C runs runs too (threads
    stopped, partial shards left for a rerun, the finalize claim released)."""


class StopOnSigterm:
    """While active, SIGTERM raises Terminated in the main thread (signal handlers can only be set
    there: elsewhere this does nothing). `received` tells the caller which signal stopped it."""

    def __init__(self):
        self.received = False
        self.previous = None

    def __enter__(self) -> StopOnSigterm:
        if threading.current_thread() is threading.main_thread():
            self.previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        if self.previous is not None:
            signal.signal(signal.SIGTERM, self.previous)

    def _handle(self, signum, frame) -> None:
        self.received = True
        raise Terminated()
