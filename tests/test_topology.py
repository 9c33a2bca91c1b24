"""``stream.topology``: bronze and silver as two queries ("layered") or one ("fused")."""

from __future__ import annotations

from pathlib import Path

import pytest
from deltalake import DeltaTable

from ingest.simulator import generate
from lakehouse.settings import Settings, load_settings
from orchestration.backfill import backfill
from orchestration.pipeline import start_layers
from silver import from_kafka
from tests.test_backfill import START, produce


def count(settings: Settings, table: str) -> int:
    return DeltaTable(settings.table_path(table)).to_pyarrow_dataset().count_rows()


def test_a_lake_keeps_the_topology_it_started_with(tmp_path: Path) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path), stream={"topology": "fused"})
    from_kafka.check_topology(s, from_kafka.QUERY)  # a new lake takes either
    from_kafka.check_topology(s, "layered")
    Path(s.checkpoint_path("silver"), "offsets").mkdir(parents=True)  # e.g. a reprocessed generation
    from_kafka.check_topology(s, from_kafka.QUERY)
    Path(s.checkpoint_path("bronze"), "offsets").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"built by the layered topology \(checkpoint bronze\).*"
                                         r"stream.topology = 'layered'"):
        from_kafka.check_topology(s, from_kafka.QUERY)
    t = load_settings(environ={}, data_root=str(tmp_path / "other"), stream={"topology": "layered"})
    Path(t.checkpoint_path(from_kafka.QUERY), "offsets").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"built by the fused topology.*stream.topology = 'fused'"):
        start_layers(None, t, ("bronze",))


def test_fused_bronze_and_silver_start_together_and_only_where_fused_applies(tmp_path: Path) -> None:
    s = load_settings(environ={}, data_root=str(tmp_path), stream={"topology": "fused"})
    with pytest.raises(ValueError, match="start both layers"):
        start_layers(None, s, ("silver", "gold"))
    with pytest.raises(ValueError, match='stream.topology = "fused" needs JSON payloads'):
        load_settings(environ={}, data_root=str(tmp_path), stream={"topology": "fused", "dedup": "state_store"})
    auto = load_settings(environ={}, data_root=str(tmp_path), stream={"dedup": "state_store"})
    assert auto.stream.topology == "auto" and not auto.fused  # the state store: layered
    assert load_settings(environ={}, data_root=str(tmp_path)).fused


def test_fused_backfill_writes_both_layers_once_whichever_is_asked(settings: Settings, spark) -> None:
    """The Airflow backfill runs a task per layer: with one query for both, the bronze task
    writes silver too and the silver task finds nothing; a rerun changes nothing."""
    settings.stream.topology = "fused"
    msgs = generate(settings, 400, devices=4, duplicates=10, malformed=5, start=START)
    produce(settings, msgs)
    assert backfill(settings, ["bronze"], max_rows=150) == {"bronze": 400}
    assert count(settings, "bronze") == 400
    assert count(settings, "silver") == 400 - 10 - 5
    assert count(settings, "quarantine") == 5
    versions = {t: DeltaTable(settings.table_path(t)).version() for t in ("bronze", "silver")}
    assert backfill(settings, ["silver"]) == {"silver": 0}
    assert backfill(settings, ["bronze", "silver"]) == {"bronze": 0, "silver": 0}
    assert versions == {t: DeltaTable(settings.table_path(t)).version() for t in versions}
