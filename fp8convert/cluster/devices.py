"""--devices: one spawned worker process per device of this machine, splitting this worker's shards.

A child gets the parent's Settings whole, with only its device and worker slot changed, so every option
reaches it by construction. The children never finalize; the parent does once they all succeeded.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from ..errors import FP8ConvertError, UsageError
from ..options import Settings
from ..units import plural
from .workers import WorkerSpec


def parse_devices(devices: str | list[str] | tuple[str, ...]) -> list[str]:
    """'cuda:0,cuda:1' / ['cuda:0', 'cuda:1'] / 'all' (every CUDA device); 'cpu' entries too (several CPU
    workers, mostly for tests). Bare 'cuda' is refused: say which GPU."""
    items = devices.split(",") if isinstance(devices, str) else list(devices)
    items = [d.strip() for d in items if d.strip()]
    if items == ["all"]:
        import torch

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
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
    Children get no --overwrite: the parent has already replaced OUT, and a worker of several may not."""
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
