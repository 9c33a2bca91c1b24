"""infra/prometheus/: the rules and example configurations are what Prometheus' and
Alertmanager's own tools accept, the rules' unit tests pass, every series they read is one
iotlake exports, and the example Alertmanager configuration inhibits as it says."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml
from alertmanager_fixture import Alertmanager

from gold.alerts.channels import AlertmanagerChannel
from gold.alerts.notification import Notification

INFRA = Path(__file__).resolve().parents[1] / "infra" / "prometheus"
RULES = INFRA / "iotlake-rules.yml"


def tool(name: str) -> str:
    found = shutil.which(name)
    if not found:
        pytest.fail(f"{name} is missing: run `make test-deps` (Debian's prometheus / "
                    "prometheus-alertmanager packages)")
    return found


def run(*argv: str) -> str:
    p = subprocess.run(argv, cwd=INFRA, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{' '.join(argv)}: {p.stdout}{p.stderr}"
    return p.stdout + p.stderr


def test_promtool_checks_the_rules_and_the_prometheus_example():
    assert "SUCCESS: 13 rules found" in run(tool("promtool"), "check", "rules", RULES.name)
    out = run(tool("promtool"), "check", "config", "prometheus.yml")
    assert "SUCCESS: 1 rule files found" in out and "SUCCESS: 13 rules found" in out


def test_promtool_unit_tests_of_the_rules_pass():
    assert "SUCCESS" in run(tool("promtool"), "test", "rules", "iotlake-rules.test.yml")


def test_amtool_checks_the_alertmanager_example():
    out = run(tool("amtool"), "check-config", "alertmanager.yml")
    assert "SUCCESS" in out and "2 inhibit rules" in out and "1 receivers" in out


def _exported() -> set[str]:
    """Every series name iotlake's code registers (process-wide registry, the bridge's collector)."""
    from prometheus_client import REGISTRY
    from prometheus_client.core import Metric

    import gold.alerts.outbox  # noqa: F401 - registers its metrics
    import lakehouse.monitoring.metrics  # noqa: F401
    import orchestration.upkeep  # noqa: F401
    from ingest.bridge_metrics import COUNTERS, GAUGES, BridgeCollector, LatencyHistogram

    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    families: list[Metric] = [*REGISTRY.collect(), *BridgeCollector(
        "b", lambda: dict.fromkeys([*COUNTERS, *GAUGES], 0), LatencyHistogram()).collect()]
    return {f.name + s for f in families if f.name.startswith("iotlake_") for s in suffixes[f.type]}


def test_every_series_the_rules_read_is_one_iotlake_exports():
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    read = {name for r in rules for name in re.findall(r"\biotlake_[a-z0-9_]+", r["expr"])}
    assert len(read) >= 10
    assert read - _exported() == set()
    assert all(r["labels"]["severity"] in ("critical", "warning") and r["annotations"]["summary"]
               for r in rules)


def test_the_example_alertmanager_config_inhibits_a_silent_sites_devices(tmp_path):
    """As shipped (its receiver need not answer: inhibition shows in the API at once)."""
    with Alertmanager(tmp_path / "am", config_text=(INFRA / "alertmanager.yml").read_text()) as am:
        channel = AlertmanagerChannel(am.url, timeout=5, resend_seconds=60)
        now = datetime.now(UTC)

        def alert(name: str, **labels: str) -> Notification:
            return Notification(key=f"{name}:{labels}", fingerprint=name, status="firing",
                                labels={"alertname": name, "severity": "warning", **labels},
                                annotations={"summary": name}, starts_at=now)

        channel.post([alert("SiteSilent", site="north"),
                      alert("DeviceOffline", site="north", device_id="d1"),
                      alert("DeviceOffline", site="south", device_id="d2")])
        deadline = time.monotonic() + 10
        while True:
            got = {a["labels"].get("device_id", a["labels"]["alertname"]): a for a in am.alerts()}
            if len(got) == 3 and got["d1"]["status"]["state"] == "suppressed" or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        channel.close()
    assert {k: a["status"]["state"] for k, a in got.items()} == {
        "SiteSilent": "active", "d1": "suppressed", "d2": "active"}
    assert got["d1"]["status"]["inhibitedBy"] == [got["SiteSilent"]["fingerprint"]]
