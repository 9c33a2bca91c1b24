"""A starting expectation suite generated from the telemetry model (``iotlake expectations``).

The suite file stays what users edit and the single source of silver's rules; this only writes
a first version that fits the fleet the model describes: ids present, of a sane length and free
of whitespace and control characters (no id pattern of any one fleet), an event time, and each
metric within its declared range. A model that names no suite file is validated with this
suite as generated at start; the example fleets' suites (``examples/*.json``) are its output.
"""

from __future__ import annotations

import argparse
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from lakehouse.settings import Settings
from lakehouse.telemetry import TelemetryModel

#: Whitespace and control characters: never part of an id a fleet means.
_UNPRINTABLE = r"[\s\x00-\x1f\x7f]"
EVENT_ID_MAX_LENGTH = 128


def _expectation(etype: str, name: str, **kwargs: Any) -> dict[str, Any]:
    # stable ids: regenerating the suite for the same model gives the same file
    return {"type": etype, "kwargs": kwargs, "meta": {"name": name},
            "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"iotlake:{name}")), "severity": "critical"}


def default_suite(model: TelemetryModel, name: str = "telemetry") -> dict[str, Any]:
    """A GX 1.x suite (as JSON) for silver rows of ``model``."""
    e = [_expectation("expect_column_values_to_not_be_null", f"{c}_not_null", column=c)
         for c in ("event_id", "device_id", "event_time")]
    e += [
        _expectation("expect_column_value_lengths_to_be_between", "device_id_length",
                     column="device_id", min_value=1, max_value=model.device_id_max_length),
        _expectation("expect_column_values_to_not_match_regex", "device_id_printable",
                     column="device_id", regex=_UNPRINTABLE),
        _expectation("expect_column_value_lengths_to_be_between", "event_id_length",
                     column="event_id", min_value=1, max_value=EVENT_ID_MAX_LENGTH),
        _expectation("expect_column_values_to_not_match_regex", "event_id_printable",
                     column="event_id", regex=_UNPRINTABLE),
    ]
    for m in model.metrics:
        if m.min is not None or m.max is not None:
            bounds = {k: v for k, v in (("min_value", m.min), ("max_value", m.max)) if v is not None}
            e.append(_expectation("expect_column_values_to_be_between", f"{m.name}_in_range",
                                  column=m.name, **bounds))
    e += [_expectation("expect_column_values_to_be_unique", "event_id_unique", column="event_id"),
          _expectation("expect_table_row_count_to_be_between", "row_count", min_value=0)]
    return {"name": name, "id": str(uuid.uuid5(uuid.NAMESPACE_URL, f"iotlake:suite:{name}")),
            "expectations": e, "meta": {"generated_by": "iotlake expectations"}, "notes": None}


def _run(args: argparse.Namespace, settings: Settings) -> int:
    text = json.dumps(default_suite(settings.telemetry.require_metrics()), indent=2, ensure_ascii=False) + "\n"
    if not args.out:
        sys.stdout.write(text)
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        print(f"iotlake expectations: {out} exists; pass --force to overwrite it", file=sys.stderr)
        return 2
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}: point telemetry.suite at it to use it", file=sys.stderr)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "expectations", help="print (or write) a starting GX suite for the telemetry model",
        description="Generate a Great Expectations suite from the [telemetry] model: ids present, "
                    "of a sane length and printable, event time present, metrics in range. Edit "
                    "it freely; silver reads the file telemetry.suite names (without one, this "
                    "suite as generated at start).")
    p.add_argument("--out", help="write the suite here instead of printing it")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.set_defaults(func=_run)
