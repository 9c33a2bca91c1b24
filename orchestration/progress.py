"""Progress of batch commands' streaming queries (``iotlake backfill``, ``iotlake reprocess``).

Rows and micro-batches are counted by a :class:`lakehouse.monitoring.metrics.BatchTotals` listener, not
from ``recentProgress`` (its last 100 batches only). On a terminal (stderr) a bar shows rows done
of rows to do, the rate and the time left; otherwise (a log, an Airflow task) one line per
interval says the same.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable

from pyspark.sql.streaming import StreamingQuery

from lakehouse.monitoring.metrics import BatchTotals

log = logging.getLogger(__name__)


class RowsProgress:
    """``label``: ``rows`` of ``todo`` rows done, as a bar on a terminal or log lines."""

    def __init__(self, label: str, todo: int, every: float = 2.0, tty: bool | None = None) -> None:
        self.label, self.todo, self.every = label, todo, every
        self.tty = sys.stderr.isatty() if tty is None else tty
        self.started = time.monotonic()
        self._last_log = self.started
        self._bar = None

    def __enter__(self) -> RowsProgress:
        if self.tty:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 TextColumn("{task.fields[figures]}"),
                                 console=Console(file=sys.stderr), transient=False)
            self._bar.start()
            self._task = self._bar.add_task(self.label, total=self.todo or None, figures="")
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()

    def figures(self, rows: int, batches: int) -> str:
        """``1,200 / 5,000 rows (24%), 12 batches, 600 rows/s, 6 s left``."""
        elapsed = max(time.monotonic() - self.started, 1e-9)
        rate = rows / elapsed
        pct = 100.0 * rows / self.todo if self.todo else 100.0
        text = f"{rows:,} / {self.todo:,} rows ({pct:.0f}%), {batches:,} batches, {rate:,.0f} rows/s"
        if rate > 0 and rows < self.todo:
            text += f", {_duration((self.todo - rows) / rate)} left"
        return text

    def update(self, rows: int, batches: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=rows, total=max(self.todo, rows) or None,
                             figures=self.figures(rows, batches))
        elif time.monotonic() - self._last_log >= self.every:
            log.info("%s: %s", self.label, self.figures(rows, batches))
            self._last_log = time.monotonic()


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else (
        f"{s // 60}:{s % 60:02d}" if s >= 60 else f"{s} s")


def follow(totals: BatchTotals, main: StreamingQuery, queries: Iterable[StreamingQuery], label: str,
           todo: int, every: float = 2.0) -> tuple[int, int]:
    """Wait for ``queries`` (``main`` among them) to stop, showing ``main``'s progress; returns
    its (input rows, micro-batches), exact once the listener has had its end."""
    queries = list(queries)
    with RowsProgress(label, todo, every) as shown:
        while any(q.isActive for q in queries):
            shown.update(*totals.totals(main))
            time.sleep(0.5)
        rows, batches = totals.final(main)
        shown.update(rows, batches)
    log.info("%s: done, %s", label, shown.figures(rows, batches))
    return rows, batches
