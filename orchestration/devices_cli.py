"""``iotlake devices add | revoke | rotate | list | import | apply | refused``: provisioning.

A device's credential is its id as the user name and a password shown once (stored only as
Mosquitto's hash), or with ``--cert`` a client certificate of iotlake's CA whose common name is
its id (``lakehouse.mqtt.tls``; for ``mqtt.embedded_cert_port``); it may publish only as itself
(``lakehouse.mqtt.auth``). Each command
rewrites the broker's files once and reloads the running embedded broker (SIGHUP; a reload
disconnects a client whose credential was revoked or rotated), and records the device in the
registry table ``devices``. Output for scripts: one JSON line per device.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa

from lakehouse import device_registry
from lakehouse.mqtt import auth as mqtt_auth
from lakehouse.mqtt import tls as mqtt_tls
from lakehouse.settings import Settings
from lakehouse.tables import DEVICES


@dataclass
class Device:
    device_id: str
    site: str | None = None
    labels: dict[str, str] = field(default_factory=dict)


def _label(text: str) -> tuple[str, str]:
    key, eq, value = text.partition("=")
    if not eq or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r}: a label is KEY=VALUE, e.g. --label floor=3")
    return key.strip(), value.strip()


def _labels(text: str) -> dict[str, str]:
    """A CSV cell: ``k=v;k2=v2`` or a JSON object."""
    text = text.strip()
    if text.startswith("{"):
        obj = json.loads(text)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return {str(k): str(v) for k, v in obj.items()}
    return dict(_label(part) for part in text.split(";") if part.strip())


def read_csv(file: Path) -> list[Device]:
    """Devices of a CSV file with a header ``device_id,site,labels`` (site and labels may be
    empty or left out); ValueError naming the line at the first bad row."""
    try:
        f = open(file, newline="")
    except OSError as e:
        raise ValueError(f"cannot read {file}: {e.strerror}") from None
    with f:
        rows = csv.DictReader(f)
        if not rows.fieldnames or "device_id" not in rows.fieldnames:
            raise ValueError(f"{file}: the first line must name the columns: device_id,site,labels")
        unknown = set(rows.fieldnames) - {"device_id", "site", "labels"}
        if unknown:
            raise ValueError(f"{file}: unknown columns {sorted(unknown)} (the columns are device_id,site,labels)")
        out = []
        for row in rows:
            try:
                out.append(Device(row["device_id"].strip(), (row.get("site") or "").strip() or None,
                                  _labels(row.get("labels") or "")))
            except (ValueError, argparse.ArgumentTypeError) as e:
                raise ValueError(f"{file}, line {rows.line_num}: labels: {e} (k=v;k2=v2 or a JSON "
                                 "object)") from None
    return out


def _now() -> datetime:
    return datetime.now(UTC)


def _iso(t: datetime | None) -> str | None:
    return t.isoformat(timespec="seconds").replace("+00:00", "Z") if t else None


def _rows(devices: list[Device], created: datetime) -> pa.Table:
    return pa.Table.from_pylist(
        [{"device_id": d.device_id, "site": d.site, "labels": json.dumps(d.labels, sort_keys=True),
          "created": created, "revoked": None} for d in devices], schema=DEVICES)


def _apply(settings: Settings, store: dict[str, str]) -> int:
    """The broker's files from ``store``, then the running brokers reloaded (how many)."""
    mqtt_auth.write_files(settings, store)
    n = mqtt_auth.reload(settings)
    if not mqtt_auth.managed(settings):
        print(f"iotlake: the MQTT broker at {settings.mqtt.host} is not iotlake's: give it "
              f"password_file {mqtt_auth.password_file(settings)} and acl_file "
              f"{mqtt_auth.acl_file(settings)}, then reload it (SIGHUP)", file=sys.stderr)
    elif n == 0:
        print("iotlake: no embedded broker is running from this data root: the change takes "
              "effect when it starts", file=sys.stderr)
    return n


def _certificates_on(settings: Settings) -> None:
    m = settings.mqtt
    if not (m.tls and m.embedded_cert_port):
        raise ValueError("--cert: devices with certificates log in at the embedded broker's "
                         "certificate listener: set mqtt.tls = true and mqtt.embedded_cert_port "
                         "(e.g. 8883)")


def _credentials(settings: Settings, ids: list[str], cert: bool) -> list[dict[str, str]]:
    """Each device's new credential: a password, or a certificate and key."""
    if cert:
        issued = mqtt_tls.issue(settings, ids)
        return [{"device_id": i, "username": i, **issued[i]} for i in ids]
    return [{"device_id": i, "username": i, "password": mqtt_auth.new_password()} for i in ids]


def provision(settings: Settings, devices: list[Device], cert: bool = False) -> list[dict[str, str]]:
    """New credentials for ``devices`` (none may have one already): one registry commit, one
    rewrite of the broker's files, one reload. Returns each one's credential: a password, or
    with ``cert`` a client certificate and key (PEM) and the CA's certificate."""
    if cert:
        _certificates_on(settings)
    ids = [d.device_id for d in devices]
    for i in ids:
        mqtt_auth.check_device_id(settings, i)
    twice = sorted(i for i, n in Counter(ids).items() if n > 1)
    if twice:
        raise ValueError(f"devices listed more than once: {', '.join(twice[:5])}")
    with mqtt_auth.locked(settings):
        store = mqtt_auth.read_devices(settings)
        have = [i for i in ids if i in store]
        if have:
            raise ValueError(f"already provisioned: {', '.join(have[:5])}{' ...' if len(have) > 5 else ''} "
                             "(`iotlake devices rotate ID` gives one a new password; nothing was changed)")
        creds = _credentials(settings, ids, cert)
        device_registry.upsert(settings, _rows(devices, _now()))
        store.update({c["username"]: mqtt_auth.hash_password(c["password"]) if "password" in c else ""
                      for c in creds})
        _apply(settings, store)
    return creds


def _provisioned(settings: Settings, store: dict[str, str], device_id: str) -> None:
    if device_id not in store:
        raise ValueError(f"device {device_id!r} is not provisioned (iotlake devices add {device_id})")


def revoke(settings: Settings, device_id: str) -> datetime:
    """The device's credential removed (a connected client is disconnected at the reload) and
    its registry row marked revoked."""
    with mqtt_auth.locked(settings):
        store = mqtt_auth.read_devices(settings)
        _provisioned(settings, store, device_id)
        now = _now()
        rows = device_registry.read(settings).to_pylist()
        row = next((r for r in rows if r["device_id"] == device_id),
                   {"device_id": device_id, "site": None, "labels": "{}", "created": None})
        device_registry.upsert(settings, pa.Table.from_pylist([{**row, "revoked": now}], schema=DEVICES))
        del store[device_id]
        had_cert = mqtt_tls.revoke(settings, device_id)
        if _apply(settings, store) and had_cert:
            mqtt_auth.cut_off(settings, device_id)
    return now


def rotate(settings: Settings, device_id: str) -> dict[str, str]:
    """A new password, or certificate for a device that has one; the old one stops working
    (and its connected client is disconnected)."""
    with mqtt_auth.locked(settings):
        store = mqtt_auth.read_devices(settings)
        _provisioned(settings, store, device_id)
        cert = mqtt_tls.has_certificate(settings, device_id)
        (cred,) = _credentials(settings, [device_id], cert)
        store[device_id] = "" if cert else mqtt_auth.hash_password(cred["password"])
        if _apply(settings, store) and cert:
            mqtt_auth.cut_off(settings, device_id)
    return cred


# ---- the commands ----------------------------------------------------------------------------


def _add(args: argparse.Namespace, settings: Settings) -> int:
    (cred,) = provision(settings, [Device(args.device_id, args.site, dict(args.label or []))], args.cert)
    print(json.dumps(cred))
    return 0


def _import(args: argparse.Namespace, settings: Settings) -> int:
    devices = read_csv(Path(args.file))
    if not devices:
        raise ValueError(f"{args.file}: no devices (a header line device_id,site,labels, then a line per device)")
    sys.stdout.write("".join(json.dumps(c) + "\n" for c in provision(settings, devices, args.cert)))
    return 0


def _revoke(args: argparse.Namespace, settings: Settings) -> int:
    print(json.dumps({"device_id": args.device_id, "revoked": _iso(revoke(settings, args.device_id))}))
    return 0


def _rotate(args: argparse.Namespace, settings: Settings) -> int:
    print(json.dumps(rotate(settings, args.device_id)))
    return 0


def _list(args: argparse.Namespace, settings: Settings) -> int:
    rows = sorted(device_registry.read(settings).to_pylist(), key=lambda r: r["device_id"])
    for r in rows:
        r["labels"] = json.loads(r["labels"] or "{}")
        r["created"], r["revoked"] = _iso(r["created"]), _iso(r["revoked"])
    if args.format == "json":
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print("no devices provisioned (iotlake devices add DEVICE_ID)")
    for r in rows:
        labels = ",".join(f"{k}={v}" for k, v in r["labels"].items())
        state = f"revoked {r['revoked']}" if r["revoked"] else "active"
        print(f"{r['device_id']:<24} {r['site'] or '-':<12} {state:<28} created {r['created']}  {labels}")
    return 0


def _apply_cmd(args: argparse.Namespace, settings: Settings) -> int:
    with mqtt_auth.locked(settings):
        n = _apply(settings, mqtt_auth.read_devices(settings))
    print(json.dumps({"password_file": str(mqtt_auth.password_file(settings)),
                      "acl_file": str(mqtt_auth.acl_file(settings)), "reloaded": n}))
    return 0


def _refused(args: argparse.Namespace, settings: Settings) -> int:
    r = mqtt_auth.refused(settings)
    last = datetime.fromtimestamp(r["last"], UTC) if r["last"] is not None else None
    print(json.dumps({"refused": r["refused"], "last": _iso(last)}))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("devices", help="provision devices: MQTT credentials and the registry")
    sub = p.add_subparsers(dest="devices_command", required=True, metavar="ACTION")
    a = sub.add_parser("add", help="a new device: prints its credential as one JSON line (the "
                                   "password is shown once)")
    a.add_argument("device_id")
    a.add_argument("--site", help="the device's site (registry metadata)")
    a.add_argument("--label", type=_label, action="append", metavar="KEY=VALUE",
                   help="registry metadata, repeatable")
    a.add_argument("--cert", action="store_true",
                   help="a client certificate and key (PEM, in the JSON line) instead of a "
                        "password, for mqtt.embedded_cert_port")
    a.set_defaults(func=_add)
    r = sub.add_parser("revoke", help="remove a device's credential (a connected one is cut off)")
    r.add_argument("device_id")
    r.set_defaults(func=_revoke)
    o = sub.add_parser("rotate", help="a new password for a device (prints it as one JSON line)")
    o.add_argument("device_id")
    o.set_defaults(func=_rotate)
    ls = sub.add_parser("list", help="the registry: every device, active or revoked")
    ls.add_argument("--format", choices=("table", "json"), default="table")
    ls.set_defaults(func=_list)
    i = sub.add_parser("import", help="provision every device of a CSV file (device_id,site,labels; "
                                      "labels as k=v;k2=v2): one JSON line per device")
    i.add_argument("file")
    i.add_argument("--cert", action="store_true", help="client certificates instead of passwords")
    i.set_defaults(func=_import)
    w = sub.add_parser("apply", help="rewrite the broker's password and ACL files from the "
                                     "devices and the settings (e.g. after a topic pattern change; "
                                     "an external broker's first start) and reload it")
    w.set_defaults(func=_apply_cmd)
    f = sub.add_parser("refused", help="connections the embedded broker refused for their "
                                       "credentials, from its log")
    f.set_defaults(func=_refused)
