"""Helpers shared by the layer streams: stable query ids, triggers, lifecycle."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

from lakehouse.settings import Settings


def query_id(checkpoint: str) -> str:
    """The streaming query id persisted in the checkpoint, created before the first start.

    Spark keeps the id in ``<checkpoint>/metadata`` across restarts; writing it ourselves first
    lets the sinks use it as their Delta app-transaction id before the query exists.
    """
    meta = Path(checkpoint, "metadata")
    if meta.exists():
        return json.loads(meta.read_text().splitlines()[0])["id"]
    meta.parent.mkdir(parents=True, exist_ok=True)
    qid = str(uuid.uuid4())
    tmp = meta.with_suffix(".tmp")
    tmp.write_text(json.dumps({"id": qid}) + "\n")
    tmp.rename(meta)
    return qid


def trigger_kwargs(settings: Settings, mode: str = "live") -> dict:
    """``live``: processingTime from settings; ``available_now`` / ``once`` for batch catch-up."""
    if mode == "available_now":
        return {"availableNow": True}
    if mode == "once":
        return {"once": True}
    if mode != "live":
        raise ValueError(f"unknown trigger mode {mode!r}: use live, available_now or once")
    return {"processingTime": f"{int(settings.stream.trigger_seconds * 1000)} milliseconds"}
