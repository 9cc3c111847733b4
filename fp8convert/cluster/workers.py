"""Splitting one conversion over several processes: which worker am I, which shards are mine, who finalizes;
with --devices, one spawned worker process per device of this machine splits this worker's shards.

Every worker computes the same plan; worker K of N writes the shards with index % N == K. Workers share
nothing but OUT: a shard gets its final name only once complete, so whoever finds every shard there can
finalize, and finalizing twice writes the same bytes. torchrun and multi-task srun are detected always
(N copies of one command would collide), Slurm arrays and Kubernetes indexed Jobs only with --worker auto
(an array also runs different models: batch)."""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from ..errors import FP8ConvertError, UsageError
from ..options import Settings, env_number
from ..output.finalize import finalize, finished_shards
from ..output.manifest import WORK_DIR
from ..plan.plan import Plan
from ..run.progress import log
from ..units import plural

BARRIER_TIMEOUT_S = 24 * 3600  # a rank may wait that long for the slowest one before rank 0 finalizes
CLAIM = "finalize.claim"  # in OUT/.fp8convert: the worker finalizing now (workers without a barrier)
STALE_CLAIM_S = 600  # a claim older than this was left by a worker that died while finalizing


@dataclass(frozen=True)
class WorkerSpec:
    """This process's share of a conversion: worker `index` of `count`."""

    index: int = 0
    count: int = 1
    launcher: str = "single"  # single, explicit, torchrun, slurm, slurm-array, k8s
    local_rank: int | None = None  # picks the GPU when the launcher starts one process per GPU
    # The workers sharing this machine's memory and cores, where the launcher says (torchrun's processes
    # per node, srun's tasks per node; 1 for an array task or a pod). None: all of them.
    on_this_machine: int | None = None

    @property
    def text(self) -> str:
        return f"{self.index}/{self.count}"

    @property
    def sharing(self) -> int:
        """The workers on this machine, this one included: what the prefetch window is divided by."""
        return min(self.on_this_machine or self.count, self.count)

    def owned(self, shard_count: int) -> set[int]:
        return {i for i in range(shard_count) if i % self.count == self.index}

    def split(self, parts: int, part: int) -> WorkerSpec:
        """Sub-worker `part` of `parts` within this worker's share (--devices): shard i with i % N == K
        goes to sub-worker (i // N) % parts, i.e. i % (N * parts) == K + N * part. The sub-workers own
        exactly this worker's shards, however many devices other workers split theirs over."""
        here = self.on_this_machine * parts if self.on_this_machine else None  # the sub-workers run here
        return WorkerSpec(self.index + self.count * part, self.count * parts, "explicit", on_this_machine=here)


def _checked(
    index: int, count: int, launcher: str, where: str, local_rank: int | None = None, on_this_machine: int | None = None
) -> WorkerSpec:
    if count < 1 or not 0 <= index < count:
        raise FP8ConvertError(f"{where}: worker {index} of {count} is not a valid split (need 0 <= K < N)")
    if count == 1:
        return WorkerSpec(index, count, "single", local_rank)
    return WorkerSpec(index, count, launcher, local_rank, on_this_machine)


def tasks_per_node(env) -> int | None:
    """The most tasks of this srun step on any one node, from $SLURM_STEP_TASKS_PER_NODE (else
    $SLURM_TASKS_PER_NODE), written like '8(x4)' or '2(x3),1'; None where neither can be read."""
    for name in ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        counts = [re.fullmatch(r"(\d+)(\(x\d+\))?", part.strip()) for part in env.get(name, "").split(",")]
        if all(counts):
            return max(int(match.group(1)) for match in counts)
    return None


def detect_worker(env=None, opt_in: bool = False) -> WorkerSpec | None:
    """The launcher's split, from environment variables; None when none is found. With `opt_in`
    (--worker auto) also a Slurm array task or a Kubernetes indexed Job."""
    env = os.environ if env is None else env
    if env.get("RANK") and env.get("WORLD_SIZE"):
        local, per_node = env_number(env, "LOCAL_RANK"), env_number(env, "LOCAL_WORLD_SIZE")
        rank, size = env_number(env, "RANK"), env_number(env, "WORLD_SIZE")
        return _checked(rank, size, "torchrun", "torchrun ($RANK/$WORLD_SIZE)", local, per_node)
    tasks_var = "SLURM_STEP_NUM_TASKS" if env.get("SLURM_STEP_NUM_TASKS") else "SLURM_NTASKS"
    tasks = env_number(env, tasks_var, 0) if env.get("SLURM_PROCID") else 0
    if tasks > 1:
        local, procid = env_number(env, "SLURM_LOCALID"), env_number(env, "SLURM_PROCID")
        return _checked(procid, tasks, "slurm", f"srun ($SLURM_PROCID/${tasks_var})", local, tasks_per_node(env))
    if not opt_in:
        return None
    if env.get("SLURM_ARRAY_TASK_ID"):
        if not env.get("SLURM_ARRAY_TASK_COUNT"):
            raise FP8ConvertError("Slurm array: $SLURM_ARRAY_TASK_COUNT is not set; pass --worker K/N")
        step, first = env_number(env, "SLURM_ARRAY_TASK_STEP", 1), env_number(env, "SLURM_ARRAY_TASK_MIN", 0)
        offset = env_number(env, "SLURM_ARRAY_TASK_ID") - first
        if step < 1 or offset % step:
            raise FP8ConvertError(
                f"Slurm array: task {env['SLURM_ARRAY_TASK_ID']} is not on the array's grid; pass --worker K/N"
            )
        index, count, launcher = offset // step, env_number(env, "SLURM_ARRAY_TASK_COUNT"), "slurm-array"
        where = "Slurm array ($SLURM_ARRAY_TASK_ID - $SLURM_ARRAY_TASK_MIN of $SLURM_ARRAY_TASK_COUNT)"
    elif env.get("JOB_COMPLETION_INDEX"):
        if not env.get("JOB_COMPLETIONS"):
            raise FP8ConvertError(
                "Kubernetes indexed Job: set JOB_COMPLETIONS in the pod's env to the Job's "
                "completions, or pass --worker $JOB_COMPLETION_INDEX/N"
            )
        index, count, launcher = env_number(env, "JOB_COMPLETION_INDEX"), env_number(env, "JOB_COMPLETIONS"), "k8s"
        where = "Kubernetes indexed Job ($JOB_COMPLETION_INDEX of $JOB_COMPLETIONS)"
    else:
        raise FP8ConvertError(
            "--worker auto: no launcher found (torchrun, srun with several tasks, a Slurm array "
            "or a Kubernetes indexed Job); pass --worker K/N"
        )
    return _checked(index, count, launcher, where, on_this_machine=1)  # each task is an allocation of its own


def resolve_worker(worker: str | tuple[int, int] | WorkerSpec | None) -> WorkerSpec:
    """None: detect torchrun / multi-task srun, else one worker; 'auto': any launcher; 'K/N' or (K, N)."""
    if isinstance(worker, WorkerSpec):
        return worker
    if worker is None:
        return detect_worker() or WorkerSpec()
    if isinstance(worker, tuple):
        return _checked(worker[0], worker[1], "explicit", f"--worker {worker[0]}/{worker[1]}")
    if str(worker).strip().lower() == "auto":
        return detect_worker(opt_in=True)
    try:
        index, count = (int(p) for p in str(worker).strip().split("/"))
    except ValueError:
        raise UsageError(f"--worker {worker!r}: expected K/N (worker K of N, counting from 0), or auto") from None
    try:
        return _checked(index, count, "explicit", f"--worker {worker}")
    except FP8ConvertError as e:  # the split itself is what the command line says
        raise UsageError(str(e)) from None


def device_for(spec: WorkerSpec, device: str) -> str:
    """One process per GPU (torchrun, srun --gpus-per-task...): 'auto'/'cuda' becomes cuda:LOCAL_RANK."""
    if spec.local_rank is None or device not in ("auto", "cuda"):
        return device
    from ..run.warmup import cuda_device_count

    count = cuda_device_count()
    if not count:
        return "cpu" if device == "auto" else device
    return f"cuda:{spec.local_rank % count}"


def parse_devices(devices: str | list[str] | tuple[str, ...]) -> list[str]:
    """'cuda:0,cuda:1' / ['cuda:0', 'cuda:1'] / 'all' (every CUDA device); 'cpu' entries too (several CPU
    workers, mostly for tests). Bare 'cuda' is refused: say which GPU."""
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    items = [d.strip() for d in items if d.strip()]
    if items == ["all"]:
        from ..run.warmup import cuda_device_count

        count = cuda_device_count()
        if not count:
            raise FP8ConvertError("--devices all: no CUDA device on this machine")
        return [f"cuda:{i}" for i in range(count)]
    if not items:
        raise UsageError("--devices: empty list (examples: cuda:0,cuda:1 or all)")
    for d in items:
        kind, _, number = d.partition(":")
        if not (d == "cpu" or (kind == "cuda" and number.isdigit())):
            raise UsageError(f"--devices {d!r}: expected cuda:N (or cpu), or all")
    return items


def split_settings(settings: Settings) -> tuple[Settings, list[str] | None]:
    """`settings` and the devices its --devices names, checked here; None for no split (one becomes --device)."""
    if not settings.devices:
        return settings, None
    devices = parse_devices(settings.devices)
    if settings.device != "auto":
        raise UsageError(f"--device {settings.device} and --devices {','.join(devices)}: give only one of them")
    from ..run.device import resolve_device

    for d in devices:  # a GPU this machine lacks fails now, named as --devices, not later as --device
        resolve_device(d, "--devices")
    if len(devices) == 1:  # no child process needed
        return replace(settings, device=devices[0], devices=None), None
    return settings, devices


def run_on_devices(target: Callable, src: str, out: str, settings: Settings, spec: WorkerSpec, devices: list) -> list:
    """target(src, out, settings) in one spawned process per device (so importable by name): their Reports.
    A child gets the parent's Settings whole, with only its device and worker slot changed, so every option
    reaches it by construction. Children never finalize (the parent does once they all succeeded), and get
    no --overwrite: the parent has already replaced OUT, and a worker of several may not."""
    children = [
        replace(settings, device=d, devices=None, worker=spec.split(len(devices), i), finalize=False, overwrite=False)
        for i, d in enumerate(devices)
    ]
    ctx = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    with ProcessPoolExecutor(len(children), mp_context=ctx) as pool:
        jobs = [(child.device, pool.submit(target, src, out, child)) for child in children]
        reports, errors = [], []
        try:
            for device, job in jobs:
                try:
                    reports.append(job.result())
                except FP8ConvertError as e:
                    errors.append(f"worker on {device}: {e}")
                except Exception as e:  # a crashed child (BrokenProcessPool) or an unexpected error
                    errors.append(f"worker on {device}: {type(e).__name__}: {e}")
        except BaseException:  # Ctrl-C or SIGTERM: leaving the pool would wait for the workers to finish
            # SIGTERM the workers now (what they wrote stays resumable): a SIGTERM sent to this process
            # alone (Kubernetes signals only PID 1) would not reach them. The pool has no public way to.
            for process in list((getattr(pool, "_processes", None) or {}).values()):
                process.terminate()
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    if errors:
        more = f" (and {plural(len(errors) - 1, 'more worker')} failed)" if len(errors) > 1 else ""
        raise FP8ConvertError(errors[0] + more)
    return reports


def barrier() -> None:
    """Wait until every torchrun rank is here, in a gloo group of our own when the program has none
    (with a long timeout: ranks finish their shards at different times)."""
    from datetime import timedelta

    import torch.distributed as dist

    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=timedelta(seconds=BARRIER_TIMEOUT_S))
    try:
        dist.barrier()
    finally:
        if created:
            dist.destroy_process_group()


def claim_finalize(out_dir: Path) -> bool:
    """Become the one worker that finalizes now (a claim file naming host and pid); False while another holds
    it. A claim left by a dead worker (its pid gone on this host, or older than STALE_CLAIM_S) is taken over."""
    path = Path(out_dir) / WORK_DIR / CLAIM
    for _ in range(2):
        try:
            with open(path, "x") as f:
                f.write(f"{os.uname().nodename} {os.getpid()}\n")
            return True
        except FileExistsError:
            try:
                age = time.time() - path.stat().st_mtime
                holder = path.read_text().split()
            except FileNotFoundError:
                continue  # released just now: try again
            if age < STALE_CLAIM_S and not _dead_here(holder):
                return False
            path.unlink(missing_ok=True)
    return False


def _dead_here(holder: list[str]) -> bool:
    """The claim's holder ran on this host and its process is gone."""
    if len(holder) != 2 or holder[0] != os.uname().nodename or not holder[1].isdigit():
        return False
    try:
        os.kill(int(holder[1]), 0)
        return False
    except OSError as e:
        return isinstance(e, ProcessLookupError)


def release_finalize(out_dir: Path) -> None:
    (Path(out_dir) / WORK_DIR / CLAIM).unlink(missing_ok=True)


def finalize_share(plan: Plan, out_dir: Path, spec: WorkerSpec, progress: bool) -> bool:
    """Finalize when this worker may: alone, as torchrun's rank 0 after the barrier, or as the worker that
    finds every shard present and takes the claim. Whether OUT is complete."""
    if spec.count == 1:
        finalize(plan, out_dir)
        return True
    if spec.launcher == "torchrun":
        log(f"worker {spec.text}: shards written; waiting for the other ranks", progress)
        barrier()
        if spec.index == 0:
            finalize(plan, out_dir)
        return spec.index == 0
    present = finished_shards(plan, out_dir)
    if len(present) < len(plan.shards):
        log(
            f"worker {spec.text}: shards written; {len(present)} of {len(plan.shards)} shards present. "
            f"The last worker to finish finalizes, or run: fp8convert finalize {out_dir}",
            progress,
        )
        return False
    if not claim_finalize(out_dir):
        log(f"worker {spec.text}: every shard present; another worker is finalizing {out_dir}", progress)
        return False
    try:
        finalize(plan, out_dir)
    finally:
        release_finalize(out_dir)
    return True
