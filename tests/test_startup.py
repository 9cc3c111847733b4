"""Start-up: torch takes seconds to import (more with cold files), so the CLI must not import it on its
main thread: quantize and dequantize import it in the background thread that overlaps it with
planning and the first writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import fp8convert
from fp8convert.run.warmup import PINNED_ALLOC_CONF
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



# Runs the CLI with its own environment untouched by the test and reports the allocator setting torch
# found when it loaded.
ALLOC_SPY = """
import json, os, sys
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
"""


def cli_allocator_conf(*args, env: dict) -> dict:
    run = subprocess.run([sys.executable, "-c", ALLOC_SPY, *map(str, args)], capture_output=True, text=True,
                         timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_gpu_run_pins_host_memory_by_registering_unless_the_user_configured_the_allocator(tmp_path):
    """The setting is made before torch loads (it reads it once); a CPU run and a user's own
    configuration are left alone."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    gpu = cli_allocator_conf("quantize", src, tmp_path / "a", "--device", "auto", "-q", env=env)
    assert gpu == {"rc": 0, "conf": PINNED_ALLOC_CONF}
    cpu = cli_allocator_conf("quantize", src, tmp_path / "b", "--device", "cpu", "-q", env=env)
    assert cpu == {"rc": 0, "conf": None}
    mine = cli_allocator_conf("quantize", src, tmp_path / "c", "--device", "auto", "-q",
                              env={**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert mine == {"rc": 0, "conf": "expandable_segments:True"}
    theirs = cli_allocator_conf("quantize", src, tmp_path / "d", "--device", "auto", "-q",
                                env={**env, "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert theirs == {"rc": 0, "conf": None}


def test_no_allocator_setting_once_torch_is_loaded(monkeypatch):
    """In a process where torch is already loaded (the Python API after the caller's own import),
    torch has read its configuration: changing the environment then would only mislead."""
    from fp8convert.run import warmup
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    warmup.pin_by_registering()  # torch is loaded in the test process
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
