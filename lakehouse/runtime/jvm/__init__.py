"""A small JVM shim for Spark on the local file system, built from source with ``javac``.

Without libhadoop (pyspark ships none), Hadoop sets the permissions of every file it creates
on a local path by forking ``chmod``: about two processes per checkpoint or state-store file,
dozens per second with four streaming queries, each forked from a 1 GB JVM. The classes in
``src/`` do the same through java.nio. The jar is compiled on first use into the package
directory (or ``IOTLAKE_JVM_CACHE``); without a JDK Spark runs with Hadoop's default.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SRC = Path(__file__).parent / "src"

#: Spark settings that route local-file I/O (FileSystem and FileContext APIs) through the shim.
HADOOP_CONF = {
    "spark.hadoop.fs.file.impl": "iotlake.hadoop.NioLocalFileSystem",
    "spark.hadoop.fs.AbstractFileSystem.file.impl": "iotlake.hadoop.NioLocalFs",
}


def _javac() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and Path(home, "bin", "javac").exists():
        return str(Path(home, "bin", "javac"))
    return shutil.which("javac")


def shim_jar(spark_jars: Path) -> Path | None:
    """The shim jar (built if missing or stale), or None when there is no JDK to build it."""
    sources = sorted(SRC.rglob("*.java"))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources)).hexdigest()[:12]
    cache = Path(os.environ.get("IOTLAKE_JVM_CACHE") or Path(__file__).parent)
    jar = cache / f"iotlake-hadoop-{digest}.jar"
    if jar.exists():
        return jar
    javac = _javac()
    jar_tool = Path(javac).with_name("jar") if javac else None
    if javac is None or jar_tool is None or not jar_tool.exists():
        log.info("no JDK (javac): Spark writes local checkpoints with Hadoop's forking chmod")
        return None
    with tempfile.TemporaryDirectory() as out:
        try:
            subprocess.run([javac, "--release", "17", "-nowarn", "-cp", f"{spark_jars}/*", "-d", out,
                            *map(str, sources)], check=True, capture_output=True, text=True)
            cache.mkdir(parents=True, exist_ok=True)
            tmp = jar.with_suffix(f".{os.getpid()}.tmp")
            subprocess.run([str(jar_tool), "cf", str(tmp), "-C", out, "."], check=True,
                           capture_output=True, text=True)
            tmp.rename(jar)  # atomic: concurrent builders never see half a jar
        except (subprocess.CalledProcessError, OSError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            log.warning("could not build the Hadoop shim, using Hadoop's default: %s", detail[-500:])
            return None
    return jar
