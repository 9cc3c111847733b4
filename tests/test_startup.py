"""Start-up: torch takes seconds to import (more with cold files), so the CLI must not import it on its
main thread: quantize and dequantize import it in the background thread that overlaps it with
planning and the first writes."""
from __future__ import annotations

import json
import subprocess
import sys

import fp8convert
from tiny_ckpt import llama_tensors, write_checkpoint

# Runs the CLI in a fresh interpreter and reports which thread imported torch first (None: nobody).
SPY = """
import builtins, json, sys, threading
first = []
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name.split(".")[0] == "torch" and "torch" not in sys.modules and not first:
        first.append(threading.current_thread().name)
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "first_import": first[0] if first else None}))
"""


def who_imports_torch(*args) -> dict:
    run = subprocess.run([sys.executable, "-c", SPY, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_quantize_imports_torch_in_the_background_thread(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    result = who_imports_torch("quantize", src, tmp_path / "out", "--device", "cpu", "-q")
    assert result == {"rc": 0, "first_import": "fp8convert-torch"}


def test_dequantize_imports_torch_in_the_background_thread(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    fp8 = tmp_path / "fp8"
    fp8convert.quantize(src, fp8, scheme="block", format="fp8", device="cpu", progress=False)
    result = who_imports_torch("dequantize", fp8, tmp_path / "out", "--device", "cpu", "-q")
    assert result == {"rc": 0, "first_import": "fp8convert-torch"}

