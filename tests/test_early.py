"""The numpy quantizer that runs while torch loads (run/early.py, run/numpy_quantize.py): the same bytes as
run/numerics.py, and a conversion whose groups it took, all or some, writes what the pipeline alone writes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import fp8convert
from fp8convert import api
from fp8convert.cli import main
from fp8convert.options import Options
from fp8convert.plan.plan import build_plan
from fp8convert.plan.runs import output_runs
from fp8convert.run import early, numpy_quantize
from fp8convert.run.numerics import quantize_group, quantize_with_scale
from fp8convert.run.warmup import TorchStart
from fp8convert.source.local import open_local
from tiny_ckpt import llama_tensors, tree_bytes, write_checkpoint


def test_e4m3_codes_are_torchs_cast():
    """A sweep of float32 bit patterns over [-448, 448], every e4m3 value, and the midpoints between
    neighbours (ties go to the even code) and one ulp either side of them."""
    values = np.arange(0, 0x43E00000 + 1, 4099, dtype=np.uint32).view(np.float32)
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    midpoints = ((codes[:-1].astype(np.float64) + codes[1:]) / 2).astype(np.float32).view(np.uint32)
    near = np.concatenate([midpoints, midpoints + 1, midpoints - 1]).view(np.float32)
    values = np.concatenate([values, codes, near])
    values = np.concatenate([values, -values])
    expected = torch.from_numpy(values.copy()).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    out = np.empty(values.size, dtype=np.uint8)
    numpy_quantize.e4m3_codes(values.copy(), out)
    assert np.array_equal(out, expected)


@pytest.mark.parametrize("scale", [1.0, 2.0 ** -20, 3.7e-3, 0.0123, 5.5e2, 1e30])
def test_the_per_tensor_table_codes_every_bf16_value_as_numerics_does(scale):
    """Every finite BF16 bit pattern (Inf and NaN are refused before), divided by scales from tiny to
    huge: the table's code is numerics.quantize_with_scale's."""
    patterns = np.arange(1 << 16, dtype=np.uint16)
    finite = patterns[(patterns & 0x7FFF) < 0x7F80]
    scale32 = np.array([[scale]], dtype=np.float32)
    table = numpy_quantize.codes_table(scale32)
    weight = torch.from_numpy(finite.view(np.int16).copy()).view(torch.bfloat16).reshape(1, 1, -1)
    expected = quantize_with_scale(weight, torch.from_numpy(scale32).reshape(1, 1, 1), "tensor", cpu_path=False)
    assert np.array_equal(table[finite], expected.view(torch.uint8).reshape(-1).numpy())


def awkward_weight(out: int, cols: int, seed: int) -> torch.Tensor:
    """Random BF16 rows spanning magnitudes, with a zero row, a row of tiny values (codes in e4m3's
    subnormal range) and negative zeros."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out, cols, generator=g) * torch.logspace(-3, 1, out).unsqueeze(1)
    w[0] = 0
    if out > 2:
        w[1] = torch.randn(cols, generator=g) * 1e-6
        w[2, ::3] = 1e-30
    w = w.to(torch.bfloat16)
    w[-1, 0] = -0.0
    return w


def bits_of(w: torch.Tensor) -> np.ndarray:
    return w.view(torch.int16).numpy().view(np.uint16)


def numpy_quantized(members: list[torch.Tensor], scheme: str, scale_format: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """early's steps over whole tensors (one chunk each); members share one amax in the tensor scheme."""
    largest = [numpy_quantize.magnitudes_max(bits_of(w), scheme) for w in members]
    if scheme == "tensor":
        largest = [np.maximum.reduce(largest)] * len(members)
    results = []
    for w, top in zip(members, largest):
        scale = numpy_quantize.scale_from_amax(numpy_quantize.as_float32(top), scale_format)
        codes = np.empty(tuple(w.shape), dtype=np.uint8)
        numpy_quantize.quantize_rows(bits_of(w), scale, scheme, codes)
        results.append((codes, scale))
    return results


@pytest.mark.parametrize("scheme,scale_format", [("tensor", "float"), ("channel", "float"), ("block", "float"),
                                                 ("block", "ue8m0")])
@pytest.mark.parametrize("shapes", [[(300, 260)], [(1, 7)], [(128, 256), (64, 256), (16, 256)], [(257, 129)]])
def test_the_same_codes_and_scales_as_numerics(scheme, scale_format, shapes):
    members = [awkward_weight(out, cols, seed) for seed, (out, cols) in enumerate(shapes)]
    codes, scales = quantize_group([w.unsqueeze(0) for w in members], scheme, cpu_path=True, scale_format=scale_format)
    for (q, s), ours in zip(zip(codes, scales), numpy_quantized(members, scheme, scale_format)):
        assert np.array_equal(ours[0], q[0].view(torch.uint8).numpy())
        assert np.array_equal(ours[1].reshape(-1).view(np.uint32), s[0].reshape(-1).numpy().view(np.uint32))


def test_only_whole_bf16_weights_of_the_three_schemes_are_taken(tmp_path, zoo_source):
    src = write_checkpoint(tmp_path / "llama")
    plan = build_plan(open_local(src), Options(scheme="tensor"))
    groups = early.early_groups(plan.units, "tensor")
    names = [{t.name for t in g} for g in groups]
    assert {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight"} in names  # a fused group shares one scale: together
    assert sum(len(g) for g in groups) == 14  # every linear of both layers
    channel = early.early_groups(build_plan(open_local(src), Options(scheme="channel")).units, "channel")
    assert all(len(g) == 1 for g in channel) and len(channel) == 14
    assert early.early_groups(build_plan(open_local(src), Options(scheme="mxfp8")).units, "mxfp8") == []
    fp16 = write_checkpoint(tmp_path / "fp16", llama_tensors(dtype=torch.float16))
    assert early.early_groups(build_plan(open_local(fp16), Options()).units, "tensor") == []
    plan = build_plan(open_local(zoo_source("llama4")), Options(scheme="channel"))  # fused 3-D experts, cut
    taken = {t.name for g in early.early_groups(plan.units, "channel") for t in g}
    cut = {t.name for t in plan.tensors if t.cut is not None}
    assert cut and not taken & cut and taken


class EarlyHarness:
    """Makes a conversion in this process (torch already loaded) run as a fresh one does: the early
    quantizer's processes are forked, and torch "loads" in a thread until `ready(quantizer)` says so (at
    most 30 s). Its start begins with the run unless `deferred` (then when the run begins it). Records
    the quantizers, what they wrote, whether torch's start began and whether it was waited for."""

    def __init__(self, monkeypatch, ready, processes: int = 2, tile: int | None = None, deferred: bool = False):
        self.quantizers: list[early.EarlyQuantizer] = []
        self.done: list[list[str]] = []
        self.at_once: list[bool] = []  # what the run asked of torch's start: begin at once, or wait
        self.began: list[bool] = []
        self.joined: list[bool] = []
        real_init, real_stop, real_start = early.EarlyQuantizer.__init__, early.EarlyQuantizer.stop, api.start_torch
        real_join = TorchStart.join
        harness = self

        def init(quantizer, *args):
            real_init(quantizer, *args)
            harness.quantizers.append(quantizer)

        def start_torch(device, begin=True):
            harness.at_once.append(begin)
            harness.began.append(False)
            harness.joined.append(False)
            return real_start(device, begin=begin or not deferred)

        def load(start):
            harness.began[-1] = True
            deadline = time.monotonic() + 30
            while not ready(harness.quantizers[-1]) and time.monotonic() < deadline:
                time.sleep(0.002)

        def stop(quantizer):
            done = real_stop(quantizer)
            harness.done.append([t.name for t in done])
            return done

        def join(start):
            harness.joined[-1] = True
            real_join(start)

        monkeypatch.setattr(api, "torch_loaded", lambda: False)
        monkeypatch.setattr(api, "early_processes", lambda spec, scheme: processes)  # whatever this machine's cores
        monkeypatch.setattr(api, "start_torch", start_torch)
        monkeypatch.setattr(TorchStart, "_load", load)
        monkeypatch.setattr(early.EarlyQuantizer, "__init__", init)
        monkeypatch.setattr(early.EarlyQuantizer, "stop", stop)
        monkeypatch.setattr(TorchStart, "join", join)
        if tile:
            monkeypatch.setattr(numpy_quantize, "TILE_ELEMENTS", tile)


def all_done(quantizer) -> bool:
    return quantizer.finished.is_set()


def never(quantizer) -> bool:
    return False


def awkward_llama():
    """Linears over one 128 block and partial at the edges (144 = 128 + 16; 320 = 2.5 blocks), so chunks
    of rows and blocks are cut several ways."""
    return llama_tensors(hidden=144, inter=320, seed=3)


@pytest.mark.parametrize("scheme,fmt,extra", [("tensor", "compressed-tensors", []), ("tensor", "fp8", []),
                                              ("channel", "compressed-tensors", []),
                                              ("block", "compressed-tensors", []),
                                              ("block", "fp8", ["--scale-format", "ue8m0"])])
def test_a_conversion_quantized_early_writes_the_pipelines_bytes_without_waiting_for_torch(
        tmp_path, monkeypatch, capsys, scheme, fmt, extra):
    src = write_checkpoint(tmp_path / "src", awkward_llama())
    args = ["--scheme", scheme, "--format", fmt, "--device", "cpu", "-q", "--max-shard-size", "100KB", *extra]
    assert main(["quantize", str(src), str(tmp_path / "plain"), *args]) == 0  # torch loaded: nothing early
    capsys.readouterr()
    harness = EarlyHarness(monkeypatch, never, tile=144 * 8)  # 8 rows per chunk (128 for blocks)
    monkeypatch.setattr(early, "FDS_PER_MESSAGE", 2)  # the shard files handed over in several messages
    assert main(["quantize", str(src), str(tmp_path / "early"), *args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["shards"] > 2
    assert len(harness.done[0]) == 14 and report["tensors_quantized_early"] == 14  # every linear
    assert harness.joined == [False] and report["device"] == "cpu"  # torch, still "loading", not waited for
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


@pytest.mark.parametrize("arch", ["gpt2", "phi3", "dbrx", "llama4", "deepseek_v3", "qwen3_5_moe"])
def test_zoo_models_quantized_early_are_the_pipelines_bytes(arch, zoo_source, tmp_path, monkeypatch):
    """Transposed Conv1D weights, fused projections split, experts cut from fused tensors, MTP layers,
    vision towers: the early quantizer takes only what it can, the pipeline the rest once torch is ready,
    and the output does not change."""
    src = zoo_source(arch)
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False)
    harness = EarlyHarness(monkeypatch, all_done)
    report = fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False)
    assert report.tensors_quantized_early == len(harness.done[0])
    assert harness.done[0] or arch == "gpt2"  # gpt2's Conv1D weights are all transposed: none is taken
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def four_layers():
    return llama_tensors(layers=4, hidden=144, inter=320, seed=5)


def slowed(monkeypatch, seconds: float) -> None:
    """Each group quantized early takes `seconds` longer."""
    real_group = numpy_quantize.GroupQuantizer.quantize_group

    def slow_group(quantizer, group, files):
        time.sleep(seconds)
        real_group(quantizer, group, files)
    monkeypatch.setattr(numpy_quantize.GroupQuantizer, "quantize_group", slow_group)


def test_the_pipeline_takes_every_group_the_early_quantizer_did_not_finish(tmp_path, monkeypatch):
    src = write_checkpoint(tmp_path / "src", four_layers())
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, scheme="channel")
    slowed(monkeypatch, 0.05)
    harness = EarlyHarness(monkeypatch, lambda q: len(q.done) >= 3, processes=1)
    report = fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False, scheme="channel")
    assert 3 <= len(harness.done[0]) < 28 and harness.joined == [True]
    assert report.tensors_quantized_early == len(harness.done[0]) and report.device == "cpu"
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def test_the_processes_share_the_groups(tmp_path, monkeypatch):
    """Each child takes the next group not taken: with three, each wrote some, none twice."""
    src = write_checkpoint(tmp_path / "src", four_layers())
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, scheme="channel")
    real_group = numpy_quantize.GroupQuantizer.quantize_group
    log = tmp_path / "log"

    def logged_group(quantizer, group, files):
        time.sleep(0.02)  # so that no child takes them all before the others start
        real_group(quantizer, group, files)
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {group[0].name}\n")
    monkeypatch.setattr(numpy_quantize.GroupQuantizer, "quantize_group", logged_group)
    harness = EarlyHarness(monkeypatch, never, processes=3)
    fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False, scheme="channel")
    lines = [line.split() for line in log.read_text().splitlines()]
    assert len({pid for pid, _ in lines}) == 3
    assert sorted(name for _, name in lines) == sorted(harness.done[0]) and len(lines) == 28
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def test_torch_never_starts_while_the_early_quantizer_keeps_up_with_the_disk(tmp_path, monkeypatch):
    """It can take every weight, so torch's start waits until the disk's reads run AHEAD_BEFORE_TORCH
    ahead of it; a small model's never do: the run ends without beginning torch's start."""
    src = write_checkpoint(tmp_path / "src", four_layers())
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, scheme="channel")
    harness = EarlyHarness(monkeypatch, never, deferred=True)
    report = fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False, scheme="channel")
    assert harness.at_once == [False] and harness.began == [False] and harness.joined == [False]
    assert report.tensors_quantized_early == 28 and report.device == "cpu"
    assert "torch_began_at" not in report.stage_seconds
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def test_torch_starts_once_the_disk_reads_ahead_of_the_early_quantizer(tmp_path, monkeypatch):
    """The same run with the limit at one byte (a disk faster than the processes quantize): torch's start
    begins as the first reads land, and once it is ready the pipeline takes the groups left."""
    src = write_checkpoint(tmp_path / "src", four_layers())
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, scheme="channel")
    slowed(monkeypatch, 0.05)
    monkeypatch.setattr(api, "AHEAD_BEFORE_TORCH", 1)
    harness = EarlyHarness(monkeypatch, lambda q: len(q.done) >= 3, processes=1, deferred=True)
    report = fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False, scheme="channel")
    assert harness.at_once == [False] and harness.began == [True] and harness.joined == [True]
    assert 3 <= report.tensors_quantized_early < 28
    assert 0 < report.stage_seconds["torch_began_at"] < report.stage_seconds["torch_ready_at"]
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def test_torch_starts_at_once_where_the_early_quantizer_cannot_take_every_weight(zoo_source, tmp_path, monkeypatch):
    """llama4's experts are cut from fused tensors, which only the pipeline does; with --prefetch 0 nothing
    tells how fast the disk reads."""
    harness = EarlyHarness(monkeypatch, all_done, deferred=True)
    fp8convert.quantize(zoo_source("llama4"), tmp_path / "llama4", device="cpu", progress=False)
    assert harness.at_once == [True] and harness.began == [True] and harness.quantizers[0].groups
    src = write_checkpoint(tmp_path / "src", four_layers())
    report = fp8convert.quantize(src, tmp_path / "unread", device="cpu", progress=False, prefetch=0)
    assert harness.at_once[1] is False and "torch_began_at" in report.stage_seconds
    assert report.tensors_quantized_early == 28


def test_the_limit_is_half_a_small_prefetch_window(monkeypatch):
    """A window smaller than twice AHEAD_BEFORE_TORCH could never get that far ahead."""
    began = []
    monkeypatch.setattr(TorchStart, "_load", lambda start: began.append(start.device))

    class Reads:
        def __init__(self, window: int):
            self.window, self.landed = window, 0

        def ahead(self) -> int:
            return self.landed

    for window, limit in ((32 << 30, api.AHEAD_BEFORE_TORCH), (2 << 30, 1 << 30)):
        reads, start = Reads(window), TorchStart("cpu", None)
        ready = api._torch_ready(start, reads)
        reads.landed = limit - 1
        assert not ready() and start.thread is None
        reads.landed = limit
        ready()
        start.thread.join()
        assert ready() and began[-1] == "cpu"
    assert len(began) == 2


def test_a_child_that_dies_leaves_its_group_to_the_pipeline(tmp_path, monkeypatch):
    """Killed in the middle of writing a group (half its rows written), a child reports nothing: the
    pipeline writes the group whole once torch is ready, and the output is still the pipeline's."""
    src = write_checkpoint(tmp_path / "src", four_layers())
    fp8convert.quantize(src, tmp_path / "plain", device="cpu", progress=False, scheme="channel")
    real_quantize = numpy_quantize.GroupQuantizer._quantize_by_rows
    victim = "model.layers.2.mlp.down_proj.weight"

    def dying(quantizer, t, files):
        if t.name == victim:
            quantizer.writer.write(output_runs(quantizer.plan, [t], merge=False)[0], b"\xff" * 100)
            os._exit(9)
        real_quantize(quantizer, t, files)
    monkeypatch.setattr(numpy_quantize.GroupQuantizer, "_quantize_by_rows", dying)
    harness = EarlyHarness(monkeypatch, all_done, processes=1)
    report = fp8convert.quantize(src, tmp_path / "early", device="cpu", progress=False, scheme="channel")
    assert victim not in harness.done[0] and harness.joined == [True] and report.tensors_quantized_early > 0
    assert tree_bytes(tmp_path / "early") == tree_bytes(tmp_path / "plain")


def test_a_nan_weight_quantized_early_is_refused_by_name(tmp_path, monkeypatch, capsys):
    tensors = awkward_llama()
    tensors["model.layers.1.mlp.up_proj.weight"][5, 7] = float("nan")
    src = write_checkpoint(tmp_path / "src", tensors)
    harness = EarlyHarness(monkeypatch, never)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", "-q"]) == 1
    assert harness.quantizers[0].error is not None and harness.joined == [False]  # not the pipeline's find
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "model-00002-of-00003.safetensors: tensor model.layers.1.mlp.up_proj.weight contains NaN or Inf" in err[0]
    assert not harness.quantizers[0].children  # every child reaped


def test_a_weight_too_large_for_power_of_two_block_scales_is_refused_early_by_name(tmp_path, monkeypatch, capsys):
    """248 * 2^120 (BF16 bits 0x7F78) would round to code 256 under scale 2^120: 2^128, Inf in float32."""
    tensors = awkward_llama()
    tensors["model.layers.1.mlp.up_proj.weight"].view(torch.int16)[5, 7] = 0x7F78
    src = write_checkpoint(tmp_path / "src", tensors)
    harness = EarlyHarness(monkeypatch, never)
    args = ["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", "-q", "--scheme", "block"]
    assert main([*args, "--scale-format", "ue8m0"]) == 1
    assert harness.quantizers[0].error is not None and harness.joined == [False]  # not the pipeline's find
    # the plan's warnings (these block shapes do not load everywhere), then the one error line
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith("warning: ")]
    assert len(err) == 1
    assert "tensor model.layers.1.mlp.up_proj.weight holds values within 3% of float32's maximum" in err[0]
    assert main([*args, "--overwrite"]) == 0  # float scales write it


def test_nothing_is_quantized_early_when_torch_is_already_loaded(tmp_path, monkeypatch):
    """An API caller's process with torch loaded has no start-up to fill: the pipeline does it all."""
    made = []
    real_init = early.EarlyQuantizer.__init__
    monkeypatch.setattr(early.EarlyQuantizer, "__init__", lambda q, *a, **k: (made.append(q), real_init(q, *a, **k))[1])
    report = fp8convert.quantize(write_checkpoint(tmp_path / "src"), tmp_path / "out", device="cpu", progress=False)
    assert len(made) == 1 and made[0].groups == [] and made[0].done == [] and not made[0].children
    assert report.tensors_quantized_early == 0 and report.device == "cpu"


@pytest.mark.parametrize("cores,workers,scheme,processes", [
    (2, 1, "tensor", 1), (2, 2, "tensor", 0), (1, 1, "tensor", 0), (16, 2, "tensor", 4),
    (2, 1, "channel", 0), (4, 1, "block", 0), (8, 1, "channel", 4), (16, 1, "block", 8), (16, 16, "channel", 0),
    (128, 1, "tensor", 8), (128, 2, "block", 4)])
def test_half_the_cores_up_to_eight_quantize_early_per_row_and_block_from_eight(monkeypatch, cores, workers,
                                                                              scheme, processes):
    from fp8convert.cluster.workers import WorkerSpec
    monkeypatch.delenv(api.EARLY_PROCESSES_ENV, raising=False)
    monkeypatch.setattr(api, "usable_cores", lambda: cores)
    assert api.early_processes(WorkerSpec(0, workers), scheme) == processes


def test_the_early_processes_are_shared_by_the_workers_on_this_machine(monkeypatch):
    """A split over several nodes divides them by the workers on each node, not by all of them; an array
    task or a pod, each its own allocation, shares them with nobody."""
    from fp8convert.cluster.workers import WorkerSpec
    monkeypatch.delenv(api.EARLY_PROCESSES_ENV, raising=False)
    monkeypatch.setattr(api, "usable_cores", lambda: 16)
    assert api.early_processes(WorkerSpec(9, 32, "slurm", on_this_machine=4), "tensor") == 2
    assert api.early_processes(WorkerSpec(9, 32, "slurm"), "tensor") == 0
    assert api.early_processes(WorkerSpec(3, 100, "slurm-array", on_this_machine=1), "block") == 8


@pytest.mark.parametrize("text,processes", [("0", 0), ("1", 1), (" 3 ", 3)])
def test_the_environment_sets_the_early_processes_on_any_cores(monkeypatch, text, processes):
    from fp8convert.cluster.workers import WorkerSpec
    monkeypatch.setenv(api.EARLY_PROCESSES_ENV, text)
    for cores in (2, 16):  # per row: none on 2 cores by default, 8 on 16
        monkeypatch.setattr(api, "usable_cores", lambda: cores)
        assert api.early_processes(WorkerSpec(0, 1), "channel") == processes


@pytest.mark.parametrize("text", ["-1", "two", "1.5"])
def test_a_bad_early_processes_setting_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, text):
    src = write_checkpoint(tmp_path / "src")
    monkeypatch.setenv(api.EARLY_PROCESSES_ENV, text)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "$FP8CONVERT_EARLY_PROCESSES=" in err[0] and text in err[0], err
    assert not (tmp_path / "out").exists()


# The CLI in a fresh interpreter, its early quantizer forced to one process writing slowly (chunks of two
# rows, one per 0.2 s: a group takes half a minute), so that a test can kill the run in the middle of it.
SLOW_EARLY = """
import sys, time
import fp8convert.api as api
from fp8convert.run import numpy_quantize
from fp8convert.run.early import DirectWriter
api.early_processes = lambda spec, scheme: 1
numpy_quantize.TILE_ELEMENTS = 2 * 320
write = DirectWriter.write
DirectWriter.write = lambda self, *a: (time.sleep(0.2), write(self, *a))[1]
from fp8convert.cli import run
run(sys.argv[1:])
"""


def forked_children(pid: int) -> list[int]:
    """`pid`'s children that are forks of it (its command line): not what its imports may spawn."""
    def cmdline(p: int) -> bytes:
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split() if cmdline(int(p)) == cmdline(pid)]


def first_fork(run: subprocess.Popen, log: Path, timeout: float = 60) -> int:
    """The pid of `run`'s first forked child, once there is one; a run that ends first, or forks nothing
    in `timeout` seconds, fails the test with what it printed into `log`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = forked_children(run.pid)
        if children:
            return min(children)
        if run.poll() is not None:
            pytest.fail(f"the run ended (exit {run.returncode}) before it forked: {log.read_text()[-2000:]}")
        time.sleep(0.01)
    run.kill()
    run.wait()
    pytest.fail(f"the run forked nothing in {timeout} s: {log.read_text()[-2000:]}")


def test_the_children_die_with_a_killed_run(tmp_path):
    """A SIGKILL (or the OOM killer) leaves no child writing into the files a rerun rewrites: the child
    dies at once, not when it next reports to the dead run."""
    src = write_checkpoint(tmp_path / "src", four_layers())
    log = tmp_path / "run.log"  # a file, not a pipe nobody reads: the run can never block on printing
    with open(log, "wb") as out:
        run = subprocess.Popen([sys.executable, "-c", SLOW_EARLY, "quantize", str(src), str(tmp_path / "out"),
                                "--device", "cpu", "-q"], stdout=out, stderr=subprocess.STDOUT)
    child = first_fork(run, log)  # the early quantizer's, made before torch starts
    time.sleep(0.5)  # it is writing now
    run.kill()
    run.wait()
    deadline = time.monotonic() + 2
    while os.path.exists(f"/proc/{child}") and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not os.path.exists(f"/proc/{child}")


def test_a_run_that_fails_before_the_children_start_leaves_none(tmp_path, monkeypatch, capsys):
    """The shard files cannot be made (here: refused at creation): the run fails with one line, and the
    children, forked but never handed the files, are gone."""
    from fp8convert.errors import FP8ConvertError
    from fp8convert.run.writer import ShardWriter
    src = write_checkpoint(tmp_path / "src", awkward_llama())

    def refuse(writer, index):
        raise FP8ConvertError(f"{writer.partial_path(index)}: cannot create (No space left on device)")
    monkeypatch.setattr(ShardWriter, "_create", refuse)
    harness = EarlyHarness(monkeypatch, never)
    assert main(["quantize", str(src), str(tmp_path / "out"), "--device", "cpu", "-q"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot create (No space left on device)" in err[0]
    quantizer = harness.quantizers[0]
    assert quantizer.groups and not quantizer.children and quantizer.tasks is None and quantizer.reports is None
