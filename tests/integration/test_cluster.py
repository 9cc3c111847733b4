"""Batch and distributed conversion (docs/cluster.md): the work split over workers, launcher detection,
finalize, several devices, and batch jobs files. Every split run must give the bytes of one process,
every file of OUT included (shards, index, config, card, manifest)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tiny_ckpt import cli_subprocess, looks_complete, tree_bytes

from fp8convert import api
from fp8convert.cli import main
from fp8convert.cluster.batch import read_jobs, task_index_from_env
from fp8convert.cluster.workers import WorkerSpec, detect_worker, parse_devices, resolve_worker
from fp8convert.demo import make_demo_model
from fp8convert.errors import FP8ConvertError

try:
    from fakehub import fake_hub  # noqa: F401  (a fixture)
except ImportError:  # tests/ imported as a package
    from tests.fakehub import fake_hub  # noqa: F401

SHARDS = ["--max-shard-size", "1MB"]  # the demo model in 1 MB shards: 6 output shards
ARGS = [*SHARDS, "-q"]  # -q drops the summary line: tests that read it pass SHARDS
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """A 4-shard demo checkpoint and the bytes of its one-process conversion."""
    base = tmp_path_factory.mktemp("cluster")
    src = make_demo_model(base / "src", shards=4)
    assert main(["quantize", str(src), str(base / "ref"), "--device", "cpu", *ARGS]) == 0
    reference = tree_bytes(base / "ref")
    assert sum(name.startswith("model-") for name in reference) == 6
    return src, reference


def run_cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([*map(str, args)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


def one_error_line(rc: int, err: str, exit_code: int = 1) -> str:
    assert rc == exit_code, err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


def shard_paths(out: Path) -> list[Path]:
    return sorted(out.glob("model-*-of-*.safetensors"))


# ---------------------------------------------------------------- same bytes, however the work is split


@pytest.mark.slow
def test_torchrun_two_ranks_give_the_bytes_of_one_process(ref, tmp_path):
    src, reference = ref
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_RANK"))}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "fp8convert",
            "quantize",
            str(src),
            str(out),
            "--device",
            "cpu",
            *ARGS,
        ],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert tree_bytes(out) == reference


def test_explicit_workers_then_finalize(ref, tmp_path, capsys):
    src, reference = ref
    out = tmp_path / "out"
    for k in range(2):
        report = api.quantize(src, out, device="cpu", max_shard_size="1MB", worker=f"{k}/2", finalize=False)
        assert report.worker == f"{k}/2" and report.shards_written == 3 and not report.complete
    assert not looks_complete(out)
    rc, stdout, err = run_cli(capsys, "finalize", out)
    assert rc == 0, err
    assert "finalized" in stdout
    assert tree_bytes(out) == reference
    assert run_cli(capsys, "finalize", out)[0] == 0  # idempotent
    assert tree_bytes(out) == reference


def test_finalizing_a_complete_output_writes_nothing_so_a_read_only_copy_finalizes(ref, tmp_path, capsys, monkeypatch):
    """Every file already holds its bytes: none is rewritten (a read-only model store finalizes too, its
    lock folder unwritable)."""
    src, reference = ref
    out = tmp_path / "out"
    assert api.quantize(src, out, device="cpu", max_shard_size="1MB").complete
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}

    real_open = os.open

    def read_only(path, *args):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    def open_for_reading_only(path, flags, *args):
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            read_only(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "replace", read_only)
    monkeypatch.setattr(os, "open", open_for_reading_only)
    rc, _, err = run_cli(capsys, "finalize", out)
    monkeypatch.undo()
    assert rc == 0, err
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()} == stamps
    assert tree_bytes(out) == reference


def test_finalizing_again_keeps_the_verification_in_the_card(ref, tmp_path, capsys):
    """verify puts its figures in the card; finalizing the complete output again keeps them (it dropped them)."""
    src, _ = ref
    out = tmp_path / "out"
    assert api.quantize(src, out, device="cpu").complete
    assert run_cli(capsys, "verify", src, out, "-q")[0] == 0
    card = (out / "README.md").read_text()
    assert "## Verification" in card
    assert run_cli(capsys, "finalize", out)[0] == 0
    assert (out / "README.md").read_text() == card


def test_the_last_worker_finalizes(ref, tmp_path, capsys):
    """Each worker writes only its own shards (its report says so); the one that finds every shard
    present finalizes, so `srun -n N fp8convert quantize ...` ends complete."""
    src, reference = ref
    out = tmp_path / "out"
    rc, stdout, err = run_cli(capsys, "quantize", src, out, "--device", "cpu", "--worker", "1/3", *SHARDS)
    assert rc == 0, err
    assert "worker 1/3: wrote 2 of 6" in stdout and not looks_complete(out)
    assert [p.name for p in shard_paths(out)] == [f"model-0000{i}-of-00006.safetensors" for i in (2, 5)]
    for k in (2, 0):
        assert run_cli(capsys, "quantize", src, out, "--device", "cpu", "--worker", f"{k}/3", *ARGS)[0] == 0
    assert tree_bytes(out) == reference


def test_finalize_claim_between_workers(ref, tmp_path):
    """Two workers that both find every shard present: only the one holding the claim finalizes; a
    claim left by a dead process is taken over."""
    src, reference = ref
    out = tmp_path / "out"
    kwargs = dict(device="cpu", max_shard_size="1MB")
    api.quantize(src, out, worker="0/2", **kwargs)
    claim = out / ".fp8convert" / "finalize.claim"
    claim.write_text(f"{os.uname().nodename} {os.getpid()}\n")  # a live holder: "another worker is finalizing"
    report = api.quantize(src, out, worker="1/2", **kwargs)
    assert report.shards_written == 3 and not report.complete and not looks_complete(out)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    claim.write_text(f"{os.uname().nodename} {dead.pid}\n")
    report = api.quantize(src, out, worker="1/2", **kwargs)
    assert report.shards_written == 0 and report.complete
    assert tree_bytes(out) == reference


@pytest.mark.slow
def test_concurrent_workers_on_an_empty_output(ref, tmp_path):
    """Workers started together on an empty OUT: none trips over the others' work directory or
    manifest, and the output is complete and exact."""
    src, reference = ref
    out = tmp_path / "out"
    procs = [cli_subprocess(["quantize", src, out, "--device", "cpu", "--worker", f"{k}/3", *ARGS]) for k in range(3)]
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    assert tree_bytes(out) == reference


@pytest.mark.slow
def test_srun_tasks_are_detected(ref, tmp_path, capsys, monkeypatch):
    """No --worker under a multi-task srun: SLURM_PROCID/SLURM_NTASKS split the work."""
    src, reference = ref
    out = tmp_path / "out"
    for name in ("RANK", "WORLD_SIZE", "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    for k in range(2):
        monkeypatch.setenv("SLURM_PROCID", str(k))
        rc, stdout, err = run_cli(capsys, "quantize", src, out, "--device", "cpu", *SHARDS)
        assert rc == 0, err
        assert ("worker 0/2: wrote 3 of 6" in stdout) == (k == 0), stdout  # the second one finalizes
    assert tree_bytes(out) == reference


@pytest.mark.slow
def test_devices_one_process_each(ref, tmp_path, capsys):
    """--devices spawns one worker per device (cpu entries allowed, so this runs without a GPU)."""
    src, reference = ref
    out = tmp_path / "out"
    rc, stdout, err = run_cli(capsys, "quantize", src, out, "--devices", "cpu,cpu", *SHARDS)
    assert rc == 0, err
    assert "on cpu,cpu" in stdout
    assert tree_bytes(out) == reference


@pytest.mark.slow
def test_devices_with_overwrite_replace_an_earlier_output(ref, tmp_path, capsys, monkeypatch):
    """--overwrite with --devices: the parent replaces OUT once, and the workers (each one of several,
    which may not replace OUT themselves) write it again; the same through a batch job."""
    src, reference = ref
    out = tmp_path / "out"
    rc, _, err = run_cli(
        capsys, "quantize", src, out, "--device", "cpu", "--scheme", "channel", "-q", "--max-shard-size", "1MB"
    )
    assert rc == 0, err
    rc, _, err = run_cli(capsys, "quantize", src, out, "--devices", "cpu,cpu", "--overwrite", *ARGS)
    assert rc == 0, err
    assert tree_bytes(out) == reference
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    jobs = tmp_path / "jobs.jsonl"
    jobs.write_text(
        json.dumps(
            {"source": str(src), "out": str(out), "overwrite": True, "devices": "cpu,cpu", "max_shard_size": "1MB"}
        )
        + "\n"
    )
    rc, _, err = run_cli(capsys, "batch", jobs, "-q")
    assert rc == 0, err
    assert tree_bytes(out) == reference


# ---------------------------------------------------------------- finalize refuses what is not complete


@pytest.mark.parametrize("breakage", ["missing", "truncated", "header"])
def test_finalize_refuses_a_missing_or_partial_shard(ref, tmp_path, capsys, breakage):
    src, _ = ref
    out = tmp_path / "out"
    for k in range(2):
        api.quantize(src, out, device="cpu", max_shard_size="1MB", worker=f"{k}/2", finalize=False)
    victim = shard_paths(out)[1]
    if breakage == "missing":
        victim.unlink()
    elif breakage == "truncated":
        os.truncate(victim, victim.stat().st_size - 1)
    else:  # same size, other header bytes
        data = victim.read_bytes()
        assert data.count(b'"pt"') == 1
        victim.write_bytes(data.replace(b'"pt"', b'"np"'))
    line = one_error_line(*run_cli(capsys, "finalize", out)[::2])
    assert victim.name in line
    assert {"missing": "missing", "truncated": "bytes", "header": "header"}[breakage] in line
    assert not looks_complete(out)


def test_finalize_refuses_a_changed_source_and_a_foreign_directory(ref, tmp_path, capsys):
    src, _ = ref
    copy = tmp_path / "src"
    copy.mkdir()
    for p in src.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    out = tmp_path / "out"
    for k in range(2):
        api.quantize(copy, out, device="cpu", max_shard_size="1MB", worker=f"{k}/2", finalize=False)
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))
    line = one_error_line(*run_cli(capsys, "finalize", out)[::2])
    assert "plan" in line and str(out) in line
    line = one_error_line(*run_cli(capsys, "finalize", copy)[::2])
    assert "manifest" in line


def test_finalize_a_hub_source(fake_hub, tmp_path):
    """Workers converting a repo id (each downloading only the source shards it reads); finalize
    re-plans from remote headers and fetches the side files and card itself (here into an emptied
    cache), giving the bytes of a one-process run."""
    import shutil

    from huggingface_hub import constants

    root = make_demo_model(tmp_path / "model", shards=4)
    (root / "README.md").write_text("---\nlicense: apache-2.0\n---\n# demo\n")
    (root / "tokenizer_config.json").write_text('{"model_max_length": 512}\n')
    fake_hub.add_repo("acme/demo", from_dir=root)
    kwargs = dict(device="cpu", max_shard_size="1MB", token=fake_hub.token)
    api.quantize("acme/demo", tmp_path / "ref", **kwargs)
    out = tmp_path / "out"
    plan = api.make_plan(root, max_shard_size="1MB")
    fetched = []
    for k in range(2):
        shutil.rmtree(constants.HF_HUB_CACHE)  # each worker fetches what it reads (as on its own node)
        api.quantize("acme/demo", out, worker=(k, 2), finalize=False, **kwargs)
        reads = {t.source.file for u in plan.units_in(WorkerSpec(k, 2).owned(6)) for t in u.tensors}
        fetched.append({p.name for p in Path(constants.HF_HUB_CACHE).rglob("model-*.safetensors")})
        assert fetched[-1] == reads
    assert [len(f) for f in fetched] == [3, 4]  # of the 4 source shards
    shutil.rmtree(constants.HF_HUB_CACHE)
    report = api.finalize_output(out, token=fake_hub.token)
    assert report.source == "acme/demo" and report.shards == 6
    assert tree_bytes(out) == tree_bytes(tmp_path / "ref")


# ---------------------------------------------------------------- what is refused up front


def test_refusals(ref, tmp_path, capsys):
    src, _ = ref
    out = tmp_path / "out"
    # exit 2: the command line is wrong whatever the machine; 1: it is wrong here (or for this OUT)
    cases = [
        (["--worker", "0/2", "--overwrite"], "--overwrite", 1),
        (["--worker", "2/2"], "--worker 2/2", 2),
        (["--worker", "x"], "K/N", 2),
        (["--devices", "tpu:0"], "tpu:0", 2),
        (["--devices", "cpu,cpu", "--device", "cpu"], "--devices", 2),
    ]
    if not torch.cuda.is_available():  # one GPU this machine lacks: named as --devices, not --device
        cases += [(["--devices", "cuda:0"], "--devices cuda:0: CUDA is not available", 1)]
    for extra, needle, exit_code in cases:
        line = one_error_line(*run_cli(capsys, "quantize", src, out, *ARGS, *extra)[::2], exit_code)
        assert needle in line, (extra, line)
        assert not out.exists()


# ---------------------------------------------------------------- launcher detection (pure)


@pytest.mark.parametrize(
    "env,opt_in,expected",
    [
        ({}, False, None),
        ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1"}, False, WorkerSpec(3, 8, "torchrun", 1)),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, False, WorkerSpec(0, 1, "single", 0)),
        # torchrun inside an srun step: torchrun's ranks win
        (
            {"RANK": "5", "WORLD_SIZE": "16", "LOCAL_RANK": "5", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"},
            False,
            WorkerSpec(5, 16, "torchrun", 5),
        ),
        ({"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0"}, False, WorkerSpec(2, 4, "slurm", 0)),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "2"}, False, WorkerSpec(1, 2, "slurm")),
        ({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}, False, None),
        # arrays and indexed Jobs only with --worker auto
        ({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"}, False, None),
        (
            {"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "1", "SLURM_ARRAY_TASK_COUNT": "4"},
            True,
            WorkerSpec(2, 4, "slurm-array", on_this_machine=1),
        ),  # each array task is its own allocation
        (
            {
                "SLURM_ARRAY_TASK_ID": "4",
                "SLURM_ARRAY_TASK_MIN": "0",
                "SLURM_ARRAY_TASK_STEP": "2",
                "SLURM_ARRAY_TASK_COUNT": "3",
            },
            True,
            WorkerSpec(2, 3, "slurm-array", on_this_machine=1),
        ),
        ({"JOB_COMPLETION_INDEX": "0", "JOB_COMPLETIONS": "3"}, False, None),
        ({"JOB_COMPLETION_INDEX": "2", "JOB_COMPLETIONS": "3"}, True, WorkerSpec(2, 3, "k8s", on_this_machine=1)),
        # the workers on this node: torchrun's LOCAL_WORLD_SIZE, the most srun tasks on any node
        (
            {"RANK": "9", "WORLD_SIZE": "32", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "8"},
            False,
            WorkerSpec(9, 32, "torchrun", 1, on_this_machine=8),
        ),
        (
            {"SLURM_PROCID": "9", "SLURM_NTASKS": "32", "SLURM_STEP_TASKS_PER_NODE": "8(x4)"},
            False,
            WorkerSpec(9, 32, "slurm", on_this_machine=8),
        ),
        (
            {"SLURM_PROCID": "6", "SLURM_NTASKS": "7", "SLURM_TASKS_PER_NODE": "2(x3),1"},
            False,
            WorkerSpec(6, 7, "slurm", on_this_machine=2),
        ),
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_TASKS_PER_NODE": "two"}, False, WorkerSpec(1, 2, "slurm")),
    ],
)
def test_detect_worker(env, opt_in, expected):
    assert detect_worker(env, opt_in=opt_in) == expected


@pytest.mark.parametrize(
    "env,needle",
    [
        ({}, "no launcher"),
        ({"JOB_COMPLETION_INDEX": "1"}, "JOB_COMPLETIONS"),
        ({"SLURM_ARRAY_TASK_ID": "1"}, "SLURM_ARRAY_TASK_COUNT"),
        ({"JOB_COMPLETION_INDEX": "3", "JOB_COMPLETIONS": "3"}, "not a valid split"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, r"^\$RANK='x': not an integer$"),
    ],
)
def test_detect_worker_errors(env, needle):
    with pytest.raises(FP8ConvertError, match=needle):
        detect_worker(env, opt_in=True)


def test_resolve_worker_reads_the_process_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith(("SLURM_", "JOB_COMPLETION")) or name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            monkeypatch.delenv(name)
    assert resolve_worker(None) == WorkerSpec()
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "3")
    assert resolve_worker(None) == WorkerSpec(1, 3, "slurm")
    assert resolve_worker("0/1") == WorkerSpec()  # explicit wins over detection
    assert resolve_worker("2/5") == WorkerSpec(2, 5, "explicit")
    assert resolve_worker((1, 2)) == WorkerSpec(1, 2, "explicit")
    assert WorkerSpec(1, 2).split(3, 2) == WorkerSpec(5, 6, "explicit")
    assert WorkerSpec(1, 3).owned(8) == {1, 4, 7}


def test_the_workers_sharing_a_machine():
    """What the prefetch window is divided by: every worker of the
    split unless the launcher says how many run here; --devices' sub-workers all run here."""
    assert WorkerSpec(1, 2).sharing == 2 and WorkerSpec(2, 4, "slurm-array", on_this_machine=1).sharing == 1
    assert WorkerSpec(9, 32, "torchrun", 1, on_this_machine=8).sharing == 8
    assert WorkerSpec(0, 2, "slurm", on_this_machine=8).sharing == 2  # never more than the split has
    assert WorkerSpec(2, 4, "k8s", on_this_machine=1).split(3, 1).sharing == 3
    assert WorkerSpec(9, 32, "torchrun", 1, on_this_machine=8).split(2, 0).sharing == 16
    assert WorkerSpec(1, 2).split(3, 2).sharing == 6


@pytest.mark.parametrize("count", [1, 2, 3])
def test_device_split_covers_exactly_the_workers_shards(count):
    """--devices splits a worker's own shards, whatever device count the other workers use."""
    shards = 50
    for index in range(count):
        worker = WorkerSpec(index, count)
        for parts in (1, 2, 3, 4):
            subs = [worker.split(parts, part).owned(shards) for part in range(parts)]
            assert set().union(*subs) == worker.owned(shards)
            assert sum(len(s) for s in subs) == len(worker.owned(shards))  # disjoint


def test_parse_devices():
    assert parse_devices("cuda:0, cuda:1") == ["cuda:0", "cuda:1"]
    assert parse_devices(["cpu", "cpu"]) == ["cpu", "cpu"]
    for bad in ("cuda", "", "gpu:0", "cuda:x"):
        with pytest.raises(FP8ConvertError, match="--devices"):
            parse_devices(bad)
    if torch.cuda.is_available():
        assert parse_devices("all") == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    else:
        with pytest.raises(FP8ConvertError, match="--devices all: no CUDA device"):
            parse_devices("all")


# ---------------------------------------------------------------- batch


def write_jobs(path: Path, src: Path, base: Path) -> Path:
    path.write_text(f"""
[defaults]
max_shard_size = "1MB"
device = "cpu"

[[job]]
name = "first"
source = "{src}"
out = "{base / "a"}"

[[job]]
name = "broken"
source = "{base / "no-such-model"}"
out = "{base / "b"}"

[[job]]
name = "channel"
source = "{src}"
out = "{base / "c"}"
scheme = "channel"
ignore = ["re:.*down_proj$"]
""")
    return path


def test_batch_goes_on_after_a_failure(ref, tmp_path, capsys, monkeypatch):
    src, reference = ref
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    jobs = write_jobs(tmp_path / "jobs.toml", src, tmp_path)
    rc, stdout, err = run_cli(capsys, "batch", jobs, "-q")
    line = one_error_line(rc, err)
    assert "1 of 3" in line and "broken" in line
    rows = {row.split()[1]: row.split() for row in stdout.splitlines() if row[:1].isdigit()}
    assert rows["first"][4] == "done" and rows["broken"][4] == "failed" and rows["channel"][4] == "done"
    assert tree_bytes(tmp_path / "a") == reference
    assert looks_complete(tmp_path / "c")
    # A rerun skips finished jobs; --json gives the summary.
    rc, stdout, err = run_cli(capsys, "batch", jobs, "-q", "--json")
    assert rc == 1
    summary = json.loads(stdout)
    assert [j["status"] for j in summary["jobs"]] == ["skipped", "failed", "skipped"]
    assert summary["failed"] == 1 and summary["skipped"] == 2 and summary["ok"] is False
    assert "no-such-model" in summary["jobs"][1]["error"]


def test_batch_names_an_unnamed_failed_job_by_what_it_converts(tmp_path, capsys, monkeypatch):
    """A job without a name is named by its source and output, not by its index twice (`job 0 (0)`)."""
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    missing, out = tmp_path / "no-such-model", tmp_path / "out"
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(f'[[job]]\nsource = "{missing}"\nout = "{out}"\n')
    rc, stdout, err = run_cli(capsys, "batch", jobs, "-q")
    title = f"job 0 ({missing} -> {out})"
    assert f"(first: {title}: {missing}: " in one_error_line(rc, err), err
    assert f"{title} failed: {missing}: " in stdout, stdout
    assert not out.exists()


def test_batch_task_index_runs_one_job(ref, tmp_path, capsys, monkeypatch):
    src, reference = ref
    jobs = write_jobs(tmp_path / "jobs.toml", src, tmp_path)
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    rc, stdout, err = run_cli(capsys, "batch", jobs, "-q", "--task-index", "0")
    assert rc == 0, err
    assert tree_bytes(tmp_path / "a") == reference
    assert not (tmp_path / "c").exists() and not (tmp_path / "b").exists()
    # In a Slurm array task id N runs job N, whatever the array's first id and step: --array=1-2 runs
    # jobs 1 and 2, --array=2 (rerunning the failed job 2) runs job 2.
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "2")
    monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", "1")
    monkeypatch.setenv("SLURM_ARRAY_TASK_STEP", "1")
    rc, stdout, err = run_cli(capsys, "batch", jobs, "-q")
    assert rc == 0, err
    assert looks_complete(tmp_path / "c") and not (tmp_path / "b").exists()
    line = one_error_line(*run_cli(capsys, "batch", jobs, "--task-index", "3")[::2])
    assert "task index 3" in line


def test_a_job_takes_every_quantize_option_and_writes_the_command_lines_bytes(ref, tmp_path, capsys, monkeypatch):
    """recipe (a table of pattern = scheme), target_tp, base_model and write_unloadable, as quantize takes them."""
    src, _ = ref
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    rule, flags = "re:.*mlp.*", ["--device", "cpu", "-q", "--target-tp", "2", "--base-model", "acme/tiny"]
    assert main(["quantize", src, tmp_path / "cli", *flags, "--scheme", "channel", "--scheme", f"{rule}=block"]) == 0
    jobs = tmp_path / "jobs.toml"
    jobs.write_text(
        f'[defaults]\ndevice = "cpu"\nscheme = "channel"\nwrite_unloadable = true\n\n[[job]]\nsource = "{src}"\n'
        f'out = "{tmp_path / "job"}"\ntarget_tp = 2\nbase_model = "acme/tiny"\n[job.recipe]\n"{rule}" = "block"\n'
    )
    rc, _, err = run_cli(capsys, "batch", jobs, "-q")
    assert rc == 0, err
    assert tree_bytes(tmp_path / "job") == tree_bytes(tmp_path / "cli")


def test_batch_json_lines_and_validation(ref, tmp_path, capsys, monkeypatch):
    src, _ = ref
    monkeypatch.delenv("SLURM_ARRAY_TASK_ID", raising=False)
    good = tmp_path / "jobs.jsonl"
    good.write_text(
        "# models\n"
        + json.dumps({"source": str(src), "out": str(tmp_path / "x"), "device": "cpu", "max_shard_size": "1MB"})
        + "\n\n"
    )
    assert [j.source for j in read_jobs(good)] == [str(src)]
    rc, stdout, err = run_cli(capsys, "batch", good, "-q", "--json")
    assert rc == 0, err
    assert json.loads(stdout)["done"] == 1 and json.loads(stdout)["ok"] is True
    bad = {
        "unknown.toml": ('[[job]]\nsource = "a"\nout = "b"\nschme = "block"\n', ["job 0", "schme"]),
        "no_out.toml": ('[[job]]\nname = "m"\nsource = "a"\n', ["job 0 (m)", "'out'"]),
        "scheme.jsonl": (
            '{"source": "a", "out": "b"}\n{"source": "a", "out": "c", "scheme": "x"}\n',
            ["job 1", "--scheme"],
        ),
        "twice.toml": (
            '[[job]]\nsource = "a"\nout = "o"\n[[job]]\nsource = "b"\nout = "o"\n',
            ["job 1 writes to o, as job 0 does"],
        ),
        "types.toml": ('[[job]]\nsource = "a"\nout = "b"\nprivate = "yes"\n', ["job 0", "private"]),
        "several.toml": (  # one line names every job's problem
            '[[job]]\nsource = "a"\nout = "b"\nschme = "block"\n[[job]]\nsource = "a"\n'
            '[[job]]\nsource = "a"\nout = "c"\nformat = "fp8"\nscheme = "channel"\n'
            '[[job]]\nsource = "a"\nout = "o"\n[[job]]\nsource = "a"\nout = "o"\n',
            [
                "4 problems: job 0: unknown key 'schme'",
                "; job 1: missing 'out'; job 2: --format fp8",
                "; job 4 writes to o",
            ],
        ),
        "push.toml": ('[[job]]\nsource = "a"\nout = "b"\npush_to_hub = "not a repo"\n', ["job 0", "push_to_hub"]),
        "defaults.toml": ('[defaults]\nout = "x"\n[[job]]\nsource = "a"\nout = "b"\n', ["[defaults]", "out"]),
        "empty.toml": ("", ["no jobs"]),
        "broken.jsonl": ('{"source": \n', ["broken.jsonl:1"]),
        "dtype.toml": (
            '[[job]]\nsource = "a"\nout = "b"\ndtype = "fp16"\n',
            ["job 0", "--dtype applies to dequantize"],
        ),
        "recipe.toml": ('[[job]]\nsource = "a"\nout = "b"\nrecipe = 5\n', ["job 0", "recipe rule 5"]),
        "tp.toml": ('[[job]]\nsource = "a"\nout = "b"\ntarget_tp = [2, true]\n', ["job 0", "--target-tp"]),
    }
    for name, (text, needles) in bad.items():
        (tmp_path / name).write_text(text)
        line = one_error_line(*run_cli(capsys, "batch", tmp_path / name)[::2])
        for needle in needles:
            assert needle in line, (name, line)
        assert not (tmp_path / "b").exists()


def test_task_index_from_env():
    assert task_index_from_env({}) is None
    assert task_index_from_env({"SLURM_ARRAY_TASK_ID": "7"}) == 7
    # --array=3,7 reruns jobs 3 and 7 (not 0 and 4)
    assert (
        task_index_from_env({"SLURM_ARRAY_TASK_ID": "3", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "7"}) == 3
    )
    assert (
        task_index_from_env({"SLURM_ARRAY_TASK_ID": "7", "SLURM_ARRAY_TASK_MIN": "3", "SLURM_ARRAY_TASK_MAX": "7"}) == 7
    )
