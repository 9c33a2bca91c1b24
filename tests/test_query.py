"""`iotlake query`: DuckDB SQL over real Delta tables, time travel, and clear errors (exit 2)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest

from lakehouse.settings import Settings, load_settings
from orchestration.cli import main
from orchestration.query import QueryError, existing_tables, run_query
from tests.lakehouse_fixture import build_lakehouse, write


@pytest.fixture
def lake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Settings, dict]:
    # The CLI loads settings from the environment: keep the test runner's IOTLAKE_* out of it.
    for key in [k for k in os.environ if k.startswith("IOTLAKE_")]:
        monkeypatch.delenv(key)
    monkeypatch.chdir(tmp_path)
    settings = load_settings(environ={}, data_root=str(tmp_path / "lake"))
    return settings, build_lakehouse(settings, devices=30, hours=1)


def cli(settings: Settings, *args: str) -> int:
    return main(["--data-root", settings.data_root, "query", *args])


def test_query_returns_expected_rows(lake, capsys) -> None:
    settings, facts = lake
    sql = "SELECT status, count(*) AS n FROM device_current GROUP BY status ORDER BY status"
    assert run_query(settings, sql).to_pylist() == [
        {"status": s, "n": facts["fleet"][s]} for s in sorted(facts["fleet"])]

    sql = ("SELECT a.device_id, a.metric, a.value, d.status FROM anomalies a "
           "JOIN device_current d USING (device_id)")
    assert cli(settings, sql, "--format", "json") == 0
    rows = json.loads(capsys.readouterr().out)
    an = facts["anomaly"]
    assert rows == [{"device_id": an["device_id"], "metric": "temperature", "value": 95.0,
                     "status": facts["status"][an["device_id"]]}]

    assert cli(settings, "SELECT count(*) AS n FROM silver") == 0
    out = capsys.readouterr().out
    assert str(facts["silver_rows"]) in out and "(1 rows)" in out
    assert cli(settings, "SELECT device_id FROM device_current ORDER BY 1 LIMIT 2", "--format", "csv") == 0
    assert capsys.readouterr().out.splitlines() == ['"device_id"', '"dev-0000"', '"dev-0001"']


def test_time_travel_sees_the_old_version(lake, capsys) -> None:
    settings, facts = lake
    extra = run_query(settings, "SELECT * FROM device_current LIMIT 5")
    write(settings, "device_current", extra, mode="append")  # version 1
    sql = "SELECT count(*) AS n FROM device_current"
    assert run_query(settings, sql).to_pylist() == [{"n": facts["devices"] + 5}]
    assert cli(settings, sql, "--as-of-version", "0", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out) == [{"n": facts["devices"]}]
    assert cli(settings, sql, "--as-of-version", "1", "--format", "json") == 0
    assert json.loads(capsys.readouterr().out) == [{"n": facts["devices"] + 5}]
    # A timestamp before the append reads version 0 (commit times are wall-clock ms).
    from deltalake import DeltaTable

    v0 = DeltaTable(settings.table_path("device_current")).history()[-1]["timestamp"]
    assert run_query(settings, sql, as_of_timestamp=_iso_ms(v0)).to_pylist() == [{"n": facts["devices"]}]
    with pytest.raises(QueryError, match="has no version 7"):
        run_query(settings, sql, as_of_version=7)


def _iso_ms(ms: int) -> str:
    from datetime import UTC, datetime

    return (datetime.fromtimestamp(ms / 1000, UTC) + timedelta(milliseconds=1)).isoformat()


def test_bad_sql_and_unknown_table_exit_2(lake, capsys) -> None:
    settings, _ = lake
    assert cli(settings, "SELEC * FROM device_current") == 2
    err = capsys.readouterr().err
    assert "iotlake query:" in err and "syntax error" in err

    assert cli(settings, "SELECT * FROM devices_current") == 2
    err = capsys.readouterr().err
    assert "unknown table 'devices_current'; known tables:" in err
    assert "device_current" in err and "gold_metrics_1m" in err

    assert cli(settings, "SELECT nope FROM device_current") == 2
    assert "nope" in capsys.readouterr().err
    assert cli(settings, "SELECT 1", "--as-of-version", "99") == 0  # no table: nothing to travel


# ---- `iotlake sql`: Spark SQL over the same tables (in-process, on the session's Spark) -------

SAME_AS_QUERY = [
    "SELECT status, count(*) AS n FROM device_current GROUP BY status ORDER BY status",
    "SELECT a.device_id, a.metric, a.value, d.status FROM anomalies a "
    "JOIN device_current d USING (device_id)",
    "SELECT device_id, count(*) AS n, max(event_time) AS last_event, round(avg(temperature), 6) AS t "
    "FROM silver GROUP BY device_id ORDER BY device_id",
    "SELECT metric, CAST(sum(count) AS BIGINT) AS n FROM gold_metrics_5m GROUP BY metric ORDER BY metric",
    "SELECT count(*) AS n FROM quarantine WHERE reason = 'temperature_in_range'",
]


def sql(spark, settings: Settings, text: str, *args, **kwargs) -> int:
    from orchestration.sql_cli import execute

    return execute(spark, settings, text, *args, **kwargs)


def test_sql_results_equal_iotlake_query(lake, spark, capsys) -> None:
    settings, facts = lake
    for statement in SAME_AS_QUERY:
        assert cli(settings, statement, "--format", "json") == 0
        expected = capsys.readouterr().out
        assert sql(spark, settings, statement, fmt="json") == 0
        assert capsys.readouterr().out == expected, statement
    # several statements in one go (as -e/-f give them), each printed; views dropped after
    script = "SELECT count(*) AS n FROM silver; -- a comment; with a ';'\nSELECT ';' AS s;"
    assert sql(spark, settings, script, fmt="csv") == 0
    assert capsys.readouterr().out == f'"n"\n{facts["silver_rows"]}\n"s"\n";"\n'
    assert not spark.catalog.tableExists("silver")


def test_sql_time_travel(lake, spark, capsys) -> None:
    from deltalake import DeltaTable

    settings, facts = lake
    write(settings, "device_current", run_query(settings, "SELECT * FROM device_current LIMIT 5"),
          mode="append")  # version 1
    statement = "SELECT count(*) AS n FROM device_current"
    for version, n in ((0, facts["devices"]), (1, facts["devices"] + 5), (None, facts["devices"] + 5)):
        assert sql(spark, settings, statement, as_of_version=version, fmt="json") == 0
        assert json.loads(capsys.readouterr().out) == [{"n": n}], version
    v0 = DeltaTable(settings.table_path("device_current")).history()[-1]["timestamp"]
    assert sql(spark, settings, statement, as_of_timestamp=_iso_ms(v0), fmt="json") == 0
    assert json.loads(capsys.readouterr().out) == [{"n": facts["devices"]}]
    # other tables have only version 0: fine unless the statement reads them
    assert sql(spark, settings, "SELECT count(*) AS n FROM silver", as_of_version=1) == 2
    assert "table 'silver' has no version 1" in capsys.readouterr().err


def test_sql_bad_statements_exit_2(lake, spark, capsys) -> None:
    from orchestration.sql_cli import SqlSession, repl

    settings, _ = lake
    assert sql(spark, settings, "SELEC * FROM device_current") == 2
    err = capsys.readouterr().err
    assert err.startswith("iotlake sql: [PARSE_SYNTAX_ERROR]") and err.count("\n") == 1
    assert sql(spark, settings, "SELECT * FROM devices_current") == 2
    err = capsys.readouterr().err
    assert "unknown table 'devices_current'; known tables:" in err and "gold_metrics_1m" in err
    assert sql(spark, settings, "SELECT 1 AS one; SELECT nope FROM device_current") == 2
    out, err = capsys.readouterr()
    assert "(1 rows)" in out and "`nope` cannot be resolved" in err and err.count("\n") == 1
    assert sql(spark, settings, "-- nothing;") == 2
    assert "no SQL statement" in capsys.readouterr().err
    assert not spark.catalog.tableExists("device_current")

    # the prompt: statements span lines and end with ';', an error does not end the session
    lines = iter(["SELECT count(*) AS n", "FROM device_current;", "SELEC 1;",
                  "SELECT 'a;b' AS s;", "exit"])
    session = SqlSession(spark, settings)
    try:
        assert repl(session, "csv", read=lambda _prompt: next(lines)) == 0
    finally:
        session.close()
    out, err = capsys.readouterr()
    assert out == '"n"\n30\n"s"\n"a;b"\n' and "error: [PARSE_SYNTAX_ERROR]" in err


def test_sql_cli_arguments(lake, tmp_path: Path, capsys) -> None:
    settings, _ = lake
    assert main(["--data-root", settings.data_root, "sql", "-f", str(tmp_path / "none.sql")]) == 2
    assert "cannot read" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: -e and -f exclude each other
        main(["--data-root", settings.data_root, "sql", "-e", "SELECT 1", "-f", "x.sql"])


# ---- `iotlake sql` reads the lake's tables, nothing else on disk (docs/guarantees.md) ----------

SECRET = "iotlake-secret-7f3a"


@pytest.fixture
def outside(lake, tmp_path: Path) -> Path:
    """A text file, a CSV and a Delta table beside the lake, not in it."""
    import pyarrow as pa
    from deltalake import write_deltalake

    out = tmp_path / "outside"
    out.mkdir()
    (out / "secret.txt").write_text(SECRET + "\n")
    (out / "secret.csv").write_text(f"a\n{SECRET}\n")
    write_deltalake(str(out / "delta"), pa.table({"a": [SECRET]}))
    return out


REFUSED_SQL = [  # (statement, what the message names); {o} is the folder outside the lake
    ("SELECT * FROM text.`{o}/secret.txt`", "is refused: iotlake sql reads the lake's tables by name"),
    ("SELECT * FROM csv.`{o}/secret.csv`", "`csv`.`{o}/secret.csv` is refused"),
    ("SELECT * FROM delta.`{o}/delta`", "`delta`.`{o}/delta` is refused"),
    ("SELECT * FROM parquet.`{o}`", "`parquet`.`{o}` is refused"),
    ("SELECT * FROM json.`{o}/secret.txt`", "is refused"),
    ("SELECT * FROM orc.`{o}`", "is refused"),
    ("SELECT * FROM binaryFile.`{o}/secret.txt`", "`binaryFile`.`{o}/secret.txt` is refused"),
    ("SELECT * FROM `text`.`{o}/secret.txt` UNION ALL SELECT 'x'", "is refused"),
    ("WITH s AS (SELECT * FROM text.`{o}/secret.txt`) SELECT * FROM s", "is refused"),
    ("SELECT (SELECT max(value) FROM text.`{o}/secret.txt`) AS v", "is refused"),
    ("SELECT * FROM silver WHERE device_id IN (SELECT value FROM text.`{o}/secret.txt`)", "is refused"),
    ("SELECT * FROM IDENTIFIER('text.`{o}/secret.txt`')", "is refused"),
    ("SELECT * FROM IDENTIFIER('text.' || '`{o}/secret.txt`')", "IDENTIFIER(expression) is refused"),
    ("EXECUTE IMMEDIATE 'SELECT * FROM text.`{o}/secret.txt`'", "EXECUTE IMMEDIATE is refused"),
    ("SELECT * FROM read_files('{o}/secret.txt')", "table function read_files() is refused"),
    ("SELECT * FROM table_changes_by_path('{o}/delta', 0)", "table function table_changes_by_path() is refused"),
    ("SELECT reflect('java.lang.System', 'getenv', 'HOME')", "reflect() is refused"),
    ("SELECT java_method('java.lang.System', 'getProperty', 'user.home')", "java_method() is refused"),
    ("LOAD DATA LOCAL INPATH '{o}/secret.txt' INTO TABLE silver", "LOAD DATA is refused"),
    ("ADD JAR {o}/x.jar", "ADD JAR is refused"),
    ("ADD FILE {o}/secret.txt", "ADD FILE is refused"),
    ("CREATE TABLE t (value STRING) USING text LOCATION '{o}'", "CREATE TABLE is refused"),
    ("CREATE TABLE t USING parquet AS SELECT 1 AS x", "CREATE TABLE AS SELECT is refused"),
    ("CREATE TEMPORARY VIEW v USING text OPTIONS (path '{o}/secret.txt')", "CREATE TEMPORARY VIEW ... USING is refused"),
    ("CREATE TEMPORARY VIEW v AS SELECT * FROM text.`{o}/secret.txt`", "is refused"),
    ("CACHE TABLE c AS SELECT * FROM csv.`{o}/secret.csv`", "is refused"),
    ("EXPLAIN SELECT * FROM text.`{o}/secret.txt`", "is refused"),
    ("INSERT OVERWRITE DIRECTORY '{o}/written' USING csv SELECT 1", "INSERT OVERWRITE DIRECTORY is refused"),
    ("INSERT INTO silver SELECT * FROM silver", "INSERT is refused"),
    ("CREATE TEMPORARY FUNCTION f AS 'x.Y' USING JAR '{o}/x.jar'", "CREATE FUNCTION is refused"),
    ("VACUUM delta.`{o}/delta`", "VACUUM TABLE is refused"),
    ("CONVERT TO DELTA parquet.`{o}`", "CONVERT TO DELTA is refused"),
    ("SET spark.sql.runSQLOnFiles=true", "SET spark.sql.runSQLOnFiles is refused"),
    ("SET spark.sql.catalog.x=org.apache.spark.sql.execution.datasources.v2.jdbc.JDBCTableCatalog",
     "SET spark.sql.catalog.x is refused"),
    ("SET spark.hadoop.fs.file.impl=x", "SET spark.hadoop.fs.file.impl is refused"),
    ("CREATE VIEW pv AS SELECT 1 AS x", "CREATE VIEW is refused"),
]


def test_sql_refuses_what_reaches_outside_the_lake(lake, spark, outside: Path, capsys) -> None:
    """Each statement is refused with its reason and reads or writes nothing; the command exits
    2 with that reason on one line."""
    from orchestration.sql_cli import SqlSession

    settings, _ = lake
    session = SqlSession(spark, settings)  # one session: opening the views is most of a call
    try:
        for statement, message in REFUSED_SQL:
            with pytest.raises(QueryError) as refused:
                session.run(statement.format(o=outside))
            assert message.format(o=outside) in str(refused.value), (statement, refused.value)
            assert SECRET not in str(refused.value) and "\n" not in str(refused.value)
            assert sorted(p.name for p in outside.iterdir()) == ["delta", "secret.csv", "secret.txt"]
            assert not (Path.cwd() / "spark-warehouse").exists()
        assert session.run("SELECT count(*) AS n FROM device_current").to_pylist() == [{"n": 30}]
    finally:
        session.close()
    assert spark.conf.get("spark.sql.runSQLOnFiles") == "true"  # the caller's session as it was
    statement = f"SELECT value FROM text.`{outside}/secret.txt`; SELECT 1 AS one"
    assert sql(spark, settings, statement) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == f"iotlake sql: `text`.`{outside}/secret.txt` is refused: iotlake sql " \
        "reads the lake's tables by name (" + ", ".join(existing_tables(settings)) + \
        "), not files or other catalogs' tables\n"


def test_sql_runs_queries_and_read_only_commands(lake, spark, outside: Path, capsys) -> None:
    """The lake's tables by name, CTEs, subqueries, generators, session views and options."""
    settings, facts = lake
    script = """
        SET spark.sql.shuffle.partitions = 3;
        SET spark.sql.shuffle.partitions;
        CREATE TEMPORARY VIEW offline AS SELECT device_id FROM device_current WHERE status = 'offline';
        CACHE TABLE recent AS SELECT device_id, max(event_time) AS t FROM silver GROUP BY device_id;
        WITH o AS (SELECT * FROM offline)
        SELECT (SELECT count(*) FROM o) AS offline, (SELECT count(*) FROM recent) AS heard,
               (SELECT count(*) FROM range(4)) AS r, (SELECT count(*) FROM explode(array(1, 2))) AS e,
               (SELECT count(*) FROM VALUES (1), (2), (3) AS v(x)) AS v,
               (SELECT count(*) FROM silver WHERE device_id IN (SELECT device_id FROM offline)) > 0 AS joined;
        UNCACHE TABLE recent;
        DESCRIBE device_current;
        SHOW VIEWS;
        EXPLAIN SELECT device_id FROM anomalies WHERE score > 1;
        DESCRIBE QUERY SELECT * FROM quarantine;
        SHOW FUNCTIONS LIKE 'perc*';
        RESET spark.sql.shuffle.partitions"""
    assert sql(spark, settings, script, fmt="json") == 0
    out, err = capsys.readouterr()
    assert err == ""
    results, at, decoder = [], 0, json.JSONDecoder()
    while out[at:].strip():  # one JSON array per statement
        result, at = decoder.raw_decode(out, len(out) - len(out[at:].lstrip()))
        results.append(result)
    assert len(results) == 12
    assert {"key": "spark.sql.shuffle.partitions", "value": "3"} in results[1]
    assert results[4] == [{"offline": facts["fleet"]["offline"], "heard": facts["devices"],
                           "r": 4, "e": 2, "v": 3, "joined": True}]
    assert {"col_name": "status", "data_type": "string", "comment": None} in results[6]
    assert {r["viewName"] for r in results[7]} >= {"silver", "device_current", "offline", "recent"}
    assert "FileScan parquet" in results[8][0]["plan"] and str(outside) not in out
    spark.catalog.dropTempView("offline")
    spark.catalog.dropTempView("recent")
    # a script's statements are not split when they reach the session (the prompt splits them)
    from orchestration.sql_cli import SqlSession

    session = SqlSession(spark, settings)
    try:
        with pytest.raises(QueryError, match=r"^a SQL script \(BEGIN \.\.\. END\) is refused"):
            session.run(f"BEGIN SELECT * FROM text.`{outside}/secret.txt`; END")
    finally:
        session.close()


def test_sql_allow_files_reads_paths(lake, spark, outside: Path, capsys) -> None:
    settings, _ = lake
    statement = f"SELECT value FROM text.`{outside}/secret.txt`"
    assert sql(spark, settings, statement, fmt="json", allow_files=True) == 0
    assert json.loads(capsys.readouterr().out) == [{"value": SECRET}]


def test_sql_cli_refuses_a_path_read(lake, outside: Path, capsys) -> None:
    """The command line as a user types it (its own Spark session, in a process of its own)."""
    import subprocess
    import sys

    settings, _ = lake
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    run = subprocess.run([sys.executable, "-m", "orchestration.cli", "--data-root", settings.data_root,
                          "sql", "-e", f"SELECT * FROM text.`{outside}/secret.txt`; "
                          "SELECT count(*) AS n FROM device_current", "--format", "csv"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 2, run.stderr
    assert SECRET not in run.stdout + run.stderr
    assert f"iotlake sql: `text`.`{outside}/secret.txt` is refused" in run.stderr
