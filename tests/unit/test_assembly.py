"""The assembly of a batch's outputs into the byte runs they fill (what the CUDA path writes), run on
the CPU: every merged run must hold exactly the bytes a conversion writes at its place."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8convert
from fp8convert.plan.batches import make_batches, output_runs
from fp8convert.run.pipeline import BatchOutput
from fp8convert.run.quantizer import quantize_steps, read_order
from fp8convert.run.reader import BatchReader

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
@pytest.mark.parametrize(
    "scheme,fmt", [("tensor", "compressed-tensors"), ("block", "fp8"), ("mxfp8", "compressed-tensors")]
)
def test_merged_runs_hold_the_bytes_the_shards_get(source_model, tmp_path, kind, scheme, fmt):
    """Runs of at most 16 KiB (unless one output is larger), each handed over once its last output is in:
    every one holds exactly the shard's bytes at its place, and some leave before their batch's last step."""
    src = source_model(kind)
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    plan = fp8convert.make_plan(src, scheme=scheme, format=fmt, max_shard_size="150KB")
    shards = {i: (out / s.name).read_bytes() for i, s in enumerate(plan.shards)}
    pieces, shared_runs, early_runs, runs_written = 0, 0, 0, 0
    with BatchReader(Path(src), CPU) as reader:
        for batch in make_batches(plan.units, 64 << 10):
            buf, offsets = reader.read(read_order(batch))
            runs = output_runs(plan, batch.tensors, merge=True, max_bytes=16 << 10)
            assert all(run.nbytes <= 16 << 10 or len(run.pieces) == 1 for run in runs)
            assembled = BatchOutput(runs, CPU)
            steps = list(quantize_steps(batch, buf, offsets, scale_format=plan.options.scale_format))
            for n, outputs in enumerate(steps):
                for run, data in assembled.put_all(outputs):
                    assert data.numpy().tobytes() == shards[run.shard][run.start : run.start + run.nbytes]
                    pieces += len(run.pieces)
                    shared_runs += len(run.pieces) > 1
                    early_runs += n < len(steps) - 1
                    runs_written += 1
            assembled.check_complete()
    assert shared_runs  # runs of several outputs, each copied into its place
    assert early_runs < runs_written and (early_runs > 0 or kind != "qwen3_moe")  # (a MoE layer has many steps)
    assert pieces == len({name for s in plan.shards for name in s.tensors})  # every output, once


def test_runs_stop_growing_at_their_size(source_model):
    """Cut runs place every output byte where the uncut ones do, none larger than asked but a lone output."""
    plan = fp8convert.make_plan(source_model("qwen3_moe"))
    batch = max(make_batches(plan.units, 1 << 30), key=lambda b: len(b.tensors))
    whole = output_runs(plan, batch.tensors, merge=True)
    cut = output_runs(plan, batch.tensors, merge=True, max_bytes=8 << 10)

    def placed(runs):
        return sorted((r.shard, r.start + p.offset, p.name, p.at, p.nbytes) for r in runs for p in r.pieces)

    assert len(cut) > len(whole)
    assert placed(cut) == placed(whole)
    assert all(r.nbytes <= 8 << 10 or len(r.pieces) == 1 for r in cut)
    assert all(sum(p.nbytes for p in r.pieces) == r.nbytes for r in cut)


def test_put_all_refuses_bytes_the_plan_does_not_expect(source_model):
    plan = fp8convert.make_plan(source_model("llama"))
    batch = make_batches(plan.units, 1 << 30)[0]
    with BatchReader(plan.source.root, CPU) as reader:
        buf, offsets = reader.read(read_order(batch))
    outputs = [out for step in quantize_steps(batch, buf, offsets) for out in step]
    name, tensor, at = outputs[0]
    assembled = BatchOutput(output_runs(plan, batch.tensors, merge=True), CPU)
    with pytest.raises(AssertionError, match=name):
        assembled.put_all([(name, tensor.view(-1)[:-1], at)])
