"""CPU and memory of the processes ``iotlake run`` is made of, by role, from /proc.

Shared by the benches that run the pipeline as a user does (``e2e_latency``, ``soak``): a role is
found from the command line (the first key it holds wins), so the JVMs, Python workers, brokers
and the driver are told apart without asking them.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

#: Process roles by command line (first match wins). The JVMs come first: the Spark JVM's
#: command line names ``pyspark.worker`` too (a warnings filter passed to executors).
ROLES = (("kafka.Kafka", "kafka broker"), ("org.apache.spark.deploy", "spark jvm"),
         ("simulate", "simulator"), ("ingest.bridge", "bridge"), ("pyspark.daemon", "spark python workers"),
         ("pyspark/daemon", "spark python workers"), ("pyspark.worker", "spark python workers"),
         ("java", "spark jvm"), ("orchestration.cli run", "driver (python)"), ("mosquitto", "mosquitto"))
#: The roles that are ``iotlake run`` itself (not the simulator, not the bench or the rest).
IOTLAKE = ("bridge", "spark python workers", "kafka broker", "spark jvm", "driver (python)", "mosquitto")

_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def processes() -> dict[int, tuple[int, str, float, int]]:
    """pid -> (parent pid, command line, CPU seconds, resident bytes) of every live process."""
    out = {}
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            f = (p / "stat").read_text().rsplit(")", 1)[1].split()
            rss = int((p / "statm").read_text().split()[1]) * _PAGE
        except (OSError, IndexError, ValueError):
            continue
        out[int(p.name)] = (int(f[1]), cmd, sum(int(x) for x in f[11:13]) / _TICK, rss)
    return out


def by_role(roots: list[int] | None = None) -> dict[str, dict[str, float]]:
    """CPU seconds so far and resident bytes now, summed by role: of every process on the
    machine (``other``: the rest), or only of ``roots`` and their descendants."""
    procs = processes()
    if roots is not None:
        keep, frontier = set(), [r for r in roots if r in procs]
        while frontier:
            pid = frontier.pop()
            keep.add(pid)
            frontier += [c for c, (ppid, *_) in procs.items() if ppid == pid and c not in keep]
        procs = {p: v for p, v in procs.items() if p in keep}
    out: dict[str, dict[str, float]] = {}
    for _, cmd, cpu, rss in procs.values():
        role = next((r for key, r in ROLES if key in cmd), "other")
        agg = out.setdefault(role, {"cpu_s": 0.0, "rss": 0, "processes": 0})
        agg["cpu_s"] += cpu
        agg["rss"] += rss
        agg["processes"] += 1
    return out


def stop_now(proc: subprocess.Popen, timeout: float = 60.0) -> bool:
    """Stop ``iotlake run`` without waiting for its running batches: Ctrl-C twice, as a user in a
    hurry does (the batches are replayed at a restart). For benches once their figures are
    taken: the graceful wait would cost a cold gold batch or two. False: still running after
    ``timeout`` (the caller kills it)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(1.0)  # the first signal handled before the second
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        return False
    return True
