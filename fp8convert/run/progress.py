"""Progress: a rich bar (bytes, throughput, ETA) on a terminal; plain timestamped lines otherwise."""

from __future__ import annotations

import sys
import time

from ..units import format_size

# The most the columns right of the bar take ('123.4/456.7 GB', '123.4 MB/s', '0:00:12') and the spaces
# between the five columns; the description and the bar share the rest of the terminal's width.
NUMBERS_WIDTH = 14 + 10 + 7 + 4
BAR_WIDTH = (10, 40)  # least, most
LOG_INTERVAL_S = 10.0


class Progress:
    """`plain`: log lines even on a terminal (several workers' live bars would garble it)."""

    def __init__(self, total_bytes: int, label: str, enabled: bool = True, stream=None, plain: bool = False):
        self.total, self.label, self.enabled = total_bytes, label, enabled
        self.stream = stream or sys.stderr
        self.done = 0
        self.start = self.last_log = time.monotonic()
        self.bar = None
        if enabled and not plain and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, DownloadColumn, TimeRemainingColumn, TransferSpeedColumn
            from rich.progress import Progress as RichProgress

            self.bar_column = BarColumn()
            self.bar = RichProgress(
                "[bold]{task.description}",
                self.bar_column,
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(file=self.stream),
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task(self.fit(""), total=total_bytes)

    def fit(self, what: str) -> str:
        """Shortened in the middle (its start says which run, its end which layer); the bar takes what is left."""
        text = f"{self.label} {what}".strip()
        room = self.bar.console.width - NUMBERS_WIDTH
        most = max(room - BAR_WIDTH[0], 10)
        if len(text) > most:
            head = text.find(" ") + 1  # the command word, where it leaves room for the layer
            head = head if 0 < head <= most // 3 else most // 3
            text = text[:head] + "…" + text[len(text) - (most - head - 1) :]
        self.bar_column.bar_width = max(BAR_WIDTH[0], min(BAR_WIDTH[1], room - len(text)))
        return text

    def advance(self, nbytes: int, what: str = "") -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, description=self.fit(what))
            return
        now = time.monotonic()
        if self.enabled and (now - self.last_log >= LOG_INTERVAL_S or self.done >= self.total):
            self.last_log = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            pct = 100.0 * self.done / self.total if self.total else 100.0
            line = (
                f"{self.label}: {format_size(self.done)} of {format_size(self.total)} ({pct:.0f}%), "
                f"{format_size(rate)}/s, eta {eta:.0f}s"
            )
            log(line, stream=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def log(message: str, enabled: bool = True, stream=None) -> None:
    """A plain timestamped line on `stream`, else stderr (cluster logs are files, not terminals)."""
    if enabled:
        print(f"{time.strftime('%Y-%m-%dT%H:%M:%S')} {message}", file=stream or sys.stderr, flush=True)
