"""Settings fail fast and say which key is wrong; a taken port gives a clear error."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from lakehouse.settings import SettingsError, load_settings
from orchestration.cli import main
from orchestration.services import ServiceError, kafka_service


def test_defaults_and_env_overrides(tmp_path: Path) -> None:
    cfg = tmp_path / "iotlake.toml"
    cfg.write_text('data_root = "/tmp/x"\n[kafka]\ntopic = "t1"\n[stream]\nwatermark_seconds = 60\n')
    s = load_settings(cfg, environ={"IOTLAKE_KAFKA__TOPIC": "t2", "IOTLAKE_SPARK__MASTER": "local[1]"})
    assert s.kafka.topic == "t2"  # env beats file
    assert s.stream.watermark_seconds == 60
    assert s.spark.master == "local[1]"
    assert s.table_path("silver") == "/tmp/x/tables/silver"
    assert load_settings(environ={}).spark.master == "local[*]"


def test_unknown_key_is_named(tmp_path: Path) -> None:
    cfg = tmp_path / "iotlake.toml"
    cfg.write_text("[kafka]\ntopik = 'x'\n")
    with pytest.raises(SettingsError, match=r"unknown setting 'kafka.topik'"):
        load_settings(cfg, environ={})


def test_bad_value_is_named() -> None:
    with pytest.raises(SettingsError, match=r"setting 'stream.watermark_seconds'"):
        load_settings(environ={"IOTLAKE_STREAM__WATERMARK_SECONDS": "ten minutes"})
    with pytest.raises(SettingsError, match=r"setting 'kafka.partitions'"):
        load_settings(environ={}, kafka={"partitions": 0})
    with pytest.raises(SettingsError, match=r"setting 'simulator.device_prefix'"):
        load_settings(environ={}, simulator={"device_prefix": "a/b"})  # a topic level of its own
    with pytest.raises(SettingsError, match=r"gold.slide_window_seconds \(30\) must be 0 \(no sliding"):
        load_settings(environ={}, gold={"slide_window_seconds": 30})
    with pytest.raises(SettingsError, match=r"'spark.driver_memory'.*e\.g\. 2g or 768m"):
        load_settings(environ={}, spark={"driver_memory": "2 GB"})
    assert [load_settings(environ={}, spark={"driver_memory": m}).spark.driver_memory_mb
            for m in ("2g", "768M", "1gb")] == [2048, 768, 1024]


def test_password_never_echoed() -> None:
    with pytest.raises(SettingsError) as e:
        load_settings(environ={"IOTLAKE_MQTT__PASSWORD": "[1,2]"})
    assert "1,2" not in str(e.value)


def test_variables_that_are_not_settings_are_not_read_as_settings() -> None:
    """``IOTLAKE_JARS_DIR`` (lakehouse.runtime.jars' error message suggests it) is not a setting."""
    env = {"IOTLAKE_JARS_DIR": "/opt/jars", "IOTLAKE_BIN": "/x/iotlake", "IOTLAKE_TEST_KAFKA_PORT": "1"}
    assert load_settings(environ=env).kafka.topic == "telemetry"


def test_missing_config_file_and_cli_exit_code(tmp_path: Path, capsys) -> None:
    with pytest.raises(SettingsError, match="does not exist"):
        load_settings(tmp_path / "nope.toml", environ={})
    assert main(["--config", str(tmp_path / "nope.toml"), "demo"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_bad_cli_argument_exits_2(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "--events", "-5"])
    assert e.value.code == 2
    assert "must be > 0" in capsys.readouterr().err


def test_taken_port_gives_clear_error(tmp_path: Path) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        with pytest.raises(ServiceError, match=rf"port {port} is already in use.*"
                                               r"IOTLAKE_KAFKA__EMBEDDED_PORT"):
            kafka_service(s, port=port).start()
        # the embedded Kafka's controller listens on the next port
        with pytest.raises(ServiceError, match=rf"port {port} is already in use.*"
                                               r"IOTLAKE_KAFKA__EMBEDDED_CONTROLLER_PORT"):
            kafka_service(s, port=port - 1).start()


def test_shuffle_partitions_auto_follows_the_local_cores() -> None:
    import os

    from lakehouse.spark import shuffle_partitions

    def auto(master: str) -> int:
        return shuffle_partitions(load_settings(environ={}, spark={"master": master}))

    assert auto("local[3]") == 3 and auto("local[1]") == 2 and auto("local[4,2]") == 4
    assert auto("local[*]") == max(2, os.cpu_count() or 2)
    assert auto("spark://master:7077") == 4
    assert shuffle_partitions(load_settings(environ={}, spark={"shuffle_partitions": 7})) == 7


def test_each_layer_gets_its_trigger_interval() -> None:
    from lakehouse.streams import trigger_kwargs

    def ms(stream: dict, layer: str) -> str:
        s = load_settings(environ={}, stream={"trigger_seconds": 0.5, **stream})
        return trigger_kwargs(s, "live", layer)["processingTime"]

    # the defaults: 0.5 s for bronze and silver, 3 s for gold's health, 10 s for its windows
    assert (ms({}, ""), ms({}, "gold"), ms({}, "windows")) == (
        "500 milliseconds", "3000 milliseconds", "10000 milliseconds")
    same = {"gold_trigger_seconds": -1, "windows_trigger_seconds": -1}
    assert ms(same, "") == ms(same, "gold") == ms(same, "windows") == "500 milliseconds"
    assert ms({"gold_trigger_seconds": 3, "windows_trigger_seconds": -1}, "gold") == "3000 milliseconds"
    assert ms({"gold_trigger_seconds": 3, "windows_trigger_seconds": -1}, "windows") == "3000 milliseconds"
    assert ms({"gold_trigger_seconds": 3, "windows_trigger_seconds": 10}, "windows") == "10000 milliseconds"
    assert ms({"gold_trigger_seconds": 3, "windows_trigger_seconds": 10}, "gold") == "3000 milliseconds"
    assert ms({"windows_trigger_seconds": 10}, "") == "500 milliseconds"


def test_embedded_kafka_settings() -> None:
    s = load_settings(environ={})
    assert s.bridge.linger_ms == 5
    k = s.kafka
    assert (k.embedded_port, k.embedded_controller_port, k.embedded_retention_hours,
            k.embedded_retention_bytes, k.embedded_segment_bytes, k.embedded_heap_mb) == (
        19092, 0, 168, 1 << 30, 64 << 20, 256)
    env = {"IOTLAKE_KAFKA__EMBEDDED_RETENTION_BYTES": "-1", "IOTLAKE_BRIDGE__LINGER_MS": "7"}
    s = load_settings(environ=env)
    assert s.kafka.embedded_retention_bytes == -1 and s.bridge.linger_ms == 7
    with pytest.raises(SettingsError, match="kafka.embedded_retention_bytes"):
        load_settings(environ={"IOTLAKE_KAFKA__EMBEDDED_RETENTION_BYTES": "1000"})
    with pytest.raises(SettingsError, match="linger_ms"):
        load_settings(environ={"IOTLAKE_BRIDGE__LINGER_MS": "-1"})


def test_embedded_kafka_controller_port_never_collides() -> None:
    """Test workers' brokers are 100 ports apart, `make run`'s at 19092: controllers at + 1."""
    from orchestration.services import kafka_controller_port

    s = load_settings(environ={})
    assert kafka_controller_port(s, 19092) == 19093
    assert kafka_controller_port(s, 29092) == 29093 and kafka_controller_port(s, 29192) == 29193
    s = load_settings(environ={"IOTLAKE_KAFKA__EMBEDDED_CONTROLLER_PORT": "40000"})
    assert kafka_controller_port(s, 19092) == 40000


def test_driver_starts_from_the_class_archive_when_there_is_one(tmp_path: Path, monkeypatch,
                                                               spark) -> None:
    from lakehouse.runtime import jars, native_memory

    monkeypatch.setenv("IOTLAKE_JARS_DIR", str(tmp_path))
    plain = " ".join((f"-Dlog4j2.configurationFile={jars.LOG4J2}",
                      *native_memory.jvm_options(jars.java_binary()), jars.KEEP_HEAP))
    assert jars.driver_java_options() == plain  # no archive: plain start
    archive = jars.class_archive()
    archive.parent.mkdir(parents=True)
    archive.write_bytes(b"")
    assert f"-XX:SharedArchiveFile={archive}" in jars.driver_java_options()
    assert jars.driver_java_options(class_data_sharing=False) == plain
    # the suite's own driver was started with the archive `make` built, when there is one
    monkeypatch.delenv("IOTLAKE_JARS_DIR")
    args = list(spark._jvm.java.lang.management.ManagementFactory.getRuntimeMXBean().getInputArguments())
    built = jars.class_archive().is_file()
    assert any(a == f"-XX:SharedArchiveFile={jars.class_archive()}" for a in args) == built, args
    assert spark._jvm.java.lang.System.getProperty("jdk.nio.maxCachedBufferSize") == "262144"
    assert set(native_memory.jvm_options(jars.java_binary())) <= set(args)
    # the compiled-code cache is the setting's size (and none is asked for with 0)
    mb = load_settings(environ={}).spark.code_cache_mb
    assert f"-XX:ReservedCodeCacheSize={mb}m" in args and mb > 0
    diag = spark._jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        spark._jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean"))
    assert diag.getVMOption("ReservedCodeCacheSize").getValue() == str(mb << 20)
    assert "ReservedCodeCacheSize" not in jars.driver_java_options(code_cache_mb=0)
    # spark.fixed_heap (off by default): the heap fixed at driver_memory, touched at start
    assert not load_settings(environ={}).spark.fixed_heap
    assert "-Xms2048m -XX:+AlwaysPreTouch" in jars.driver_java_options(fixed_heap_mb=2048)
    assert "Xms" not in jars.driver_java_options(fixed_heap_mb=0)
    touched = diag.getVMOption("AlwaysPreTouch").getValue() == "true"
    assert touched == any(a.startswith("-Xms") for a in args), args
    # the heap, once grown, is kept (no shrink after a concurrent cycle)
    assert diag.getVMOption("MaxHeapFreeRatio").getValue() == "100"


def test_a_checkpoint_keeps_only_the_configured_batches(spark, tmp_path: Path) -> None:
    """``stream.checkpoint_batches`` bounds each query's offsets and commits logs (and its state
    versions) while it runs: older entries are deleted after each batch."""
    key = "spark.sql.streaming.minBatchesToRetain"
    assert spark.conf.get(key) == str(load_settings(environ={}).stream.checkpoint_batches)
    batches = 3  # the session's setting, lowered for this query: fewer batches to run
    spark.conf.set(key, str(batches))
    ckpt = tmp_path / "ckpt"
    try:
        q = (spark.readStream.format("rate").option("rowsPerSecond", 100).load().writeStream
             .format("noop").option("checkpointLocation", str(ckpt))
             .trigger(processingTime="20 milliseconds").start())
    finally:
        spark.conf.set(key, spark.sparkContext.getConf().get(key))
    try:
        while (q.lastProgress or {}).get("batchId", 0) < batches + 5:
            q.awaitTermination(0.2)
    finally:
        q.stop()
    for log_dir in ("offsets", "commits"):
        ids = sorted(int(p.name) for p in (ckpt / log_dir).iterdir() if p.name.isdigit())
        assert ids[0] > 0 and len(ids) <= batches + 1, (log_dir, ids)


def test_expressions_are_compiled_in_batch_processes_and_interpreted_in_streams(spark) -> None:
    """``spark.expression_codegen`` (default "batch") is Spark's expression factory mode:
    compiled for the sessions of batch processes, interpreted for the streams'; "on" / "off"
    (or the booleans the setting once was) everywhere; anything else fails naming the choices.
    A session that exists keeps its mode. A query gives the same rows either way."""
    from lakehouse.settings import load_settings
    from lakehouse.spark import codegen_factory_mode, spark_session

    assert spark.conf.get("spark.sql.codegen.factoryMode") == "NO_CODEGEN"  # the suite's: streams'
    modes = {}
    for value in (None, "on", "off", "true", "false", "batch"):
        s = load_settings(environ={"IOTLAKE_SPARK__EXPRESSION_CODEGEN": value} if value else {})
        modes[value] = (s.spark.expression_codegen, codegen_factory_mode(s, batch=True),
                        codegen_factory_mode(s, batch=False))
    assert modes == {None: ("batch", "FALLBACK", "NO_CODEGEN"), "batch": ("batch", "FALLBACK", "NO_CODEGEN"),
                     "on": ("on", "FALLBACK", "FALLBACK"), "true": ("on", "FALLBACK", "FALLBACK"),
                     "off": ("off", "NO_CODEGEN", "NO_CODEGEN"), "false": ("off", "NO_CODEGEN", "NO_CODEGEN")}
    with pytest.raises(SettingsError, match=r"spark.expression_codegen.*'batch', 'on' or 'off'"):
        load_settings(environ={"IOTLAKE_SPARK__EXPRESSION_CODEGEN": "sometimes"})
    assert spark_session(load_settings(environ={}), batch=True) is spark  # reused, mode kept
    assert spark.conf.get("spark.sql.codegen.factoryMode") == "NO_CODEGEN"
    df = spark.range(1000).selectExpr("id % 7 AS k", "id * 1.5 AS v").groupBy("k").sum("v").orderBy("k")
    interpreted = [tuple(r) for r in df.collect()]
    spark.conf.set("spark.sql.codegen.factoryMode", "FALLBACK")
    try:
        assert [tuple(r) for r in df.collect()] == interpreted
    finally:
        spark.conf.set("spark.sql.codegen.factoryMode", "NO_CODEGEN")
    assert interpreted[0] == (0, sum(i * 1.5 for i in range(0, 1000, 7)))


def test_compiled_plans_stay_cached_past_a_hundred_others(spark) -> None:
    """The session keeps 1,000 compiled plans, not Spark's 100: a plan run again after 150
    other distinct ones is not compiled again (with 100, a cyclic set of more plans than that
    compiled every one of them every time)."""
    compiled = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics.METRIC_COMPILATION_TIME()

    def plan(i: int) -> list:
        return spark.range(3).selectExpr(f"id * {i} + {i} AS v").collect()

    from lakehouse.spark import session_confs

    assert spark.conf.get("spark.sql.codegen.cache.maxEntries") == "1000"
    with session_confs(spark, {"spark.sql.codegen.factoryMode": "FALLBACK"}):
        first = compiled.getCount()
        assert [r.v for r in plan(100_003)] == [100_003, 200_006, 300_009]
        assert compiled.getCount() > first  # it was compiled: the check below means something
        for i in range(150):
            plan(200_000 + i)
        again = compiled.getCount()
        plan(100_003)
        assert compiled.getCount() == again


def test_maintenance_retentions(spark, tmp_path: Path) -> None:
    """Retentions below an hour need ``allow_short_retention``, and the log's must cover
    vacuum's (Delta's rule); the tables iotlake creates carry both as Delta properties and leave
    the log's clean-up to iotlake; an unknown retention table is named."""
    from lakehouse.delta.tables import ensure_table
    from lakehouse.tables import BRONZE

    m = load_settings(environ={}).maintenance
    assert (m.auto, m.vacuum_retention_hours, m.log_retention_hours, m.vacuum_interval_hours,
            m.retention_days["bronze"]) == (True, 1, 1, 24, 7)
    with pytest.raises(SettingsError, match="maintenance.vacuum_retention_hours below 1 h.*allow_short_retention"):
        load_settings(environ={"IOTLAKE_MAINTENANCE__VACUUM_RETENTION_HOURS": "0.5"})
    with pytest.raises(SettingsError, match="log_retention_hours .1. must be at least vacuum_retention_hours .24."):
        load_settings(environ={"IOTLAKE_MAINTENANCE__VACUUM_RETENTION_HOURS": "24"})
    short = load_settings(environ={"IOTLAKE_MAINTENANCE__VACUUM_RETENTION_HOURS": "0.25",
                                   "IOTLAKE_MAINTENANCE__ALLOW_SHORT_RETENTION": "true",
                                   "IOTLAKE_MAINTENANCE__LOG_RETENTION_HOURS": "0.5"})
    assert (short.maintenance.vacuum_retention_hours, short.maintenance.log_retention_hours) == (0.25, 0.5)
    with pytest.raises(SettingsError, match="maintenance.retention_days.*device_current"):
        load_settings(environ={}, maintenance={"retention_days": {"device_current": 1}})
    with pytest.raises(SettingsError, match="must be > 0 days"):
        load_settings(environ={}, maintenance={"retention_days": {"bronze": 0}})
    with pytest.raises(SettingsError, match="partition_minutes must divide a day"):
        load_settings(environ={}, maintenance={"partition_minutes": 7})
    with pytest.raises(SettingsError, match=r"retention_days of \['bronze'\] is shorter than one partition"):
        load_settings(environ={}, maintenance={"retention_days": {"bronze": 0.5}})
    assert load_settings(environ={}, maintenance={"retention_days": {"bronze": 0.5},
                                                  "partition_minutes": 60}).maintenance.partition_minutes == 60
    # the suite's session was made from the default settings: an hour each
    path = str(tmp_path / "t")
    ensure_table(spark, path, BRONZE)
    props = {r["key"]: r["value"] for r in spark.sql(f"SHOW TBLPROPERTIES delta.`{path}`").collect()}
    assert (props["delta.logRetentionDuration"], props["delta.deletedFileRetentionDuration"],
            props["delta.enableExpiredLogCleanup"]) == ("interval 60 minutes", "interval 60 minutes", "false")


def test_routine_spark_warnings_are_quiet(spark) -> None:
    """Lines Spark logs on every micro-batch or MERGE (e.g. "RDD N was locally checkpointed"
    after each Delta MERGE) would fill a long run's log: those loggers are at ERROR."""
    from lakehouse.spark import QUIET_LOGGERS

    log4j = spark._jvm.org.apache.logging.log4j
    assert "org.apache.spark.rdd.MapPartitionsRDD" in QUIET_LOGGERS
    for name in QUIET_LOGGERS:
        assert log4j.LogManager.getLogger(name).getLevel().toString() == "ERROR", name


def test_spark_logs_to_stderr_from_warn_up(spark) -> None:
    """stdout is a command's output (a bench's last JSON line): Spark's lines, even those it
    logs while the JVM shuts down after that line, go to stderr."""
    ctx = spark._jvm.org.apache.logging.log4j.LogManager.getContext(False)
    root = ctx.getConfiguration().getRootLogger()
    assert root.getLevel().toString() == "WARN"
    targets = [a.getTarget().toString() for a in root.getAppenders().values()]
    assert targets == ["SYSTEM_ERR"]


@pytest.mark.parametrize("path", ["iotlake.toml.example", "examples/sensor.toml", "examples/pump.toml",
                                  "infra/spark/iotlake.toml"])
def test_every_shipped_configuration_loads(path: str) -> None:
    """A setting renamed in code must be renamed in the files users copy; each describes a fleet."""
    repo = Path(__file__).resolve().parents[1]
    s = load_settings(repo / path, environ={})
    assert s.telemetry.require_metrics()
    assert s.fused == (path != "infra/spark/iotlake.toml")  # its roles split bronze and silver
    assert not s.telemetry.suite or Path(s.telemetry.suite).is_file()  # relative: beside the file
    if not s.remote:  # a local lake in the repository (data/, data-*/: git-ignored)
        assert s.root.parent == repo and s.root.name.startswith("data"), s.root


def test_relative_paths_are_the_settings_files(tmp_path: Path, monkeypatch) -> None:
    """A settings file's relative paths are its folder's, from any working directory; those of
    the environment and keyword overrides are the working directory's (left as given)."""
    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    s = load_settings(repo / "examples" / "sensor.toml", environ={})
    assert s.telemetry.suite == str(repo / "examples" / "sensor.json")
    assert s.data_root == str(repo / "data") and s.root == repo / "data"  # "../data" beside it
    env = load_settings(repo / "examples" / "sensor.toml",
                        environ={"IOTLAKE_DATA_ROOT": "lake", "IOTLAKE_TELEMETRY__SUITE": "s.json"})
    assert (env.data_root, env.telemetry.suite, env.root) == ("lake", "s.json", tmp_path / "lake")
    kw = load_settings(repo / "examples" / "pump.toml", environ={}, data_root="kw",
                       storage={"checkpoint_root": "ck"})
    assert (kw.data_root, kw.storage.checkpoint_root) == ("kw", "ck")

    conf = tmp_path / "conf"
    (conf / "secrets").mkdir(parents=True)
    (conf / "secrets" / "mqtt").write_text("hunter2\n")
    (conf / "iotlake.toml").write_text(
        'data_root = "lake"\n[storage]\ncheckpoint_root = "../ck"\n'
        '[mqtt]\ntls_ca = "certs/ca.pem"\ntls_cert = "/etc/ssl/c.pem"\ntls_key = "~/k.pem"\n'
        'password_file = "secrets/mqtt"\n')
    f = load_settings(conf / "iotlake.toml", environ={})
    assert f.data_root == str(conf / "lake") and f.storage.checkpoint_root == str(tmp_path / "ck")
    assert (f.mqtt.tls_ca, f.mqtt.tls_cert, f.mqtt.tls_key) == (str(conf / "certs" / "ca.pem"),
                                                                "/etc/ssl/c.pem", "~/k.pem")
    assert f.mqtt.password == "hunter2"  # read from beside the file, not from the working directory
    (conf / "iotlake.toml").write_text('data_root = "s3://lake/iot"\n[storage]\ncheckpoint_root = "ck"\n')
    assert load_settings(conf / "iotlake.toml", environ={}).data_root == "s3://lake/iot"

    # a saved copy (for child processes) means the same places, wherever it lies
    saved = kw.save(tmp_path / "run" / "settings.json")
    again = load_settings(saved, environ={})
    assert again.root == tmp_path / "kw" and again.storage.checkpoint_root == str(tmp_path / "ck")
    assert again.telemetry == kw.telemetry


def test_a_command_reads_an_example_suite_from_another_directory(tmp_path: Path) -> None:
    """``iotlake --config /abs/examples/sensor.toml validate silver`` from elsewhere finds the
    suite beside the file (``sensor.json``), its lake where the environment says (cwd-relative)."""
    import os
    import subprocess
    import sys

    import pyarrow as pa
    from deltalake import write_deltalake
    from fleets import SENSOR

    from lakehouse.tables import silver_schema

    repo = Path(__file__).resolve().parents[1]
    ts = pa.scalar(1_764_000_000_000_000, pa.timestamp("us", tz="UTC")).as_py()
    rows = [{"event_id": f"{i:032x}", "device_id": f"dev-{i:05d}", "event_time": ts, "temperature": 20.0,
             "humidity": 40.0, "battery": 90.0, "status": "ok", "schema_version": 1, "extra": None,
             "kafka_partition": 0, "kafka_offset": i, "ingest_time": ts} for i in range(1, 6)]
    write_deltalake(str(tmp_path / "lake" / "tables" / "silver"),
                    pa.Table.from_pylist(rows, schema=silver_schema(SENSOR)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    proc = subprocess.run([str(Path(sys.executable).with_name("iotlake")), "--config",
                           str(repo / "examples" / "sensor.toml"), "validate", "silver"],
                          cwd=tmp_path, env={**env, "IOTLAKE_DATA_ROOT": "lake"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "silver" in proc.stdout and len(list((tmp_path / "lake" / "quality").rglob("validation_result.json"))) == 1
