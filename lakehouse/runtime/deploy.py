"""Shipping iotlake's code to Spark executors when the master is not ``local[...]``.

Executors unpickle our UDFs and state functions by module name, so they need ``lakehouse``,
``bronze``, ``silver``, ``gold`` and ``ingest`` importable. :func:`ship_packages` zips those
packages (plus the expectation suites) and adds the zip with ``SparkContext.addPyFile``: nothing
has to be installed on the workers except the same Python with iotlake's dependencies
(``pip install iotlake`` there works too). The JVM side (delta-spark, Spark's Kafka connector,
S3A) reaches executors through ``spark.jars``, which the driver serves to them.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

#: Top-level packages executors import (UDFs and state functions live in them).
PACKAGES = ("lakehouse", "ingest", "bronze", "silver", "gold")
_ROOT = Path(__file__).resolve().parents[2]


def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``: one JVM, code already importable."""
    return master.startswith("local")


def _sources(root: Path) -> list[Path]:
    # modules and their data (the default telemetry model is a .toml the executors read too)
    files = [p for pkg in PACKAGES for pattern in ("*.py", "*.toml") for p in (root / pkg).rglob(pattern)
             if "__pycache__" not in p.parts]
    files += sorted((root / "expectations").glob("*.json"))
    return sorted(files)


def package_zip(dest_dir: str | os.PathLike[str] | None = None, root: Path = _ROOT) -> Path:
    """Zip of iotlake's packages, named by content hash (stale code never runs; built once)."""
    files = _sources(root)
    if not files:
        raise RuntimeError(f"no iotlake packages under {root}")
    h = hashlib.sha256()
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    dest = Path(dest_dir or Path(tempfile.gettempdir()) / "iotlake-pyfiles")
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"iotlake-{h.hexdigest()[:16]}.zip"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for f in files:
                z.write(f, f.relative_to(root).as_posix())
        tmp.replace(out)
    return out


def ship_packages(spark: SparkSession, dest_dir: str | os.PathLike[str] | None = None) -> Path:
    """Add the package zip to the session so every executor's Python worker imports from it.

    The packages are imported on the driver first: ``addPyFile`` also puts the zip on the
    driver's ``sys.path``, and an already-imported package keeps resolving its submodules from
    the source tree (whose non-Python files, e.g. the expectation suites, stay readable).
    """
    for pkg in PACKAGES:
        importlib.import_module(pkg)
    z = package_zip(dest_dir)
    if Path(z).name not in {Path(p).name for p in spark.sparkContext._python_includes or []}:
        spark.sparkContext.addPyFile(str(z))
        log.info("shipped %s to executors", z.name)
    return z


if __name__ == "__main__":  # python -m lakehouse.runtime.deploy [DIR]: build the zip for spark-submit
    print(package_zip(sys.argv[1] if len(sys.argv) > 1 else None))
