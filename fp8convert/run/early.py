"""BF16 weights quantized with numpy while torch is still loading.

A cold `import torch` (and a CUDA context) takes seconds, in which the disk reads the checkpoint and the
kept tensors are copied, but nothing is quantized: in first runs on an H200 box every read of a dense
8B-shaped checkpoint was done before torch was ready, and all of its writes came after. This module
quantizes, in the pipeline's order and in forked processes, the scale groups that need nothing torch
does: BF16 weights, whole (not cut from a fused expert tensor), per tensor, per row or per 128x128 block.
When torch is ready the run stops it (`stop`): the groups in hand are finished, and the pipeline takes
every group not done. When it has written every tensor the pipeline would quantize, the run ends
without waiting for torch; when it can take every one, torch's start waits until the disk's reads run
ahead of it, so a disk it keeps up with never shares its time with torch's start-up reads (api.py).

The math is in run/numpy_quantize.py, imported by the processes once forked.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import struct
import threading
from pathlib import Path
from typing import Callable

from ..errors import FP8ConvertError
from ..plan.plan import Action, Plan, TensorPlan, Unit
from ..plan.runs import Run, output_runs
from ..safetensors_io import SourceFiles
from .writer import pwrite_all

SCHEMES = ("tensor", "channel", "block")
FDS_PER_MESSAGE = 200  # shard files handed over per message: the kernel takes at most 253 descriptors
PR_SET_PDEATHSIG = 1  # prctl's option: a signal for this process when its parent dies (Linux)


def eligible(t: TensorPlan) -> bool:
    return (t.action is Action.QUANTIZE and t.cut is None and t.source.dtype == "BF16" and len(t.shape) == 2
            and not t.input_scale_name)


def early_groups(units: list[Unit], scheme: str) -> list[list[TensorPlan]]:
    """The units' scale groups this module can quantize, in the units' order: a fused group's members
    together in the tensor scheme (they share one scale), else each weight alone."""
    if scheme not in SCHEMES:
        return []
    groups: list[list[TensorPlan]] = []
    for unit in units:
        by_key: dict[str, list[TensorPlan]] = {}
        for t in unit.tensors:
            if t.computed:
                by_key.setdefault(t.group if scheme == "tensor" and t.group else f"tensor:{t.name}", []).append(t)
        groups += [g for g in by_key.values() if all(eligible(t) for t in g)]
    return groups


class EarlyQuantizer:
    """Quantizes `groups` (early_groups) into their shards in `processes` forked processes, each taking the
    next group not taken, until every group is written or the run stops it. Processes, not threads: a
    thread quantized 0.02 GB/s beside torch's import, which holds the GIL (2-core machine); and on an H200
    box threads of one process stopped gaining at 4 (1.2 GB/s).

    The parent's steps: `fork()` before torch's thread starts (a small process forks quickly, and
    neither side then copies pages the other writes); `start(writer, on_done)` once the writer can make
    the shard files (the children write through descriptors of them); `wait_for(ready)` until torch is
    ready or every group is written; `stop()` (the groups in hand are finished) for the tensors written;
    `close()` (also on leaving it as a context manager) reaps the children."""

    def __init__(self, plan: Plan, groups: list[list[TensorPlan]], processes: int):
        self.plan, self.groups = plan, groups
        self.processes = max(1, min(processes, len(groups)))  # none are forked without groups
        self.root = Path(plan.source.root)
        self.done: list[TensorPlan] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()  # every child has left: all groups written, or stopped
        self.children: list[tuple[int, socket.socket]] = []  # pid, and the socket its files go through
        self.tasks: int | None = None  # the pipe's write end the group numbers go through
        self.stop_pipe: int | None = None  # closed to stop the children
        self.reports: int | None = None  # the pipe's read end they report through
        self.feeder: threading.Thread | None = None
        self.listener: threading.Thread | None = None
        self.writer = None
        self.on_done: Callable[[int], None] = lambda nbytes: None

    def fork(self) -> None:
        if not self.groups or self.children:
            return
        tasks_r, self.tasks = os.pipe()
        stop_r, self.stop_pipe = os.pipe()
        self.reports, reports_w = os.pipe()
        parent = os.getpid()
        for _ in range(self.processes):
            parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)  # messages kept whole
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    die_with_parent(parent)
                    signal.signal(signal.SIGINT, signal.SIG_DFL)  # Ctrl-C ends the children with the run
                    for fd in (self.tasks, self.stop_pipe, self.reports):
                        os.close(fd)
                    for sock in [parent_end] + [end for _, end in self.children]:
                        sock.close()
                    self._child(child_end, tasks_r, stop_r, reports_w)
                    code = 0
                finally:
                    os._exit(code)
            child_end.close()
            self.children.append((pid, parent_end))
        for fd in (tasks_r, stop_r, reports_w):
            os.close(fd)

    def start(self, writer, on_done: Callable[[int], None]) -> None:
        """Hand the children the shard files (made now) and the group numbers; account for their reports."""
        if not self.children:
            self.finished.set()
            return
        self.writer, self.on_done = writer, on_done
        shards = sorted({self.plan.shard_of[t.name] for g in self.groups for t in g})  # a tensor's outputs share one
        with writer.lock:
            files = {s: writer._fd(s) for s in shards if s in writer.remaining}
        shards = list(files)
        for _, channel in self.children:
            for at in range(0, len(shards), FDS_PER_MESSAGE):
                part = shards[at:at + FDS_PER_MESSAGE]
                last = at + FDS_PER_MESSAGE >= len(shards)
                socket.send_fds(channel, [json.dumps({"shards": part, "last": last}).encode()], [files[s] for s in part])
            channel.close()
        tasks, self.tasks = self.tasks, None  # the feeder's now: it closes it
        self.feeder = threading.Thread(target=self._feed, args=(tasks,), name="fp8convert-early-feed", daemon=True)
        self.feeder.start()
        reports, self.reports = self.reports, None
        self.listener = threading.Thread(target=self._listen, args=(reports,), name="fp8convert-early", daemon=True)
        self.listener.start()

    def takes_all(self, units: list[Unit]) -> bool:
        """Whether its groups are every tensor `units` computes: the run may then need no torch."""
        return bool(self.groups) and sum(map(len, self.groups)) == sum(t.computed for u in units for t in u.tensors)

    def wait_for(self, ready: Callable[[], bool]) -> None:
        """Until `ready()` (torch's start is done) or every child has left."""
        while not ready() and not self.finished.wait(0.01):
            pass

    def stop(self) -> list[TensorPlan]:
        """Stop the children (each finishes its group in hand) and return the tensors they wrote; raise
        the first error one of them reported (a NaN or Inf weight, a short file)."""
        self.close()
        if self.error is not None:
            raise self.error
        return list(self.done)

    def close(self) -> None:
        for _, channel in self.children:
            channel.close()  # never started: a child told nothing leaves
        for name in ("tasks", "stop_pipe", "reports"):  # those not handed to a thread yet
            if getattr(self, name) is not None:
                os.close(getattr(self, name))
                setattr(self, name, None)
        if self.listener is not None:
            self.listener.join()
            self.listener = None
        for pid, _ in self.children:
            os.waitpid(pid, 0)
        self.children = []
        if self.feeder is not None:  # with every child gone, its next write fails at once
            self.feeder.join()
            self.feeder = None

    def __enter__(self) -> "EarlyQuantizer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _feed(self, tasks: int) -> None:
        """The group numbers, in order, into the pipe the children take them from (it holds 16k; a
        larger model's wait here for room)."""
        try:
            for index in range(len(self.groups)):
                os.write(tasks, struct.pack("<I", index))
        except OSError:  # the children have left (stopped, or failed)
            pass
        finally:
            os.close(tasks)

    def _listen(self, reports: int) -> None:
        """The parent's thread: account for each group a child wrote, as they report them."""
        with os.fdopen(reports, "r", errors="replace") as lines:  # a message cut inside a character
            for line in lines:
                kind, _, rest = line.rstrip("\n").partition(" ")
                if kind == "done":
                    group = self.groups[int(rest)]
                    try:
                        for t in group:
                            for run in output_runs(self.plan, [t], merge=False):
                                self.writer.written_elsewhere(run)
                    except BaseException as e:  # noqa: BLE001 - raised by stop()
                        self.error = self.error or e
                        continue
                    self.done += group
                    self.on_done(sum(t.in_bytes for t in group))
                elif kind == "error":
                    self.error = self.error or FP8ConvertError(rest)
        self.finished.set()

    def _child(self, channel: socket.socket, tasks: int, stop: int, reports: int) -> None:
        """A child: takes group numbers until none is left or the stop pipe is closed."""
        shard_files: dict[int, int] = {}
        while True:
            message, fds, _, _ = socket.recv_fds(channel, 1 << 16, FDS_PER_MESSAGE)
            if not message:  # the run ended before starting us
                return
            part = json.loads(message)
            shard_files.update(zip(part["shards"], fds))
            if part["last"]:
                break
        from .numpy_quantize import GroupQuantizer  # numpy: imported here, not before the run's first reads
        quantizer = GroupQuantizer(self.plan, DirectWriter(shard_files))
        os.set_blocking(stop, False)
        with SourceFiles(self.root) as files:
            while not stopped(stop):
                number = os.read(tasks, 4)
                if len(number) < 4:  # every group taken
                    return
                index = struct.unpack("<I", number)[0]
                try:
                    quantizer.quantize_group(self.groups[index], files)
                except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
                    text = str(e) if isinstance(e, FP8ConvertError) else f"{type(e).__name__}: {e}"
                    # one write under PIPE_BUF (4096 bytes) is never interleaved with another child's
                    os.write(reports, ("error " + text.replace("\n", " ")).encode()[:4000] + b"\n")
                    return
                os.write(reports, f"done {index}\n".encode())


def die_with_parent(parent: int) -> None:
    """Have the kernel kill this child when the run's process dies (a SIGKILL, the OOM killer): a child
    left writing would race the rerun that rewrites the same files."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request was made
        os._exit(1)


def stopped(stop: int) -> bool:
    """Whether the parent has closed the stop pipe (`stop`: its read end, not blocking)."""
    try:
        return os.read(stop, 1) == b""
    except BlockingIOError:  # still open
        return False


class DirectWriter:
    """The child's writer: straight into the shard files the parent made, at the planned places."""

    def __init__(self, fds: dict[int, int]):
        self.fds = fds

    def write(self, run: Run, data) -> None:
        # every shard a group writes into was handed over: the run's units write only its own shards
        pwrite_all(self.fds[run.shard], memoryview(data).cast("B"), run.start)
