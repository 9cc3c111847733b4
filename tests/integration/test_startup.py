"""Start-up: torch takes seconds to import (more with cold files), so the CLI must not import it on its
main thread: quantize and dequantize import it in the background thread that overlaps it with
planning and the first writes. The program also sets up torch's pinned allocator before that import, and
records and reads ahead the pages torch's start-up reads (run/warmup.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_ckpt import llama_tensors, write_checkpoint

import fp8convert
from fp8convert import api
from fp8convert.run.warmup import PINNED_ALLOC_CONF

# Runs the CLI in a fresh interpreter and reports which thread imported torch first (None: nobody).
# The torch thread's first import of torch is held back by DELAY seconds.
SPY = """
import builtins, json, sys, threading, time
DELAY = {delay}
first = []
real_import = builtins.__import__
def spy(name, *args, **kwargs):
    if name.split(".")[0] == "torch" and "torch" not in sys.modules and not first:
        if threading.current_thread().name == "fp8convert-torch":
            time.sleep(DELAY)
        first.append(threading.current_thread().name)
    return real_import(name, *args, **kwargs)
builtins.__import__ = spy
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "first_import": first[0] if first else None}))
"""


def run_spy(script: str, *args, env: dict | None = None) -> dict:
    """Run `script` (a spy around the CLI, given `args`) in a fresh interpreter; the JSON it printed last."""
    run = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)], capture_output=True, text=True, timeout=300, env=env
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def who_imports_torch(*args, delay: float = 0.0, env: dict | None = None) -> dict:
    """`env`: added to the environment."""
    return run_spy(SPY.replace("{delay}", str(delay)), *args, env={**os.environ, **(env or {})})


@pytest.mark.slow
def test_quantize_imports_torch_in_the_background_thread(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    result = who_imports_torch("quantize", src, tmp_path / "out", "--device", "cpu", "-q")
    assert result == {"rc": 0, "first_import": "fp8convert-torch"}


@pytest.mark.slow
def test_main_thread_waits_for_a_late_torch_thread(tmp_path):
    """The main thread reaches the pipeline in milliseconds on a small model; it must then wait for the
    torch thread rather than import torch itself, however late that thread gets to its import (the
    dequantize test below failed once on a 16-core machine, most likely so)."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    result = who_imports_torch("quantize", src, tmp_path / "out", "--device", "cpu", "-q", delay=1.5)
    assert result == {"rc": 0, "first_import": "fp8convert-torch"}


def test_a_ranks_gpu_is_its_local_rank_among_the_visible_devices(monkeypatch):
    from fp8convert.cluster.workers import WorkerSpec, device_for
    from fp8convert.run import warmup

    rank5 = WorkerSpec(5, 8, "torchrun", 5)
    monkeypatch.setattr(warmup, "cuda_device_count", lambda: 4)
    assert device_for(rank5, "auto") == device_for(rank5, "cuda") == "cuda:1"
    assert device_for(rank5, "cuda:0") == "cuda:0" and device_for(WorkerSpec(), "auto") == "auto"
    monkeypatch.setattr(warmup, "cuda_device_count", lambda: 0)
    assert device_for(rank5, "auto") == "cpu" and device_for(rank5, "cuda") == "cuda"  # refused later, by torch


@pytest.mark.slow
def test_dequantize_imports_torch_in_the_background_thread(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    fp8 = tmp_path / "fp8"
    fp8convert.quantize(src, fp8, scheme="block", format="fp8", device="cpu", progress=False)
    result = who_imports_torch("dequantize", fp8, tmp_path / "out", "--device", "cpu", "-q")
    assert result == {"rc": 0, "first_import": "fp8convert-torch"}


# Runs the CLI in a fresh interpreter; reports whether numpy was loaded when the prefetcher started reading.
# The background import of torch (which loads numpy) is switched off: only the main thread's own imports
# count, so the answer does not depend on which thread the machine runs first.
PREFETCH_SPY = """
import json, sys
from fp8convert.run import prefetch, warmup
warmup.TorchStart._load = lambda self: None
seen = []
real_enter = prefetch.Prefetcher.__enter__
def enter(self):
    seen.append("numpy" in sys.modules)
    return real_enter(self)
prefetch.Prefetcher.__enter__ = enter
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "numpy_loaded": seen}))
"""


@pytest.mark.slow
def test_the_checkpoint_is_read_before_numpy_is_imported(tmp_path):
    """numpy takes a tenth of a second to import with cold files: nothing the main thread does before the
    checkpoint's reads start (while the plan is made, then the run's own) imports it."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    result = run_spy(PREFETCH_SPY, "quantize", src, tmp_path / "out", "--device", "cpu", "-q")
    assert result == {"rc": 0, "numpy_loaded": [False, False]}


# Runs the CLI with its own environment untouched by the test and reports the allocator setting torch
# found when it loaded.
ALLOC_SPY = """
import json, os, sys
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")}))
"""


def cli_allocator_conf(*args, env: dict) -> dict:
    return run_spy(ALLOC_SPY, *args, env=env)


@pytest.mark.slow
def test_a_gpu_run_pins_host_memory_by_registering_unless_the_user_configured_the_allocator(tmp_path):
    """The setting is made before torch loads (it reads it once); a CPU run and a user's own
    configuration are left alone."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    gpu = cli_allocator_conf("quantize", src, tmp_path / "a", "--device", "auto", "-q", env=env)
    assert gpu == {"rc": 0, "conf": PINNED_ALLOC_CONF}
    cpu = cli_allocator_conf("quantize", src, tmp_path / "b", "--device", "cpu", "-q", env=env)
    assert cpu == {"rc": 0, "conf": None}
    mine = cli_allocator_conf(
        "quantize",
        src,
        tmp_path / "c",
        "--device",
        "auto",
        "-q",
        env={**env, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
    )
    assert mine == {"rc": 0, "conf": "expandable_segments:True"}
    theirs = cli_allocator_conf(
        "quantize",
        src,
        tmp_path / "d",
        "--device",
        "auto",
        "-q",
        env={**env, "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
    )
    assert theirs == {"rc": 0, "conf": None}


def test_no_allocator_setting_once_torch_is_loaded(monkeypatch):
    """In a process where torch is already loaded (the Python API after the caller's own import),
    torch has read its configuration: changing the environment then would only mislead."""
    from fp8convert.run import warmup

    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    warmup.pin_by_registering()  # torch is loaded in the test process
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


# Runs the CLI in a fresh interpreter; reports the files it asked the kernel to read ahead.
FADVISE_SPY = """
import json, os, sys
asked = set()
real = os.posix_fadvise
def spy(fd, offset, length, advice):
    asked.add(os.readlink(f"/proc/self/fd/{fd}"))
    return real(fd, offset, length, advice)
os.posix_fadvise = spy
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "asked": sorted(asked)}))
"""


def cli_run(*args, cache: Path) -> dict:
    return run_spy(FADVISE_SPY, *args, env=dict(os.environ, XDG_CACHE_HOME=str(cache)))


@pytest.mark.slow
def test_a_run_records_its_pages_and_the_next_run_reads_them_ahead(tmp_path):
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    cache = tmp_path / "cache"
    first = cli_run("quantize", src, tmp_path / "a", "--device", "cpu", "-q", cache=cache)
    assert first == {"rc": 0, "asked": []}  # nothing recorded yet
    (record,) = (cache / "fp8convert").glob("startup-pages-cpu-*.json")
    files = {path: ranges for path, _, _, ranges in json.loads(record.read_text())["files"]}
    torch_lib = Path(torch.__file__).parent / "lib"
    assert any(Path(p).parent == torch_lib and "libtorch" in Path(p).name and ranges for p, ranges in files.items())
    # the modules it imported: their bytecode, or their source where none is written
    assert any("fp8convert" in p and p.endswith((".pyc", ".py")) and "pipeline" in p for p in files)
    written = record.stat().st_mtime_ns
    time.sleep(0.01)
    second = cli_run("quantize", src, tmp_path / "b", "--device", "cpu", "-q", cache=cache)
    assert second["rc"] == 0
    assert any(Path(p).parent == torch_lib for p in second["asked"])
    assert record.stat().st_mtime_ns != written  # rewritten by the second run


# Runs the CLI in a fresh interpreter; reports how many recorded reads it asked for, when it asked for
# the last one, and when torch's import began.
ORDER_SPY = """
import builtins, json, os, sys, time
asked, began = [], []
real_fadvise, real_import = os.posix_fadvise, builtins.__import__
def fadvise(*args):
    asked.append(time.monotonic())
    return real_fadvise(*args)
def spy(name, *args, **kwargs):
    if name.split(".")[0] == "torch" and "torch" not in sys.modules and not began:
        began.append(time.monotonic())
    return real_import(name, *args, **kwargs)
os.posix_fadvise, builtins.__import__ = fadvise, spy
from fp8convert.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "asked": len(asked), "last_asked": max(asked, default=None), "import_began": began[0]}))
"""


@pytest.mark.slow
def test_every_recorded_read_is_asked_for_before_torchs_import_begins(tmp_path):
    """Asking for them beside the import (which holds the GIL) took ten times as long, and the
    checkpoint's reads wait until they are all asked for."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    cache = tmp_path / "cache"
    assert cli_run("quantize", src, tmp_path / "a", "--device", "cpu", "-q", cache=cache)["rc"] == 0  # records
    result = run_spy(
        ORDER_SPY,
        "quantize",
        src,
        tmp_path / "b",
        "--device",
        "cpu",
        "-q",
        env=dict(os.environ, XDG_CACHE_HOME=str(cache)),
    )
    assert result["rc"] == 0
    assert result["asked"] > 100  # torch's libraries and its thousand-odd Python files
    assert result["last_asked"] < result["import_began"]


# Runs the CLI in a fresh interpreter with a stand-in for CUDA's driver library; reports the calls made to
# it, each with the thread that made it.
def test_whether_torch_has_cuda_is_known_without_importing_it():
    from fp8convert.run import warmup

    assert warmup.torch_has_cuda() == (torch.version.cuda is not None)


class PullSpy:
    """Stands in for the prefetcher's pull into the page cache: records (file name, offset) and whether any
    pull came before the plan was made."""

    def __init__(self, monkeypatch, wait: float):
        from fp8convert.run import prefetch

        self.pulled, self.calls, self.before_plan = threading.Event(), [], []
        real_pull, real_plan = prefetch.pull_into_cache, api.build_plan

        def pull(sink, fd, offset, length):
            self.calls.append((Path(os.readlink(f"/proc/self/fd/{fd}")).name, offset))
            self.pulled.set()
            return real_pull(sink, fd, offset, length)

        def build_plan(*args, **kwargs):
            self.before_plan.append(self.pulled.wait(wait))
            return real_plan(*args, **kwargs)

        monkeypatch.setattr(prefetch, "pull_into_cache", pull)
        monkeypatch.setattr(api, "build_plan", build_plan)


def test_a_fresh_conversion_reads_the_source_while_the_plan_is_made(tmp_path, monkeypatch):
    """The disk starts on the checkpoint's first file at once, not after the plan (a second or more for
    thousands of tensors); the output is the same as with no read-ahead at all."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    spy = PullSpy(monkeypatch, wait=10)
    fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False, prefetch_threads=1)  # reads in order
    first_file = sorted(p.name for p in src.glob("*.safetensors"))[0]
    assert spy.before_plan == [True]
    assert spy.calls[0][0] == first_file
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, prefetch=0)
    shards = sorted((tmp_path / "plain").glob("*.safetensors"))
    assert len(shards) == len(list((tmp_path / "out").glob("*.safetensors"))) > 0
    for shard in shards:
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()


def test_no_read_before_the_plan_for_a_resumed_output_or_one_worker_of_several(tmp_path, monkeypatch):
    """A resumed OUT may have its first shards done, and a worker reads only its share: the plan says what."""
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False, finalize=False)
    spy = PullSpy(monkeypatch, wait=1)
    fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False)  # finalizes what is there
    fp8convert.quantize(src, tmp_path / "half", device="cpu", progress=False, worker="0/2")
    assert spy.before_plan == [False, False]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="what a machine without CUDA records")
def test_an_auto_device_run_without_cuda_records_under_cpu(tmp_path):
    """--device auto (the default) runs on the CPU here, so its record is the CPU's, not `-cuda-`."""
    cache = tmp_path / "cache"
    assert (
        cli_run("quantize", write_checkpoint(tmp_path / "src", llama_tensors()), tmp_path / "out", "-q", cache=cache)[
            "rc"
        ]
        == 0
    )
    assert [p.name.split("-")[2] for p in (cache / "fp8convert").glob("startup-pages-*.json")] == ["cpu"]


def test_auto_names_the_cuda_record_only_where_the_driver_loads(monkeypatch):
    from fp8convert.run import warmup

    monkeypatch.setattr(warmup, "torch_has_cuda", lambda: True)  # a CUDA build of torch
    monkeypatch.setattr(warmup, "CUDA_DRIVER", "libfp8convert-no-such-driver.so.1")
    assert "-cpu-" in warmup.record_path("auto").name and "-cuda-" in warmup.record_path("cuda:1").name
    monkeypatch.setattr(warmup, "CUDA_DRIVER", "libc.so.6")  # a library that loads, standing in for libcuda
    assert "-cuda-" in warmup.record_path("auto").name and "-cpu-" in warmup.record_path("cpu").name


@pytest.mark.slow
def test_the_demo_leaves_the_start_up_record_for_the_first_real_conversion(tmp_path):
    """The README's first command builds its model with torch, so its conversion records nothing itself;
    the demo writes the record, and the next conversion reads torch's pages ahead."""
    cache = tmp_path / "cache"
    demo = cli_run("demo", tmp_path / "demo", "--device", "cpu", cache=cache)
    assert demo["rc"] == 0
    (record,) = (cache / "fp8convert").glob("startup-pages-cpu-*.json")
    files = [path for path, _, _, _ in json.loads(record.read_text())["files"]]
    torch_lib = Path(torch.__file__).parent / "lib"
    assert any(Path(p).parent == torch_lib and "libtorch" in Path(p).name for p in files)
    src = write_checkpoint(tmp_path / "src", llama_tensors())
    first = cli_run("quantize", src, tmp_path / "out", "--device", "cpu", "-q", cache=cache)
    assert first["rc"] == 0 and any(Path(p).parent == torch_lib for p in first["asked"])
