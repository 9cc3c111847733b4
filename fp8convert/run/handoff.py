"""Hand-offs between a run's threads that never wait past its stop.

Every wait wakes every POLL_S to check the run's stop event, so a thread ends even when an interrupt landed
inside a queue operation and a notification was lost. A thread's failure is handed over as `Failed`, for
the consuming thread to raise.
"""

from __future__ import annotations

import queue
import threading

POLL_S = 0.1
STOPPED = object()  # what get_unless_stopped returns once the run stopped with nothing to take


class Failed:
    def __init__(self, error: BaseException):
        self.error = error


def put_unless_stopped(handoff: queue.Queue, item, stop: threading.Event) -> bool:
    """Put `item` once there is room; False (not put) once `stop` is set."""
    while not stop.is_set():
        try:
            handoff.put(item, timeout=POLL_S)
            return True
        except queue.Full:
            continue
    return False


def get_unless_stopped(handoff: queue.Queue, stop: threading.Event):
    """The next item; STOPPED once `stop` is set and the queue is empty."""
    while True:
        try:
            return handoff.get(timeout=POLL_S)
        except queue.Empty:
            if stop.is_set():
                return STOPPED


def acquire_unless_stopped(slot: threading.Semaphore, stop: threading.Event) -> bool:
    """Take a slot once one is free; False (none taken) once `stop` is set."""
    while not slot.acquire(timeout=POLL_S):
        if stop.is_set():
            return False
    return True
