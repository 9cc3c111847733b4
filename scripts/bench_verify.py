#!/usr/bin/env python3
"""How long `verify` takes against `quantize` on the same checkpoint and machine.

Each round runs, as child processes, `fp8convert quantize SRC OUT` and then `fp8convert verify SRC OUT`
(both with --device and -q; OUT is removed before each quantize), and records their wall time
(start-up and imports included), CPU time (user + system, all threads), peak RSS and the machine's
1-minute load average when each started (it counts the previous command too): on a shared machine the
load says how far to trust a round, and CPU time moves less than wall time. Rounds alternate the two commands, so a
slow spell of the machine hits both. The checkpoint is built with scripts/anchor/make_ckpt.py (or the
demo model for `tiny`) and kept in --work for later calls.

    python3 scripts/bench_verify.py --ckpt moe2 --device cpu --rounds 5          # the CPU numbers
    python3 scripts/bench_verify.py --ckpt moe8 --device cuda --drop-caches      # on a GPU machine, as root

Prints a Markdown table with each round and the medians, and writes results.json into --out.
Standard library only; the children use this checkout's fp8convert.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CKPTS = {"tiny": ("demo", 0), "moe2": ("moe", 2), "dense2": ("dense", 2), "moe8": ("moe", 8), "dense16": ("dense", 16)}


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def build(name: str, work: Path) -> Path:
    path = work / name
    if (path / "config.json").is_file():
        return path
    kind, layers = CKPTS[name]
    if kind == "demo":
        cmd = [
            sys.executable,
            "-c",
            "import sys; from fp8convert.demo import make_demo_model; make_demo_model(sys.argv[1])",
            str(path),
        ]
    else:
        cmd = [
            sys.executable,
            str(REPO / "scripts" / "anchor" / "make_ckpt.py"),
            str(path),
            "--kind",
            kind,
            "--layers",
            str(layers),
            "--shard-gb",
            "2",
        ]
    print(f"building {path} ...", flush=True)
    subprocess.run(cmd, check=True, env=child_env())
    return path


def drop_caches() -> None:
    subprocess.run("sync; echo 3 > /proc/sys/vm/drop_caches", shell=True, check=True)


def run(args: list[str]) -> dict:
    """One fp8convert command as a child process: wall seconds, peak RSS, exit status, load at start."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "fp8convert", *args],
        env=child_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.stdout.close()
    proc.stderr.close()
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"fp8convert {' '.join(args)} failed ({code}):\n{out[-2000:]}{err[-2000:]}")
    return {
        "wall_s": round(wall, 2),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 2),
        "rss_gib": round(usage.ru_maxrss / 2**20, 2),
        "load": round(load, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", choices=sorted(CKPTS), default="moe2")
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/fp8bench-verify"))
    ap.add_argument("--out", type=Path, default=Path("bench-verify"))
    ap.add_argument("--device", default="cpu", help="fp8convert's --device for both commands")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--drop-caches", action="store_true", help="drop the page cache before each command (root)")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    src = build(args.ckpt, args.work)
    out = args.work / f"{args.ckpt}-fp8"
    rounds = []
    for n in range(args.rounds):
        shutil.rmtree(out, ignore_errors=True)
        if args.drop_caches:
            drop_caches()
        quantize = run(["quantize", str(src), str(out), "--device", args.device, "-q"])
        if args.drop_caches:
            drop_caches()
        verify = run(["verify", str(src), str(out), "--device", args.device, "-q"])
        rounds.append(
            {"quantize": quantize, "verify": verify, "ratio": round(verify["wall_s"] / quantize["wall_s"], 2)}
        )
        print(
            f"round {n + 1}: quantize {quantize['wall_s']} s (load {quantize['load']}), verify "
            f"{verify['wall_s']} s (load {verify['load']}), verify/quantize {rounds[-1]['ratio']}",
            flush=True,
        )
    size = sum(p.stat().st_size for p in src.glob("*.safetensors"))
    lines = [
        f"{args.ckpt}: {size / 1e9:.2f} GB, --device {args.device}"
        + (", page cache dropped before each command" if args.drop_caches else ", page cache warm"),
        "",
        "| round | quantize wall s (load) | verify wall s (load) | verify / quantize | CPU s q / v | "
        "peak RSS GiB q / v |",
        "|---|---|---|---|---|---|",
    ]
    for n, r in enumerate(rounds, 1):
        q, v = r["quantize"], r["verify"]
        lines.append(
            f"| {n} | {q['wall_s']} ({q['load']}) | {v['wall_s']} ({v['load']}) | {r['ratio']} | "
            f"{q['cpu_s']} / {v['cpu_s']} | {q['rss_gib']} / {v['rss_gib']} |"
        )
    median = {
        k: {m: statistics.median(r[k][m] for r in rounds) for m in ("wall_s", "cpu_s")} for k in ("quantize", "verify")
    }
    lines.append(
        f"| median | {median['quantize']['wall_s']} | {median['verify']['wall_s']} | "
        f"{median['verify']['wall_s'] / median['quantize']['wall_s']:.2f} | "
        f"{median['quantize']['cpu_s']} / {median['verify']['cpu_s']} | |"
    )
    print("\n".join(lines))
    (args.out / "results.json").write_text(
        json.dumps(
            {
                "ckpt": args.ckpt,
                "bytes": size,
                "device": args.device,
                "drop_caches": args.drop_caches,
                "rounds": rounds,
            },
            indent=2,
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
