"""The dashboard against a real lakehouse: JSON API over HTTP, then a real Chromium via Playwright."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fleets import SENSOR

from dashboard.app import Memo, TableCache, create_app
from lakehouse.settings import Settings, load_settings
from orchestration.query import run_query
from orchestration.services import free_port
from tests.lakehouse_fixture import build_lakehouse, write, write_alerts

TOKEN = "test-token-123"
REPO = Path(__file__).resolve().parents[1]
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@contextmanager
def serve(app: Any) -> Iterator[str]:
    """``app`` served over HTTP on a free loopback port; yields its base URL."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "dashboard did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Settings, dict[str, Any]]]:
    """A lakehouse plus the dashboard serving it over HTTP on a free loopback port."""
    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path_factory.mktemp("dash") / "lake"))
    facts = build_lakehouse(settings, devices=60, hours=2)
    facts["alerts"] = write_alerts(settings, facts)
    with serve(create_app(settings, token=TOKEN, check_every=0.0)) as base:
        yield base, settings, facts


def get(base: str, path: str, token: str | None = TOKEN) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.get(base + path, headers=headers, timeout=10)


def test_api(served) -> None:
    base, settings, facts = served
    assert get(base, "/api/fleet", token=None).status_code == 401
    assert get(base, "/api/fleet", token="wrong").status_code == 401
    # no `iotlake run` on this lake: not running (the healthy side is tests/test_status.py's);
    # without the token only the verdict, with it the whole status
    health = get(base, "/healthz", token=None)
    assert health.status_code == 503
    assert health.json() == {"time": None, "role": "all", "running": False, "healthy": False}
    health = get(base, "/healthz")
    assert health.status_code == 503 and health.json()["problems"] == [
        f"not running: no status file {settings.run_dir / 'status.json'} (start `iotlake run`)"]

    fleet = get(base, "/api/fleet").json()
    assert fleet["by_status"] == facts["fleet"] and fleet["total"] == facts["devices"]

    page = get(base, "/api/devices?size=7&page=2").json()
    assert page["total"] == 60 and [d["device_id"] for d in page["items"]] == [
        f"dev-{i:04d}" for i in range(7, 14)]
    offline = get(base, "/api/devices?status=offline&q=DEV-00&size=500").json()
    assert offline["total"] == facts["fleet"]["offline"]
    assert {d["status"] for d in offline["items"]} == {"offline"}
    assert all(d["status_since"].endswith("Z") for d in offline["items"])

    an = facts["anomaly"]
    dev = get(base, f"/api/device/{an['device_id']}?hours=2").json()
    assert dev["device"]["status"] == facts["status"][an["device_id"]]
    assert [(a["metric"], a["event_time"], a["value"]) for a in dev["anomalies"]] == [
        ("temperature", an["event_time"].isoformat().replace("+00:00", "Z"), 95.0)]
    assert len(dev["series"]["temperature"]["t"]) == 121  # a 1-minute window per minute, both ends
    assert len(dev["points"]["humidity"]["v"]) == 361  # every 20 s for 2 h, both ends included
    assert max(dev["series"]["temperature"]["max"]) == 95.0
    assert get(base, "/api/device/dev-9999").status_code == 404
    assert get(base, "/api/device/dev-0001?hours=0").status_code == 422

    offline_dev = next(d for d, s in facts["status"].items() if s == "offline")
    assert get(base, f"/api/device/{offline_dev}").json()["device"]["status_reason"] == "no_data"

    # open alerts: critical first, then newest first; acknowledged and silenced flagged
    al = facts["alerts"]
    alerts = get(base, "/api/alerts").json()
    assert alerts["total"] == al["open"] == len(al["offline"]) + 2
    assert list(alerts["by_severity"].items()) == [("critical", 1), ("warning", len(al["offline"])), ("info", 1)]
    assert [(a["rule"], a["subject"]) for a in alerts["items"]] == [
        ("PipelineStale", "silver"), *[("DeviceOffline", d) for d in reversed(al["offline"])],
        ("HighTemperature", an["device_id"])]
    flags = {a["subject"]: (a["acknowledged"], a["silenced"]) for a in alerts["items"]}
    assert flags[al["offline"][0]] == (True, False) and flags[an["device_id"]] == (False, True)
    assert sum(a + b for a, b in flags.values()) == 2
    stale = alerts["items"][0]
    assert stale["labels"] == {"alertname": "PipelineStale", "severity": "critical", "query": "silver"}
    assert stale["starts_at"] == (facts["now"] - timedelta(minutes=5)).isoformat().replace("+00:00", "Z")
    assert stale["summary"] == "query silver: no progress for 75 s" and stale["value"] == 75.0
    assert [a["rule"] for a in get(base, "/api/alerts?limit=2").json()["items"]] == ["PipelineStale", "DeviceOffline"]
    assert get(base, "/api/alerts?limit=0").status_code == 422

    # recent events: a device's status changes are one line, an alert burst or flap is one line
    events = get(base, "/api/events").json()
    not_online = {d: s for d, s in facts["status"].items() if s != "online"}
    changed = {e["device_id"]: e["status"] for e in events["status_changes"]}
    assert changed == {**not_online, al["flapper"]: "online"}
    flap = next(e for e in events["status_changes"] if e["device_id"] == al["flapper"])
    assert (flap["previous_status"], flap["status"], flap["reason"], flap["changes"]) == (
        "degraded", "online", "data", 2 * al["flaps"])
    assert events["totals"]["status_changes"] == {"changes": len(not_online) + 2 * al["flaps"],
                                                  "devices": len(not_online) + 1}
    assert {e["reason"] for e in events["status_changes"] if e["status"] == "offline"} == {"no data for 10 min"}
    latest3 = get(base, "/api/events?limit=3").json()
    assert latest3["status_changes"] == sorted(events["status_changes"], key=lambda e: e["changed_at"],
                                               reverse=True)[:3]
    assert latest3["totals"] == events["totals"]
    k = len(al["offline"])
    assert [(t["rule"], t["transition"], t["subjects"], t["transitions"], t["sample"])
            for t in events["alert_transitions"]] == [
        ("DeviceDegraded", "resolved", 1, 2 * al["flaps"], [al["flapper"]]),
        ("PipelineStale", "firing", 1, 1, ["silver"]),
        ("DeviceOffline", "acknowledged", 1, 2, [al["offline"][0]]),
        ("DeviceOffline", "firing", k - 1, k - 1, al["offline"][::-1][:3]),
        ("HighTemperature", "firing", 1, 1, [an["device_id"]])]
    assert events["totals"]["alert_transitions"] == al["transitions"] == k + 1 + 1 + 1 + 2 * al["flaps"]
    assert [a["device_id"] for a in events["anomalies"]] == [an["device_id"]]
    assert events["anomalies"][0]["count"] == 1 and events["totals"]["anomalies"] == {"count": 1, "devices": 1}
    # a 6-minute window, up to the newest change: the devices whose latest change is in it
    short = get(base, "/api/events?hours=0.1").json()
    newest = max(datetime.fromisoformat(e["changed_at"]) for e in events["status_changes"])
    assert [e["device_id"] for e in short["status_changes"]] == [
        e["device_id"] for e in events["status_changes"]
        if datetime.fromisoformat(e["changed_at"]) >= newest - timedelta(minutes=6)]

    pipe = get(base, "/api/pipeline").json()
    assert [q["query_name"] for q in pipe["queries"]] == ["bronze", "gold", "silver"]
    assert pipe["queries"][0]["batch_id"] == 9 and pipe["queries"][0]["lag"] == 9
    rates = {q["expectation"]: q["quarantine_rate"] for q in pipe["quality"]}
    assert rates["device_id_not_null"] == 0
    assert rates["temperature_in_range"] == pytest.approx(facts["quarantine_rate"])


def ids_of(base: str, query: str) -> list[str]:
    """Every device id ``/api/devices?<query>`` lists (one page of 500)."""
    page = get(base, f"/api/devices?size=500&{query}").json()
    assert page["total"] == len(page["items"])
    return [d["device_id"] for d in page["items"]]


def test_devices_carry_the_registry_and_filter_by_site_and_label(served) -> None:
    """Each device's site and labels (device_current's registry columns) in the list and the
    device's answer; the list filters by site and by a label exactly, with the other filters."""
    base, _, facts = served
    reg = facts["registry"]
    items = {d["device_id"]: d for d in get(base, "/api/devices?size=500").json()["items"]}
    assert {d: (x["site"], x["labels"], x["registered"]) for d, x in items.items()} == {
        d: (reg[d]["site"], reg[d]["labels"], True) if d in reg else (None, {}, False) for d in items}
    assert [d for d, x in items.items() if x["revoked_at"]] == ["dev-0010"]
    assert get(base, "/api/fleet").json()["sites"] == ["north", "south"]

    north = sorted(d for d, r in reg.items() if r["site"] == "north")
    assert ids_of(base, "site=north") == north and len(north) == 30
    floor1 = sorted(d for d, r in reg.items() if r["labels"]["floor"] == "1")
    assert ids_of(base, "label=floor%3D1") == floor1 and 0 < len(floor1) < len(reg)
    assert ids_of(base, "label=%20floor%20=%201") == floor1  # spaces around the key and value
    north_b = [d for d in north if reg[d]["labels"]["zone"] == "b"]
    assert ids_of(base, "site=north&label=zone%3Db") == north_b and 0 < len(north_b) < len(north)
    assert ids_of(base, "site=north&label=zone%3Db&q=DEV-003") == [d for d in north_b if d.startswith("dev-003")]
    offline_south = sorted(d for d, r in reg.items() if r["site"] == "south" and facts["status"][d] == "offline")
    assert ids_of(base, "site=south&status=offline") == offline_south
    assert ids_of(base, "site=nowhere") == [] and ids_of(base, "label=floor%3D9") == []
    assert ids_of(base, "label=floo%3D1") == [] and ids_of(base, "label=floor%3D") == []
    assert get(base, "/api/devices?label=floor").status_code == 400
    assert get(base, "/api/devices?label=%3D1").status_code == 400
    dev = get(base, "/api/device/dev-0010").json()["device"]
    assert (dev["site"], dev["labels"], dev["registered"]) == ("north", reg["dev-0010"]["labels"], True)
    assert dev["revoked_at"] == reg["dev-0010"]["revoked_at"].isoformat().replace("+00:00", "Z")
    assert get(base, "/api/device/dev-0003").json()["device"]["registered"] is False


def test_reloads_only_on_new_version(served) -> None:
    base, settings, facts = served
    before = get(base, "/api/fleet").json()
    assert get(base, "/api/fleet").json() == before  # same version: memoised answer
    row = run_query(settings, "SELECT * FROM device_current WHERE device_id = 'dev-0000'")
    row = row.set_column(0, "device_id", [["dev-new"]])
    write(settings, "device_current", row, mode="append")
    after = fleet_at_version(base, before["version"] + 1)
    assert after["total"] == facts["devices"] + 1
    # Put the fleet back as it was for the browser test (a new version again).
    write(settings, "device_current",
          run_query(settings, "SELECT * FROM device_current WHERE device_id <> 'dev-new'"),
          mode="overwrite")
    assert fleet_at_version(base, before["version"] + 2)["by_status"] == facts["fleet"]


def fleet_at_version(base: str, version: int) -> dict[str, Any]:
    """The fleet answer once the dashboard's background refresh has read ``version``."""
    deadline = time.monotonic() + 20
    while (fleet := get(base, "/api/fleet").json())["version"] < version:
        assert time.monotonic() < deadline, fleet
        time.sleep(0.05)
    assert fleet["version"] == version
    return fleet


def test_a_request_gets_the_last_snapshot_while_the_next_is_read(tmp_path: Path) -> None:
    """A new Delta version is read by a background refresh, never inside the request."""
    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path / "lake"))
    build_lakehouse(settings, devices=3, hours=1)
    cache = TableCache(settings, check_every=0.0)
    first = cache.get("device_current")
    assert first.table.num_rows == 3  # read whole when opened (a preloaded table)
    write(settings, "device_current", first.table.slice(0, 1), mode="append")
    assert cache.get("device_current") is first  # the request is answered from what is loaded
    deadline = time.monotonic() + 20
    while (snap := cache.get("device_current")).version == first.version:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert snap.version == first.version + 1 and snap.table.num_rows == 4
    assert "table" in vars(snap)  # the refresh read it, not this request
    while cache.refreshing("device_current"):
        time.sleep(0.01)
    assert cache.get("device_current") is snap  # no new version: the same snapshot


def test_a_lake_without_alerts_or_the_new_device_columns(tmp_path: Path) -> None:
    """A lake written before alerts (no alerts tables, device_current without status_reason,
    last_received or topic columns) is shown as it is: no open alerts, no error."""
    from deltalake import write_deltalake

    from dashboard.app import Lake

    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"), data_root=str(tmp_path / "lake"))
    facts = build_lakehouse(settings, devices=6, hours=1)
    old = run_query(settings, "SELECT * FROM device_current").drop_columns(
        ["status_reason", "last_received", "labels", "registered", "revoked_at", "site"])
    write_deltalake(settings.table_path("device_current"), old, mode="overwrite", schema_mode="overwrite")
    lake = Lake(settings, check_every=0.0)
    assert lake.alerts(50) == {"total": 0, "by_severity": {}, "items": [], "version": -1}
    events = lake.events(50)
    assert events["alert_transitions"] == [] and "alert_transitions" not in events["totals"]
    assert len(events["status_changes"]) == sum(s != "online" for s in facts["status"].values())
    device = lake.device("dev-0001", 1)
    assert device["topics"] == [] and "status_reason" not in device["device"]
    assert "labels" not in device["device"] and lake.fleet()["sites"] == []
    assert lake.fleet()["by_status"] == facts["fleet"]
    assert lake.devices("", "", 1, 50, site="north")["total"] == 0
    assert lake.devices("", "", 1, 50, label=("floor", "1"))["total"] == 0
    assert lake.devices("", "", 1, 50)["total"] == 6


def test_latest_serves_the_previous_answer_while_the_next_is_computed() -> None:
    """Requests never wait for a version check or a recompute, only for the very first answer."""
    memo, release, computed = Memo(), threading.Event(), []

    def answer(v: str):
        return lambda: computed.append(v) or v

    def settled() -> None:
        deadline = time.monotonic() + 10
        while memo.refreshing("p") and time.monotonic() < deadline:
            time.sleep(0.01)

    def slow_versions() -> tuple:
        release.wait(10)
        return (1,)

    assert memo.latest("p", lambda: (1,), answer("v1")) == "v1"  # the first answer: computed at once
    started = time.monotonic()
    assert memo.latest("p", slow_versions, answer("no")) == "v1"  # a slow log read: not waited for
    assert time.monotonic() - started < 5
    release.set()
    settled()
    assert computed == ["v1"]  # same versions: not recomputed

    release.clear()

    def slow() -> str:
        release.wait(10)
        return "v2"

    started = time.monotonic()
    assert memo.latest("p", lambda: (2,), slow) == "v1"  # new versions: the old answer, not a wait
    assert memo.latest("p", lambda: (3,), answer("no")) == "v1"  # one refresh at a time
    assert time.monotonic() - started < 5
    release.set()
    settled()
    assert memo.latest("p", lambda: (2,), answer("no")) == "v2"
    settled()
    assert computed == ["v1"]
    # a refresh that fails keeps the last answer; the next request tries again
    assert memo.latest("p", lambda: (4,), lambda: 1 / 0) == "v2"
    settled()
    assert memo.latest("p", lambda: (5,), answer("v5")) == "v2"
    settled()
    assert memo.latest("p", lambda: (5,), answer("no")) == "v5"
    settled()
    assert computed == ["v1", "v5"]


# ---- security: Host allowlist without a token, headers, the token never on the command line ----

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")


def assert_security_headers(r: httpx.Response) -> None:
    assert r.headers["content-security-policy"] == CSP, r.url
    assert r.headers["x-content-type-options"] == "nosniff"
    assert r.headers["x-frame-options"] == "DENY" and r.headers["referrer-policy"] == "no-referrer"


def test_without_a_token_only_allowed_host_names_are_answered(served) -> None:
    """DNS rebinding: a page of evil.example whose name now points at 127.0.0.1 sends
    ``Host: evil.example``; it gets 421 and no data. Loopback names, the bind address and
    ``dashboard.allowed_hosts`` are answered; /healthz stays open to probes, verdict only."""
    _, served_settings, facts = served
    settings = load_settings(environ={}, telemetry=SENSOR.model_dump(mode="json"),
                             data_root=served_settings.data_root,
                             dashboard={"allowed_hosts": ["ops.example.com"]})
    with serve(create_app(settings, check_every=0.0, bind="10.1.2.3")) as base:
        port = base.rsplit(":", 1)[1]

        def at(path: str, host: str) -> httpx.Response:
            return httpx.get(base + path, headers={"Host": host}, timeout=10)

        for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example",
                     "localhost.", "ops.example.com.evil.example", ""):
            for path in ("/api/fleet", "/", "/static/app.js", "/api/device/dev-0001"):
                r = at(path, host)
                assert r.status_code == 421, (host, path, r.status_code)
                assert facts["fleet"]["online"] != 0 and "dev-0001" not in r.text
                assert r.text.startswith("this dashboard answers to 10.1.2.3, 127.0.0.1, ::1, "
                                         "localhost, ops.example.com")
                assert_security_headers(r)
            health = at("/healthz", host)
            assert health.status_code == 503 and health.json() == {
                "time": None, "role": "all", "running": False, "healthy": False}
        for host in (f"127.0.0.1:{port}", "localhost", f"[::1]:{port}", "10.1.2.3",
                     "ops.example.com", "OPS.Example.com:443"):
            r = at("/api/fleet", host)
            assert r.status_code == 200 and r.json()["by_status"] == facts["fleet"], host
            assert_security_headers(r)
        assert "problems" in at("/healthz", "localhost").json()  # a trusted name: the details
        page = at("/", "localhost")
        assert page.status_code == 200 and "<script src=\"/static/app.js\">" in page.text
        assert_security_headers(page)


def test_with_a_token_the_token_decides_and_headers_are_set(served) -> None:
    base, _, facts = served
    r = httpx.get(base + "/api/fleet", headers={"Host": "dash.example", "Authorization": f"Bearer {TOKEN}"},
                  timeout=10)
    assert r.status_code == 200 and r.json()["by_status"] == facts["fleet"]
    assert_security_headers(r)
    refused = get(base, "/api/fleet", token=None)
    assert refused.status_code == 401
    assert_security_headers(refused)
    for path in ("/", "/static/app.js", "/static/style.css"):
        assert_security_headers(get(base, path, token=None))


def test_token_from_a_file_never_on_the_command_line(served, tmp_path: Path, capsys) -> None:
    """``--token-file`` (the token is not in ``ps``); ``--token`` is refused, saying why."""
    from orchestration.cli import main

    _, settings, facts = served
    assert main(["--data-root", settings.data_root, "dashboard", "--token", TOKEN]) == 2
    err = capsys.readouterr().err
    assert err == ("iotlake dashboard: --token would show in `ps`; put the token in "
                   "IOTLAKE_DASHBOARD_TOKEN or in a file read with --token-file FILE\n")
    assert main(["--data-root", settings.data_root, "dashboard", "--token-file",
                 str(tmp_path / "none")]) == 2
    assert "cannot read --token-file" in capsys.readouterr().err
    (tmp_path / "empty").write_text("\n")
    assert main(["--data-root", settings.data_root, "dashboard", "--token-file",
                 str(tmp_path / "empty")]) == 2
    assert capsys.readouterr().err.endswith("is empty\n")

    secret = tmp_path / "token"
    secret.write_text("file-token-456\n")
    secret.chmod(0o600)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    proc = subprocess.Popen([sys.executable, "-m", "orchestration.cli", "--data-root", settings.data_root,
                             "dashboard", "--port", str(port), "--token-file", str(secret)],
                            cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "the dashboard did not answer"
                time.sleep(0.2)
        assert "file-token-456" not in Path(f"/proc/{proc.pid}/cmdline").read_text()
        assert get(base, "/api/fleet", token=None).status_code == 401
        assert get(base, "/api/fleet", token=TOKEN).status_code == 401
        fleet = get(base, "/api/fleet", token="file-token-456")
        assert fleet.status_code == 200 and fleet.json()["by_status"] == facts["fleet"]
    finally:
        proc.terminate()
        proc.wait(30)


def _chromium() -> str | None:
    for candidate in ("/usr/bin/chromium", shutil.which("chromium"), shutil.which("chromium-browser")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def test_browser_shows_fleet_device_and_anomaly(served) -> None:
    chromium = _chromium()
    if chromium is None:
        pytest.skip("no Chromium found (/usr/bin/chromium); install it with: apt-get install -y chromium")
    from playwright.sync_api import expect, sync_playwright

    base, _, facts = served
    an = facts["anomaly"]
    offline = next(d for d, s in facts["status"].items() if s == "offline")
    errors: list[str] = []
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(f"{base}/#token={TOKEN}")
            page.wait_for_selector('[data-count="online"]')
            assert page.url == f"{base}/"  # the token left the address bar
            shown = {s: page.text_content(f'[data-count="{s}"]') for s in facts["fleet"]}
            assert shown == {s: str(n) for s, n in facts["fleet"].items()}
            assert page.text_content('[data-count="total"]') == str(facts["devices"])

            page.fill("#q", offline)
            # the page's CSP forbids eval, so waits are locators' (wait_for_function evaluates a string)
            expect(page.locator("#devices tr")).to_have_count(1)
            assert page.text_content(f'#devices tr[data-device="{offline}"] [data-status]') == "offline"
            page.click(f'#devices tr[data-device="{offline}"]')
            page.wait_for_selector(f'#device-title[data-device="{offline}"]')
            assert page.text_content("#device-status") == "offline"

            page.fill("#q", an["device_id"])
            page.wait_for_selector(f'#devices tr[data-device="{an["device_id"]}"]')
            page.click(f'#devices tr[data-device="{an["device_id"]}"]')
            page.wait_for_selector(f'#device-title[data-device="{an["device_id"]}"]')
            assert page.text_content("#device-status") == facts["status"][an["device_id"]]
            marker = page.wait_for_selector('figure[data-metric="temperature"] .anomaly-marker')
            when = an["event_time"].isoformat().replace("+00:00", "Z")
            assert marker.get_attribute("data-anomaly") == when
            assert page.locator(".anomaly-marker").count() == 1
            assert page.locator('figure[data-metric="temperature"] .pt').count() > 100
            assert page.locator("#anomaly-events li[data-event=anomaly]").count() == 1
            assert page.locator("#queries tr").count() == 3
            al = facts["alerts"]
            changed = sum(n for s, n in facts["fleet"].items() if s != "online") + 1  # + the flapper
            assert page.locator("#status-events li[data-event=status]").count() == 20  # the page's limit
            assert page.text_content("#status-summary") == (
                f"{changed - 1 + 2 * al['flaps']} changes on {changed} devices · the 20 latest devices shown")
            assert page.text_content(f'#status-events li[data-device="{al["flapper"]}"] [data-flap]') == \
                f"{2 * al['flaps']} changes"
            assert page.locator("#alert-events li[data-event=alert]").count() == 5
            burst = page.locator('#alert-events li[data-rule="DeviceOffline"][data-transition="firing"]')
            assert burst.get_attribute("data-subjects") == str(len(al["offline"]) - 1)
            assert burst.locator("a[data-link]").count() == 3  # a sample, not the whole burst

            # open alerts: critical first; flags; a device's alert opens the device
            rows = page.locator("#alerts tr[data-alert]")
            assert rows.count() == al["open"]
            assert rows.first.get_attribute("data-severity") == "critical"
            assert rows.last.get_attribute("data-severity") == "info"
            assert page.locator("#alerts [data-flag=acknowledged]").count() == 1
            assert page.locator("#alerts [data-flag=silenced]").count() == 1
            assert page.text_content('#alert-counts [data-severity-count="critical"]') == "1 critical"
            page.click(f'#alerts a[data-link="{al["offline"][-1]}"]')
            page.wait_for_selector(f'#device-title[data-device="{al["offline"][-1]}"]')
            assert "(no_data)" in page.text_content("#device-meta")
            page.click(f'#devices tr[data-device="{an["device_id"]}"]')
            page.wait_for_selector(f'#device-title[data-device="{an["device_id"]}"]')

            # the registry's site and labels in the list, which filters by them
            north = sorted(d for d, r in facts["registry"].items() if r["site"] == "north")
            page.fill("#q", "")
            page.select_option("#site", "north")
            expect(page.locator("#devices tr")).to_have_count(25)  # the page's size
            assert page.text_content("#page-info").startswith(f"{len(north)} devices")
            assert page.text_content(f'#devices tr[data-device="{north[0]}"] [data-site]') == "north"
            floor = facts["registry"][north[0]]["labels"]["floor"]
            page.fill("#label", f"floor={floor}")
            expect(page.locator("#devices tr")).to_have_count(
                sum(facts["registry"][d]["labels"]["floor"] == floor for d in north))
            assert page.locator(f'#devices tr[data-device="{north[0]}"] [data-label="floor={floor}"]').count() == 1
            page.fill("#label", "")
            page.select_option("#site", "")

            page.fill("#q", "")  # a full device list for the screenshot; the selection stays
            expect(page.locator("#devices tr")).to_have_count(25)
            assert page.locator("#devices tr.selected").get_attribute("data-device") == an["device_id"]
            time.sleep(0.3)  # let the last paint settle before the screenshot
            out = REPO / "test-artifacts" / "dashboard.png"
            out.parent.mkdir(exist_ok=True)
            page.screenshot(path=str(out), full_page=True)
        finally:
            browser.close()
    assert not errors, errors
    docs = REPO / "docs" / "dashboard.png"
    if not docs.exists() or os.environ.get("UPDATE_DOCS_SCREENSHOT") == "1":
        docs.parent.mkdir(exist_ok=True)
        shutil.copyfile(out, docs)
    assert out.stat().st_size > 20_000
