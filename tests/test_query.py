"""`iotlake query`: DuckDB SQL over real Delta tables, time travel, and clear errors (exit 2)."""

from __future__ import annotations

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest

from lakehouse.settings import Settings, load_settings
from orchestration.cli import main
from orchestration.query import QueryError, run_query
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
