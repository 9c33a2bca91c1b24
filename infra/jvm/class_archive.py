"""Record a class-data-sharing archive: the Spark driver's or the embedded Kafka broker's
(``make`` runs this after the jars).

A JVM started with ``-XX:ArchiveClassesAtExit`` writes every class it loaded to the archive when
it exits; later JVMs map those classes instead of reading, parsing and verifying them from the
jars (``lakehouse.runtime.jars.driver_java_options``, ``orchestration.services.kafka_service``).

- ``spark``: a short ``iotlake demo`` (MQTT -> Kafka -> bronze -> silver -> gold, on its own
  brokers and a temporary data root) records the driver's classes.
- ``kafka``: one broker starts on a free port and a temporary data root, and stops once it
  answers.

An archive belongs to this JDK and these jars: the Makefile rebuilds it when the jars change,
and a JVM that cannot use it starts without it.

    .venv/bin/python infra/jvm/class_archive.py spark .jars/cds/spark-driver.jsa
    .venv/bin/python infra/jvm/class_archive.py kafka .jars/cds/kafka-broker.jsa
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lakehouse.runtime.jars import driver_java_options
from lakehouse.settings import load_settings
from orchestration.services import ServiceError, free_port, kafka_service


def record_spark(dump: Path, tmp: Path) -> str | None:
    """Run the demo with the driver recording into ``dump``; the failure, if any."""
    root = Path(__file__).resolve().parents[2]
    sensor = load_settings(root / "examples" / "sensor.toml", environ={}).telemetry
    config = tmp / "iotlake.json"
    config.write_text(json.dumps({
        "telemetry": {**sensor.model_dump(mode="json"), "suite": str(root / sensor.suite)},
        "data_root": str(tmp / "lake"),
        "kafka": {"embedded_port": free_port(pair=True)},
        "mqtt": {"embedded_port": free_port()},
        "observability": {"metrics_port": 0},
        # the driver's usual options, recording instead of using an archive
        "spark": {"master": "local[2]", "conf": {"spark.driver.extraJavaOptions":
                  f"{driver_java_options(class_data_sharing=False)} -XX:ArchiveClassesAtExit={dump}"}},
    }))
    env = {k: v for k, v in os.environ.items() if not k.startswith("IOTLAKE_")}
    env["IOTLAKE_CONFIG"] = str(config)
    proc = subprocess.run([sys.executable, "-m", "orchestration.cli", "demo", "--events", "400",
                           "--devices", "4"], env=env, capture_output=True, text=True)
    return f"demo exited {proc.returncode}:\n{proc.stderr[-2000:]}" if proc.returncode else None


def record_kafka(dump: Path, tmp: Path) -> str | None:
    """Start and stop one broker recording into ``dump``; the failure, if any."""
    settings = load_settings(environ={}, data_root=str(tmp / "lake"),
                             kafka={"embedded_port": free_port(pair=True)})
    svc = kafka_service(settings, record_archive=dump)
    try:
        svc.start(timeout=120)
    except ServiceError as e:
        return str(e)
    finally:
        svc.stop()
    return None


RECORDERS = {"spark": record_spark, "kafka": record_kafka}


def build(kind: str, target: Path) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f"iotlake-cds-{kind}-") as tmp:
        dump = Path(tmp) / target.name
        error = RECORDERS[kind](dump, Path(tmp))
        if error or not dump.is_file():
            # not fatal: every JVM works without the archive, only starts slower
            print(f"{kind} class archive not built ({error or 'nothing written'}); it starts "
                  "without it", file=sys.stderr)
            return 0
        os.replace(dump, target)
    print(f"{kind} class archive: {target} ({target.stat().st_size // 2**20} MB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in RECORDERS:
        raise SystemExit(f"usage: class_archive.py {'|'.join(RECORDERS)} TARGET.jsa")
    raise SystemExit(build(sys.argv[1], Path(sys.argv[2])))
