"""The documented cluster flows on a real Slurm (docs/cluster.md): `srun -n 2`, the three sbatch scripts
of scripts/, and an array task cancelled mid-run then resubmitted. Every output must hold the bytes of a
one-process run, every job's log be free of tracebacks.

Needs a Slurm whose jobs run on this machine as the user running the tests (`bash scripts/slurm_up.sh`
starts a one-node one as root). Without one these tests skip; under CI (CI=true) they fail.
The jobs run this process's python and fp8convert: its bin directory leads PATH and the folder
fp8convert is imported from leads PYTHONPATH (sbatch and srun pass the environment on). The scripts'
requests (GPUs, 16 CPUs, 64 GB) are overridden on the command line with what a small CPU node has."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tiny_ckpt import SLOW_CLI, llama_tensors, looks_complete, tree_bytes, write_checkpoint

import fp8convert

pytestmark = [pytest.mark.slurm, pytest.mark.slow]  # jobs are child processes: not the fast loop

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
ARGS = ["--device", "cpu", "--max-shard-size", "100KB"]  # a tiny llama in 6 output shards
SMALL = ["--gpus=0", "--cpus-per-task=1", "--mem=1G"]  # command-line options win over #SBATCH lines
JOB_TIMEOUT = 120  # seconds a test waits for its jobs
ENDED = (
    "COMPLETED",
    "FAILED",
    "CANCELLED",
    "TIMEOUT",
    "OUT_OF_MEMORY",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
)


def slurm_problem() -> str | None:
    """Why no job can run here, or None when Slurm answers with a node ready for work."""
    if shutil.which("sinfo") is None:
        return "no sinfo on PATH"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo did not answer in 30s"
    states = proc.stdout.split()
    if proc.returncode != 0 or not {"idle", "mixed", "allocated"} & set(states):
        return f"sinfo: {proc.stderr.strip() or ' '.join(states) or 'no nodes'}"
    return None


@pytest.fixture(scope="module")
def job_env() -> dict[str, str]:
    """The environment jobs are submitted with (and so run with)."""
    problem = slurm_problem()
    if problem:
        message = f"Slurm is not running ({problem}); start it with `bash scripts/slurm_up.sh` (as root)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}  # no outer allocation
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    package_root = str(Path(fp8convert.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in [package_root, env.get("PYTHONPATH", "")] if p)
    return env


def slurm(env, cwd, *args, timeout: float = 60) -> str:
    """A Slurm command's stdout; a non-zero exit fails the test with its stderr."""
    proc = subprocess.run([*map(str, args)], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(map(str, args))} exited {proc.returncode}: {proc.stderr.strip()}"
    return proc.stdout


def submit(env, cwd, *args) -> str:
    """sbatch ARGS; the job id."""
    return slurm(env, cwd, "sbatch", "--parsable", *args).strip().split(";")[0]


def job_states(env, job: str) -> dict[str, str]:
    """{job id, or ARRAYJOB_TASK for an array's task: state} of a job or every task of an array."""
    states = {}
    for line in slurm(env, None, "scontrol", "-o", "show", "job", job).splitlines():
        fields = dict(re.findall(r"\b(JobId|ArrayJobId|ArrayTaskId|JobState)=(\S+)", line))
        name = f"{fields['ArrayJobId']}_{fields['ArrayTaskId']}" if "ArrayTaskId" in fields else fields["JobId"]
        states[name] = fields["JobState"]
    return states


def wait_for(env, job: str, until=None, timeout: float = JOB_TIMEOUT) -> dict[str, str]:
    """Poll until every task of `job` has ended (or `until()` holds); the states. A job still going at
    the timeout is cancelled and fails the test."""
    deadline = time.monotonic() + timeout
    while True:
        states = job_states(env, job)
        if until is not None and until():
            return states
        if all(state in ENDED for state in states.values()):
            return states
        if time.monotonic() > deadline:
            subprocess.run(["scancel", job], env=env)
            pytest.fail(f"job {job} not done after {timeout}s: {states}")
        time.sleep(0.3)


def wait_completed(env, job: str, cwd: Path) -> set[str]:
    """Wait for `job` (every task of an array); the tasks, each of which must have COMPLETED, else the
    test fails with the tails of the logs in `cwd`."""
    states = wait_for(env, job)
    failed = {name: state for name, state in states.items() if state != "COMPLETED"}
    assert not failed, f"{failed}\n" + "\n".join(
        f"--- {log}\n{log.read_text()[-2000:]}" for log in sorted(cwd.glob("*.log"))
    )
    return set(states)


def assert_clean_logs(logs: list[Path]) -> None:
    assert logs, "no job log written"
    for log in logs:
        text = log.read_text()
        assert "Traceback" not in text and "error:" not in text, f"{log}:\n{text[-3000:]}"


@pytest.fixture(scope="module")
def llama(source_model, converted):
    """A tiny llama and the bytes of its one-process conversion with ARGS."""
    return source_model("llama"), tree_bytes(converted("llama", "compressed-tensors", "tensor", max_shard_size="100KB"))


def test_srun_two_tasks_end_complete(job_env, llama, tmp_path):
    src, reference = llama
    out = tmp_path / "out"
    slurm(
        job_env,
        tmp_path,
        "srun",
        "-n",
        "2",
        "--cpus-per-task=1",
        "--mem=1G",
        "--output=task-%t.json",
        "--error=task-%t.log",
        "fp8convert",
        "quantize",
        src,
        out,
        *ARGS,
        "--json",
        timeout=JOB_TIMEOUT,
    )
    assert tree_bytes(out) == reference
    assert_clean_logs(sorted(tmp_path.glob("task-*.log")))
    reports = [json.loads((tmp_path / f"task-{k}.json").read_text()) for k in range(2)]
    assert [r["worker"] for r in reports] == ["0/2", "1/2"]  # srun's tasks split the work
    assert sum(r["shards_written"] for r in reports) == 6 and any(r["complete"] for r in reports)


def test_array_script_runs_one_job_per_task(job_env, source_model, converted, tmp_path):
    """scripts/slurm_array.sbatch: task i converts job i of the jobs file; its JSON summary beside its log."""
    jobs = {"llama": ("tensor", tmp_path / "llama-fp8"), "qwen3": ("channel", tmp_path / "qwen3-fp8")}
    tables = "".join(
        f'[[job]]\nsource = "{source_model(kind)}"\nout = "{out}"\nscheme = "{scheme}"\n\n'
        for kind, (scheme, out) in jobs.items()
    )
    jobs_file = tmp_path / "jobs.toml"
    jobs_file.write_text(f'[defaults]\ndevice = "cpu"\nmax_shard_size = "100KB"\n\n{tables}')
    array = submit(job_env, tmp_path, "--array=0-1", *SMALL, SCRIPTS / "slurm_array.sbatch", jobs_file)
    assert wait_completed(job_env, array, tmp_path) == {f"{array}_0", f"{array}_1"}
    assert_clean_logs(sorted(tmp_path.glob(f"fp8convert-{array}_*.log")))
    for task, (kind, (scheme, out)) in enumerate(jobs.items()):
        reference = converted(kind, "compressed-tensors", scheme, max_shard_size="100KB")
        assert tree_bytes(out) == tree_bytes(reference), kind
        summary = json.loads((tmp_path / f"fp8convert-{array}_{task}.json").read_text())
        assert (summary["done"], summary["failed"], len(summary["jobs"])) == (1, 0, 1), summary
        job = summary["jobs"][0]
        assert (job["index"], job["status"], job["out"], job["report"]["scheme"]) == (task, "done", str(out), scheme)


def quantize_array(env, cwd, src, out, command: list[str], args: list[str]) -> str:
    """An array of 3 tasks splitting one model with --worker auto (the header of slurm_finalize.sbatch)."""
    wrap = shlex.join([*map(str, command), "quantize", str(src), str(out), *args, "--worker", "auto"])
    return submit(env, cwd, "--array=0-2", *SMALL, "--output=worker-%A_%a.log", "--wrap", wrap)


def finalize_after(env, cwd, array: str, out: Path) -> str:
    """scripts/slurm_finalize.sbatch OUT, submitted while `array` runs, to start once it has succeeded.
    Waits for both (the array first: where it fails, the finalize would wait forever); the finalize's id."""
    final = submit(
        env,
        cwd,
        f"--dependency=afterok:{array}",
        "--cpus-per-task=1",
        "--mem=1G",
        SCRIPTS / "slurm_finalize.sbatch",
        out,
    )
    assert len(wait_completed(env, array, cwd)) == 3
    assert wait_completed(env, final, cwd) == {final}
    return final


def test_worker_array_then_dependent_finalize(job_env, llama, tmp_path):
    src, reference = llama
    out = tmp_path / "out"
    array = quantize_array(job_env, tmp_path, src, out, ["fp8convert"], ARGS)
    final = finalize_after(job_env, tmp_path, array, out)
    assert tree_bytes(out) == reference
    assert_clean_logs(sorted(tmp_path.glob("*.log")))
    for task in range(3):  # --worker auto read the array: task K is worker K of 3
        assert f"worker {task}/3 (slurm-array)" in (tmp_path / f"worker-{array}_{task}.log").read_text()
    assert "finalized" in (tmp_path / f"fp8convert-finalize-{final}.log").read_text()


def test_cancelled_array_task_resubmitted_ends_identical(job_env, tmp_path):
    """Task 1 cancelled (scancel) while writing its shards; the same array submitted again does what is
    missing and the output is the bytes of one process."""
    src = write_checkpoint(tmp_path / "src", llama_tensors(layers=6))
    args = ["--device", "cpu", "--max-shard-size", "20KB", "--max-resident", "10KB"]  # 20 shards
    fp8convert.quantize(str(src), str(tmp_path / "ref"), device="cpu", max_shard_size="20KB", max_resident="10KB")
    reference = tree_bytes(tmp_path / "ref")
    out = tmp_path / "out"
    slow = tmp_path / "slow_fp8convert.py"  # every tensor write 0.1 s late: each task runs for seconds
    slow.write_text(SLOW_CLI)
    array = quantize_array(job_env, tmp_path, src, out, [sys.executable, slow, "0.1"], args)
    task = f"{array}_1"

    def shards_of_task_1() -> list[Path]:  # worker 1 of 3 owns model-00002, -00005, ... (7 of 20)
        return [p for p in out.glob("model-*-of-00020.safetensors") if int(p.name[6:11]) % 3 == 2]

    state = wait_for(job_env, task, until=shards_of_task_1).get(task)
    assert state == "RUNNING", f"task 1 ended ({state}) before it was cancelled"
    slurm(job_env, None, "scancel", task)
    assert wait_for(job_env, array) == {f"{array}_0": "COMPLETED", task: "CANCELLED", f"{array}_2": "COMPLETED"}
    assert 1 <= len(shards_of_task_1()) < 7 and not looks_complete(out)  # cancelled mid-run
    written = {p.name: p.stat().st_mtime_ns for p in out.glob("model-*.safetensors")}
    killed_log = (tmp_path / f"worker-{task}.log").read_text()
    assert "terminated (SIGTERM)" in killed_log and "Traceback" not in killed_log, killed_log[-3000:]
    for log in tmp_path.glob("worker-*.log"):
        log.rename(log.with_suffix(".first"))

    again = quantize_array(job_env, tmp_path, src, out, ["fp8convert"], args)
    finalize_after(job_env, tmp_path, again, out)
    assert tree_bytes(out) == reference
    assert {name: (out / name).stat().st_mtime_ns for name in written} == written  # only the rest was written
    assert_clean_logs(sorted(tmp_path.glob("*.log")))


def test_torchrun_script_two_cpu_ranks(job_env, llama, tmp_path):
    """scripts/slurm_torchrun.sbatch on one node, two ranks on CPU (NPROC_PER_NODE)."""
    src, reference = llama
    out = tmp_path / "out"
    env = dict(job_env, NPROC_PER_NODE="2")
    job = submit(
        env,
        tmp_path,
        "--nodes=1",
        "--gpus-per-node=0",
        "--cpus-per-task=2",
        "--mem=2G",
        SCRIPTS / "slurm_torchrun.sbatch",
        src,
        out,
        *ARGS,
    )
    assert wait_completed(env, job, tmp_path) == {job}
    assert tree_bytes(out) == reference
    log = tmp_path / f"fp8convert-{job}.log"
    assert_clean_logs([log])
    assert "worker 0/2 (torchrun)" in log.read_text() and "worker 1/2 (torchrun)" in log.read_text()
