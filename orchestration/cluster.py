"""Throwaway Spark standalone clusters (scale-out tests and benchmarks) and ``iotlake package``.

:class:`StandaloneCluster` starts one master and N workers from pyspark's own jars (no Spark
download). Code reaches their executors as on any cluster (:mod:`lakehouse.runtime.deploy`).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from lakehouse.runtime.deploy import package_zip
from orchestration.services import free_port

log = logging.getLogger(__name__)



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
    ``orchestration.cluster`` in ``orchestration.cli.COMMAND_MODULES``)."""
    p = sub.add_parser("package", help="zip iotlake's packages for Spark executors (--py-files)")
    p.add_argument("--out", default=None, help="directory for the zip (default: a temp dir)")
    p.set_defaults(func=lambda a, _s: (print(package_zip(a.out)), 0)[1])
