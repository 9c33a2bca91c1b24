"""``iotlake status``: is ``iotlake run`` healthy? Its last snapshot (``<run_dir>/status.json``,
``orchestration.status``) as a table or JSON; exit 0 healthy, 1 not (or not running)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from lakehouse.monitoring.status_file import DEFAULT_MAX_AGE, read_status
from lakehouse.settings import Settings
from orchestration.run import ROLES


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help="the running pipeline's health (exit 1 when unhealthy)")
    p.add_argument("--format", choices=("table", "json"), default="table")
    p.add_argument("--max-age", type=_seconds, default=DEFAULT_MAX_AGE, metavar="SECONDS",
                   help=f"a status older than this means not running (default {DEFAULT_MAX_AGE:g})")
    p.add_argument("--role", choices=ROLES, default="all",
                   help="the `iotlake run --role` process to ask (default: all)")
    p.set_defaults(func=_status_cmd)


def _status_cmd(args: argparse.Namespace, settings: Settings) -> int:
    status = read_status(settings, args.max_age, args.role)
    print(json.dumps(status, indent=1) if args.format == "json" else render(status))
    return 0 if status["healthy"] else 1


def _s(v: Any, unit: str = " s") -> str:
    return "-" if v is None else f"{v:g}{unit}" if isinstance(v, float) else f"{v}{unit}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()
            for r in [header, *rows]]


def render(s: dict[str, Any]) -> str:
    """The snapshot for a terminal: verdict, problems, then each part."""
    head = "healthy" if s.get("healthy") else "UNHEALTHY"
    where = f"role {s.get('role')}" + (f", pid {s.get('pid')}, {_s(s.get('age_s'))} ago"
                                       if s.get("running") else "")
    out = [f"iotlake: {head} ({where})"]
    if s.get("problems"):
        out += ["problems:", *(f"  - {p}" for p in s["problems"])]
    if s.get("queries"):
        out.append("queries:")
        out += _table(["name", "active", "progress", "batch", "rows/s", "lag", "error"], [
            [name, "yes" if q["active"] else "NO", _s(q["last_progress_age_s"]),
             _s(q["last_batch_age_s"]), _s(q["input_rows_per_s"], ""), _s(q["lag"], ""),
             q["error"] or ""] for name, q in s["queries"].items()])
    if b := s.get("bridge"):
        state = ("running" if b["running"] else "STOPPED") + (", delivering" if b["delivering"] else ", NOT DELIVERING")
        out.append(f"bridge {b['id']}: {state}; last delivery {_s(b['last_delivery_age_s'])} ago, "
                   f"delivered {b['delivered']}, pending {b['pending']}")
    if s.get("brokers"):
        out.append("brokers:")
        out += _table(["name", "endpoint", "up", ""], [
            [kind, f["endpoint"], "yes" if f["up"] else "NO", "embedded" if f["embedded"] else "external"]
            for kind, f in s["brokers"].items()])
    if d := s.get("disk"):
        out.append(f"disk: {d['free_gb']:g} GB free under {d['path']} (minimum {d['min_free_gb']:g} GB)"
                   f"{'' if d['ok'] else ' LOW'}")
    a = s.get("alerts") or {"open": 0, "firing": []}
    out.append(f"alerts: {a['open']} open" + (":" if a["firing"] else ""))
    out += [f"  - {_alert(f)}" for f in a["firing"]]
    return "\n".join(out)


def _alert(f: Any) -> str:
    """A firing alert of the engine's summary (``gold.alerts.engine``): severity, rule, subject."""
    if not isinstance(f, dict):
        return str(f)
    what = " ".join(str(f[k]) for k in ("rule", "subject") if f.get(k))
    return f"[{f.get('severity', '?')}] {what}" + (f": {f['summary']}" if f.get("summary") else "")


def _seconds(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (got {text})")
    return v
