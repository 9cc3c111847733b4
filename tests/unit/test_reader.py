"""The reader's preads: tensors adjacent in a file are read together (a MoE layer is hundreds of small
tensors), in pieces of at most one chunk, every byte landing where the batch buffer expects it."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from fp8convert.errors import FP8ConvertError
from fp8convert.run.reader import BatchReader, plan_pieces
from fp8convert.safetensors_io import TensorInfo


def info(name: str, file: str, offset: int, nbytes: int) -> TensorInfo:
    return TensorInfo(name, "U8", (nbytes,), file, offset, nbytes)


def fill(files: dict[str, np.ndarray], tensors: list[TensorInfo], chunk: int, merge: bool) -> tuple[np.ndarray, list]:
    """The batch buffer as the pieces fill it (a pread into staging, then each part to its place)."""
    offsets, total = BatchReader.layout(tensors)
    buf = np.zeros(total, dtype=np.uint8)
    pieces = plan_pieces(tensors, offsets, chunk, merge)
    for piece in pieces:
        staging = files[piece.file][piece.offset : piece.offset + piece.length]
        assert len(staging) == piece.length <= chunk
        for at, dest, n in piece.parts:
            buf[dest : dest + n] = staging[at : at + n]
    return buf, pieces


def expected(files: dict[str, np.ndarray], tensors: list[TensorInfo]) -> np.ndarray:
    offsets, total = BatchReader.layout(tensors)
    buf = np.zeros(total, dtype=np.uint8)
    for t in tensors:
        buf[offsets[t.name] : offsets[t.name] + t.nbytes] = files[t.file][t.offset : t.offset + t.nbytes]
    return buf


def test_adjacent_tensors_are_one_pread_whatever_their_order_in_the_buffer():
    files = {"a": np.arange(1000, dtype=np.uint8)}
    # the buffer wants them as b, a, c (a stack's members first); the file has them as a, b, c
    tensors = [info("b", "a", 164, 100), info("a", "a", 100, 64), info("c", "a", 264, 36)]
    buf, pieces = fill(files, tensors, chunk=1 << 20, merge=True)
    assert [(p.file, p.offset, p.length) for p in pieces] == [("a", 100, 200)]
    assert np.array_equal(buf, expected(files, tensors))


def test_a_gap_or_another_file_starts_a_new_pread():
    files = {"a": np.arange(1000, dtype=np.uint8), "b": np.arange(1000, dtype=np.uint8)[::-1].copy()}
    tensors = [info("x", "a", 100, 64), info("y", "a", 200, 64), info("z", "b", 164, 64), info("w", "b", 100, 64)]
    buf, pieces = fill(files, tensors, chunk=1 << 20, merge=True)
    assert [(p.file, p.offset, p.length) for p in pieces] == [("a", 100, 64), ("a", 200, 64), ("b", 100, 128)]
    assert np.array_equal(buf, expected(files, tensors))


def test_pieces_are_cut_at_the_chunk_even_inside_a_tensor():
    files = {"a": (np.arange(5000) % 251).astype(np.uint8)}
    tensors = [info("p", "a", 0, 1500), info("q", "a", 1500, 2000), info("r", "a", 3500, 10)]
    buf, pieces = fill(files, tensors, chunk=1024, merge=True)
    assert [(p.offset, p.length) for p in pieces] == [(0, 1024), (1024, 1024), (2048, 1024), (3072, 438)]
    assert np.array_equal(buf, expected(files, tensors))


def test_without_merging_each_tensor_is_read_alone_into_its_place():
    files = {"a": (np.arange(5000) % 251).astype(np.uint8)}
    tensors = [info("q", "a", 1500, 2000), info("p", "a", 0, 1500), info("e", "a", 3500, 0)]
    offsets, _ = BatchReader.layout(tensors)
    buf, pieces = fill(files, tensors, chunk=1024, merge=False)
    assert [(p.offset, p.length) for p in pieces] == [(1500, 1024), (2524, 976), (0, 1024), (1024, 476)]
    assert all(len(p.parts) == 1 and p.parts[0][0] == 0 for p in pieces)  # a pread straight into the buffer
    assert np.array_equal(buf, expected(files, tensors))


@pytest.mark.parametrize("seed", range(20))
def test_every_byte_lands_where_the_buffer_expects_it(seed):
    """Random files of back-to-back tensors with gaps, a random batch of them in a random order."""
    rng = random.Random(seed)
    files, pool = {}, []
    for f in range(rng.randint(1, 3)):
        name, cursor = f"f{f}", rng.randint(0, 300)
        for i in range(rng.randint(1, 30)):
            n = rng.choice([0, 2, 64, 100, 1000, 4096, 5000])
            pool.append(info(f"{name}.t{i}", name, cursor, n))
            cursor += n + (rng.choice([0, 0, 0, 8, 512]))
        files[name] = np.frombuffer(rng.randbytes(cursor + 10), dtype=np.uint8)
    tensors = rng.sample(pool, rng.randint(1, len(pool)))
    for merge in (True, False):
        buf, pieces = fill(files, tensors, chunk=rng.choice([256, 1000, 4096, 1 << 20]), merge=merge)
        assert np.array_equal(buf, expected(files, tensors))
        assert sum(p.length for p in pieces) == sum(t.nbytes for t in tensors)  # no byte read twice


def test_the_cpu_reader_reads_a_batch_as_written(tmp_path):
    data = (np.arange(10_000) % 253).astype(np.uint8)
    (tmp_path / "a").write_bytes(data.tobytes())
    tensors = [info("q", "a", 1500, 2000), info("p", "a", 0, 1500), info("r", "a", 3500, 3)]
    with BatchReader(tmp_path, torch.device("cpu"), threads=2, chunk_bytes=1024) as reader:
        buf, offsets = reader.read(tensors)
    for t in tensors:  # (the alignment padding between them is never written)
        assert np.array_equal(
            buf.numpy()[offsets[t.name] : offsets[t.name] + t.nbytes], data[t.offset : t.offset + t.nbytes]
        )


def test_a_pending_read_waits_only_for_the_tensors_asked_for(tmp_path, monkeypatch):
    """A step of the batch can start once its own tensors are read, while later ones are still being read."""
    data = (np.arange(8000) % 251).astype(np.uint8)
    (tmp_path / "a").write_bytes(data.tobytes())
    first, second, last = info("w1", "a", 0, 3000), info("w2", "a", 3000, 100), info("w3", "a", 5000, 2500)
    held, done = threading.Event(), set()
    real = BatchReader._read_piece

    def read_piece(self, piece, buf):
        if piece.offset >= 5000:  # the last tensor's pieces wait until the test lets them go
            held.wait(10)
        real(self, piece, buf)
        done.add(piece.offset)

    monkeypatch.setattr(BatchReader, "_read_piece", read_piece)
    with BatchReader(tmp_path, torch.device("cpu"), threads=2, chunk_bytes=1024) as reader:
        pending = reader.start([first, second, last])
        pending.wait([first, second])
        assert not done & {5000, 6024, 7048}  # returned before any of the last tensor's pieces was read
        for t in (first, second):
            at = pending.offsets[t.name]
            assert np.array_equal(pending.buf.numpy()[at : at + t.nbytes], data[t.offset : t.offset + t.nbytes])
        assert pending.arrival([first]) < pending.arrival([second]) < pending.arrival([last])
        assert pending.arrival([]) == -1
        held.set()
        pending.wait([last])
        at = pending.offsets[last.name]
        assert np.array_equal(pending.buf.numpy()[at : at + last.nbytes], data[5000:7500])


def test_a_failed_read_is_raised_by_the_wait_for_that_tensor(tmp_path):
    (tmp_path / "a").write_bytes(bytes(1000))
    with BatchReader(tmp_path, torch.device("cpu"), threads=2) as reader:
        pending = reader.start([info("whole", "a", 0, 500), info("cut_short", "a", 600, 800)])
        pending.wait([info("whole", "a", 0, 500)])  # its own read went well
        with pytest.raises(FP8ConvertError, match=r"a: unexpected end of file"):
            pending.wait([info("cut_short", "a", 600, 800)])


def test_the_run_quantizes_a_batch_while_it_is_read_and_writes_it_as_it_is_quantized(
    source_model, tmp_path, monkeypatch
):
    """With one slow reader thread, the main thread quantizes a batch's first stacks while the rest of it
    is still being read, and the writer writes a batch's first outputs while the rest of it is still
    being quantized. The shards are the same."""
    import fp8convert
    from fp8convert.run import pipeline, quantizer
    from fp8convert.run.writer import ShardWriter

    events: list[str] = []
    real_read, real_start, real_group = BatchReader._read_piece, BatchReader.start, quantizer.quantize_group
    real_write = ShardWriter.write

    def read_piece(self, piece, buf):
        time.sleep(0.01)
        real_read(self, piece, buf)
        events.append("read")

    def start(self, tensors):
        events.append("batch")
        return real_start(self, tensors)

    def quantize_group(*args, **kwargs):
        time.sleep(0.01)
        events.append("quantize")
        return real_group(*args, **kwargs)

    def write(self, *args, **kwargs):
        if threading.current_thread().name == "fp8convert-writer":  # (not the copier of kept tensors)
            events.append("write")
        return real_write(self, *args, **kwargs)

    monkeypatch.setattr(BatchReader, "_read_piece", read_piece)
    monkeypatch.setattr(BatchReader, "start", start)
    monkeypatch.setattr(quantizer, "quantize_group", quantize_group)
    monkeypatch.setattr(ShardWriter, "write", write)
    monkeypatch.setattr(pipeline, "io_threads", lambda device_type: (1, 1))
    src = source_model("qwen3_moe")
    result = fp8convert.quantize(src, tmp_path / "out", device="cpu", max_resident="64KB")  # a layer a batch
    monkeypatch.undo()
    fp8convert.quantize(src, tmp_path / "plain", device="cpu")

    # Between two "batch" marks the main thread quantizes only that batch: the next one's reads start
    # once it is done, and the batch before was written first. So a read after one of its quantize steps
    # is one of its own reads, and a write between two of them is one of its own outputs.
    segments = [seg.split() for seg in " ".join(events).split("batch")]
    assert sum(1 for seg in segments if seg) > 2
    assert any("read" in seg[seg.index("quantize") :] for seg in segments if "quantize" in seg)
    assert any(
        "write" in seg[seg.index("quantize") : len(seg) - seg[::-1].index("quantize")]
        for seg in segments
        if "quantize" in seg
    )
    assert result.complete
    for shard in (tmp_path / "plain").glob("*.safetensors"):
        assert (tmp_path / "out" / shard.name).read_bytes() == shard.read_bytes()
