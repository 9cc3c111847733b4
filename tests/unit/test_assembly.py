"""A batch's outputs handed to the writer as the byte runs they fill, run on the CPU: every run holds
exactly the bytes a conversion writes at its place."""

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
def test_runs_hold_the_bytes_the_shards_get(source_model, tmp_path, kind, scheme, fmt):
    """Each run is handed over once its output is in: every one holds exactly the shard's bytes at its
    place, every output once, and some leave before their batch's last step."""
    src = source_model(kind)
    out = tmp_path / "out"
    fp8convert.quantize(src, out, scheme=scheme, format=fmt, device="cpu", max_shard_size="150KB")
    plan = fp8convert.make_plan(src, scheme=scheme, format=fmt, max_shard_size="150KB")
    shards = {i: (out / s.name).read_bytes() for i, s in enumerate(plan.shards)}
    early_runs, runs_written = 0, 0
    with BatchReader(Path(src), CPU) as reader:
        for batch in make_batches(plan.units, 64 << 10):
            buf, offsets = reader.read(read_order(batch))
            assembled = BatchOutput(output_runs(plan, batch.tensors))
            steps = list(quantize_steps(batch, buf, offsets, scale_format=plan.options.scale_format))
            for n, outputs in enumerate(steps):
                for run, data in assembled.put_all(outputs):
                    assert data.numpy().tobytes() == shards[run.shard][run.start : run.start + run.nbytes]
                    early_runs += n < len(steps) - 1
                    runs_written += 1
            assembled.check_complete()
    assert early_runs < runs_written and (early_runs > 0 or kind != "qwen3_moe")  # (a MoE layer has many steps)
    assert runs_written == len({name for s in plan.shards for name in s.tensors})  # every output, once


def test_put_all_refuses_bytes_the_plan_does_not_expect(source_model):
    plan = fp8convert.make_plan(source_model("llama"))
    batch = make_batches(plan.units, 1 << 30)[0]
    with BatchReader(plan.source.root, CPU) as reader:
        buf, offsets = reader.read(read_order(batch))
    outputs = [out for step in quantize_steps(batch, buf, offsets) for out in step]
    name, tensor, at = outputs[0]
    assembled = BatchOutput(output_runs(plan, batch.tensors))
    with pytest.raises(AssertionError, match=name):
        assembled.put_all([(name, tensor.view(-1)[:-1], at)])
