"""CPU of one local Spark application split into what a cluster parallelises and what it does not.

In ``local[N]`` the driver and the executor share one JVM, but their threads have names: task
threads are ``Executor task launch worker ...`` (Linux keeps the first 15 characters in
``/proc/<pid>/task/<tid>/comm``). Work on those threads, and in the Python workers they feed
(children of the JVM), runs on executors in a cluster and spreads over them. Everything else in
the JVM (planning, scheduling, the streaming source's offset bookkeeping, Delta commits and log
reads) and the driver's own Python (``foreachBatch`` bodies) stays on the one driver: the serial
part of Amdahl's law. GC and JIT threads serve both sides and are split in proportion.

A thread's CPU is only readable while it lives, so threads are sampled every ``interval``
seconds; the JVM's process total (which keeps the CPU of exited threads) bounds the driver side.
"""

from __future__ import annotations

import os
import re
import resource
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
_EXECUTOR = "Executor task"
_RUNTIME = ("GC Thread", "G1 ", "C1 Compiler", "C2 Compiler", "VM Thread", "VM Periodic", "Sweeper thread")


def _stat(path: Path) -> tuple[str, list[str]]:
    """(comm, fields after it) of a /proc stat file."""
    text = path.read_text()
    head, rest = text.rsplit(")", 1)
    return head.split("(", 1)[1], rest.split()


def _cpu(fields: list[str], children: bool = False) -> float:
    """utime + stime (fields 14, 15; with ``children`` also 16, 17) in seconds."""
    ticks = sum(int(f) for f in fields[11:15 if children else 13])
    return ticks / _TICK


@dataclass(frozen=True)
class CpuSplit:
    driver_jvm: float
    executor_jvm: float
    runtime: float
    python_workers: float
    driver_python: float
    #: driver-side JVM CPU by thread name (digits dropped), largest first: where the serial part goes
    driver_threads: tuple[tuple[str, float], ...] = ()

    @property
    def serial(self) -> float:
        """Driver CPU with its share of GC/JIT."""
        d, e = self.driver_jvm + self.driver_python, self.executor_jvm + self.python_workers
        return d + self.runtime * (d / (d + e) if d + e else 0.5)

    @property
    def parallel(self) -> float:
        return self.driver_jvm + self.driver_python + self.executor_jvm + self.python_workers \
            + self.runtime - self.serial

    def predicted_speedup(self, executors: int) -> float:
        """Amdahl: the same work with the parallel part spread over ``executors``."""
        total = self.serial + self.parallel
        return total / (self.serial + self.parallel / executors) if total else 1.0


class SparkCpuSampler:
    """Samples the threads of the JVM ``jvm_pid`` and its child processes between start and stop."""

    def __init__(self, jvm_pid: int, interval: float = 0.2) -> None:
        self.pid, self.interval = jvm_pid, interval
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, float]] = {}
        self._workers_first: dict[int, float] = {}
        self._workers_last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="spark-cpu-sampler", daemon=True)
        self._sampler_cpu = 0.0

    def start(self) -> SparkCpuSampler:
        self._jvm0 = _cpu(_stat(Path(f"/proc/{self.pid}/stat"))[1])
        self._self0 = resource.getrusage(resource.RUSAGE_SELF)
        self._sample(first=True)
        self._thread.start()
        return self

    def stop(self) -> CpuSplit:
        self._stop.set()
        self._thread.join()
        self._sample()
        jvm = _cpu(_stat(Path(f"/proc/{self.pid}/stat"))[1]) - self._jvm0
        me = resource.getrusage(resource.RUSAGE_SELF)
        driver_python = (me.ru_utime - self._self0.ru_utime + me.ru_stime - self._self0.ru_stime
                         - self._sampler_cpu)
        executor = runtime = 0.0
        by_name: dict[str, float] = {}
        for tid, (name, cpu) in self._last.items():
            used = cpu - self._first.get(tid, 0.0)
            if name.startswith(_EXECUTOR):
                executor += used
            elif name.startswith(_RUNTIME):
                runtime += used
            else:
                key = re.sub(r"\d+", "N", name)
                by_name[key] = by_name.get(key, 0.0) + used
        top = tuple(sorted(((k, round(v, 2)) for k, v in by_name.items() if v > 0),
                           key=lambda kv: -kv[1])[:10])
        workers = sum(v - self._workers_first.get(p, 0.0) for p, v in self._workers_last.items())
        return CpuSplit(driver_jvm=max(0.0, jvm - executor - runtime), executor_jvm=executor,
                        runtime=runtime, python_workers=workers, driver_python=max(0.0, driver_python),
                        driver_threads=top)

    def _run(self) -> None:
        t0 = time.thread_time()
        while not self._stop.wait(self.interval):
            self._sample()
        self._sampler_cpu = time.thread_time() - t0

    def _sample(self, first: bool = False) -> None:
        for tid in _listdir(f"/proc/{self.pid}/task"):
            try:
                name, fields = _stat(Path(f"/proc/{self.pid}/task/{tid}/stat"))
            except (OSError, IndexError):
                continue
            cpu = _cpu(fields)
            if first:
                self._first[tid] = cpu
            self._last[tid] = (name, cpu)
        for pid in self._descendants():
            try:
                cpu = _cpu(_stat(Path(f"/proc/{pid}/stat"))[1], children=True)
            except (OSError, IndexError):
                continue
            if first:
                self._workers_first[pid] = cpu
            self._workers_last[pid] = cpu

    def _descendants(self) -> list[int]:
        parent: dict[int, int] = {}
        for p in _listdir("/proc"):
            try:
                parent[p] = int(_stat(Path(f"/proc/{p}/stat"))[1][1])
            except (OSError, IndexError, ValueError):
                continue
        found, frontier = [], [self.pid]
        while frontier:
            kids = [p for p, pp in parent.items() if pp in frontier]
            found += kids
            frontier = kids
        return found


def _listdir(path: str) -> list[int]:
    try:
        return [int(n) for n in os.listdir(path) if n.isdigit()]
    except OSError:
        return []
