"""Running on a Spark cluster: ship iotlake's code to executors; throwaway standalone clusters.

Executors unpickle our UDFs and state functions by module name, so they need ``lakehouse``,
``bronze``, ``silver``, ``gold`` and ``ingest`` importable. When the master is not
``local[...]``, :func:`ship_packages` zips those packages (plus the expectation suites) and
adds the zip with ``SparkContext.addPyFile``: nothing has to be installed on the workers
except the same Python with iotlake's dependencies (``pip install iotlake`` there works too).

:class:`StandaloneCluster` starts one master and N workers from pyspark's own jars (no Spark
download), for the scale-out tests and benchmarks. The JVM side (delta-spark, Spark's Kafka
connector, S3A) reaches executors through ``spark.jars``, which the driver serves to them.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from lakehouse.services import free_port

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger(__name__)

#: Top-level packages executors import (UDFs and state functions live in them).
PACKAGES = ("lakehouse", "ingest", "bronze", "silver", "gold")
_ROOT = Path(__file__).resolve().parents[1]


def is_local(master: str) -> bool:
    """``local``, ``local[N]``, ``local[*]``: one JVM, code already importable."""
    return master.startswith("local")


def _sources(root: Path) -> list[Path]:
    files = [p for pkg in PACKAGES for p in (root / pkg).rglob("*.py") if "__pycache__" not in p.parts]
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


# ---- a throwaway standalone cluster (tests, benchmarks) --------------------------------------

def spark_home() -> Path:
    import pyspark

    return Path(pyspark.__file__).parent


def _scala_version(home: Path) -> str:
    """Workers build executor classpaths with Spark's launcher, which needs the Scala version."""
    jar = next(home.glob("jars/spark-core_*.jar"), None)
    return jar.name.split("_")[1].split("-")[0] if jar else "2.13"


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str, log_file: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}): {log_file.read_text()[-2000:]}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"{what} did not listen on {port} within {timeout:.0f}s (log {log_file})")


class StandaloneCluster:
    """One master and ``workers`` workers (separate JVMs) on loopback, free ports.

    Each worker offers ``cores`` cores and ``memory``; daemons run with a small heap. ``stop``
    kills each daemon's process group (the worker's executors and their Python workers too).
    """

    def __init__(self, workers: int = 2, cores: int = 1, memory: str = "1g",
                 work_dir: str | os.PathLike[str] | None = None, daemon_heap: str = "256m") -> None:
        self.workers, self.cores, self.memory, self.daemon_heap = workers, cores, memory, daemon_heap
        self._own_dir = work_dir is None  # a temp dir of ours is removed by stop()
        self.dir = Path(work_dir or tempfile.mkdtemp(prefix="iotlake-spark-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.port = self.ui_port = 0

    @property
    def master_url(self) -> str:
        return f"spark://127.0.0.1:{self.port}"

    def _java(self, name: str, cls: str, *args: str) -> tuple[subprocess.Popen, Path]:
        home = spark_home()
        log_file = self.dir / f"{name}.log"
        env = {**os.environ, "SPARK_HOME": str(home), "SPARK_LOCAL_IP": "127.0.0.1",
               "SPARK_WORKER_DIR": str(self.dir / name), "PYSPARK_PYTHON": sys.executable,
               "SPARK_SCALA_VERSION": _scala_version(home)}
        cmd = ["java", f"-Xmx{self.daemon_heap}", "-cp", f"{home}/conf:{home}/jars/*",
               "-Dspark.ui.showConsoleProgress=false", cls, *args]
        with open(log_file, "ab") as out:
            p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(p)
        return p, log_file

    def start(self, timeout: float = 60.0) -> StandaloneCluster:
        self.port, self.ui_port = free_port(), free_port()
        m, mlog = self._java("master", "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1",
                             "--port", str(self.port), "--webui-port", str(self.ui_port))
        _wait_port(self.port, m, timeout, "spark master", mlog)
        started = []
        for i in range(self.workers):  # workers start in parallel; each registers by itself
            wport = free_port()
            started.append((wport, *self._java(
                f"worker-{i}", "org.apache.spark.deploy.worker.Worker", self.master_url,
                "--host", "127.0.0.1", "--port", str(wport), "--webui-port", "0",
                "--cores", str(self.cores), "--memory", self.memory,
                "--work-dir", str(self.dir / f"worker-{i}"))))
        for i, (wport, w, wlog) in enumerate(started):
            _wait_port(wport, w, timeout, f"spark worker {i}", wlog)
        self._wait_registered(timeout)
        log.info("standalone cluster %s with %d worker(s) up", self.master_url, self.workers)
        return self

    def _wait_registered(self, timeout: float) -> None:
        """Workers listen before they registered with the master; wait for the master's word."""
        import json
        import urllib.request

        deadline = time.monotonic() + timeout
        alive = 0
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.ui_port}/json/", timeout=2) as r:
                    alive = sum(w.get("state") == "ALIVE" for w in json.load(r).get("workers", []))
                if alive >= self.workers:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"only {alive}/{self.workers} workers registered with {self.master_url}")

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
                try:
                    p.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(5)
        self.procs.clear()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> StandaloneCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def cluster_conf(executor_memory: str = "512m", cores_max: int | None = None) -> dict[str, str]:
    """Spark conf for a driver on this machine talking to a loopback standalone cluster."""
    conf = {"spark.executor.memory": executor_memory, "spark.executor.cores": "1",
            "spark.driver.host": "127.0.0.1", "spark.driver.bindAddress": "127.0.0.1"}
    if cores_max:
        conf["spark.cores.max"] = str(cores_max)
    return conf


def register(sub: argparse._SubParsersAction) -> None:
    """``iotlake package [--out DIR]``: the zip for ``spark-submit --py-files`` (needs
    ``lakehouse.cluster`` in ``lakehouse.cli.COMMAND_MODULES``)."""
    p = sub.add_parser("package", help="zip iotlake's packages for Spark executors (--py-files)")
    p.add_argument("--out", default=None, help="directory for the zip (default: a temp dir)")
    p.set_defaults(func=lambda a, _s: (print(package_zip(a.out)), 0)[1])


if __name__ == "__main__":  # python -m lakehouse.cluster [DIR]: build the zip for spark-submit
    print(package_zip(sys.argv[1] if len(sys.argv) > 1 else None))
