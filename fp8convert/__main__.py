"""The `fp8convert` program. The CLI is imported inside a handler so that Ctrl-C during that import (a few
tenths of a second) ends as anywhere else: one line and exit 130, not a traceback."""

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
