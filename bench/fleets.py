"""The example fleets' telemetry models (``examples/*.toml``), for benchmarks and tests that
need a fleet: iotlake itself declares none."""

from __future__ import annotations

from functools import cache
from pathlib import Path

from lakehouse.settings import load_settings
from lakehouse.telemetry import TelemetryModel

ROOT = Path(__file__).resolve().parents[1]


@cache
def example(name: str) -> TelemetryModel:
    """``examples/<name>.toml``'s model, its suite file named by absolute path (any cwd)."""
    model = load_settings(ROOT / "examples" / f"{name}.toml", environ={}).telemetry
    return model.model_copy(update={"suite": str(ROOT / model.suite)}) if model.suite else model


def toml_text(name: str) -> str:
    """``examples/<name>.toml`` for a settings file of one's own: its suite path made absolute."""
    text = (ROOT / "examples" / f"{name}.toml").read_text()
    suite = load_settings(ROOT / "examples" / f"{name}.toml", environ={}).telemetry.suite
    return text.replace(f'"{suite}"', f'"{ROOT / suite}"') if suite else text


SENSOR = example("sensor")
