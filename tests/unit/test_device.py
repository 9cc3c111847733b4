"""How much of the host a CPU run takes: torch's quantizing threads leave the readers their cores
(where there are more than 4)."""

from __future__ import annotations

import os

import pytest
import torch
from tiny_ckpt import llama_tensors, write_checkpoint

import fp8convert
from fp8convert.run import device, prefetch, quantizer
from fp8convert.run.device import quantizing_threads


def test_quantizing_threads_leave_the_readers_their_cores():
    assert quantizing_threads(16, 16, environ={}) == 12  # 4 readers on 16 cores
    assert quantizing_threads(64, 64, environ={}) == 60  # (never more than 4)
    assert quantizing_threads(8, 8, environ={}) == 6  # 2 on 8
    assert quantizing_threads(4, 4, environ={}) == 4  # too few cores to spare one
    assert quantizing_threads(2, 2, environ={}) == 2
    assert quantizing_threads(4, 16, environ={}) == 4  # never more than the caller gave torch
    assert quantizing_threads(16, 16, environ={"OMP_NUM_THREADS": "16"}) is None  # the user's choice stands


def test_a_cpu_run_quantizes_with_those_threads_and_gives_the_callers_back(tmp_path, monkeypatch):
    seen = []
    real = quantizer.quantize_group

    def quantize_group(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    src = write_checkpoint(tmp_path / "src", llama_tensors())
    monkeypatch.setattr(quantizer, "quantize_group", quantize_group)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(device, "usable_cores", lambda: 8)
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    try:
        fp8convert.quantize(src, tmp_path / "out", device="cpu", progress=False)
        assert seen and set(seen) == {6}  # 8 cores less 2 readers
        assert torch.get_num_threads() == 8
        seen.clear()
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        fp8convert.quantize(src, tmp_path / "out2", device="cpu", progress=False)
        assert seen and set(seen) == {8}
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: nothing to pin away")
def test_a_run_counts_the_cores_it_may_run_on_not_the_machines():
    """A cluster job pinned to one core of a bigger node (as Slurm and taskset do) gets threads for one core."""
    from fp8convert.run.prefetch import usable_cores

    allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(allowed)})  # this thread only, for the calls below
    try:
        assert (usable_cores(), device.io_threads("cpu"), prefetch.default_threads()) == (1, (1, 1), 1)
    finally:
        os.sched_setaffinity(0, allowed)
