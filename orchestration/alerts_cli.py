"""``iotlake alerts list | ack ID | silence ... | unsilence ID``: operators and open alerts.

These read and write the engine's state file (``gold.alerts.store``) beside the checkpoints,
from any process: the running engine applies an acknowledgement or a silence at its next tick
(``alerts.evaluate_seconds``). A silence stops notifications to every receiver iotlake
delivers to; Alertmanager's own silences stay Alertmanager's.
"""

from __future__ import annotations

import argparse
import getpass
import json
import re
import sys
import time
from datetime import UTC, datetime

from gold.alerts import store
from lakehouse.settings import Settings

_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _until(text: str) -> float:
    """``30m``, ``2h``, ``1d`` from now, or an ISO time."""
    m = _DURATION.match(text)
    if m:
        return time.time() + float(m.group(1)) * _UNITS[m.group(2)]
    try:
        t = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a duration (30m, 2h, 1d) nor an ISO "
                                         "time (2026-12-24T08:00:00Z)") from None
    t = t if t.tzinfo else t.replace(tzinfo=UTC)
    if t.timestamp() <= time.time():
        raise argparse.ArgumentTypeError(f"{text!r} is in the past")
    return t.timestamp()


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _conn(settings: Settings):
    path = store.db_path(settings)
    if not path.exists():
        return None
    return store.connect(path)


def _list(args: argparse.Namespace, settings: Settings) -> int:
    conn = _conn(settings)
    alerts = sorted(store.open_alerts(conn).values(), key=lambda a: a.alert_id) if conn else []
    sil = store.silences(conn) if conn else []
    if args.format == "json":
        print(json.dumps({
            "alerts": [{"alert_id": a.alert_id, "rule": a.rule, "kind": a.kind, "severity": a.severity,
                        "subject": a.subject, "labels": a.labels, "summary": a.summary, "value": a.value,
                        "since": _iso(a.starts_at), "acknowledged": a.acknowledged, "silenced": a.silenced,
                        "fingerprint": a.fingerprint} for a in alerts],
            "silences": [{"id": s.id, "rule": s.rule, "device_id": s.device_id, "site": s.site,
                          "until": _iso(s.until), "comment": s.comment} for s in sil]}))
        return 0
    if not alerts:
        print("no open alerts")
    for a in alerts:
        flags = "".join([" [acked]" if a.acknowledged else "", " [silenced]" if a.silenced else ""])
        print(f"{a.alert_id:>5}  {a.severity:<8} {a.rule:<20} {a.subject:<24} since {_iso(a.starts_at)}"
              f"{flags}  {a.summary}")
    for s in sil:
        what = ", ".join(f"{k}={v}" for k, v in (("rule", s.rule), ("device", s.device_id), ("site", s.site)) if v)
        print(f"silence {s.id}: {what or 'everything'} until {_iso(s.until)}"
              f"{f' ({s.comment})' if s.comment else ''}")
    return 0


def _ack(args: argparse.Namespace, settings: Settings) -> int:
    conn = _conn(settings)
    open_ids = {a.alert_id for a in store.open_alerts(conn).values()} if conn else set()
    if args.id not in open_ids:
        print(f"iotlake alerts: no open alert {args.id} (iotlake alerts list shows them)", file=sys.stderr)
        return 2
    with store.transaction(conn):
        store.request_ack(conn, args.id, args.by)
    print(json.dumps({"acknowledged": args.id, "by": args.by}))
    return 0


def _silence(args: argparse.Namespace, settings: Settings) -> int:
    if not (args.rule or args.device or args.site):
        print("iotlake alerts silence: name what to silence: --rule, --device and/or --site", file=sys.stderr)
        return 2
    conn = store.connect(store.db_path(settings))
    with store.transaction(conn):
        sid = store.add_silence(conn, args.until, args.rule, args.device, args.site, args.comment)
    print(json.dumps({"silence": sid, "rule": args.rule, "device_id": args.device, "site": args.site,
                      "until": _iso(args.until)}))
    return 0


def _unsilence(args: argparse.Namespace, settings: Settings) -> int:
    conn = _conn(settings)
    ended = False
    if conn is not None:
        with store.transaction(conn):
            ended = store.end_silence(conn, args.id)
    if not ended:
        print(f"iotlake alerts: no active silence {args.id} (iotlake alerts list shows them)", file=sys.stderr)
        return 2
    print(json.dumps({"unsilenced": args.id}))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("alerts", help="open alerts: list, acknowledge, silence")
    cmds = p.add_subparsers(dest="alerts_command", required=True, metavar="ACTION")
    ls = cmds.add_parser("list", help="open alerts and active silences")
    ls.add_argument("--format", choices=("table", "json"), default="table")
    ls.set_defaults(func=_list)
    ack = cmds.add_parser("ack", help="acknowledge an open alert: no more re-notifications")
    ack.add_argument("id", type=int, metavar="ID")
    ack.add_argument("--by", default=getpass.getuser(), help="who acknowledges (default: you)")
    ack.set_defaults(func=_ack)
    si = cmds.add_parser("silence", help="no notifications for a rule, device and/or site until a time")
    si.add_argument("--rule", help="rule name ([[alerts.rules]] name)")
    si.add_argument("--device", help="device id")
    si.add_argument("--site", help="site")
    si.add_argument("--until", "--for", dest="until", type=_until, required=True,
                    help="a duration from now (30m, 2h, 1d) or an ISO time")
    si.add_argument("--comment")
    si.set_defaults(func=_silence)
    un = cmds.add_parser("unsilence", help="end a silence now")
    un.add_argument("id", type=int, metavar="ID")
    un.set_defaults(func=_unsilence)
