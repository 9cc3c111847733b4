#!/usr/bin/env python3
"""Where the pipeline's time goes, stage by stage, with no disk in the way.

The checkpoint is read once first (so it sits in the page cache) and the output goes to a tmpfs
directory; then, in this one process, with torch already imported:
  read       the reader alone: every batch into device memory;
  +quantize  the reader and the quantizer (outputs dropped);
  pipeline   the whole run (reader thread, quantize, writer thread) into OUT, as a conversion does;
  no-write   the same with the writes doing nothing: what the pipeline does without an output medium.
Each line gives seconds and GB/s of input. A stage much slower than the one before it is the one to
look at.

    python3 scripts/profile_stages.py CKPT --device cuda --out /dev/shm/profile
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def warm(root: Path) -> float:
    """Read every file once (into the page cache); returns GB read."""
    total = 0
    for p in sorted(root.iterdir()):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while chunk := f.read(64 << 20):
                    total += len(chunk)
    return total / 1e9


def time_reads(plan, batches, reader, sync, line) -> None:
    """The read stage alone, then reads and quantizing (outputs dropped)."""
    from fp8convert.run.quantizer import quantize_steps, read_order

    with reader:
        t0 = time.perf_counter()
        for b in batches:
            buf, _ = reader.read(read_order(b))
            reader.recycle(buf)
            del buf
        sync()
        line("read", time.perf_counter() - t0)
        t0 = time.perf_counter()
        for b in batches:
            buf, offsets = reader.read(read_order(b))
            steps = quantize_steps(
                b, buf, offsets, scale_format=plan.options.scale_format, source_scheme=plan.source_scheme
            )
            outputs = [out for step in steps for out in step]
            sync()
            del outputs
            reader.recycle(buf)
            del buf
        line("+quantize", time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path("/dev/shm/fp8convert-profile"))
    ap.add_argument("--scheme", default="tensor")
    ap.add_argument("--format", default="compressed-tensors")
    ap.add_argument("--max-resident", default=None)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dequantize", action="store_true", help="profile `dequantize` of an FP8 checkpoint")
    ap.add_argument("--dtype", help="with --dequantize: bf16, fp16 or fp32")
    ap.add_argument("--no-pipeline", action="store_true", help="only the read and +quantize stages")
    ap.add_argument("--readers", type=int, help="reader threads (default: the device's)")
    ap.add_argument("--writers", type=int, help="writer threads (default: the device's)")
    ap.add_argument("--write-ahead", type=int, help="batches quantized ahead of the writer (pipeline.WRITE_AHEAD)")
    ap.add_argument("--read-ahead", type=int, help="batches read ahead of the quantizer (pipeline.READ_AHEAD)")
    ap.add_argument("--pipeline-only", action="store_true", help="only the pipeline and no-write stages")
    ap.add_argument(
        "--no-preallocate",
        action="store_true",
        help="create each shard as its first bytes arrive, blocks unreserved (writer.PREALLOCATE)",
    )
    args = ap.parse_args()

    import torch

    from fp8convert.options import Settings
    from fp8convert.plan.batches import make_batches
    from fp8convert.plan.build import build_plan
    from fp8convert.run import device as device_module
    from fp8convert.run import pipeline as pipeline_module
    from fp8convert.run.device import budget_for, resolve_device
    from fp8convert.run.pipeline import convert
    from fp8convert.run.progress import Progress
    from fp8convert.run.reader import BatchReader
    from fp8convert.run.writer import ShardWriter
    from fp8convert.source.checkpoint import open_local
    from fp8convert.source.streaming import NoFetcher

    if args.write_ahead:
        pipeline_module.WRITE_AHEAD = args.write_ahead
    if args.read_ahead:
        pipeline_module.READ_AHEAD = args.read_ahead
    from fp8convert.run import writer as writer_module

    writer_module.PREALLOCATE = not args.no_preallocate
    default_io = device_module.io_threads
    device_module.io_threads = pipeline_module.io_threads = lambda kind: (
        args.readers or default_io(kind)[0],
        args.writers or default_io(kind)[1],
    )
    settings = Settings(
        scheme=args.scheme,
        format=args.format,
        device=args.device,
        max_resident=args.max_resident,
        dequantize=args.dequantize,
        dtype=args.dtype,
    )
    dev = resolve_device(args.device)
    torch.empty(1, device=dev)
    gb = warm(args.ckpt)
    plan = build_plan(open_local(args.ckpt), settings.options)
    batches = make_batches(plan.units, budget_for(dev, settings.max_resident))
    nbytes = sum(b.in_bytes for b in batches)
    print(
        f"{args.ckpt.name}: {gb:.2f} GB in the page cache, {len(plan.tensors)} tensors, {len(batches)} batches, "
        f"device {dev}",
        flush=True,
    )

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def line(name: str, seconds: float) -> None:
        print(f"  {name:<10} {seconds:7.3f} s  {nbytes / seconds / 1e9:6.2f} GB/s", flush=True)

    def timed_pipeline(name: str):
        """One whole run into a fresh OUT. The shards are created and reserved first, untimed: in a
        conversion that happens while torch loads."""
        shutil.rmtree(args.out, ignore_errors=True)
        (args.out / ".fp8convert").mkdir(parents=True)
        with ShardWriter(plan, args.out, args.out / ".fp8convert", set()) as writer:
            t0 = time.perf_counter()
            if writer_module.PREALLOCATE:
                writer.allocator.join()
                print(f"  {'allocate':<10} {time.perf_counter() - t0:7.3f} s  (before the timer)", flush=True)
            t0 = time.perf_counter()
            stage_seconds, _, peak_bytes = convert(
                plan,
                plan.units,
                writer,
                args.device,
                settings.max_resident,
                NoFetcher(),
                Progress(nbytes, "profile", enabled=False),
            )
        line(name, time.perf_counter() - t0)
        return stage_seconds, peak_bytes

    readers, _ = device_module.io_threads(dev.type)
    for _ in range(args.repeat):
        if not args.pipeline_only:
            time_reads(plan, batches, BatchReader(plan.source.root, dev, threads=readers), sync, line)
        if args.no_pipeline:
            continue
        stage_seconds, peak_bytes = timed_pipeline("pipeline")
        peak = f", peak device {peak_bytes / 2**30:.2f} GiB" if peak_bytes else ""
        print(f"             stages {stage_seconds}{peak}", flush=True)
        # the same without the output medium: bytes still leave the device, the writes do nothing
        real = writer_module.pwrite_all
        writer_module.pwrite_all = lambda fd, data, offset: None
        timed_pipeline("no-write")
        writer_module.pwrite_all = real
    shutil.rmtree(args.out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
