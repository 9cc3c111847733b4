"""JSON documents on stdout. A command's --json output goes through `print_json`, so that when the
command then fails, main() knows a document went out already and does not print a second one."""

from __future__ import annotations

import json

from ..errors import FP8ConvertError


class _Printed:
    json = False


printed = _Printed()


def print_json(doc) -> None:
    try:
        print(json.dumps(doc, indent=2))
    except OSError as e:  # a full disk under `> report.json`, a closed pipe
        raise FP8ConvertError(f"stdout: cannot write the JSON report ({e.strerror})") from e
    printed.json = True
