#!/usr/bin/env python3
"""Benchmark fp8convert against the I/O floor, llm-compressor's model_free_ptq and the naive script.

One command for the GPU box (see scripts/README.md). For each checkpoint asked for it:
  1. builds it with scripts/anchor/make_ckpt.py (fp8convert.demo for `tiny`); removes it after use (small disks)
     unless --keep-ckpts, and reuses one a previous call kept;
  2. measures the I/O floor: fastest cold read of the inputs (1/4/16 threads of 16 MB preads) plus the
     fastest fsync'd write of the expected output size (1/4 threads);
  3. drops the page cache and runs each contender as a child process (fp8convert twice: a first run with
     no record of torch's start-up pages in its cache, WORK/cache, then a run with the one it wrote): wall
     time (start-up included), the time the tool itself reports, the time a `sync` takes afterwards
     (outputs not fsync'd by the tool), peak RSS of the process tree, peak GPU memory (self-reported and from NVML);
  4. optionally reads it cold with other loaders (--loaders), and checks that fp8convert's CPU and CUDA
     outputs are byte-identical (--check-identical).
With --dequantize, each checkpoint is first converted to native fp8 with 128x128 blocks (DeepSeek-V3's
layout, by fp8convert itself; kept beside it) and the contenders are `fp8convert dequantize` and the
naive whole-shard dequantizer written after DeepSeek's fp8_cast_bf16.py (anchor/naive_dequant.py).
Prints Markdown tables; writes OUT/bench.log (every child's output tail) and OUT/results.json (rewritten
after every step, so a run cut short still leaves its results).

Standard library only; the children use the machine's torch and safetensors, plus wheels from .whl/
(llm-compressor, into /tmp/site) and .whl-loaders/ (into /tmp/site-loaders), each put on PYTHONPATH of
its own children only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "scripts" / "anchor"  # checkpoint builder and the two comparison converters
PY = sys.executable
GiB = 2**30
CHUNK = 16 << 20
DEADLINE = float("inf")  # time.monotonic() by which the tables must be printed (--budget)
RESERVE = 25.0  # seconds kept for cleanup and printing

# name -> (make_ckpt kind, layers); `tiny` is fp8convert.demo's ~6 MB Llama, for trying this script anywhere
CKPTS = {
    "tiny": ("demo", 0),
    "dense2": ("dense", 2),
    "dense16": ("dense", 16),
    "dense32": ("dense", 32),
    "moe2": ("moe", 2),
    "moe8": ("moe", 8),
    "moe16": ("moe", 16),
}
DOUBLES = {"moe8": "moe16", "dense16": "dense32"}
LOADERS = ["plain-read", "safetensors", "fp8convert-reader", "runai-streamer", "fastsafetensors", "fastsafetensors-gds"]


# ----------------------------------------------------------------------------------------------- output


class Log:
    """Everything goes to OUT/bench.log; only progress lines and tables go to stdout too."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(path, "w", buffering=1)

    def say(self, text: str = "") -> None:
        print(text, flush=True)
        self.f.write(text + "\n")

    def quiet(self, text: str) -> None:
        self.f.write(text + "\n")


def save_json(path: Path, data) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str))
    os.replace(tmp, path)


def tail_text(path: Path, lines: int = 150) -> str:
    """Last lines of a child's output; progress bars' carriage returns count as line breaks."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    parts = [p for p in re.split(r"[\r\n]+", text) if p.strip()]
    skipped = f"[... {len(parts) - lines} lines left out ...]\n" if len(parts) > lines else ""
    return skipped + "\n".join(parts[-lines:])


def fmt(x, digits: int = 1, none: str = "-") -> str:
    return none if x is None else f"{x:.{digits}f}"


# -------------------------------------------------------------------------------- machine and page cache


def sh(cmd: str) -> str:
    r = subprocess.run(cmd, shell=True, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip()


def drop_caches(enabled: bool) -> bool | None:
    """sync, then drop the page cache. None when not asked to, False when it failed (not root, gVisor)."""
    if not enabled:
        return None
    r = subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, capture_output=True)
    return r.returncode == 0


def environment() -> dict:
    torch_info = sh(
        f"{PY} -c \"import torch, safetensors; print('torch', torch.__version__, 'cuda', "
        f"torch.version.cuda, 'available', torch.cuda.is_available(), 'safetensors', safetensors.__version__)\""
    )
    return {
        "python": sys.version.split()[0],
        "executable": PY,
        "torch": torch_info,
        "gpu": sh("nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null"),
        "cpus": os.cpu_count(),
        "kernel": os.uname().release,
        "memory": sh("free -g | head -2"),
        "git": sh(f"git -C {REPO} log -1 --format='%h %s' 2>/dev/null"),
        "git_status": sh(f"git -C {REPO} status --short 2>/dev/null"),
    }


class GpuMemory:
    """Device memory in use on GPU 0, from NVML (no CUDA context in this process) or nvidia-smi."""

    def __init__(self):
        self.nvml = None
        self.smi = shutil.which("nvidia-smi")
        try:
            import pynvml

            pynvml.nvmlInit()
            self.nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(0))
        except Exception:
            pass
        self.available = self.nvml is not None or (self.smi is not None and self.used() is not None)

    def used(self) -> int | None:
        if self.nvml:
            pynvml, handle = self.nvml
            return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        if self.smi:
            r = subprocess.run(
                [self.smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True,
                text=True,
            )
            try:
                return int(r.stdout.strip().splitlines()[0]) << 20
            except (ValueError, IndexError):
                return None
        return None


def process_tree(root: int) -> list[int]:
    """root and its descendants: same session (children start in a new one) or parent chain."""
    parent, session = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(entry)], session[int(entry)] = int(fields[1]), int(fields[3])
        except (OSError, IndexError, ValueError):
            continue
    tree = {p for p, s in session.items() if s == root} | {root}
    grew = True
    while grew:
        more = {p for p, pp in parent.items() if pp in tree} - tree
        tree |= more
        grew = bool(more)
    return sorted(tree)


def rss_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of one process in KiB."""
    rss = hwm = 0
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1])
                elif line.startswith("VmHWM:"):
                    hwm = int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return rss, hwm


class Sampler(threading.Thread):
    """Peak RSS of a process tree (sum of VmRSS; also the largest single VmHWM) and peak GPU memory."""

    def __init__(self, pid: int, gpu: GpuMemory | None, interval: float = 0.1):
        super().__init__(daemon=True)
        self.pid, self.gpu, self.interval = pid, gpu, interval
        self.stop = threading.Event()
        self.tree_peak_kib = self.hwm_peak_kib = 0
        self.gpu_base = gpu.used() if gpu and gpu.available else None
        self.gpu_peak = self.gpu_base

    def run(self) -> None:
        last_gpu = 0.0
        while not self.stop.is_set():
            total = 0
            for p in process_tree(self.pid):
                rss, hwm = rss_kib(p)
                total += rss
                self.hwm_peak_kib = max(self.hwm_peak_kib, hwm)
            self.tree_peak_kib = max(self.tree_peak_kib, total)
            now = time.monotonic()
            if self.gpu_base is not None and (self.gpu.nvml or now - last_gpu > 0.25):
                used = self.gpu.used()
                if used is not None:
                    self.gpu_peak = max(self.gpu_peak, used)
                last_gpu = now
            self.stop.wait(self.interval)


def run_measured(
    label: str, cmd: list[str], env: dict, logs: Path, log: Log, gpu: GpuMemory | None, timeout: float
) -> dict:
    """Run cmd as a child in its own session; wall time, exit code, peak RSS, GPU memory, output tails."""
    logs.mkdir(parents=True, exist_ok=True)
    out_path, err_path = logs / f"{label}.stdout", logs / f"{label}.stderr"
    log.quiet(f"\n$ {shlex.join(cmd)}")
    with open(out_path, "w") as out, open(err_path, "w") as err:
        start = time.monotonic()
        child = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=REPO, start_new_session=True)
        sampler = Sampler(child.pid, gpu)
        sampler.start()
        timed_out = threading.Event()

        def kill():
            timed_out.set()
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

        timer = threading.Timer(max(1.0, min(timeout, time_left())), kill)
        timer.start()
        _, status, usage = os.wait4(child.pid, 0)  # usage.ru_maxrss: largest process of the tree, KiB
        wall = time.monotonic() - start
        child.returncode = os.waitstatus_to_exitcode(status)
        timer.cancel()
        sampler.stop.set()
        sampler.join()
    rss_peak = max(sampler.tree_peak_kib, sampler.hwm_peak_kib, usage.ru_maxrss) * 1024
    result = {
        "label": label,
        "cmd": cmd,
        "rc": child.returncode,
        "timed_out": timed_out.is_set(),
        "wall_s": wall,
        "rss_peak_gib": rss_peak / GiB,
        "rss_tree_sampled_gib": sampler.tree_peak_kib * 1024 / GiB,
        "rss_largest_process_gib": max(sampler.hwm_peak_kib, usage.ru_maxrss) * 1024 / GiB,
        "gpu_used_nvml_gib": None if sampler.gpu_base is None else (sampler.gpu_peak - sampler.gpu_base) / GiB,
    }
    stdout = out_path.read_text(errors="replace")
    for name, path in (("stdout", out_path), ("stderr", err_path)):
        text = tail_text(path)
        if text:
            log.quiet(f"--- {label} {name} (tail)\n{text}")
    log.quiet(
        f"--- {label}: rc={result['rc']} wall={wall:.1f}s rss={result['rss_peak_gib']:.2f}GiB"
        f"{' TIMED OUT' if result['timed_out'] else ''}"
    )
    result["stdout"] = stdout
    result["stderr_tail"] = tail_text(err_path, 15)
    return result


def time_left() -> float:
    return DEADLINE - RESERVE - time.monotonic()


def out_of_time(log: Log, what: str) -> bool:
    if time_left() > 5:
        return False
    log.say(f"  skipping {what}: --budget spent")
    return True


def child_env(pythonpath: list[Path | str] | None = None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONUNBUFFERED"] = "1"
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(str(p) for p in pythonpath)
    return env


def fp8convert_env(args) -> dict:
    """fp8convert's children keep their record of torch's start-up pages in a cache of the bench's own
    (not the user's), which the first-run contender empties first."""
    return dict(child_env([REPO]), XDG_CACHE_HOME=str(args.work / "cache"))


def install_wheels(wheel_dir: Path, target: Path, log: Log) -> bool:
    """pip install --target, once per set of wheels (a stamp file remembers which)."""
    wheels = sorted(wheel_dir.glob("*.whl")) if wheel_dir.is_dir() else []
    if not wheels:
        log.say(f"no wheels in {wheel_dir}")
        return False
    stamp = target / ".bench-wheels"
    names = "\n".join(w.name for w in wheels)
    if stamp.exists() and stamp.read_text() == names:
        return True
    r = subprocess.run(
        [
            PY,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--no-deps",
            "--no-compile",
            "--no-cache-dir",
            "--upgrade",
            "--target",
            str(target),
            *map(str, wheels),
        ],
        capture_output=True,
        text=True,
    )
    log.quiet(f"pip install --target {target}: rc={r.returncode}\n{r.stdout}{r.stderr}")
    if r.returncode != 0:
        log.say(f"installing {wheel_dir} into {target} failed (see bench.log)")
        return False
    stamp.write_text(names)
    return True


# ---------------------------------------------------------------------------------------------- checkpoints


def ckpt_dir(work: Path, name: str, shard_gb: float) -> Path:
    return work / ("ckpt-tiny" if name == "tiny" else f"ckpt-{name}-{shard_gb:g}gb")


def build_checkpoint(
    name: str, shard_gb: float, work: Path, log: Log, gpu: GpuMemory | None
) -> tuple[Path, float | None]:
    """Build (or reuse) a checkpoint. Returns its path and build seconds (None when reused)."""
    path = ckpt_dir(work, name, shard_gb)
    kind, layers = CKPTS[name]
    spec = {"name": name, "kind": kind, "layers": layers, "shard_gb": shard_gb if name != "tiny" else None}
    marker = path / ".bench-spec.json"
    if marker.exists() and json.loads(marker.read_text()) == spec:
        log.say(f"reusing {path}")
        return path, None
    shutil.rmtree(path, ignore_errors=True)
    check_space(work, name, log)
    if name == "tiny":
        cmd = [PY, "-c", f"from fp8convert.demo import make_demo_model; make_demo_model({str(path)!r})"]
        env = child_env([REPO])
    else:
        cmd = [
            PY,
            str(BENCH / "make_ckpt.py"),
            str(path),
            "--kind",
            kind,
            "--layers",
            str(layers),
            "--shard-gb",
            str(shard_gb),
        ]
        env = child_env()
    log.say(f"building {path.name} ...")
    r = run_measured(f"make-{path.name}", cmd, env, work / "logs", log, gpu, timeout=900)
    if r["rc"] != 0:
        raise SystemExit(f"building {name} failed:\n{r['stderr_tail']}")
    marker.write_text(json.dumps(spec))
    return path, r["wall_s"]


def safetensors_header(path: Path) -> dict:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n))


# Output bytes per quantized value, and per weight, by scheme (estimate: FP8 one byte a value and a
# float32 scale; FP4 half a byte, an e4m3 scale per 16 or an E8M0 byte per 32, NVFP4's float32 global).
BYTES_PER_VALUE = {"nvfp4a16": 0.5 + 1 / 16, "mxfp4a16": 0.5 + 1 / 32}


def describe_checkpoint(path: Path, scheme: str = "tensor", rules: list[str] | None = None) -> dict:
    """Files, bytes and tensors, and the output size a conversion to `scheme` will write (estimate:
    2D *_proj.weight tensors become BYTES_PER_VALUE a value plus a float32 scale, in the scheme of the
    first `re:PATTERN=SCHEME` rule matching their module, else `scheme`; everything else is copied), or
    for an FP8 checkpoint the size of its BF16 dequantization (2 bytes a code, no scales)."""
    parsed = [rule.rpartition("=")[::2] for rule in rules or []]

    def scheme_of(name: str) -> str:
        module = name.removesuffix(".weight")
        return next((s for p, s in parsed if re.fullmatch(p.removeprefix("re:"), module)), scheme)

    files = sorted(path.glob("*.safetensors"))
    tensors, out_bytes = 0, 0
    for f in files:
        for name, info in safetensors_header(f).items():
            if name == "__metadata__":
                continue
            tensors += 1
            nbytes = info["data_offsets"][1] - info["data_offsets"][0]
            numel = 1
            for d in info["shape"]:
                numel *= d
            if info["dtype"] == "F8_E4M3":
                out_bytes += 2 * numel
            elif name.endswith("_scale_inv"):
                continue
            else:
                quantized = name.endswith("proj.weight") and len(info["shape"]) == 2
                out_bytes += int(numel * BYTES_PER_VALUE.get(scheme_of(name), 1)) + 4 if quantized else nbytes
    return {
        "files": [f.name for f in files],
        "bytes_in": sum(f.stat().st_size for f in files),
        "tensors": tensors,
        "bytes_out_estimate": out_bytes,
    }


def fp8_dir(path: Path) -> Path:
    return path.with_name(path.name + "-fp8block")


def build_fp8_copy(src: Path, device: str, log: Log, gpu: GpuMemory | None, work: Path) -> Path:
    """The native fp8 block copy of `src` (the DeepSeek-V3 layout) that --dequantize reads, made once."""
    path = fp8_dir(src)
    marker = path / ".bench-spec.json"
    spec = {"from": src.name, "format": "fp8", "scheme": "block"}
    if marker.exists() and json.loads(marker.read_text()) == spec:
        log.say(f"reusing {path}")
        return path
    shutil.rmtree(path, ignore_errors=True)
    log.say(f"building {path.name} (fp8convert quantize --format fp8 --scheme block) ...")
    cmd = fp8convert_cmd() + [
        "quantize",
        str(src),
        str(path),
        "--format",
        "fp8",
        "--scheme",
        "block",
        "--device",
        "cuda" if device in ("cuda", "both") else "cpu",
        "--max-shard-size",
        "2GB",
        "-q",
    ]
    r = run_measured(f"make-{path.name}", cmd, child_env([REPO]), work / "logs", log, gpu, timeout=900)
    if r["rc"] != 0:
        raise SystemExit(f"building {path.name} failed:\n{r['stderr_tail']}")
    marker.write_text(json.dumps(spec))
    return path


def prune_checkpoints(work: Path, keep: set[Path], log: Log) -> None:
    """The box's disk is 64 GiB: drop checkpoints of earlier calls that this call does not use."""
    for d in work.glob("ckpt-*"):
        if d not in keep and d.is_dir():
            log.say(f"removing unused {d}")
            shutil.rmtree(d, ignore_errors=True)


def expected_bytes(name: str) -> int:
    """Size make_ckpt.py will write (BF16), from its shapes; for the free-space check."""
    kind, layers = CKPTS[name]
    if kind == "dense":
        H, I, V, q, kv = 4096, 14336, 128256, 32 * 128, 8 * 128
        layer = H * q * 2 + H * kv * 2 + 3 * H * I + 2 * H
    elif kind == "moe":
        H, I, V, q, kv, E = 2048, 768, 151936, 32 * 128, 4 * 128, 128
        layer = H * q * 2 + H * kv * 2 + E * H + E * 3 * H * I + 2 * H + 2 * 128
    else:
        return 6 << 20
    return 2 * (2 * V * H + H + layers * layer)


def check_space(work: Path, name: str, log: Log) -> None:
    """Input + one output (about half) + slack must fit on the disk."""
    need = int(expected_bytes(name) * 1.6)
    free = shutil.disk_usage(work).free
    if free < need:
        log.say(
            f"WARNING: {work} has {free / 1e9:.1f} GB free; {name} needs about {need / 1e9:.1f} GB "
            "(checkpoint + one output)"
        )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


# ----------------------------------------------------------------------------------------------- I/O floor


def read_files(files: list[Path], threads: int) -> float:
    """Read every byte with `threads` threads of 16 MB preads (as io_limit.py). Returns seconds."""
    jobs = iter([(f, off) for f in files for off in range(0, f.stat().st_size, CHUNK)])
    lock = threading.Lock()

    def work():
        mv = memoryview(bytearray(CHUNK))
        fds = {}
        while True:
            with lock:
                job = next(jobs, None)
            if job is None:
                break
            f, off = job
            if f not in fds:
                fds[f] = os.open(f, os.O_RDONLY)
            os.preadv(fds[f], [mv], off)
        for fd in fds.values():
            os.close(fd)

    workers = [threading.Thread(target=work) for _ in range(threads)]
    start = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return time.monotonic() - start


def write_fsync(directory: Path, nbytes: int, threads: int) -> float:
    """Write nbytes in `threads` files of random data, each fsync'd. Returns seconds."""
    directory.mkdir(parents=True, exist_ok=True)
    buf = os.urandom(CHUNK)
    per = nbytes // threads

    def work(i):
        fd = os.open(directory / f"floor-{i}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        left = per
        while left > 0:
            left -= os.write(fd, buf[: min(CHUNK, left)])
        os.fsync(fd)
        os.close(fd)

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    start = time.monotonic()
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    seconds = time.monotonic() - start
    shutil.rmtree(directory, ignore_errors=True)
    return seconds


def measure_floor(path: Path, info: dict, args, log: Log) -> dict:
    files = [path / f for f in info["files"]]
    reads, writes, dropped = {}, {}, []
    for n in args.read_threads:
        dropped.append(drop_caches(args.drop_caches))
        reads[n] = read_files(files, n)
        label = "cold read" if dropped[-1] else "read (cache not dropped)"
        log.say(f"  {label}, {n:>2} threads: {info['bytes_in'] / reads[n] / 1e9:6.2f} GB/s ({reads[n]:.1f} s)")
    for n in args.write_threads:
        drop_caches(args.drop_caches)
        writes[n] = write_fsync(args.work / "floor-tmp", info["bytes_out_estimate"], n)
        log.say(
            f"  write+fsync, {n} threads: {info['bytes_out_estimate'] / writes[n] / 1e9:6.2f} GB/s ({writes[n]:.1f} s)"
        )
    floor = min(reads.values()) + min(writes.values())
    return {
        "read_s": reads,
        "write_s": writes,
        "read_best_s": min(reads.values()),
        "write_best_s": min(writes.values()),
        "floor_s": floor,
        "caches_dropped": dropped,
    }


# ----------------------------------------------------------------------------------------------- contenders


def fp8convert_cmd() -> list[str]:
    if (REPO / "fp8convert" / "__main__.py").exists():
        return [PY, "-m", "fp8convert"]
    return [PY, "-c", "from fp8convert.cli import run; run()"]


def parse_json_report(stdout: str) -> dict | None:
    start = stdout.find("{")
    if start < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(stdout[start:])[0]
    except ValueError:
        return None


# Start-up mechanisms switched off one at a time (--startup-ablation), by patching the program before it
# runs: what each one gains is the default run's wall time against these.
ABLATIONS = {
    # torch and CUDA loaded first, in the main thread (so no start-up record is read ahead either)
    "torch-first": "import torch; torch.empty(1, device='{dev}')\n",
    # no page-cache read-ahead: neither the head start while the plan is made nor the run's own
    "no-prefetch": "import sys; sys.argv += ['--prefetch', '0']\n",
}
ABLATED_CLI = "import sys; from fp8convert.cli import run; run(sys.argv[1:])"


def contenders(args) -> list[dict]:
    """label, command (SRC and OUT filled in later), environment, how it reports itself."""
    plan = []
    devices = ["cuda", "cpu"] if args.device == "both" else [args.device]
    if args.dequantize:
        for dev in devices:
            plan.append(
                {
                    "label": f"fp8convert-dequantize-{dev}",
                    "kind": "fp8convert",
                    "durable": True,
                    "cmd": fp8convert_cmd()
                    + [
                        "dequantize",
                        "{src}",
                        "{out}",
                        "--dtype",
                        "bf16",
                        "--device",
                        dev,
                        "--max-shard-size",
                        args.max_shard_size,
                        "--overwrite",
                        "--json",
                        "-q",
                    ]
                    + (["--max-resident", args.max_resident] if args.max_resident else []),
                    "env": fp8convert_env(args),
                }
            )
        if not args.skip_naive:
            plan.append(
                {
                    "label": "naive-dequant",
                    "kind": "script",
                    "durable": False,
                    "cmd": [PY, str(BENCH / "naive_dequant.py"), "{src}", "{out}"],
                    "env": child_env(),
                }
            )
        return plan
    for dev in devices:
        fp8 = {
            "label": f"fp8convert-{dev}",
            "kind": "fp8convert",
            "durable": True,
            "cmd": fp8convert_cmd()
            + [
                "quantize",
                "{src}",
                "{out}",
                "--scheme",
                args.scheme,
                *[arg for rule in args.rule for arg in ("--scheme", rule)],
                "--format",
                "compressed-tensors",
                "--device",
                dev,
                "--max-shard-size",
                args.max_shard_size,
                "--overwrite",
                "--json",
                "-q",
            ]
            + (["--max-resident", args.max_resident] if args.max_resident else []),
            "env": fp8convert_env(args),
        }
        # the first run in an environment has no record of torch's start-up pages; the next one reads
        # that run's record
        plan += [dict(fp8, label=f"fp8convert-{dev}-first-run", clear_cache=True), fp8]
        if args.warm_libs:  # same run, but torch's own files already in the page cache (checkpoint still cold)
            plan.append(
                dict(
                    plan[-1],
                    label=f"fp8convert-{dev}-libs-warm",
                    warmup=[PY, "-c", f"import torch; torch.empty(1, device='{dev}')"],
                )
            )
        if args.startup_ablation:  # the same run with one mechanism switched off
            for name, patch in ABLATIONS.items():
                plan.append(
                    dict(
                        fp8,
                        label=f"fp8convert-{dev}-{name}",
                        cmd=[PY, "-c", patch.format(dev=dev) + ABLATED_CLI] + fp8["cmd"][3:],
                    )
                )
    if not args.skip_naive:
        plan.append(
            {
                "label": "naive",
                "kind": "script",
                "durable": False,
                "cmd": [PY, str(BENCH / "naive_convert.py"), "{src}", "{out}", args.scheme],
                "env": child_env(),
            }
        )
    if not args.skip_llmc:
        for w in args.llmc_workers:
            plan.append(
                {
                    "label": f"llmc-w{w}",
                    "kind": "script",
                    "durable": False,
                    "cmd": [PY, str(BENCH / "lc_convert.py"), "{src}", "{out}", "TENSOR", str(w)],
                    "env": child_env([args.llmc_site]),
                }
            )
    return plan


def run_contender(c: dict, src: Path, info: dict, floor: dict | None, args, log: Log, gpu) -> dict:
    out = args.work / f"out-{c['label']}"
    shutil.rmtree(out, ignore_errors=True)
    if c.get("clear_cache"):
        shutil.rmtree(c["env"]["XDG_CACHE_HOME"], ignore_errors=True)
    dropped = drop_caches(args.drop_caches)
    if c.get("warmup"):
        subprocess.run(c["warmup"], env=c["env"], capture_output=True)
    cmd = [a.format(src=src, out=out) for a in c["cmd"]]
    r = run_measured(f"{src.name}-{c['label']}", cmd, c["env"], args.work / "logs", log, gpu, args.timeout)
    start = time.monotonic()
    os.sync()  # what the tool left unwritten; ~0 for a tool that fsyncs
    r["sync_s"] = time.monotonic() - start
    r.update(contender=c["label"], durable=c["durable"], caches_dropped=dropped, bytes_out=dir_bytes(out))
    r["tool_s"] = r["gpu_self_gib"] = None
    if c["kind"] == "fp8convert":
        report = parse_json_report(r["stdout"])
        if report:
            r["report"] = report
            r["tool_s"] = report.get("seconds")
            if report.get("peak_device_bytes") is not None:
                r["gpu_self_gib"] = report["peak_device_bytes"] / GiB
    else:
        m = re.search(r"done ([\d.]+)s peak_gpu=([\d.]+)GiB", r["stdout"])
        if m:
            r["tool_s"], r["gpu_self_gib"] = float(m.group(1)), float(m.group(2))
    ok = r["rc"] == 0
    r["gbps_in"] = info["bytes_in"] / r["wall_s"] / 1e9 if ok else None
    r["x_floor"] = r["wall_s"] / floor["floor_s"] if floor and ok else None
    if len(r["stdout"]) > 20000:
        r["stdout"] = r["stdout"][-20000:]
    if not args.keep_outputs:
        shutil.rmtree(out, ignore_errors=True)
    status = "ok" if r["rc"] == 0 else ("TIMED OUT" if r["timed_out"] else f"FAILED rc={r['rc']}")
    log.say(
        f"  {c['label']:<16} {status:<10} wall {r['wall_s']:6.1f} s, sync {r['sync_s']:4.1f} s, "
        f"RSS {r['rss_peak_gib']:5.2f} GiB, GPU {fmt(r['gpu_self_gib'], 2)} GiB (self) / "
        f"{fmt(r['gpu_used_nvml_gib'], 2)} GiB (nvml)"
    )
    if r["rc"] != 0:
        log.say("    " + r["stderr_tail"].replace("\n", "\n    "))
    return r


def cpu_seconds() -> tuple[float, float] | None:
    """(all CPU time, of it stolen by the hypervisor) since boot, in ticks, from /proc/stat; None elsewhere."""
    try:
        fields = [float(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal [guest guest_nice, already counted in user and nice]
    return sum(fields[:8]), fields[7] if len(fields) > 7 else 0.0


def steal_percent(before: tuple[float, float] | None, after: tuple[float, float] | None) -> float | None:
    """The share of the machine's CPU time between the two readings that other guests of the host took."""
    if before is None or after is None or after[0] <= before[0]:
        return None
    return 100 * (after[1] - before[1]) / (after[0] - before[0])


# Copies one GiB from one host buffer into another, with one thread and then with every core, best of three:
# the memory bandwidth the machine gives at that moment (a ceiling run moves several bytes of host memory
# per byte of input: the reads out of the page cache, the copies into the shards' pages)
MEMORY_PROBE = """
import os, sys, time, torch
src = torch.ones(1 << 30, dtype=torch.uint8); dst = torch.empty_like(src)
for n in (1, len(os.sched_getaffinity(0))):
    torch.set_num_threads(n); best = float("inf")
    for _ in range(3):
        t = time.perf_counter(); dst.copy_(src); best = min(best, time.perf_counter() - t)
    print(src.numel() / best / 1e9)
"""


def host_copy_gbps() -> tuple[float | None, float | None]:
    """GB/s of a host memory copy now, with one thread and with every core (None, None if the probe failed)."""
    r = subprocess.run([PY, "-c", MEMORY_PROBE], capture_output=True, text=True)
    try:
        one, every = (float(v) for v in r.stdout.split())
    except ValueError:
        return None, None
    return one, every


def warm_page_cache(src: Path) -> float:
    """Read every file of `src` once, so the run after it reads from memory; returns seconds."""
    start = time.monotonic()
    for p in sorted(src.iterdir()):
        if p.is_file():
            with open(p, "rb", buffering=0) as f:
                while f.read(CHUNK * 4):
                    pass
    return time.monotonic() - start


def run_ceiling(src: Path, info: dict, args, log: Log, gpu) -> list[dict]:
    """fp8convert with no disk in the way: the input in the page cache, the output on tmpfs. What is left
    is the pipeline itself (and start-up): its GB/s is what the tool could do on a disk of any speed."""
    rows = []
    devices = ["cuda", "cpu"] if args.device == "both" else [args.device]
    for dev in devices:  # (each run reads the input into the page cache first: ceiling_run)
        # Into tmpfs pages no run had used, the main thread waited 2.2-2.5x as long for the writer as into
        # reused ones: on a virtual machine the host backs a page on its
        # first touch, which a machine that has run for a while has done. The warm-up run is in the table.
        if not out_of_time(log, f"ceiling {dev} warm-up"):
            rows.append(ceiling_run(src, info, args, log, gpu, dev, "warm-up", -1))
        for rep in range(args.ceiling_repeat):
            if out_of_time(log, f"ceiling {dev} #{rep + 1}"):
                return rows
            rows.append(ceiling_run(src, info, args, log, gpu, dev, "run", rep))
    return rows


def ceiling_run(src: Path, info: dict, args, log: Log, gpu, dev: str, mode: str, rep: int) -> dict:
    out = args.ceiling_out / f"out-{dev}"
    shutil.rmtree(out, ignore_errors=True)
    warm_page_cache(src)
    copy_one, copy_all = host_copy_gbps()  # the run's spread between fresh processes is read against these
    cmd = fp8convert_cmd() + [
        "quantize",
        str(src),
        str(out),
        "--device",
        dev,
        "--max-shard-size",
        args.max_shard_size,
        "--overwrite",
        "--json",
        "-q",
    ]
    cpu_before = cpu_seconds()
    r = run_measured(
        f"{src.name}-ceiling-{dev}-{mode}-{rep}", cmd, fp8convert_env(args), args.work / "logs", log, gpu, args.timeout
    )
    steal = steal_percent(cpu_before, cpu_seconds())
    report = parse_json_report(r["stdout"]) or {}
    stages = report.get("stage_seconds") or {}
    row = {
        "device": dev,
        "mode": mode,
        "rep": rep + 1 if rep >= 0 else "-",
        "rc": r["rc"],
        "wall_s": r["wall_s"],
        "rss_gib": r["rss_peak_gib"],
        "gpu_gib": (report.get("peak_device_bytes") or 0) / GiB or None,
        "stages": stages,
        "ran_on": report.get("device"),
        "torch_ready_s": stages.get("torch_ready_at"),
        "pipeline_s": stages.get("pipeline"),
        "copy_one_gbps": copy_one,
        "copy_all_gbps": copy_all,
        "steal_pct": steal,
    }
    row["gbps_pipeline"] = info["bytes_in"] / row["pipeline_s"] / 1e9 if row["pipeline_s"] else None
    row["gbps_whole"] = info["bytes_in"] / r["wall_s"] / 1e9 if r["rc"] == 0 else None
    shutil.rmtree(out, ignore_errors=True)
    log.say(
        f"  ceiling {dev} {mode} #{row['rep']}: rc {r['rc']}, wall {r['wall_s']:.2f} s, torch ready "
        f"{fmt(row['torch_ready_s'], 2)} s, pipeline {fmt(row['pipeline_s'], 2)} s = "
        f"{fmt(row['gbps_pipeline'], 2)} GB/s, whole {fmt(row['gbps_whole'], 2)} GB/s, "
        f"ran on {row['ran_on']}, host copy {fmt(copy_one, 1)}/{fmt(copy_all, 1)} GB/s "
        f"before it, steal {fmt(steal, 1)}%, stages {stages}"
    )
    if r["rc"] != 0:
        log.say("    " + r["stderr_tail"].replace("\n", "\n    "))
    return row


def ceiling_table(name: str, info: dict, rows: list[dict]) -> str:
    lines = [
        f"### {name}: pipeline ceiling ({info['bytes_in'] / 1e9:.2f} GB in the page cache, output on tmpfs)",
        "",
        "| device | way | run | wall s | torch ready at s | pipeline s | GB/s pipeline "
        "| GB/s whole run | ran on | peak RSS GiB | peak GPU GiB | host copy GB/s | steal % |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['device']} | {r['mode']} | {r['rep']} | {r['wall_s']:.2f} | "
        f"{fmt(r['torch_ready_s'], 2)} | "
        f"{fmt(r['pipeline_s'], 2)} | {fmt(r['gbps_pipeline'], 2)} | {fmt(r['gbps_whole'], 2)} | "
        f"{r['ran_on']} | {fmt(r['rss_gib'], 2)} | {fmt(r['gpu_gib'], 2)} | "
        f"{fmt(r['copy_one_gbps'], 1)} / {fmt(r['copy_all_gbps'], 1)} | {fmt(r['steal_pct'], 1)} |"
        for r in rows
    ]
    lines += [
        "",
        "way: `warm-up` the pipeline alone once, first, so that the memory tmpfs takes for the outputs "
        "has been touched (on a virtual machine the host backs a page on its first touch). host copy: a 1 GiB "
        "memory copy just before the run, one thread / every core; steal: the share of the machine's CPU time "
        "that the hypervisor gave other guests during the run.",
    ]
    return "\n".join(lines)


def contender_table(name: str, info: dict, floor: dict | None, runs: list[dict]) -> str:
    lines = [f"### {name}: {info['bytes_in'] / 1e9:.2f} GB in {len(info['files'])} shards, {info['tensors']} tensors"]
    if floor:
        reads = ", ".join(f"{n}t {info['bytes_in'] / s / 1e9:.2f}" for n, s in floor["read_s"].items())
        writes = ", ".join(f"{n}t {info['bytes_out_estimate'] / s / 1e9:.2f}" for n, s in floor["write_s"].items())
        cold = "cold" if all(floor["caches_dropped"]) else "CACHES NOT DROPPED"
        lines.append(
            f"I/O floor {floor['floor_s']:.1f} s = best read {floor['read_best_s']:.1f} s ({cold}; GB/s {reads}) "
            f"+ best fsync'd write of {info['bytes_out_estimate'] / 1e9:.2f} GB {floor['write_best_s']:.1f} s "
            f"(GB/s {writes})"
        )
    lines += [
        "",
        "| contender | wall s | tool s | +sync s | GB/s in | x floor | peak RSS GiB | GPU GiB (self) "
        "| GPU GiB (nvml) | out GB | durable on return | rc |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        durable = "yes (fsync)" if r["durable"] else "no (never fsyncs)"
        rc = r["rc"] if not r["timed_out"] else "timeout"
        if r["caches_dropped"] is False:
            rc = f"{rc}, cache not dropped"
        lines.append(
            f"| {r['contender']} | {r['wall_s']:.1f} | {fmt(r['tool_s'])} | {r['sync_s']:.1f} | "
            f"{fmt(r['gbps_in'], 2)} | {fmt(r['x_floor'], 2)} | {r['rss_peak_gib']:.2f} | "
            f"{fmt(r['gpu_self_gib'], 2)} | {fmt(r['gpu_used_nvml_gib'], 2)} | {r['bytes_out'] / 1e9:.2f} | "
            f"{durable} | {rc} |"
        )
    lines.append("")
    lines.append(
        "wall: child process start to exit (imports included); tool s: what the tool itself reports "
        "(after imports); +sync s: a `sync` right after exit (writes the tool left in the page cache); "
        "peak RSS: process tree, sampled every 0.1 s, or its largest process's high-water mark; "
        "GPU self: torch max_memory_allocated as the tool reports it; GPU nvml: device memory in use "
        "above the idle baseline (CUDA context included)."
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- loaders

NOTES: list[str] = []  # what a loader child wants said beside its numbers (e.g. a silent fallback)


def loader_child(name: str, src: str, device: str) -> None:
    """Runs in a child process (`bench.py _loader NAME SRC DEVICE`): stream every tensor of SRC onto DEVICE
    with one loader, drop it, and print one JSON line with seconds and bytes."""
    import torch

    files = sorted(str(p) for p in Path(src).glob("*.safetensors"))
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    fn = {
        "plain-read": load_plain_read,
        "safetensors": load_safetensors,
        "fp8convert-reader": load_fp8convert,
        "runai-streamer": load_runai,
        "fastsafetensors": lambda f, d: load_fastsafetensors(f, d, gds=False),
        "fastsafetensors-gds": lambda f, d: load_fastsafetensors(f, d, gds=True),
    }[name]
    if dev.type == "cuda":
        torch.cuda.init()
        torch.empty(1, device=dev)  # context up before the clock starts, as for every loader
    start = time.monotonic()
    nbytes, ntensors = fn(files, dev)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.monotonic() - start
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    print(
        "LOADER_RESULT "
        + json.dumps(
            {
                "loader": name,
                "seconds": seconds,
                "bytes": nbytes,
                "tensors": ntensors,
                "peak_device_bytes": peak,
                "notes": NOTES,
            }
        ),
        flush=True,
    )


def load_plain_read(files, dev):
    """Baseline: 16 threads of 16 MB preads into host memory, nothing sent to the device."""
    read_files([Path(f) for f in files], 16)
    return sum(os.path.getsize(f) for f in files), 0


def load_safetensors(files, dev):
    """safetensors.torch.load_file(device=...) one shard at a time (mmap, then pageable copies)."""
    from safetensors.torch import load_file

    nbytes = ntensors = 0
    for f in files:
        sd = load_file(f, device=str(dev))
        nbytes += sum(t.numel() * t.element_size() for t in sd.values())
        ntensors += len(sd)
        del sd
    return nbytes, ntensors


def load_fp8convert(files, dev):
    """fp8convert's own read path: the page-cache prefetcher ahead of BatchReader, over the source's tensors in
    <= 4 GiB batches (the CUDA default), as a conversion reads them."""
    from fp8convert.run.prefetch import Prefetcher, default_window
    from fp8convert.run.reader import BatchReader
    from fp8convert.source.checkpoint import open_local

    source = open_local(Path(files[0]).parent)
    budget = 4 * GiB if dev.type == "cuda" else 1 * GiB
    batches, cur, size = [], [], 0
    for t in source.tensors:
        if cur and size + t.nbytes > budget:
            batches.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    batches.append(cur)
    with (
        Prefetcher(source.root, source.tensors, default_window(), threads=4) as prefetcher,
        BatchReader(source.root, dev) as reader,
    ):
        for b in batches:
            buf, _ = reader.read(b)
            prefetcher.advance(sum(t.nbytes for t in b))
            reader.recycle(buf)
            del buf
    return sum(t.nbytes for t in source.tensors), len(source.tensors)


def load_runai(files, dev):
    """Run:ai Model Streamer (vLLM --load-format runai_streamer): host buffers, then .to(device)."""
    from runai_model_streamer import SafetensorsStreamer

    nbytes = ntensors = 0
    with SafetensorsStreamer() as streamer:
        streamer.stream_files(files)
        for _, t in streamer.get_tensors():
            x = t.to(dev)
            nbytes += x.numel() * x.element_size()
            ntensors += 1
            del x
    return nbytes, ntensors


def load_fastsafetensors(files, dev, gds: bool):
    """fastsafetensors (vLLM --load-format fastsafetensors): one file at a time into a device buffer,
    through GPUDirect Storage when gds=True, else pread into a bounce buffer."""
    import logging
    import warnings

    from fastsafetensors import SafeTensorsFileLoader, SingleGroup

    class Fallbacks(logging.Handler):  # a GDS file-handle failure is only logged, then nogds is used
        def emit(self, record):
            NOTES.append(record.getMessage()[:200])

    if gds:
        NOTES.append(f"/dev/nvidia-fs0 {'present' if os.path.exists('/dev/nvidia-fs0') else 'absent'}")
        logging.getLogger("fastsafetensors").addHandler(Fallbacks(logging.WARNING))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader = SafeTensorsFileLoader(SingleGroup(), str(dev), nogds=not gds)
    NOTES.extend(str(w.message)[:200] for w in caught if "gds" in str(w.message).lower())
    nbytes = ntensors = 0
    try:
        for f in files:
            loader.add_filenames({0: [f]})
            keys = loader.get_keys()
            fb = loader.copy_files_to_device()
            for k in keys:
                x = fb.get_tensor(k)
                nbytes += x.numel() * x.element_size()
                ntensors += 1
                del x
            fb.close()
            loader.reset()
    finally:
        loader.close()
    return nbytes, ntensors


def cudart_dir(work: Path) -> str | None:
    """A folder holding an unversioned libcudart.so: fastsafetensors dlopens that exact name, which torch's
    pip wheels do not ship (they have libcudart.so.13); the CUDA toolkit or a symlink in WORK provides it."""
    for d in ("/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"):
        if os.path.exists(f"{d}/libcudart.so"):
            return d
    found = sh(
        f'{PY} -c "import glob, os, torch; r = os.path.dirname(os.path.dirname(torch.__file__)); '
        f"print(sorted(glob.glob(r + '/nvidia/**/libcudart.so*', recursive=True))[-1:])\""
    )
    m = re.search(r"'([^']+)'", found)
    if not m:
        return None
    link = work / "cudart" / "libcudart.so"
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(m.group(1))
    return str(link.parent)


def run_loaders(src: Path, info: dict, args, log: Log, gpu, loaders_ok: bool) -> list[dict]:
    device = "cpu" if args.device == "cpu" else "cuda"
    libdir = cudart_dir(args.work) if device == "cuda" else None
    rows = []
    for name in args.loader_list:
        if out_of_time(log, name):
            break
        if name in ("runai-streamer", "fastsafetensors", "fastsafetensors-gds") and not loaders_ok:
            rows.append({"loader": name, "skipped": f"no wheels installed from {args.loader_wheels}"})
            log.say(f"  {name:<20} skipped (no wheels)")
            continue
        dropped = drop_caches(args.drop_caches)
        env = child_env([args.loader_site, REPO])
        if libdir:
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [libdir, env.get("LD_LIBRARY_PATH")]))
        r = run_measured(
            f"{src.name}-load-{name}",
            [PY, str(Path(__file__).resolve()), "_loader", name, str(src), device],
            env,
            args.work / "logs",
            log,
            gpu,
            args.timeout,
        )
        m = re.search(r"LOADER_RESULT (\{.*\})", r["stdout"])
        got = json.loads(m.group(1)) if m else {}
        r.update(
            loader=name,
            device=device,
            caches_dropped=dropped,
            inner_s=got.get("seconds"),
            notes=got.get("notes", []),
            bytes=got.get("bytes"),
            tensors=got.get("tensors"),
            gpu_self_gib=None if got.get("peak_device_bytes") is None else got["peak_device_bytes"] / GiB,
        )
        r["gbps"] = info["bytes_in"] / r["inner_s"] / 1e9 if r["inner_s"] else None
        r.pop("stdout", None)
        rows.append(r)
        if r["rc"] == 0 and m:
            status = f"load {r['inner_s']:.1f} s ({fmt(r['gbps'], 2)} GB/s)"
        else:
            status = "FAILED: " + (r["stderr_tail"].splitlines() or ["?"])[-1][:200]
        log.say(
            f"  {name:<20} {status}, wall {r['wall_s']:.1f} s, RSS {r['rss_peak_gib']:.2f} GiB, "
            f"GPU {fmt(r['gpu_self_gib'], 2)} GiB (self) / {fmt(r['gpu_used_nvml_gib'], 2)} GiB (nvml)"
        )
    return rows


def loader_table(name: str, info: dict, rows: list[dict]) -> str:
    lines = [
        f"### loaders, {name} ({info['bytes_in'] / 1e9:.2f} GB, page cache dropped before each)",
        "",
        "| loader | device | load s | GB/s | wall s | peak RSS GiB | GPU GiB (self) | GPU GiB (nvml) | note |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['loader']} | - | - | - | - | - | - | - | {r['skipped']} |")
            continue
        note = (
            ""
            if r["rc"] == 0 and r["inner_s"]
            else "failed: " + (r["stderr_tail"].splitlines() or ["?"])[-1][:120].replace("|", "/")
        )
        if r["caches_dropped"] is False:
            note += " cache not dropped"
        note += "; ".join(r.get("notes", [])).replace("|", "/")
        lines.append(
            f"| {r['loader']} | {r['device']} | {fmt(r['inner_s'])} | {fmt(r['gbps'], 2)} | {r['wall_s']:.1f} | "
            f"{r['rss_peak_gib']:.2f} | {fmt(r['gpu_self_gib'], 2)} | {fmt(r['gpu_used_nvml_gib'], 2)} | {note} |"
        )
    lines.append(
        "\nload s: first byte to last tensor on the device (torch synchronized), CUDA context already up; "
        "plain-read reads into host memory only."
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------ CPU == CUDA check


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    return h.hexdigest()


def differing_tensors(a: Path, b: Path, limit: int = 5) -> list[str]:
    """Names of tensors whose bytes differ between two safetensors files (header-level, no torch)."""
    ha, hb = safetensors_header(a), safetensors_header(b)
    if set(ha) != set(hb):
        return [f"tensor names differ: {sorted(set(ha) ^ set(hb))[:limit]}"]
    out = []
    with open(a, "rb") as fa, open(b, "rb") as fb:
        base_a, base_b = 8 + struct.unpack("<Q", fa.read(8))[0], 8 + struct.unpack("<Q", fb.read(8))[0]
        for name in sorted(k for k in ha if k != "__metadata__"):
            ia, ib = ha[name], hb[name]
            if (ia["dtype"], ia["shape"]) != (ib["dtype"], ib["shape"]):
                out.append(f"{name}: {ia['dtype']}{ia['shape']} vs {ib['dtype']}{ib['shape']}")
            else:
                fa.seek(base_a + ia["data_offsets"][0])
                fb.seek(base_b + ib["data_offsets"][0])
                n = ia["data_offsets"][1] - ia["data_offsets"][0]
                if fa.read(n) != fb.read(n):
                    out.append(name)
            if len(out) >= limit:
                break
    return out


def compare_dirs(a: Path, b: Path) -> dict:
    files_a = {p.relative_to(a) for p in a.rglob("*") if p.is_file()}
    files_b = {p.relative_to(b) for p in b.rglob("*") if p.is_file()}
    result = {"files": len(files_a), "only_in_one": sorted(map(str, files_a ^ files_b)), "differ": {}}
    for rel in sorted(files_a & files_b):
        if file_digest(a / rel) != file_digest(b / rel):
            result["differ"][str(rel)] = differing_tensors(a / rel, b / rel) if rel.suffix == ".safetensors" else []
    result["identical"] = not result["only_in_one"] and not result["differ"]
    return result


def check_identical(src: Path, args, log: Log, gpu) -> list[dict]:
    rows = []
    for combo in args.identical_combos:
        if out_of_time(log, combo):
            break
        scheme, fmt_ = combo.split("/")
        outs = {}
        for dev in args.identical_devices:
            out = args.work / f"ident-{scheme}-{fmt_}-{dev}-{len(outs)}"
            cmd = fp8convert_cmd() + [
                "quantize",
                str(src),
                str(out),
                "--scheme",
                scheme,
                "--format",
                fmt_,
                "--device",
                dev,
                "--max-shard-size",
                args.max_shard_size,
                "--overwrite",
                "--json",
                "-q",
            ]
            r = run_measured(out.name, cmd, child_env([REPO]), args.work / "logs", log, gpu, args.timeout)
            outs[f"{dev}" if dev not in outs else f"{dev}#2"] = (out, r)
        ok = all(r["rc"] == 0 for _, r in outs.values())
        (out_a, run_a), (out_b, run_b) = outs.values()
        cmp = (
            compare_dirs(out_a, out_b)
            if ok
            else {"identical": False, "error": {dev: r["stderr_tail"] for dev, (_, r) in outs.items() if r["rc"] != 0}}
        )
        row = {
            "checkpoint": src.name,
            "scheme": scheme,
            "format": fmt_,
            "devices": list(outs),
            **cmp,
            "wall_s": {dev: r["wall_s"] for dev, (_, r) in outs.items()},
        }
        rows.append(row)
        verdict = "IDENTICAL" if cmp["identical"] else ("ERROR" if cmp.get("error") else "DIFFERENT")
        walls = ", ".join(f"{dev} {r['wall_s']:.1f} s" for dev, (_, r) in outs.items())
        log.say(f"  {scheme}/{fmt_}: {verdict} ({cmp.get('files', '?')} files; {walls})")
        if not cmp["identical"]:
            log.say(
                "    " + json.dumps({k: cmp.get(k) for k in ("only_in_one", "differ", "error") if cmp.get(k)})[:2000]
            )
        if not args.keep_outputs:
            for out, _ in outs.values():
                shutil.rmtree(out, ignore_errors=True)
    return rows


# ------------------------------------------------------------------------------------------------- main


def scaling_table(results: dict) -> str | None:
    """Doubling check: for each contender, how wall time, RSS and GPU memory grow from 8->16 MoE layers
    and 16->32 dense layers (same shard size)."""
    lines = []
    runs = {(c["name"], c["shard_gb"]): c for c in results["checkpoints"].values()}
    for (name, shard), small in runs.items():
        big = runs.get((DOUBLES.get(name), shard))
        if not big:
            continue
        by_label = {r["contender"]: r for r in big.get("runs", [])}
        for r in small.get("runs", []):
            b = by_label.get(r["contender"])
            if not b or r["rc"] or b["rc"]:
                continue

            def ratio(k, r=r, b=b):
                return None if not r.get(k) or b.get(k) is None else b[k] / r[k]

            lines.append(
                f"| {name}->{big['name']} ({shard:g} GB shards) | {r['contender']} | {r['wall_s']:.1f} -> "
                f"{b['wall_s']:.1f} (x{ratio('wall_s'):.2f}) | {r['rss_peak_gib']:.2f} -> {b['rss_peak_gib']:.2f} | "
                f"{fmt(r['gpu_self_gib'], 2)} -> {fmt(b['gpu_self_gib'], 2)} | {fmt(ratio('x_floor'), 2)} |"
            )
    if not lines:
        return None
    return "\n".join(
        [
            "### doubling check",
            "",
            "| checkpoints | contender | wall s | peak RSS GiB | GPU GiB (self) | x-floor ratio |",
            "|---|---|---|---|---|---|",
            *lines,
        ]
    )


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Example: python3 scripts/bench.py --ckpt moe8 --ckpt dense16 --out results",
    )
    p.add_argument(
        "--ckpt",
        action="append",
        choices=sorted(CKPTS),
        help="checkpoint(s) to benchmark, repeatable (default: moe8 and dense16)",
    )
    p.add_argument("--double", action="store_true", help="also moe16 and dense32 (the doubling check)")
    p.add_argument("--shard-gb", type=float, action="append", help="input shard size(s), repeatable (default 2)")
    p.add_argument(
        "--work", type=Path, default=Path("/var/tmp/fp8bench"), help="checkpoints and outputs (default %(default)s)"
    )
    p.add_argument("--out", type=Path, default=Path("bench-results"), help="bench.log and results.json go here")
    p.add_argument(
        "--device", choices=["cuda", "cpu", "both"], default="cuda", help="fp8convert's --device (default cuda)"
    )
    p.add_argument(
        "--scheme",
        default="tensor",
        choices=["tensor", "channel", "block", "nvfp4a16", "mxfp4a16"],
        help="what fp8convert and the naive script write (default tensor; the naive script has no channel or "
        "block; llm-compressor always TENSOR)",
    )
    p.add_argument(
        "--rule",
        action="append",
        default=[],
        metavar="re:PATTERN=SCHEME",
        help="a mixed recipe's rule over --scheme, repeatable, passed to fp8convert as --scheme (fp8convert only)",
    )
    p.add_argument("--max-shard-size", default="5GB", help="fp8convert's output shard size")
    p.add_argument("--max-resident", help="fp8convert's --max-resident (default: its own)")
    p.add_argument("--skip-llmc", action="store_true", help="do not run llm-compressor")
    p.add_argument(
        "--dequantize",
        action="store_true",
        help="benchmark `fp8convert dequantize` on a native fp8 block copy of each checkpoint against the "
        "naive whole-shard dequantizer (anchor/naive_dequant.py); llm-compressor is not run",
    )
    p.add_argument(
        "--startup-ablation",
        action="store_true",
        help="also run fp8convert with each start-up mechanism switched off (ABLATIONS)",
    )
    p.add_argument(
        "--warm-libs",
        action="store_true",
        help="also run fp8convert with torch's files warm in the page cache (checkpoint still cold)",
    )
    p.add_argument(
        "--llmc-workers", type=int, action="append", help="model_free_ptq max_workers, repeatable (default 1)"
    )
    p.add_argument("--skip-naive", action="store_true", help="do not run the naive shard-at-a-time script")
    p.add_argument("--skip-floor", action="store_true", help="do not measure the I/O floor")
    p.add_argument(
        "--read-threads", type=int, action="append", help="floor: cold-read thread counts (default 1, 4, 16)"
    )
    p.add_argument(
        "--write-threads", type=int, action="append", help="floor: fsync'd write thread counts (default 1, 4)"
    )
    p.add_argument(
        "--no-drop-caches", dest="drop_caches", action="store_false", help="do not drop the page cache (not root)"
    )
    p.add_argument(
        "--skip-convert", action="store_true", help="no contenders (e.g. only --loaders or --check-identical)"
    )
    p.add_argument("--loaders", action="store_true", help="also read each checkpoint cold with other loaders")
    p.add_argument("--loader", dest="loader_list", action="append", choices=LOADERS, help="which loaders (default all)")
    p.add_argument("--check-identical", action="store_true", help="fp8convert CPU vs CUDA outputs byte-identical?")
    p.add_argument("--identical-ckpt", default="moe2", choices=sorted(CKPTS), help="checkpoint for that (default moe2)")
    p.add_argument(
        "--identical-combo",
        dest="identical_combos",
        action="append",
        help="scheme/format pairs to compare (default tensor, channel, block with compressed-tensors, block/fp8)",
    )
    p.add_argument(
        "--identical-devices",
        type=lambda v: v.split(","),
        default=["cpu", "cuda"],
        help="the two devices compared (default cpu,cuda; cpu,cpu tries the check without a GPU)",
    )
    p.add_argument(
        "--ceiling",
        action="store_true",
        help="fp8convert with the input in the page cache and the output on tmpfs (the pipeline's own speed)",
    )
    p.add_argument("--ceiling-out", type=Path, default=Path("/dev/shm/fp8bench"), help="tmpfs for --ceiling outputs")
    p.add_argument("--ceiling-repeat", type=int, default=2, help="runs per device and way for --ceiling (default 2)")
    p.add_argument("--keep-ckpts", action="store_true", help="do not remove checkpoints this call does not use")
    p.add_argument("--keep-outputs", action="store_true", help="keep the contenders' outputs")
    p.add_argument("--timeout", type=float, default=480, help="seconds before a contender is killed")
    p.add_argument(
        "--budget",
        type=float,
        default=570,
        help="seconds for the whole call (keep it under any limit your job has): later steps are skipped and "
        "a running one is killed so the tables still print; 0 = no limit (default %(default)s)",
    )
    p.add_argument("--wheels", type=Path, default=REPO / ".whl", help="llm-compressor wheels (default .whl)")
    p.add_argument("--llmc-site", type=Path, default=Path("/tmp/site"))
    p.add_argument("--loader-wheels", type=Path, default=REPO / ".whl-loaders")
    p.add_argument("--loader-site", type=Path, default=Path("/tmp/site-loaders"))
    a = p.parse_args(argv)
    if not a.ckpt and not a.double and not (a.skip_convert and not a.loaders and not a.ceiling):
        a.ckpt = ["moe8", "dense16"]
    a.ckpt = list(dict.fromkeys((a.ckpt or []) + (["moe16", "dense32"] if a.double else [])))
    a.shard_gb = a.shard_gb or [2.0]
    a.llmc_workers = a.llmc_workers or [1]
    a.read_threads = a.read_threads or [1, 4, 16]
    a.write_threads = a.write_threads or [1, 4]
    a.loader_list = a.loader_list or LOADERS
    a.identical_combos = a.identical_combos or [
        "tensor/compressed-tensors",
        "channel/compressed-tensors",
        "block/compressed-tensors",
        "block/fp8",
    ]
    a.work = a.work.resolve()
    return a


def main(argv=None) -> int:
    global DEADLINE
    args = parse_args(argv)
    if args.budget > 0:
        DEADLINE = time.monotonic() + args.budget
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "bench.log")
    results_path = args.out / "results.json"
    results = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "env": environment(),
        "checkpoints": {},
        "identical": [],
    }
    for k in ("gpu", "torch", "cpus", "kernel"):
        log.say(f"{k}: {results['env'][k]}")
    log.quiet(json.dumps(results["env"], indent=2))
    if args.drop_caches and drop_caches(True) is False:
        log.say(
            "WARNING: cannot drop the page cache here (not root, or not supported): reads may be warm; "
            "pass --no-drop-caches to silence"
        )
    for f in ("make_ckpt.py", "naive_convert.py", "lc_convert.py", "naive_dequant.py"):
        if not (BENCH / f).exists():
            raise SystemExit(f"{BENCH / f} is missing")
    gpu = GpuMemory()
    results["env"]["gpu_memory_sampling"] = "nvml" if gpu.nvml else ("nvidia-smi" if gpu.available else "none")
    llmc_ok = args.skip_llmc or args.skip_convert or args.dequantize or install_wheels(args.wheels, args.llmc_site, log)
    loaders_ok = args.loaders and install_wheels(args.loader_wheels, args.loader_site, log)
    if not llmc_ok:
        log.say("llm-compressor wheels missing: its runs will fail")

    wanted = [(name, shard) for name in args.ckpt for shard in (args.shard_gb if name != "tiny" else [0])]
    keep = {ckpt_dir(args.work, n, s) for n, s in wanted}
    keep |= {fp8_dir(k) for k in keep} if args.dequantize else set()
    if args.check_identical:
        keep.add(ckpt_dir(args.work, args.identical_ckpt, args.shard_gb[0]))
    if not args.keep_ckpts:
        prune_checkpoints(args.work, keep, log)
    save_json(results_path, results)
    plan = [] if args.skip_convert else contenders(args)
    tables = []
    for name, shard in wanted:
        if out_of_time(log, f"{name} ({shard:g} GB shards)"):
            break
        src, build_s = build_checkpoint(name, shard, args.work, log, gpu)
        bf16_src = src
        if args.dequantize:
            src = build_fp8_copy(src, args.device, log, gpu, args.work)
        info = describe_checkpoint(src, "tensor" if args.dequantize else args.scheme, args.rule)
        entry = results["checkpoints"][src.name] = {
            "name": name,
            "shard_gb": shard,
            "path": str(src),
            "build_s": build_s,
            **info,
        }
        log.say(
            f"== {src.name}: {info['bytes_in'] / 1e9:.2f} GB, {len(info['files'])} shards, {info['tensors']} tensors"
        )
        floor = None
        if plan and not args.skip_floor and not out_of_time(log, "the I/O floor"):
            floor = entry["floor"] = measure_floor(src, info, args, log)
            save_json(results_path, results)
        if plan:
            entry["runs"] = []
            for c in plan:
                if out_of_time(log, c["label"]):
                    break
                entry["runs"].append(run_contender(c, src, info, floor, args, log, gpu))
                save_json(results_path, results)
            tables.append(contender_table(src.name, info, floor, entry["runs"]))
        if args.ceiling and not out_of_time(log, "the ceiling runs"):
            entry["ceiling"] = run_ceiling(src, info, args, log, gpu)
            save_json(results_path, results)
            tables.append(ceiling_table(src.name, info, entry["ceiling"]))
        if args.loaders:
            entry["loaders"] = run_loaders(src, info, args, log, gpu, loaders_ok)
            save_json(results_path, results)
            tables.append(loader_table(src.name, info, entry["loaders"]))
        if not args.keep_ckpts and not (
            args.check_identical and bf16_src == ckpt_dir(args.work, args.identical_ckpt, args.shard_gb[0])
        ):
            shutil.rmtree(src, ignore_errors=True)  # room for the next one (64 GiB disk); --keep-ckpts keeps it
            shutil.rmtree(bf16_src, ignore_errors=True)
    if args.check_identical and not out_of_time(log, "the CPU/CUDA check"):
        src, _ = build_checkpoint(args.identical_ckpt, args.shard_gb[0], args.work, log, gpu)
        log.say(f"== fp8convert outputs, {' vs '.join(args.identical_devices)}, on {src.name}")
        results["identical"] = check_identical(src, args, log, gpu)
        save_json(results_path, results)
        rows = [
            f"### fp8convert outputs, {' vs '.join(args.identical_devices)}",
            "",
            "| checkpoint | scheme | format | files | identical | differing |",
            "|---|---|---|---|---|---|",
        ]
        rows += [
            f"| {r['checkpoint']} | {r['scheme']} | {r['format']} | {r.get('files', '-')} | "
            f"{'yes' if r['identical'] else 'NO'} | "
            f"{', '.join([*r.get('differ', {}), *r.get('only_in_one', [])]) or ('error' if r.get('error') else '')} |"
            for r in results["identical"]
        ]
        tables.append("\n".join(rows))
    scaling = scaling_table(results)
    if scaling:
        tables.append(scaling)
    log.say("\n" + "\n\n".join(tables))
    results["tables"] = tables
    save_json(results_path, results)
    failed = [r["label"] for c in results["checkpoints"].values() for r in c.get("runs", []) if r["rc"] != 0]
    failed += [
        f"ceiling {r['device']}" for c in results["checkpoints"].values() for r in c.get("ceiling", []) if r["rc"] != 0
    ]
    failed += [f"identical {r['scheme']}/{r['format']}" for r in results["identical"] if not r["identical"]]
    log.say(
        f"\nresults: {results_path}, log: {args.out / 'bench.log'}"
        + (f"; FAILED/DIFFERENT: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_loader":
        loader_child(*sys.argv[2:5])
        sys.exit(0)
    sys.exit(main())
