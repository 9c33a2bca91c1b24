"""A notification: one state change of one alert, as the engine hands it to the outbox.

Receivers get it in the shape the tools operators already run understand: Alertmanager's
webhook format (version 4), so anything that takes Alertmanager's webhooks (Grafana OnCall,
PagerDuty's and Opsgenie's bridges, a chat relay) takes iotlake's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any

STATUSES = ("firing", "resolved")
#: What Alertmanager writes as ``endsAt`` for a firing alert (Go's zero time).
ZERO_TIME = "0001-01-01T00:00:00Z"


@dataclass(frozen=True)
class Notification:
    """``key`` is unique per notification (receivers deduplicate by it: delivery is at least
    once); ``fingerprint`` is the alert's, the same for its firing and its resolution."""

    key: str
    fingerprint: str
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    starts_at: datetime
    ends_at: datetime | None = None

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"notification {self.key}: status must be firing or resolved, not {self.status!r}")
        if self.status == "resolved" and self.ends_at is None:
            raise ValueError(f"notification {self.key}: a resolved notification needs ends_at")
        for name in ("starts_at", "ends_at"):
            t = getattr(self, name)
            if t is not None:
                if t.tzinfo is None:
                    raise ValueError(f"notification {self.key}: {name} must be timezone-aware (UTC)")
                object.__setattr__(self, name, t.astimezone(UTC))

    def to_json(self) -> str:
        d = asdict(self)
        d["starts_at"] = self.starts_at.isoformat()
        d["ends_at"] = self.ends_at.isoformat() if self.ends_at else None
        return json.dumps(d, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Notification:
        d = json.loads(text)
        d["starts_at"] = datetime.fromisoformat(d["starts_at"])
        d["ends_at"] = datetime.fromisoformat(d["ends_at"]) if d.get("ends_at") else None
        return cls(**d)


def rfc3339(t: datetime) -> str:
    """As Go's ``time.Time`` marshals in UTC (RFC 3339, fraction without trailing zeros)."""
    t = t.astimezone(UTC)
    s = t.strftime("%Y-%m-%dT%H:%M:%S")
    if t.microsecond:
        s += f".{t.microsecond:06d}".rstrip("0")
    return s + "Z"


def _common(maps: list[dict[str, str]]) -> dict[str, str]:
    if not maps:
        return {}
    return {k: v for k, v in maps[0].items() if all(m.get(k) == v for m in maps[1:])}


def _label_set(labels: dict[str, str]) -> str:
    """Prometheus' ``LabelSet.String()``: ``{a="1", b="2"}``, sorted, values quoted as Go does."""
    return "{" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in sorted(labels.items())) + "}"


def webhook_body(notifications: list[Notification], receiver: str = "iotlake",
                 external_url: str = "") -> dict[str, Any]:
    """Alertmanager's webhook payload (version 4) for these notifications.

    Grouped as Alertmanager's ``group_by: ['...']`` would (by every label): ``groupLabels``
    are the labels the notifications share, ``groupKey`` the root route's key over them.
    """
    if not notifications:
        raise ValueError("webhook_body needs at least one notification")
    group = dict(sorted(_common([n.labels for n in notifications]).items()))
    return {
        "version": "4",
        "groupKey": "{}:" + _label_set(group),
        "truncatedAlerts": 0,
        "status": "firing" if any(n.status == "firing" for n in notifications) else "resolved",
        "receiver": receiver,
        "groupLabels": group,
        "commonLabels": group,
        "commonAnnotations": dict(sorted(_common([n.annotations for n in notifications]).items())),
        "externalURL": external_url,
        "alerts": [{
            "status": n.status,
            "labels": dict(sorted(n.labels.items())),
            "annotations": dict(sorted(n.annotations.items())),
            "startsAt": rfc3339(n.starts_at),
            "endsAt": rfc3339(n.ends_at) if n.ends_at else ZERO_TIME,
            "generatorURL": "",
            "fingerprint": n.fingerprint,
        } for n in notifications],
    }
