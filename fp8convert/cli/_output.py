"""JSON documents on stdout. A command's --json output goes through `print_json`, so that when the
command then fails, main() knows a document went out already and does not print a second one."""
from __future__ import annotations

import json


class _Printed:
    json = False


printed = _Printed()


def print_json(doc) -> None:
    print(json.dumps(doc, indent=2))
    printed.json = True
