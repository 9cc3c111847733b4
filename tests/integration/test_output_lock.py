"""One writer per share of an output (output/lock.py): a second run into an OUT that another is writing
is refused with one line before it changes anything, the first finishes into the bytes of a run alone,
workers of one split still write side by side, and a file system without locks converts as before."""

from __future__ import annotations

import errno
import time

import pytest
from tiny_ckpt import cli_subprocess, llama_tensors, tree_bytes, write_checkpoint

from fp8convert.cli import main
from fp8convert.output import lock as lock_module
from fp8convert.output.lock import OutputLock

ARGS = ["--max-shard-size", "20KB", "--max-resident", "10KB", "-q"]
HELD = "another fp8convert run is writing it"


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    base = tmp_path_factory.mktemp("lock")
    src = write_checkpoint(base / "src", llama_tensors(layers=4))
    assert main(["quantize", str(src), str(base / "ref"), *ARGS]) == 0
    return src, tree_bytes(base / "ref")


def run(capsys, *args) -> tuple[int, str]:
    rc = main([*map(str, args)])
    return rc, capsys.readouterr().err


@pytest.mark.slow
def test_a_second_run_is_refused_while_the_first_writes_and_the_first_finishes_whole(ref, tmp_path, capsys):
    """Two runs into one OUT (the second with --overwrite and another scheme): before locks, each took the
    other's shards for finished or deleted them, and a rerun accepted half-written shards as done."""
    src, reference = ref
    out = tmp_path / "out"
    first = cli_subprocess(["quantize", src, out, *ARGS], write_delay=0.05)
    deadline = time.monotonic() + 60
    while not list(out.glob("model-*.safetensors")) and time.monotonic() < deadline:  # it is writing now
        assert first.poll() is None, first.communicate()
        time.sleep(0.01)
    before = tree_bytes(out)
    for extra in (["--overwrite", "--scheme", "channel"], []):
        rc, err = run(capsys, "quantize", src, out, *ARGS, *extra)
        assert rc == 1
        assert err.count("\n") == 1 and HELD in err and str(out) in err, err
    assert first.poll() is None, "the first run ended before the second was refused: the test proved nothing"
    now = tree_bytes(out)
    assert all(now[name] == data for name, data in before.items() if name.startswith("model-")), (
        "a refused run changed a finished shard"
    )
    _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert tree_bytes(out) == reference


def test_workers_of_one_split_write_side_by_side_but_the_same_worker_twice_is_refused(ref, tmp_path, capsys):
    src, reference = ref
    out = tmp_path / "out"
    with OutputLock(out, 0, 2) as worker_0:  # worker 0/2 is running (as far as the locks say)
        worker_0.acquire()
        rc, err = run(capsys, "quantize", src, out, *ARGS, "--worker", "1/2")
        assert rc == 0, err
        for args in (
            ["quantize", src, out, *ARGS, "--worker", "0/2"],  # the same worker again
            ["quantize", src, out, *ARGS],  # the whole output beside a worker
            ["finalize", out],
        ):  # finishing while a worker writes
            rc, err = run(capsys, *args)
            assert rc == 1 and HELD in err and err.count("\n") == 1, (args, err)
    rc, err = run(capsys, "quantize", src, out, *ARGS, "--worker", "0/2")  # its share, and it finalizes
    assert rc == 0, err
    assert tree_bytes(out) == reference


def test_a_whole_run_holds_the_output_against_every_worker(ref, tmp_path, capsys):
    src, _ = ref
    out = tmp_path / "out"
    with OutputLock(out) as whole:
        whole.acquire()
        for worker in ("0/2", "1/2"):
            rc, err = run(capsys, "quantize", src, out, *ARGS, "--worker", worker)
            assert rc == 1 and HELD in err, err
    assert not list(out.glob("model-*")), "a refused worker wrote a shard"


def test_overwrite_keeps_the_lock_it_holds(ref, tmp_path, capsys):
    """--overwrite empties the work folder but for the lock files: a run that deleted the file it locks
    would let the next run lock a new one beside it."""
    src, reference = ref
    out = tmp_path / "out"
    assert run(capsys, "quantize", src, out, *ARGS, "--scheme", "channel")[0] == 0
    lock_file = out / ".fp8convert" / "lock"
    inode = lock_file.stat().st_ino
    assert run(capsys, "quantize", src, out, *ARGS, "--overwrite")[0] == 0
    assert lock_file.stat().st_ino == inode
    assert tree_bytes(out) == reference


def test_a_file_system_without_locks_converts_as_before(ref, tmp_path, capsys, monkeypatch):
    src, reference = ref

    def no_locks(fd, mode):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(lock_module.fcntl, "flock", no_locks)
    rc, err = run(capsys, "quantize", src, tmp_path / "out", *ARGS)
    assert rc == 0, err
    assert tree_bytes(tmp_path / "out") == reference
