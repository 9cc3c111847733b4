#!/usr/bin/env python3
"""Run a command and show what the disk under PATH did meanwhile: MB/s read and written, and how busy it
was, every INTERVAL seconds (from /proc/diskstats; Linux). The gaps show where a cold run waits on
something other than the disk (torch's import, CUDA start-up).

    sync; echo 3 > /proc/sys/vm/drop_caches
    python3 scripts/disk_timeline.py /var/tmp 0.25 -- fp8convert quantize CKPT /var/tmp/out --json
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def counters(major: int, minor: int) -> tuple[int, int, int]:
    """(sectors read, sectors written, milliseconds busy) of the device, or of the busiest whole disk
    when the device is not listed (device-mapper, overlay)."""
    rows = [line.split() for line in open("/proc/diskstats")]
    for f in rows:
        if int(f[0]) == major and int(f[1]) == minor:
            return int(f[5]), int(f[9]), int(f[12])
    disks = [f for f in rows if not f[2].startswith(("loop", "ram"))]
    f = max(disks, key=lambda f: int(f[5]) + int(f[9]))
    return int(f[5]), int(f[9]), int(f[12])


def main() -> int:
    if "--" not in sys.argv or sys.argv.index("--") != 3:
        print(__doc__, file=sys.stderr)
        return 2
    path, interval, command = sys.argv[1], float(sys.argv[2]), sys.argv[4:]
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    start, before, rows = time.monotonic(), counters(major, minor), []
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while proc.poll() is None:
        time.sleep(interval)
        now = counters(major, minor)
        rows.append(
            (
                time.monotonic() - start,
                (now[0] - before[0]) * 512 / 1e6 / interval,
                (now[1] - before[1]) * 512 / 1e6 / interval,
                100 * (now[2] - before[2]) / 1000 / interval,
            )
        )
        before = now
    out, err = proc.communicate()
    print(f"rc {proc.returncode}, wall {time.monotonic() - start:.2f} s")
    print(out[-2000:], end="")
    print(err[-1000:], end="", file=sys.stderr)
    print("    t s  read MB/s  write MB/s  busy %")
    for t, read, written, busy in rows:
        print(f"{t:7.2f} {read:10.0f} {written:11.0f} {busy:7.0f}  {'R' * int(read / 200)}|{'W' * int(written / 200)}")
    idle = sum(interval for *_, busy in rows if busy < 20)
    read, written = (sum(r[i] for r in rows) * interval / 1e3 for i in (1, 2))
    print(f"read {read:.2f} GB, written {written:.2f} GB, under 20% busy for {idle:.2f} s")
    return proc.returncode


if __name__ == "__main__":
    raise SystemExit(main())
