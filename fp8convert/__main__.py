"""The `fp8convert` program (and `python -m fp8convert`). The command line is imported here, inside a
handler, so that Ctrl-C while Python is still importing it (a few tenths of a second) ends like Ctrl-C
anywhere else: one line and exit 130, not a traceback."""

import sys


def main() -> None:
    try:
        from .cli import run
    except KeyboardInterrupt:
        print("interrupted before the command started: nothing was read or written", file=sys.stderr)
        sys.exit(130)
    run()


if __name__ == "__main__":  # not when a spawned worker process imports it
    main()
