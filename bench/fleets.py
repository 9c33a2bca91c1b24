"""The example fleets' telemetry models (``examples/*.toml``), for benchmarks and tests that
need a fleet: iotlake itself declares none."""

from __future__ import annotations

import re
import tomllib
from functools import cache
from pathlib import Path

from lakehouse.settings import load_settings
from lakehouse.telemetry import TelemetryModel

ROOT = Path(__file__).resolve().parents[1]


@cache
def example(name: str) -> TelemetryModel:
    """``examples/<name>.toml``'s model, its suite file named by absolute path (any cwd)."""
    return load_settings(ROOT / "examples" / f"{name}.toml", environ={}).telemetry


def toml_text(name: str) -> str:
    """``examples/<name>.toml`` for a settings file of one's own, anywhere: its suite path made
    absolute (relative, it is the example's folder's) and its ``data_root`` left out (the caller
    names its own)."""
    path = ROOT / "examples" / f"{name}.toml"
    text = re.sub(r"(?m)^data_root\s*=.*\n", "", path.read_text())
    suite = tomllib.loads(text).get("telemetry", {}).get("suite")
    return text.replace(f'"{suite}"', f'"{load_settings(path, environ={}).telemetry.suite}"') if suite else text


SENSOR = example("sensor")
