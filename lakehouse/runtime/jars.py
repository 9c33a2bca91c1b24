"""The JVMs: where their dependencies live (resolved from Maven at install, ``make jars``, never
at run time), their options and class-data-sharing archives.

``infra/jvm/spark-jars.pom.xml`` pins delta-spark and Spark's Kafka connector for the pyspark in
``pyproject.toml``; ``infra/jvm/kafka-broker.pom.xml`` pins the embedded Apache Kafka broker.
``mvn dependency:copy-dependencies`` copies them into ``<checkout>/.jars/{spark,kafka}``
(``IOTLAKE_JARS_DIR`` points elsewhere, e.g. on a cluster image).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from lakehouse.runtime import native_memory

_CHECKOUT = Path(__file__).resolve().parents[2]


class JarsMissing(RuntimeError):
    """The Maven-resolved jars are not there; the message says how to get them."""


def jars_root() -> Path:
    return Path(os.environ.get("IOTLAKE_JARS_DIR") or _CHECKOUT / ".jars").expanduser().resolve()


def jar_dir(kind: str) -> Path:
    """``spark`` (delta-spark, spark-sql-kafka and their dependencies) or ``kafka`` (the broker)."""
    d = jars_root() / kind
    if not d.is_dir() or not any(d.glob("*.jar")):
        raise JarsMissing(
            f"no {kind} jars in {d}: run `make jars` (mvn dependency:copy-dependencies -f "
            f"infra/jvm/{'spark-jars' if kind == 'spark' else 'kafka-broker'}.pom.xml), "
            "or set IOTLAKE_JARS_DIR to a folder that holds spark/ and kafka/")
    return d


def spark_jars() -> list[str]:
    """The jars for ``spark.jars``, sorted so every process builds the same classpath."""
    return sorted(str(p) for p in jar_dir("spark").glob("*.jar"))


def kafka_classpath() -> str:
    return str(jar_dir("kafka") / "*")


def class_archive() -> Path:
    """The driver JVM's class-data-sharing archive (``make`` builds it with
    ``infra/jvm/class_archive.py spark``; a JVM that cannot use it, e.g. after a JDK or jar update,
    starts without it)."""
    return jars_root() / "cds" / "spark-driver.jsa"


def kafka_class_archive() -> Path:
    """The embedded Kafka broker's class-data-sharing archive (``make`` records it with
    ``infra/jvm/class_archive.py kafka``; a broker that cannot use it starts without it)."""
    return jars_root() / "cds" / "kafka-broker.jsa"


def java_binary() -> str | None:
    """The ``java`` Spark's launcher runs too: ``$JAVA_HOME/bin/java``, else the one on PATH."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "java").exists():
        return str(Path(home) / "bin" / "java")
    return shutil.which("java")


#: G1 hands heap back after a concurrent cycle that leaves it mostly free and takes it again at
#: the next load peak, page faults and all: a long run's RSS swung by more than its hour of
#: native growth. With this the heap grows to what the load
#: needs (at most ``spark.driver_memory``) and stays there.
KEEP_HEAP = "-XX:MaxHeapFreeRatio=100"
#: The driver's log4j2 configuration: Spark's lines to stderr at WARN and up.
LOG4J2 = Path(__file__).with_name("log4j2.properties")


def driver_java_options(class_data_sharing: bool = True, code_cache_mb: int = 0,
                        fixed_heap_mb: int = 0) -> str:
    """JVM options of the Spark driver: its logging (``LOG4J2``), ``native_memory.jvm_options``
    (bounded NIO buffer caches, native heap trims), a heap that does not shrink once grown, the
    compiled-code cache's size (``spark.code_cache_mb``), a heap fixed and touched at start
    (``spark.fixed_heap``; Spark sets -Xmx itself) and the class archive when there is one."""
    opts = " ".join((f"-Dlog4j2.configurationFile={LOG4J2}", *native_memory.jvm_options(java_binary()),
                     KEEP_HEAP))
    if fixed_heap_mb:
        opts += f" -Xms{fixed_heap_mb}m -XX:+AlwaysPreTouch"
    if code_cache_mb:
        opts += f" -XX:ReservedCodeCacheSize={code_cache_mb}m"
    if class_data_sharing:
        opts = " ".join((opts, *archive_options(class_archive())))
    return opts


def archive_options(archive: Path) -> list[str]:
    """JVM options that map ``archive`` when there is one. -Xlog off: a stale archive (a JDK or
    jar update) is skipped silently rather than warned about on every start."""
    if not archive.is_file():
        return []
    return [f"-XX:SharedArchiveFile={archive}", "-Xlog:cds=off", "-Xlog:cds+dynamic=off"]
