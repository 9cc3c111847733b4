"""Never a half-written checkpoint: a run killed (SIGKILL) or interrupted (SIGINT) at any moment, or
stopped by a full disk, leaves an output that does not look complete, whose final-named shards are
all whole, and which the same command finishes into exactly the bytes of an uninterrupted run. A
changed plan is refused. The child runs are slowed down by the tests (tiny_ckpt.SLOW_CLI: a sleep
before each tensor write), so a kill can land mid-run on a tiny model."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import threading
from pathlib import Path

import pytest
from tiny_ckpt import cli_subprocess, llama_tensors, looks_complete, tree_bytes, wait_for, write_checkpoint

from fp8convert import make_plan
from fp8convert.cli import main
from fp8convert.run.writer import ShardWriter

# 6 layers in 20 KB shards, 10 KB batches: 20 shards, about a hundred tensor writes.
ARGS = ["--max-shard-size", "20KB", "--max-resident", "10KB", "-q"]
LOUD_ARGS = ARGS[:-1]  # -q drops the summary line
DELAY = 0.03  # seconds per tensor write in the child: a run of about 3 s after start-up


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """The source and the bytes of an uninterrupted conversion of it."""
    base = tmp_path_factory.mktemp("resume")
    src = write_checkpoint(base / "src", llama_tensors(layers=6))
    assert main(["quantize", str(src), str(base / "ref"), *ARGS]) == 0
    reference = tree_bytes(base / "ref")
    assert sum(name.startswith("model-") for name in reference) >= 10
    return src, reference


def quantize(src, out, *extra) -> int:
    return main(["quantize", str(src), str(out), *ARGS, *extra])


def start(src, out) -> subprocess.Popen:
    return cli_subprocess(["quantize", src, out, *ARGS], write_delay=DELAY)


def assert_partial_is_sound(out: Path, reference: dict[str, bytes]) -> None:
    """What a stopped run leaves: not complete-looking, and every final-named file whole."""
    assert not looks_complete(out)
    for name, data in tree_bytes(out).items():
        if name.startswith("model-"):
            assert data == reference[name], f"{name} has its final name but not its final bytes"


def assert_killed_output_is_sound(out: Path, reference: dict[str, bytes]) -> None:
    """A kill can also land after config.json was written (while the manifest records completion, or
    the process exits): then the output must already be complete in every file but the manifest."""
    if not looks_complete(out):
        return assert_partial_is_sound(out, reference)
    got = tree_bytes(out)
    assert {n: got.get(n) for n in reference if n != ".fp8convert/manifest.json"} == {
        n: d for n, d in reference.items() if n != ".fp8convert/manifest.json"
    }


def shards(out: Path) -> list[Path]:
    return sorted(out.glob("model-*.safetensors"))


def manifest_written(out: Path) -> bool:
    return (out / ".fp8convert" / "manifest.json").exists()


# When to kill: as soon as a condition holds, or ("random-*") a seeded random time into the writing
# that follows the manifest (about 100 writes of DELAY seconds each; the wait ends well before them).
KILL_POINTS = {
    "manifest": manifest_written,
    "first-shard": lambda out: bool(shards(out)),
    "half": lambda out: len(shards(out)) >= 10,
    "random-1": None,
    "random-2": None,
}


@pytest.mark.slow
@pytest.mark.parametrize("point", KILL_POINTS)
def test_sigkill_then_rerun_gives_identical_bytes(ref, tmp_path, point):
    src, reference = ref
    out = tmp_path / "out"
    proc = start(src, out)
    condition = KILL_POINTS[point]
    reached = wait_for(lambda: (condition or manifest_written)(out), proc)
    if reached and condition is None:
        try:
            proc.wait(timeout=random.Random(point).uniform(0, 60 * DELAY))
        except subprocess.TimeoutExpired:
            pass
        reached = proc.poll() is None
    proc.kill()
    _, err = proc.communicate()
    # A run that ended before the kill tested nothing: that is a failure of the test, not a pass.
    assert reached, f"the run ended (exit {proc.returncode}) before the kill point {point}: {err[-300:]}"
    assert proc.returncode == -signal.SIGKILL
    assert out.exists()
    assert_killed_output_is_sound(out, reference)
    assert quantize(src, out) == 0
    assert tree_bytes(out) == reference


@pytest.mark.slow
def test_sigint_stops_cleanly_and_resumes(ref, tmp_path, capsys):
    src, reference = ref
    out = tmp_path / "out"
    proc = start(src, out)
    assert wait_for(lambda: len(shards(out)) >= 2, proc)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted" in err and "rerun" in err and "Traceback" not in err
    assert_partial_is_sound(out, reference)
    assert 2 <= len(shards(out)) < sum(n.startswith("model-") for n in reference)

    # the same output with another plan: refused, saying what changed, and left untouched
    before = tree_bytes(out)
    assert quantize(src, out, "--scheme", "channel") == 1
    err = capsys.readouterr().err
    assert "different plan" in err and "scheme was 'tensor', now 'channel'" in err and str(out) in err
    assert tree_bytes(out) == before

    assert main(["quantize", str(src), str(out), *LOUD_ARGS]) == 0
    assert tree_bytes(out) == reference
    # the summary counts the shards the rerun found written
    written = sum(name.startswith("model-") and name.endswith(".safetensors") for name in before)
    assert f", {written} already written, " in capsys.readouterr().out


# ---------------------------------------------------------------- states a kill can leave, made directly


def test_killed_before_the_manifest_was_written(ref, tmp_path):
    src, reference = ref
    for leftover in ([], [".manifest.json.tmp"]):
        out = tmp_path / f"out{len(leftover)}"
        (out / ".fp8convert").mkdir(parents=True)
        for name in leftover:
            (out / ".fp8convert" / name).write_text('{"half')
        assert quantize(src, out) == 0
        assert tree_bytes(out) == reference


def test_killed_while_finishing(ref, tmp_path):
    """Every shard renamed, config.json not yet: half-written temporary files and a manifest that
    still says incomplete."""
    src, reference = ref
    out = tmp_path / "out"
    assert quantize(src, out) == 0
    (out / "config.json").unlink()
    (out / ".config.json.tmp").write_text('{"half')
    (out / ".tokenizer_config.json.tmp").write_text("half")
    manifest = out / ".fp8convert" / "manifest.json"
    manifest.write_text(json.dumps(dict(json.loads(manifest.read_text()), complete=False), indent=2) + "\n")
    assert not looks_complete(out)
    assert quantize(src, out) == 0
    assert tree_bytes(out) == reference  # the temporary files were rewritten and renamed, none left over


def test_stale_partial_and_missing_shard_are_redone(ref, tmp_path):
    src, reference = ref
    out = tmp_path / "out"
    assert quantize(src, out) == 0
    victim = shards(out)[3]
    victim.unlink()
    (out / ".fp8convert" / (victim.name + ".partial")).write_bytes(b"garbage")
    assert quantize(src, out) == 0
    assert tree_bytes(out) == reference


def test_changed_source_shard_is_refused_then_overwrite_starts_again(ref, tmp_path, capsys):
    """Same names and shapes, other values (a shard rewritten): the plan's fingerprint is the same, but
    the shard's size and modification time are recorded, so a rerun refuses to mix old and new."""
    src, reference = ref
    copy = tmp_path / "src"
    copy.mkdir()
    for p in src.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    assert main(["quantize", str(copy), str(out), *ARGS, "--worker", "0/2"]) == 0  # half the shards
    victim = sorted(copy.glob("*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[-32:] = bytes(32)
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    before = tree_bytes(out)
    assert main(["quantize", str(copy), str(out), *ARGS]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and victim.name in err and "changed" in err and "--overwrite" in err, err
    assert tree_bytes(out) == before
    assert main(["quantize", str(copy), str(out), *ARGS, "--overwrite"]) == 0
    assert main(["verify", str(copy), str(out)]) == 0


def test_rerun_of_a_complete_output_changes_nothing(ref, tmp_path, capsys):
    src, reference = ref
    out = tmp_path / "out"
    assert quantize(src, out) == 0
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    capsys.readouterr()
    assert main(["quantize", str(src), str(out), *ARGS[:-1]]) == 0
    assert "already complete" in capsys.readouterr().out
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == stamps
    assert quantize(src, out, "--max-shard-size", "30KB") == 1  # a complete output of another plan
    assert tree_bytes(out) == reference


def full_disk_after(nbytes: int):
    """os.pwrite as on a disk that fills up after `nbytes` more bytes: short writes, then ENOSPC."""
    real_pwrite, budget = os.pwrite, [nbytes]

    def pwrite(fd, data, offset):
        if budget[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real_pwrite(fd, bytes(data)[: budget[0]], offset)
        budget[0] -= n
        return n

    return pwrite


def test_disk_full_while_writing_shards_then_resumes(ref, tmp_path, monkeypatch, capsys):
    """ENOSPC from os.pwrite after a few KB (a full disk mid-shard): one error line naming the partial
    shard, no complete-looking output, no hang; with space back the same command finishes it."""
    src, reference = ref
    out = tmp_path / "out"
    monkeypatch.setattr(os, "pwrite", full_disk_after(3000))
    result = []
    worker = threading.Thread(target=lambda: result.append(quantize(src, out)), daemon=True)
    worker.start()
    worker.join(timeout=5)  # a clean run takes well under a second
    assert not worker.is_alive(), "the conversion hung after the disk filled up"
    monkeypatch.undo()
    err = capsys.readouterr().err
    assert result == [1]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1
        and "no space left on the device" in errors[0]
        and "free there" in errors[0]
        and "more is needed" in errors[0]
        and ".partial" in errors[0]
        and "rerun" in errors[0]
    ), errors
    assert_partial_is_sound(out, reference)
    assert quantize(src, out) == 0
    assert tree_bytes(out) == reference


# ------------------------------------------------------ inside one shard: the units already written are kept

# 12 layers in one output shard (as a model under the default 5 GB limit is written): 15 units.
ONE_SHARD = ["--max-resident", "10KB", "-q"]
STOP_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143, signal.SIGKILL: -signal.SIGKILL}


@pytest.fixture(scope="module")
def one_shard(tmp_path_factory):
    """The source, the bytes of an uninterrupted conversion of it, and its plan."""
    base = tmp_path_factory.mktemp("one-shard")
    src = write_checkpoint(base / "src", llama_tensors(layers=12))
    assert main(["quantize", str(src), str(base / "ref"), *ONE_SHARD]) == 0
    reference = tree_bytes(base / "ref")
    assert sum(name.startswith("model-") for name in reference) == 1
    return src, reference, make_plan(src)


def recorded_units(out: Path) -> list[str]:
    """The labels of the units the partial shard's record says are written (whole lines only)."""
    records = list((out / ".fp8convert").glob("*.units"))
    return [line.split(" ")[0] for line in records[0].read_text().split("\n")[:-1]] if records else []


def count_written_bytes(monkeypatch) -> list[int]:
    """The data bytes this process's writer is given to write from now on."""
    counted = []
    real = ShardWriter.write

    def counting(self, run, *args, **kwargs):
        counted.append(run.nbytes)
        return real(self, run, *args, **kwargs)

    monkeypatch.setattr(ShardWriter, "write", counting)
    return counted


def rerun_json(src, out, capsys, *extra) -> dict:
    capsys.readouterr()
    assert main(["quantize", str(src), str(out), *ONE_SHARD[:-1], "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def units_bytes(plan, labels) -> int:
    return sum(u.out_bytes for u in plan.units if u.label in labels)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_stopped_mid_shard_resumes_after_the_units_written(one_shard, tmp_path, capsys, monkeypatch, sig):
    src, reference, plan = one_shard
    out = tmp_path / "out"
    proc = cli_subprocess(["quantize", src, out, *ONE_SHARD], write_delay=DELAY)
    assert wait_for(lambda: len(recorded_units(out)) >= 3, proc), "the run ended before 3 units were written"
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == STOP_EXIT[sig], err
    assert_partial_is_sound(out, reference)
    kept = recorded_units(out)
    assert 3 <= len(kept) < len(plan.units), kept

    written = count_written_bytes(monkeypatch)
    report = rerun_json(src, out, capsys)
    assert tree_bytes(out) == reference
    assert (report["units_resumed"], report["units"]) == (len(kept), len(plan.units))
    # only the other units were written again
    assert sum(written) == units_bytes(plan, {u.label for u in plan.units} - set(kept))


def stop_mid_shard(src, out, monkeypatch) -> None:
    """A run stopped by a full disk after about half the shard (ENOSPC from os.pwrite)."""
    with monkeypatch.context() as patch:
        patch.setattr(os, "pwrite", full_disk_after(200_000))
        assert main(["quantize", str(src), str(out), *ONE_SHARD]) == 1


def test_a_changed_unit_of_a_partial_shard_is_written_again(one_shard, tmp_path, capsys, monkeypatch):
    src, reference, plan = one_shard
    out = tmp_path / "out"
    stop_mid_shard(src, out, monkeypatch)
    kept = recorded_units(out)
    assert len(kept) >= 3, kept
    # one byte of the second unit recorded, changed in the partial file
    shard = plan.shards[0]
    partial = out / ".fp8convert" / (shard.name + ".partial")
    victim = next(u for u in plan.units if u.label == kept[1])
    placed = shard.tensors[victim.tensors[0].name]
    data = bytearray(partial.read_bytes())
    data[len(shard.header) + placed.offset] ^= 0xFF
    partial.write_bytes(bytes(data))

    # another plan is still refused: the partial shard holds units written
    assert main(["quantize", str(src), str(out), *ONE_SHARD, "--max-shard-size", "100KB"]) == 1
    assert "different plan" in capsys.readouterr().err

    written = count_written_bytes(monkeypatch)
    report = rerun_json(src, out, capsys)
    assert tree_bytes(out) == reference
    assert report["units_resumed"] == len(kept) - 1
    assert sum(written) == units_bytes(plan, {u.label for u in plan.units} - set(kept) | {victim.label})


def test_a_partial_shard_whose_header_changed_is_written_again(one_shard, tmp_path, capsys, monkeypatch):
    src, reference, plan = one_shard
    out = tmp_path / "out"
    stop_mid_shard(src, out, monkeypatch)
    assert len(recorded_units(out)) >= 3
    partial = out / ".fp8convert" / (plan.shards[0].name + ".partial")
    data = bytearray(partial.read_bytes())
    data[20] ^= 0xFF
    partial.write_bytes(bytes(data))
    written = count_written_bytes(monkeypatch)
    report = rerun_json(src, out, capsys)
    assert tree_bytes(out) == reference
    assert report["units_resumed"] == 0 and sum(written) == units_bytes(plan, {u.label for u in plan.units})


def test_every_unit_written_but_the_shard_not_renamed(one_shard, tmp_path, capsys, monkeypatch):
    """Stopped between the last unit's record and the shard's rename: the rerun only renames it."""
    src, reference, plan = one_shard
    out = tmp_path / "out"
    real_replace = os.replace

    def replace(a, b):
        if str(a).endswith(".partial"):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real_replace(a, b)

    with monkeypatch.context() as patch:
        patch.setattr(os, "replace", replace)
        assert main(["quantize", str(src), str(out), *ONE_SHARD]) == 1
    assert sorted(recorded_units(out)) == sorted(u.label for u in plan.units)
    written = count_written_bytes(monkeypatch)
    report = rerun_json(src, out, capsys)
    assert tree_bytes(out) == reference
    assert report["units_resumed"] == len(plan.units) and written == []
