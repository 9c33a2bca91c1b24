"""The Spark session, configured from settings: Delta Lake and Spark's Kafka connector on the
classpath from the Maven-resolved jars (``lakehouse.runtime.jars``), nothing downloaded at run time."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
from pyspark import SparkContext
from pyspark.sql import DataFrame, SparkSession

from lakehouse import storage
from lakehouse.runtime import jars
from lakehouse.runtime.deploy import is_local, ship_packages
from lakehouse.runtime.jvm_names import remember_jvm_names
from lakehouse.settings import Settings

#: Spark's FAIR scheduler pools, one per layer (``spark.fair_pools``; ``lakehouse.streams.pool``).
FAIR_POOLS = Path(__file__).parent / "runtime" / "fairscheduler.xml"


def codegen_factory_mode(settings: Settings, batch: bool) -> str:
    """Spark's expression factory mode for a process that runs batch work (``batch``: large
    batches, compiled code pays) or live streams (small batches: interpreted)."""
    mode = settings.spark.expression_codegen
    return "FALLBACK" if mode == "on" or (mode == "batch" and batch) else "NO_CODEGEN"


def spark_session(settings: Settings, app_name: str = "iotlake", batch: bool = False) -> SparkSession:
    """Create (or reuse) the session. Workers run this venv's Python so they find pyarrow.

    ``batch``: the process runs batch work (a backfill, a reprocess, SQL, maintenance); it
    decides ``spark.expression_codegen = "batch"`` when the session is created, and a reused
    session keeps the mode it was created with.

    With a cluster master (``spark://``, ``k8s://``, ``yarn``) iotlake's packages are shipped to
    the executors (``lakehouse.runtime.deploy``); executors need the same Python and dependencies.
    """
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    if settings.spark.malloc_arenas:  # read by glibc when the driver JVM starts (a child of ours)
        os.environ.setdefault("MALLOC_ARENA_MAX", str(settings.spark.malloc_arenas))
    # Object storage: fail fast on bad credentials; export AWS_* for the driver's own delta-rs
    # reads (lakehouse.delta.read). Spark itself reaches S3 through S3A (storage.spark_conf).
    storage.check(settings)
    storage.configure(settings)
    remember_jvm_names()
    b = (
        SparkSession.builder.appName(app_name)
        .master(settings.spark.master)
        .config("spark.driver.memory", settings.spark.driver_memory)
        .config("spark.sql.shuffle.partitions", str(shuffle_partitions(settings)))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.ui.enabled", str(settings.spark.ui_enabled).lower())
        .config("spark.sql.streaming.stateStore.providerClass",
                "org.apache.spark.sql.execution.streaming.state.RocksDBStateStoreProvider")
        .config("spark.sql.streaming.stateStore.rocksdb.changelogCheckpointing.enabled", "true")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.sql.streaming.noDataMicroBatches.enabled", "true")
        .config("spark.sql.streaming.minBatchesToRetain", str(settings.stream.checkpoint_batches))
        .config("spark.python.worker.reuse", "true")
        # Python workers start slowly on a loaded 2-core machine; don't fail the stream for it
        .config("spark.python.authenticate.socketTimeout", "120s")
        # exactly Int.MaxValue: otherwise Spark re-measures the Arrow batch after every row it
        # sends to a Python worker (gold's state function); maxRecordsPerBatch still caps batches
        .config("spark.sql.execution.arrow.maxBytesPerBatch", "2147483647")
        .config("spark.sql.adaptive.enabled", "false")
        # compiled plans Spark keeps (default 100): iotlake's queries generate more distinct
        # classes than that (silver's parse and checks, gold's streams, their writes), and the
        # least recently used of a cyclic set is always the next one needed, so every
        # micro-batch compiled its classes again
        .config("spark.sql.codegen.cache.maxEntries", "1000")
        .config("spark.ui.showConsoleProgress", "false")
        # pandas 2.x warns at every applyInPandasWithState batch (gold health) about a concat
        # inside pyspark's own worker and serializer, not our code: a line per batch in the log
        # of `iotlake run`, for weeks
        .config("spark.executorEnv.PYTHONWARNINGS", "ignore::FutureWarning:pyspark.worker,"
                "ignore::FutureWarning:pyspark.sql.pandas.serializers")
        .config("spark.driver.extraJavaOptions", jars.driver_java_options(
            settings.spark.class_data_sharing, settings.spark.code_cache_mb,
            settings.spark.driver_memory_mb if settings.spark.fixed_heap else 0))
        .config("spark.jars", ",".join(jars.spark_jars()))
        .config("spark.sql.extensions", "io.delta.sql.DeltaSparkSessionExtension")
        .config("spark.sql.catalog.spark_catalog", "org.apache.spark.sql.delta.catalog.DeltaCatalog")
        # tables stay readable by delta-rs (dashboard, DuckDB, Polars): no deletion vectors
        .config("spark.databricks.delta.properties.defaults.enableDeletionVectors", "false")
        # a Delta snapshot's state is small here: 50 shuffle tasks per log replay cost more
        .config("spark.databricks.delta.snapshotPartitions", "2")
        # tables created here keep commit files for the time-travel horizon only, and removed
        # data files until vacuum's retention (Delta 4 takes it from this property, not RETAIN)
        .config("spark.databricks.delta.properties.defaults.logRetentionDuration",
                _minutes(settings.maintenance.log_retention_hours))
        .config("spark.databricks.delta.properties.defaults.deletedFileRetentionDuration",
                _minutes(settings.maintenance.vacuum_retention_hours))
        .config("spark.databricks.delta.properties.defaults.checkpointInterval",
                str(settings.maintenance.log_checkpoint_commits))
        # the log is cleaned by iotlake's upkeep, which keeps what a lagging stream still has to
        # read; Delta's own clean-up at log checkpoints does not know the streams
        .config("spark.databricks.delta.properties.defaults.enableExpiredLogCleanup", "false")
    )
    if SparkContext._active_spark_context is None:  # a session of this process keeps its mode
        b = b.config("spark.sql.codegen.factoryMode", codegen_factory_mode(settings, batch))
    if settings.spark.fair_pools:
        b = (b.config("spark.scheduler.mode", "FAIR")
             .config("spark.scheduler.allocation.file", str(FAIR_POOLS)))
    # s3:// tables: S3A from the storage settings (spark.conf entries override them)
    conf = {**storage.spark_conf(settings), **settings.spark.conf}
    if is_local(settings.spark.master) and settings.spark.local_fs_shim:
        conf = _with_local_fs_shim(conf)
    for k, v in conf.items():
        b = b.config(k, v)
    spark = b.getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    _quiet_loggers(spark)
    if not is_local(settings.spark.master):
        ship_packages(spark)
    return spark


@contextmanager
def session_confs(spark: SparkSession, confs: dict[str, str]) -> Iterator[None]:
    """Session confs for one operation, then back to what they were."""
    old = {k: spark.conf.get(k, None) for k in confs}
    for k, v in confs.items():
        spark.conf.set(k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                spark.conf.unset(k)
            else:
                spark.conf.set(k, v)


#: Rows from which a driver-side Arrow table goes to Spark as Arrow batches (``arrow_frame``).
ARROW_RDD_ROWS = 20_000


def arrow_frame(spark: SparkSession, table: pa.Table) -> DataFrame:
    """A DataFrame of an Arrow table the driver holds. pyspark turns a table under
    ``spark.sql.execution.arrow.localRelationThreshold`` (48 MB) into rows in the driver, in one
    thread (seconds for a large silver batch). A large table
    goes to the tasks as Arrow batches instead, which convert them in parallel, coalesced to
    as many tasks (files, when written) as a local relation would have."""
    if table.num_rows < ARROW_RDD_ROWS:
        return spark.createDataFrame(table)
    with session_confs(spark, {"spark.sql.execution.arrow.localRelationThreshold": "0"}):
        df = spark.createDataFrame(table)
    return df.coalesce(spark.sparkContext.defaultParallelism)  # never more than it has


#: Spark loggers whose WARN lines are routine here: "Current batch is falling behind" once per
#: micro-batch longer than its trigger (on 2 cores, most of them; batch durations and lag are in
#: ``pipeline_metrics`` and on the Prometheus endpoint), "Failed to cancel job group" for
#: every query stopped between batches, and "RDD N was locally checkpointed" after every Delta
#: MERGE (it materialises its source with ``localCheckpoint``; ~480 lines an hour in a soak).
QUIET_LOGGERS = ("org.apache.spark.sql.execution.streaming.runtime.ProcessingTimeExecutor",
                 "org.apache.spark.scheduler.DAGScheduler",
                 "org.apache.spark.rdd.MapPartitionsRDD")


def _quiet_loggers(spark: SparkSession) -> None:
    try:
        jvm = spark._jvm
        level = jvm.org.apache.logging.log4j.Level.ERROR
        for name in QUIET_LOGGERS:
            jvm.org.apache.logging.log4j.core.config.Configurator.setLevel(name, level)
    except Exception as e:  # noqa: BLE001 - e.g. Spark Connect (no JVM here): just noisier logs
        import logging

        logging.getLogger(__name__).debug("could not quiet Spark loggers: %s", e)


def shuffle_partitions(settings: Settings) -> int:
    """``spark.shuffle_partitions``, or for 0 (auto) the local master's cores (at least 2) and 4
    on a cluster. A query keeps the value its checkpoint started with."""
    n = settings.spark.shuffle_partitions
    if n:
        return n
    master = settings.spark.master
    if not is_local(master):
        return 4
    inside = master[len("local"):].strip("[]").split(",")[0]
    if inside in ("", "*"):
        cores = os.cpu_count() or 2
    else:
        cores = int(inside) if inside.isdigit() else 2
    return max(2, cores)


def _minutes(hours: float) -> str:
    """A Delta table-property interval."""
    return f"interval {max(1, round(hours * 60))} minutes"


def _with_local_fs_shim(conf: dict[str, str]) -> dict[str, str]:
    """Add the fork-free local file system (``lakehouse.runtime.jvm``) unless settings chose another."""
    from pathlib import Path

    import pyspark

    from lakehouse.runtime.jvm import HADOOP_CONF, shim_jar

    if any(k in conf for k in HADOOP_CONF):
        return conf
    jar = shim_jar(Path(pyspark.__file__).parent / "jars")
    if jar is None:
        return conf
    cp = conf.get("spark.driver.extraClassPath")
    return {**HADOOP_CONF, **conf,
            "spark.driver.extraClassPath": f"{cp}{os.pathsep}{jar}" if cp else str(jar)}
