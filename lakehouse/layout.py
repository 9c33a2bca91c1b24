"""Where a lake's files live: tables, checkpoints, run files and the current generation.

Tables are under ``<data_root>/tables`` (a local folder or an ``s3://`` prefix); checkpoints
under ``<checkpoint root>/checkpoints``; run files (embedded brokers, status) and
``CURRENT_GENERATION`` under the local root. Time-travel reprocessing builds the derived tables
and queries into ``generations/<name>/`` and switches readers to it by atomically replacing
``CURRENT_GENERATION`` (orchestration.reprocess.switch_generation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from lakehouse.storage import is_uri

#: Tables and queries rebuilt by time-travel reprocessing (everything downstream of bronze).
DERIVED_TABLES = frozenset({
    "silver", "quarantine", "quality_log", "gold_metrics_1m", "gold_metrics_5m",
    "gold_metrics_1m_final", "gold_metrics_5m_final", "device_current",
    "device_status_history", "readings_scored", "anomalies"})
DERIVED_QUERIES = frozenset({"silver", "gold_metrics_1m", "gold_health"})

GENERATION_FILE = "CURRENT_GENERATION"

#: CURRENT_GENERATION's content by path, with the (mtime_ns, inode, size) it was read at.
_generations: dict[Path, tuple[tuple[int, int, int], str]] = {}


def current_generation(root: Path) -> str:
    """The generation named by ``<root>/CURRENT_GENERATION`` ("" without the file).

    Read again only when a ``stat`` shows the file changed: a switch replaces it (a new inode),
    so a long-running process sees it at its next call.
    """
    f = root / GENERATION_FILE
    try:
        st = f.stat()
    except (FileNotFoundError, NotADirectoryError):
        return ""
    key = (st.st_mtime_ns, st.st_ino, st.st_size)
    cached = _generations.get(f)
    if cached is not None and cached[0] == key:
        return cached[1]
    try:
        generation = f.read_text().strip()
    except FileNotFoundError:  # removed since the stat
        return ""
    _generations[f] = (key, generation)
    return generation


@dataclass(frozen=True)
class Layout:
    """The locations of one lake: ``data_root`` (a local path or an object-store URI),
    ``checkpoints`` (``storage.checkpoint_root``; "" = the local root) and, when ``pinned`` is
    not None, the generation used instead of the current one."""

    data_root: str
    checkpoints: str = ""
    pinned: str | None = None

    @property
    def remote(self) -> bool:
        """Tables live in object storage (``data_root`` is a URI)."""
        return is_uri(self.data_root)

    @property
    def root(self) -> Path:
        """The local directory: ``data_root``, or the checkpoint root when tables are remote.
        Checkpoints, run files and ``CURRENT_GENERATION`` live under it."""
        local = self.checkpoints if self.remote else self.data_root
        return Path(local).expanduser().resolve()

    @property
    def checkpoint_root(self) -> Path:
        return Path(self.checkpoints).expanduser().resolve() if self.checkpoints else self.root

    @property
    def run_dir(self) -> Path:
        return self.root / "run"

    def generation(self) -> str:
        """The generation of derived tables readers use ("" = the original one)."""
        return self.pinned if self.pinned is not None else current_generation(self.root)

    def _generation_parts(self, name: str, derived: frozenset[str], generation: str | None) -> list[str]:
        gen = self.generation() if generation is None else generation
        return ["generations", gen] if gen and name in derived else []

    def table_path(self, name: str, generation: str | None = None) -> str:
        """Location of a Delta table by its logical name (``bronze``, ``silver``, ...)."""
        if not name.replace("_", "").isalnum():
            raise ValueError(f"table name {name!r} must be letters, digits and '_'")
        parts = [*self._generation_parts(name, DERIVED_TABLES, generation), "tables", name]
        if self.remote:
            return "/".join([self.data_root, *parts])
        return str(self.root.joinpath(*parts))

    def checkpoint_path(self, query: str, generation: str | None = None) -> str:
        parts = [*self._generation_parts(query, DERIVED_QUERIES, generation), "checkpoints", query]
        return str(self.checkpoint_root.joinpath(*parts))
