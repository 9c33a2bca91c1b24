"""Driver-held stream state, durable the way a state store's changelog is.

A stream that keeps its state on the driver (silver's dedup index, gold's device state)
instead of in Spark's state store writes what batch N changed to ``<checkpoint>/<name>/``
before N's tables commit: ``N.arrow`` (a changelog of changes only), or ``N.changes.arrow`` and
now and then ``N.snapshot.arrow`` (the whole state), each file written whole and renamed into
place. The state in memory belongs to one batch sequence: a batch other than the one expected
next (a restart, a replay, a batch that failed half way) rebuilds it from the files of the
batches before it, from the last snapshot on; the files of that batch and later never
committed, or are being replayed, and go.

Spark's state store (``stream.dedup = "state_store"``, ``gold.health_state = "state_store"``) is
the other way to hold the same state, for volumes a driver should not hold.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pyarrow as pa

log = logging.getLogger(__name__)


class Changelog:
    """One driver-held state's files in the checkpoint, and which batch it expects next."""

    def __init__(self, directory: str | Path, what: str, compression: str | None = None) -> None:
        self.dir = Path(directory)
        self.what = what  # for the log: "dedup index", "device state"
        self._ipc = pa.ipc.IpcWriteOptions(compression=compression)
        self.next_batch: int | None = None  # None: to be rebuilt from the files

    def files(self) -> list[tuple[int, str, Path]]:
        """(batch, kind, file) by batch; kind is ``"changes"`` for a changes-only ``N.arrow``."""
        if not self.dir.exists():
            return []
        found = []
        for f in self.dir.glob("*.arrow"):
            parts = f.name.split(".")
            found.append((int(parts[0]), parts[1] if len(parts) == 3 else "changes", f))
        return sorted(found)

    def expects(self, batch_id: int) -> bool:
        """Whether the state in memory is the one ``batch_id`` starts from; warns when a
        running sequence was broken (not at the first batch after a start)."""
        if self.next_batch == batch_id:
            return True
        if self.next_batch is not None:
            log.warning("%s: expected batch %s, got %s; rebuilding from %s",
                        self.what, self.next_batch, batch_id, self.dir)
        return False

    def write(self, batch_id: int, table: pa.Table, kind: str | None = None) -> None:
        """Batch ``batch_id``'s changes (``kind`` None or ``"changes"``) or a ``"snapshot"``."""
        self.dir.mkdir(parents=True, exist_ok=True)
        name = f"{batch_id}.{kind}.arrow" if kind else f"{batch_id}.arrow"
        tmp = self.dir / f".{name}.tmp"
        with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, table.schema, options=self._ipc) as w:
            w.write_table(table)
        os.replace(tmp, self.dir / name)

    def replay(self, batch_id: int) -> list[tuple[int, pa.Table]]:
        """The tables to rebuild the state ``batch_id`` starts from, in batch order: the last
        snapshot before it and the changes after that. Files of ``batch_id`` and later go."""
        files = []
        for b, kind, f in self.files():
            if b >= batch_id:
                f.unlink()
            else:
                files.append((b, kind, f))
        since = max((b for b, kind, _ in files if kind == "snapshot"), default=-1)
        tables = []
        for b, kind, f in files:
            if b > since or (b == since and kind == "snapshot"):
                with pa.memory_map(str(f)) as src:
                    tables.append((b, pa.ipc.open_file(src).read_all()))
        return tables

    def drop(self, batch_id: int) -> None:
        """Batch ``batch_id``'s files, once nothing in them is needed again."""
        for kind in ("", ".changes", ".snapshot"):
            (self.dir / f"{batch_id}{kind}.arrow").unlink(missing_ok=True)

    def drop_before(self, batch_id: int) -> None:
        for b, _, f in self.files():
            if b < batch_id:
                f.unlink(missing_ok=True)
