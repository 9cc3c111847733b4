"""The assembly of a batch's outputs into the byte runs they fill (what the CUDA path writes), run on
the CPU: every merged run must hold exactly the bytes a conversion writes at its place."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fp8convert
from fp8convert.plan.batches import make_batches
from fp8convert.plan.runs import output_runs
from fp8convert.run.assembly import BatchOutput
from fp8convert.run.quantizer import quantize_batch, read_order
from fp8convert.run.reader import BatchReader

CPU = torch.device("cpu")


@pytest.mark.parametrize("kind", ["qwen3_moe", "llama"])
@pytest.mark.parametrize("scheme,fmt", [("tensor", "compressed-tensors"), ("block", "fp8"), ("mxfp8", "compressed-tensors")])
def test_merged_runs_hold_the_bytes_the_shards_get(source_model, tmp_path, kind, scheme, fmt):
    src = source_model(kind)
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    plan = fp8convert.make_plan(src, scheme=scheme, format=fmt, max_shard_size="150KB")
    shards = {i: (out / s.name).read_bytes() for i, s in enumerate(plan.shards)}
    pieces, shared_runs = 0, 0
    with BatchReader(Path(src), CPU) as reader:
        for batch in make_batches(plan.units, 64 << 10):
            buf, offsets = reader.read(read_order(batch))
            assembled = BatchOutput(output_runs(plan, batch.tensors, merge=True), CPU)
            assembled.put_all(quantize_batch(batch, buf, offsets, scheme, scale_format=plan.options.scale_format))
            for run, data in assembled.take():
                assert data.numpy().tobytes() == shards[run.shard][run.start:run.start + run.nbytes]
                pieces += len(run.pieces)
                shared_runs += len(run.pieces) > 1
    assert shared_runs  # runs of several outputs, each copied into its place
    assert pieces == len({name for s in plan.shards for name in s.tensors})  # every output, once


def test_put_all_refuses_bytes_the_plan_does_not_expect(source_model):
    plan = fp8convert.make_plan(source_model("llama"))
    batch = make_batches(plan.units, 1 << 30)[0]
    with BatchReader(plan.source.root, CPU) as reader:
        buf, offsets = reader.read(read_order(batch))
    outputs = quantize_batch(batch, buf, offsets, plan.options.scheme)
    name, tensor, at = outputs[0]
    assembled = BatchOutput(output_runs(plan, batch.tensors, merge=True), CPU)
    with pytest.raises(AssertionError, match=name):
        assembled.put_all([(name, tensor.view(-1)[:-1], at)])
