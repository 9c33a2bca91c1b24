"""Build the Spark driver's class-data-sharing archive (``make`` runs this after the jars).

A short ``iotlake demo`` (MQTT -> Kafka -> bronze -> silver -> gold, on its own brokers and a
temporary data root) runs with ``-XX:ArchiveClassesAtExit``: the JVM writes every class it
loaded to the archive when it exits. Later driver JVMs map those classes instead of reading,
parsing and verifying them from the jars (``lakehouse.jars.driver_java_options``). The archive
belongs to this JDK and these jars: the Makefile rebuilds it when the jars change, and a JVM
that cannot use it starts without it.

    .venv/bin/python infra/jvm/class_archive.py .jars/cds/spark-driver.jsa
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lakehouse.jars import driver_java_options
from orchestration.services import free_port


def build(target: Path) -> int:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="iotlake-cds-") as tmp:
        dump = Path(tmp) / "spark-driver.jsa"
        config = Path(tmp) / "iotlake.json"
        config.write_text(json.dumps({
            "data_root": str(Path(tmp) / "lake"),
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
        if proc.returncode != 0 or not dump.is_file():
            # not fatal: every JVM works without the archive, only starts slower
            print(f"class archive not built (demo exited {proc.returncode}); Spark starts "
                  f"without it:\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 0
        os.replace(dump, target)
    print(f"class archive: {target} ({target.stat().st_size // 2**20} MB)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: class_archive.py TARGET.jsa")
    raise SystemExit(build(Path(sys.argv[1])))
